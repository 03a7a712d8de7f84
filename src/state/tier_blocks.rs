//! One tier's live blocks: their records in store order, a page at a time,
//! and an index from a block's hash to its record.
//!
//! Invariant: records sit in pages in the order they were stored, within a
//! page and from one page to the next, so a walk in store order reads
//! memory in order, with no sort and no lookup by hash; each record's live
//! copies sit beside it in its page (0 once the block is gone: the dead
//! record stays until its page is merged or emptied); the index holds
//! exactly the live records. A record's store-wide fields are its page's:
//! the page keeps one handle per run of records storing the same fields
//! and each record names its run's by place, so a reference is taken per
//! run, not per block stored. Pages and index are copy-on-write: a clone
//! shares them, and the first write to a shared page copies its copy counts
//! (1 KiB), or, for the page being appended to, its records; no removal
//! copies records. A page whose live records fall below a quarter of it is
//! merged with a neighbour they fit beside, so dead records hold a bounded
//! share of the memory.

use std::slice;
use std::sync::Arc as SharedFields;

// Not std's: its uniqueness check is a compare-and-swap, one per write here.
use triomphe::Arc;

use super::cow_map::{CowMap, Found, Slot};
use super::prefetch::prefetch;
use super::spare_bytes::SpareBytes;
use super::{BlockRecord, StoreFields};

/// Records per page: a page appended to while a cut shares it is copied
/// whole, once, so it stays small; a cut clones one handle per page, so it
/// does not stay too small.
const PAGE: usize = 1024;
/// How far ahead of a walk each record's bytes are fetched: the records
/// are read in order (the CPU fetches them unasked), their bytes are not.
const PREFETCH_BYTES: usize = 8;
/// What a record's buffer holds before its bytes: the count and length.
const BUFFER_HEADER: usize = 16;

// A record names its fields by a `u16` place in its page.
const _: () = assert!(PAGE <= 1 << u16::BITS);

/// A block as a tier holds it: its hash beside its record.
pub(crate) type Entry = (i64, BlockRecord);

/// A page's records and the fields they store with.
#[derive(Clone, Debug, Default)]
struct Records {
    /// In store order; never more than `PAGE`.
    entries: Vec<Entry>,
    /// One handle per run of records with the same fields, which each
    /// record names by place (`BlockRecord::fields_at`): a handle per
    /// record cost 8 bytes per block and an atomic increment per block
    /// stored. At most one per record, so a place fits in a `u16`.
    fields: Vec<SharedFields<StoreFields>>,
}

impl Records {
    fn with_capacity(entries: usize) -> Self {
        Self {
            entries: Vec::with_capacity(entries),
            fields: Vec::new(),
        }
    }

    /// Appends `record` as `hash`'s, storing with `fields`. Inlined into
    /// the store loop (`TierBlocks::find_or_insert_with`): out of line, the
    /// record went through a copy and the state's apply was about 19%
    /// slower than with a handle per record (3 rounds).
    #[inline]
    fn push(&mut self, hash: i64, mut record: BlockRecord, fields: &SharedFields<StoreFields>) {
        if !self
            .fields
            .last()
            .is_some_and(|last| SharedFields::ptr_eq(last, fields))
        {
            self.fields.push(SharedFields::clone(fields));
        }
        debug_assert!(self.fields.len() <= PAGE, "at most one run per record");
        record.fields_at = (self.fields.len() - 1) as u16;
        self.entries.push((hash, record));
    }

    /// The fields `record` (one of these) stores with.
    fn fields_of(&self, record: &BlockRecord) -> &SharedFields<StoreFields> {
        &self.fields[usize::from(record.fields_at)]
    }
}

#[derive(Clone, Debug)]
struct Page {
    records: Arc<Records>,
    /// Each record's live copies; 0 once it is gone.
    copies: Arc<Vec<u8>>,
    /// Records with copies.
    live: usize,
}

impl Page {
    fn new() -> Self {
        Self {
            records: Arc::new(Records::with_capacity(PAGE)),
            copies: Arc::new(Vec::with_capacity(PAGE)),
            live: 0,
        }
    }
}

/// A live block of a tier, its copies and the fields it was stored with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LiveBlock<'a> {
    pub(crate) entry: &'a Entry,
    pub(crate) copies: u8,
    pub(crate) fields: &'a SharedFields<StoreFields>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct TierBlocks {
    index: CowMap,
    /// By page id; `None` for an id free to reuse.
    pages: Vec<Option<Page>>,
    free_ids: Vec<u32>,
    /// Page ids in store order: records are appended to the last.
    order: Vec<u32>,
}

impl TierBlocks {
    fn page(&self, id: u32) -> &Page {
        self.pages[id as usize]
            .as_ref()
            .expect("the index and the order name live pages")
    }

    fn page_mut(&mut self, id: u32) -> &mut Page {
        self.pages[id as usize]
            .as_mut()
            .expect("the index and the order name live pages")
    }

    /// The live block `hash`.
    pub(crate) fn get(&self, hash: i64) -> Option<LiveBlock<'_>> {
        let slot = *self.index.get(hash)?;
        let page = self.page(slot.page);
        let offset = slot.offset as usize;
        let entry = &page.records.entries[offset];
        Some(LiveBlock {
            entry,
            copies: page.copies[offset],
            fields: page.records.fields_of(&entry.1),
        })
    }

    /// The live record of `hash`.
    pub(crate) fn record(&self, hash: i64) -> Option<&BlockRecord> {
        self.get(hash).map(|block| &block.entry.1)
    }

    /// Asks the CPU to fetch what looking `hash` up in the index reads.
    pub(crate) fn prefetch_lookup(&self, hash: i64) {
        self.index.prefetch(hash);
    }

    /// Asks the CPU to fetch the record of `hash` and its copy count, once
    /// the index is in the cache.
    pub(crate) fn prefetch_record(&self, hash: i64) {
        if let Some(slot) = self.index.get(hash) {
            let page = self.page(slot.page);
            let offset = slot.offset as usize;
            prefetch(page.records.entries.as_ptr().wrapping_add(offset));
            prefetch(page.copies.as_ptr().wrapping_add(offset));
        }
    }

    /// Every live block, in store order.
    pub(crate) fn live(&self) -> LiveBlocks<'_> {
        LiveBlocks {
            tier: self,
            pages: self.order.iter(),
            records: &EMPTY_RECORDS,
            copies: &[],
            next: 0,
        }
    }

    /// The copies of `hash` for writing, or, if it is not live, `make()`
    /// appended as its record with one copy, storing with `fields`.
    ///
    /// Inlined into the store loop with `make`, as `CowMap`'s is: out of
    /// line, that loop's ingest was 10-15% slower.
    #[inline]
    pub(crate) fn find_or_insert_with(
        &mut self,
        hash: i64,
        fields: &SharedFields<StoreFields>,
        make: impl FnOnce() -> BlockRecord,
    ) -> Found<'_, u8> {
        let (tail, opens_page) = self.next_slot();
        let existing = match self.index.find_or_insert_with(hash, || tail) {
            Found::Inserted => None,
            Found::Existing(slot) => Some(*slot),
        };
        match existing {
            Some(slot) => {
                let page = self.page_mut(slot.page);
                Found::Existing(&mut Arc::make_mut(&mut page.copies)[slot.offset as usize])
            }
            None => {
                if opens_page {
                    self.open_page(tail.page);
                }
                let page = self.page_mut(tail.page);
                Arc::make_mut(&mut page.records).push(hash, make(), fields);
                Arc::make_mut(&mut page.copies).push(1);
                page.live += 1;
                Found::Inserted
            }
        }
    }

    /// Where the next record goes: the last page, or (true) a page to open
    /// once it is full. Nothing is opened here, so storing a block that is
    /// already live never leaves an empty page behind.
    fn next_slot(&self) -> (Slot, bool) {
        if let Some(&id) = self.order.last() {
            let len = self.page(id).records.entries.len();
            if len < PAGE {
                let slot = Slot {
                    page: id,
                    offset: len as u32,
                };
                return (slot, false);
            }
        }
        let id = match self.free_ids.last() {
            Some(&id) => id,
            None => u32::try_from(self.pages.len()).expect("fewer than 2^32 pages"),
        };
        (
            Slot {
                page: id,
                offset: 0,
            },
            true,
        )
    }

    /// Opens page `id`, as [`TierBlocks::next_slot`] chose it, at the end of
    /// the order.
    fn open_page(&mut self, id: u32) {
        if self.free_ids.last() == Some(&id) {
            self.free_ids.pop();
            self.pages[id as usize] = Some(Page::new());
        } else {
            self.pages.push(Some(Page::new()));
        }
        self.order.push(id);
    }

    /// Removes one copy of `hash`; false if it is not live. The last copy's
    /// buffer goes to `spare` once no cut shares it.
    pub(crate) fn remove_copy(&mut self, hash: i64, spare: &mut SpareBytes) -> bool {
        let Some(&slot) = self.index.get(hash) else {
            return false;
        };
        let offset = slot.offset as usize;
        let page = self.page_mut(slot.page);
        let copies = &mut Arc::make_mut(&mut page.copies)[offset];
        *copies -= 1;
        if *copies > 0 {
            return true;
        }
        page.live -= 1;
        if let Some(records) = Arc::get_mut(&mut page.records) {
            // No cut holds the page: what the dead record holds is freed now.
            free_record(&mut records.entries[offset].1, spare);
        }
        let live = page.live;
        self.index.remove(hash);
        if live == 0 {
            self.drop_page(slot.page, spare);
        } else if live == PAGE / 4 - 1 || (live < PAGE / 4 && live.is_power_of_two()) {
            // Tried as it falls below a quarter and at each halving after,
            // not at every removal: each try looks for the page in the order.
            self.merge(slot.page, spare);
        }
        true
    }

    fn position(&self, id: u32) -> usize {
        self.order
            .iter()
            .position(|&page| page == id)
            .expect("a live page is in the order")
    }

    fn drop_page(&mut self, id: u32, spare: &mut SpareBytes) {
        let position = self.position(id);
        self.order.remove(position);
        let page = self.pages[id as usize].take().expect("a live page");
        self.free_ids.push(id);
        if let Ok(mut records) = Arc::try_unwrap(page.records) {
            for (_, record) in &mut records.entries {
                free_record(record, spare);
            }
        }
    }

    /// Merges the sparse page `id` with the next page, or else the one
    /// before, if their live records fit in one page. The last page is
    /// left to fill until it is full: its free slots are not dead records.
    fn merge(&mut self, id: u32, spare: &mut SpareBytes) {
        let position = self.position(id);
        let last = position + 1 == self.order.len();
        if last && self.page(id).records.entries.len() < PAGE {
            return;
        }
        let live = |position: usize| self.page(self.order[position]).live;
        let fits = |other: usize| live(position) + live(other) <= PAGE;
        let first = if !last && fits(position + 1) {
            position
        } else if position > 0 && fits(position - 1) {
            position - 1
        } else {
            return;
        };
        let (kept_id, merged_id) = (self.order[first], self.order[first + 1]);
        let mut records = Records::with_capacity(PAGE);
        let mut copies = Vec::with_capacity(PAGE);
        for id in [kept_id, merged_id] {
            let page = self.pages[id as usize].take().expect("a live page");
            match Arc::try_unwrap(page.records) {
                Ok(Records { entries, fields }) => {
                    for ((hash, mut record), &count) in entries.into_iter().zip(page.copies.iter())
                    {
                        if count > 0 {
                            let fields = &fields[usize::from(record.fields_at)];
                            records.push(hash, record, fields);
                            copies.push(count);
                        } else {
                            free_record(&mut record, spare);
                        }
                    }
                }
                Err(shared) => {
                    for ((hash, record), &count) in shared.entries.iter().zip(page.copies.iter()) {
                        if count > 0 {
                            records.push(*hash, record.clone(), shared.fields_of(record));
                            copies.push(count);
                        }
                    }
                }
            }
        }
        for (offset, (hash, _)) in records.entries.iter().enumerate() {
            *self.index.get_mut(*hash).expect("a live record is indexed") = Slot {
                page: kept_id,
                offset: offset as u32,
            };
        }
        self.pages[kept_id as usize] = Some(Page {
            live: records.entries.len(),
            records: Arc::new(records),
            copies: Arc::new(copies),
        });
        self.free_ids.push(merged_id);
        self.order.remove(first + 1);
    }
}

/// Frees what a dead record holds, keeping its buffer for a new one.
fn free_record(record: &mut BlockRecord, spare: &mut SpareBytes) {
    if let Some(encoded) = record.encoded.take() {
        spare.keep(encoded);
    }
}

/// What a walk reads before its first page.
static EMPTY_RECORDS: Records = Records {
    entries: Vec::new(),
    fields: Vec::new(),
};

/// A tier's live blocks in store order.
pub(crate) struct LiveBlocks<'a> {
    tier: &'a TierBlocks,
    pages: slice::Iter<'a, u32>,
    records: &'a Records,
    copies: &'a [u8],
    next: usize,
}

impl<'a> Iterator for LiveBlocks<'a> {
    type Item = LiveBlock<'a>;

    fn next(&mut self) -> Option<LiveBlock<'a>> {
        loop {
            let at = self.next;
            if let Some(entry) = self.records.entries.get(at) {
                self.next += 1;
                if let Some((_, ahead)) = self.records.entries.get(at + PREFETCH_BYTES)
                    && let Some(encoded) = &ahead.encoded
                {
                    // `ptr`, not the slice: the slice's length is read from
                    // the very allocation being fetched. The line of the
                    // last byte too: with the count and length before them,
                    // a block's bytes often end on the next line.
                    let start = encoded.ptr().cast::<u8>();
                    prefetch(start);
                    let last = BUFFER_HEADER + (ahead.encoded_len as usize).max(1) - 1;
                    prefetch(start.wrapping_add(last));
                }
                let copies = self.copies[at];
                if copies > 0 {
                    let fields = self.records.fields_of(&entry.1);
                    return Some(LiveBlock {
                        entry,
                        copies,
                        fields,
                    });
                }
                continue;
            }
            let page = self.tier.page(*self.pages.next()?);
            self.records = &page.records;
            self.copies = &page.copies;
            self.next = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::StoreFields;

    fn record(order: u64) -> BlockRecord {
        BlockRecord {
            parent: 0,
            encoded: Some(triomphe::ThinArc::from_header_and_slice((), &[1, 2])),
            order,
            encoded_len: 2,
            fields_at: 0,
            has_parent: false,
        }
    }

    /// Fields told apart by their session id.
    fn fields(session: u64) -> SharedFields<StoreFields> {
        SharedFields::new(StoreFields {
            session_id: Some(session.to_string()),
            ..StoreFields::default()
        })
    }

    /// Stores `hash` with `with` as the state does: a new record, or one
    /// more copy.
    fn insert_with(tier: &mut TierBlocks, hash: i64, with: &SharedFields<StoreFields>) {
        if let Found::Existing(copies) =
            tier.find_or_insert_with(hash, with, || record(hash as u64))
        {
            *copies += 1;
        }
    }

    fn insert(tier: &mut TierBlocks, hash: i64) {
        thread_local!(static SHARED: SharedFields<StoreFields> = fields(0));
        SHARED.with(|shared| insert_with(tier, hash, shared));
    }

    fn session(block: LiveBlock<'_>) -> u64 {
        block.fields.session_id.as_deref().unwrap().parse().unwrap()
    }

    fn live(tier: &TierBlocks) -> Vec<(i64, u8)> {
        tier.live()
            .map(|block| (block.entry.0, block.copies))
            .collect()
    }

    #[test]
    fn a_record_s_bytes_start_where_the_walk_s_prefetch_counts_them_from() {
        let buffer = record(0).encoded.unwrap();
        let start = buffer.slice.as_ptr() as usize - buffer.ptr() as usize;
        assert_eq!(start, BUFFER_HEADER);
    }

    #[test]
    fn blocks_come_back_in_store_order_with_their_copies() {
        let mut tier = TierBlocks::default();
        let hashes: Vec<i64> = (0..3000).map(|n| (n * 7919) % 3001).collect();
        for &hash in &hashes {
            insert(&mut tier, hash);
        }
        insert(&mut tier, hashes[5]);
        let expected: Vec<(i64, u8)> = hashes
            .iter()
            .map(|&hash| (hash, if hash == hashes[5] { 2 } else { 1 }))
            .collect();
        let walked = live(&tier);
        let first_difference = walked.iter().zip(&expected).position(|(a, b)| a != b);
        assert_eq!(first_difference, None);
        assert_eq!(walked.len(), expected.len());
        assert_eq!(tier.get(hashes[5]).unwrap().copies, 2);
    }

    #[test]
    fn any_mix_of_stores_copies_and_removals_walks_as_the_live_blocks_in_store_order_and_cuts_keep_theirs()
     {
        // A model: live hashes in store order with their copies.
        let mut model: Vec<(i64, u8)> = Vec::new();
        let mut spare = SpareBytes::default();
        let mut tier = TierBlocks::default();
        let mut cuts: Vec<(TierBlocks, Vec<(i64, u8)>)> = Vec::new();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |bound: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % bound
        };
        for step in 0..60_000 {
            let hash = next(6000) as i64;
            // Stores and removals alike, so pages empty, thin out and merge.
            if next(2) == 0 {
                insert(&mut tier, hash);
                match model.iter_mut().find(|(live, _)| *live == hash) {
                    Some((_, copies)) => *copies += 1,
                    None => model.push((hash, 1)),
                }
            } else {
                let at = model.iter().position(|(live, _)| *live == hash);
                assert_eq!(tier.remove_copy(hash, &mut spare), at.is_some());
                if let Some(at) = at {
                    model[at].1 -= 1;
                    if model[at].1 == 0 {
                        model.remove(at);
                    }
                }
            }
            if step % 7_000 == 0 {
                cuts.push((tier.clone(), model.clone()));
            }
        }
        assert_eq!(live(&tier), model);
        for &(hash, copies) in &model {
            assert_eq!(tier.get(hash).map(|block| block.copies), Some(copies));
        }
        for (cut, then) in &cuts {
            assert_eq!(&live(cut), then, "a cut walks as the state was");
        }
        let pages = tier.order.len();
        assert!(
            pages <= 4 * model.len().div_ceil(PAGE) + 1,
            "{pages} pages for {} live blocks",
            model.len()
        );
    }

    #[test]
    fn removed_blocks_leave_the_walk_and_emptied_or_sparse_pages_are_merged_away() {
        let mut spare = SpareBytes::default();
        let mut tier = TierBlocks::default();
        for hash in 0..(4 * PAGE as i64) {
            insert(&mut tier, hash);
        }
        let frozen = tier.clone();
        // The first page emptied; of the second and third, 7 in 8 removed.
        for hash in 0..(3 * PAGE as i64) {
            if hash < PAGE as i64 || hash % 8 != 0 {
                assert!(tier.remove_copy(hash, &mut spare));
            }
        }
        assert!(!tier.remove_copy(0, &mut spare), "already gone");
        let kept: Vec<i64> = (PAGE as i64..4 * PAGE as i64)
            .filter(|hash| *hash >= 3 * PAGE as i64 || hash % 8 == 0)
            .collect();
        let walked: Vec<i64> = live(&tier).into_iter().map(|(hash, _)| hash).collect();
        assert_eq!(walked, kept);
        assert_eq!(tier.order.len(), 2, "the two sparse pages merged into one");
        for &hash in &kept {
            assert_eq!(tier.get(hash).unwrap().entry.0, hash);
        }
        assert_eq!(live(&frozen).len(), 4 * PAGE, "the clone kept every block");
        // The merged page fills again in order.
        insert(&mut tier, -1);
        assert_eq!(live(&tier).last(), Some(&(-1, 1)));
    }

    #[test]
    fn a_full_last_page_emptied_but_for_a_few_is_merged_before_the_next_page_opens() {
        let mut spare = SpareBytes::default();
        let mut tier = TierBlocks::default();
        let mut kept = Vec::new();
        for round in 0..100_i64 {
            let first = round * PAGE as i64;
            for hash in first..first + PAGE as i64 {
                insert(&mut tier, hash);
            }
            for hash in first + 1..first + PAGE as i64 {
                assert!(tier.remove_copy(hash, &mut spare));
            }
            kept.push(first);
        }
        let walked: Vec<i64> = live(&tier).into_iter().map(|(hash, _)| hash).collect();
        assert_eq!(walked, kept);
        let pages = tier.order.len();
        assert!(
            pages <= 4 * kept.len().div_ceil(PAGE) + 1,
            "{pages} pages for {} live blocks",
            kept.len()
        );
    }

    #[test]
    fn storing_a_live_block_again_when_the_last_page_is_full_opens_no_page() {
        let mut tier = TierBlocks::default();
        for hash in 0..PAGE as i64 {
            insert(&mut tier, hash);
        }
        insert(&mut tier, 7);
        assert_eq!(tier.order.len(), 1);
        assert_eq!(tier.get(7).unwrap().copies, 2);
        insert(&mut tier, -1);
        assert_eq!(tier.order.len(), 2);
        assert_eq!(live(&tier).last(), Some(&(-1, 1)));
    }

    #[test]
    fn each_block_keeps_the_fields_it_was_stored_with_through_runs_cuts_and_merges() {
        let mut spare = SpareBytes::default();
        let mut tier = TierBlocks::default();
        let sessions: Vec<_> = (0..3).map(fields).collect();
        // Runs of one store's fields, and fields changing from block to block.
        let session_of = |hash: i64| (if hash < 2000 { hash / 500 } else { hash } % 3) as u64;
        for hash in 0..4 * PAGE as i64 {
            insert_with(&mut tier, hash, &sessions[session_of(hash) as usize]);
        }
        insert_with(&mut tier, 7, &sessions[2]);
        let first_page = &tier.page(tier.order[0]).records;
        assert_eq!(
            first_page.fields.len(),
            3,
            "one handle per run of 500, not per block"
        );
        let cut = tier.clone();
        for hash in 0..3 * PAGE as i64 {
            if hash % 8 != 0 {
                assert!(tier.remove_copy(hash, &mut spare));
            }
        }
        assert!(tier.order.len() < 4, "sparse pages merged");
        for (walked, was_at) in [(&tier, "the state"), (&cut, "the cut")] {
            let mut blocks = 0;
            for block in walked.live() {
                let hash = block.entry.0;
                assert_eq!(session(block), session_of(hash), "{hash} in {was_at}");
                blocks += 1;
            }
            assert!(blocks > 0);
        }
        assert_eq!(session(tier.get(8).unwrap()), session_of(8));
        assert_eq!(
            session(cut.get(7).unwrap()),
            0,
            "a copy keeps the first store's fields"
        );
        drop((tier, cut));
        assert!(
            sessions
                .iter()
                .all(|shared| SharedFields::strong_count(shared) == 1),
            "the pages hold their fields until they go"
        );
    }
}
