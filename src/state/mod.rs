//! The live blocks of every rank, as the engine's events left them.
//!
//! Invariants: the drain is the only writer; a block is keyed by
//! (rank, tier, hash) and counts its physical copies (a hash stored again
//! while live is a second copy, capped at 8); each record keeps what its
//! first store carried, so a snapshot can re-issue that store. Each tier
//! keeps its records in store order (`TierBlocks`), in pages shared
//! copy-on-write like its index (`CowMap`), so `cut` costs well under a
//! millisecond however large the state is, the drain goes on mutating while
//! a subscriber walks the cut, and a snapshot reads the records in order.
//!
//! The store-wide fields (tier, medium, LoRA, salt, …) are interned: blocks
//! of one store share one `Arc`, which keeps a record small.

pub(crate) mod cow_map;
mod prefetch;
pub mod retraction;
pub mod snapshot;
mod spare_bytes;
pub(crate) mod tier;
mod tier_blocks;

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;

use triomphe::ThinArc;

use crate::wire::event::{BlockFields, EncodedBlock};
use cow_map::Found;
use snapshot::lone_block_entry_len;
use spare_bytes::SpareBytes;
use tier::{PerTier, Tier, TierCounts};
use tier_blocks::TierBlocks;

use crate::proto::common::{KvBlocksRemoved, KvBlocksStored, KvCacheEvent, kv_cache_event::Data};

/// Copies counted per block; more stores of a live hash are still forwarded.
pub const MAX_COPIES: u8 = 8;

/// Everything a store carried besides its blocks (and each block's own
/// fields).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreFields {
    /// The wire tier (`KvCacheTier`), as the store carried it.
    pub tier: Option<i32>,
    /// The engine's storage medium name.
    pub medium: Option<String>,
    /// The KV-cache group of hybrid models.
    pub group_idx: Option<u32>,
    /// The attention kind of the group's cache spec.
    pub kv_cache_spec_kind: Option<String>,
    /// The sliding window of the group's cache spec.
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// Where the blocks live relative to the engine.
    pub locality: Option<i32>,
    /// Who owns the blocks (an ownerless clear removes every owner's).
    pub ownership: Option<String>,
    /// The request session that stored them.
    pub session_id: Option<String>,
    /// The LoRA adapter's name.
    pub lora_name: Option<String>,
    /// The cache salt that keeps tenants' prefixes apart.
    pub cache_salt: Option<String>,
    /// Per block in the proto, per store on the engine side.
    pub lora_id: Option<i64>,
    /// The engine's cache level of the store.
    pub cache_level: Option<i32>,
}

/// [`StoreFields`] borrowed, from a store as it arrives or from shared
/// fields: what the interner hashes and compares, so a store whose fields
/// are already shared copies no text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct StoreFieldsRef<'a> {
    tier: Option<i32>,
    medium: Option<&'a str>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<&'a str>,
    kv_cache_spec_sliding_window: Option<u32>,
    locality: Option<i32>,
    ownership: Option<&'a str>,
    session_id: Option<&'a str>,
    lora_name: Option<&'a str>,
    cache_salt: Option<&'a str>,
    lora_id: Option<i64>,
    cache_level: Option<i32>,
}

impl<'a> StoreFieldsRef<'a> {
    /// The fields of `stored`, with the LoRA id and cache level given.
    fn of(stored: &'a KvBlocksStored, (lora_id, cache_level): (Option<i64>, Option<i32>)) -> Self {
        Self {
            tier: stored.tier,
            medium: stored.medium.as_deref(),
            group_idx: stored.group_idx,
            kv_cache_spec_kind: stored.kv_cache_spec_kind.as_deref(),
            kv_cache_spec_sliding_window: stored.kv_cache_spec_sliding_window,
            locality: stored.locality,
            ownership: stored.ownership.as_deref(),
            session_id: stored.session_id.as_deref(),
            lora_name: stored.lora_name.as_deref(),
            cache_salt: stored.cache_salt.as_deref(),
            lora_id,
            cache_level,
        }
    }

    fn to_fields(self) -> StoreFields {
        StoreFields {
            tier: self.tier,
            medium: self.medium.map(str::to_owned),
            group_idx: self.group_idx,
            kv_cache_spec_kind: self.kv_cache_spec_kind.map(str::to_owned),
            kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window,
            locality: self.locality,
            ownership: self.ownership.map(str::to_owned),
            session_id: self.session_id.map(str::to_owned),
            lora_name: self.lora_name.map(str::to_owned),
            cache_salt: self.cache_salt.map(str::to_owned),
            lora_id: self.lora_id,
            cache_level: self.cache_level,
        }
    }
}

impl StoreFields {
    fn borrowed(&self) -> StoreFieldsRef<'_> {
        StoreFieldsRef {
            tier: self.tier,
            medium: self.medium.as_deref(),
            group_idx: self.group_idx,
            kv_cache_spec_kind: self.kv_cache_spec_kind.as_deref(),
            kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window,
            locality: self.locality,
            ownership: self.ownership.as_deref(),
            session_id: self.session_id.as_deref(),
            lora_name: self.lora_name.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
            lora_id: self.lora_id,
            cache_level: self.cache_level,
        }
    }

    /// At least the encoded length of [`Self::to_store`] with any parent,
    /// measured without building it: every number at its widest. A store's
    /// fields are all numbered below 16, so each key takes one byte.
    fn store_len_bound(&self) -> usize {
        // Key and varint: the parent is an int64; tier and locality are
        // enums, written as int32 (10 bytes when negative); the group and
        // the sliding window are uint32.
        const WIDEST_SIGNED: usize = 1 + 10;
        const WIDEST_UNSIGNED: usize = 1 + 5;
        let text = |value: &Option<String>| {
            value.as_ref().map_or(0, |text| {
                1 + prost::encoding::encoded_len_varint(text.len() as u64) + text.len()
            })
        };
        3 * WIDEST_SIGNED
            + 2 * WIDEST_UNSIGNED
            + text(&self.medium)
            + text(&self.kv_cache_spec_kind)
            + text(&self.ownership)
            + text(&self.session_id)
            + text(&self.lora_name)
            + text(&self.cache_salt)
    }

    /// A store event with these fields and no blocks yet.
    pub fn to_store(&self, parent_block_hash: Option<i64>) -> KvBlocksStored {
        KvBlocksStored {
            blocks: Vec::new(),
            parent_block_hash,
            tier: self.tier,
            medium: self.medium.clone(),
            group_idx: self.group_idx,
            kv_cache_spec_kind: self.kv_cache_spec_kind.clone(),
            kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window,
            locality: self.locality,
            ownership: self.ownership.clone(),
            session_id: self.session_id.clone(),
            lora_name: self.lora_name.clone(),
            cache_salt: self.cache_salt.clone(),
        }
    }
}

/// One live block, kept small: a million of them is a normal cache.
///
/// The block is kept as it was written, its `KvBlock` body but for the hash
/// (the index has it): a snapshot copies those bytes instead of encoding
/// the tokens again, and the converter wrote them for the live batch
/// already. Cloning must not allocate (the drain clones the page it appends
/// to while a cut shares it), hence the shared buffer; a thin one, since a
/// fat pointer would cost 8 more bytes per block. Its live copies are kept
/// beside it in its page, which a removal writes without copying records.
#[derive(Clone, Debug)]
pub struct BlockRecord {
    /// Meaningful only with `has_parent` (an `Option<i64>` would take 16 bytes).
    parent: i64,
    /// The block's bytes after its hash (an [`EncodedBlock`]'s `rest`), the
    /// first `encoded_len` of a buffer of their size class. `None` once the
    /// block is gone and no cut holds its page: the buffer went to the next
    /// new record.
    encoded: Option<ThinArc<(), u8>>,
    /// When the block was stored, in the state's store order: engines store
    /// parents first, so sorting by it puts parents first (a snapshot walks
    /// in this order instead of chasing parent links).
    order: u64,
    /// Here rather than in the buffer, so a snapshot sizes a block from the
    /// record it reads anyway.
    encoded_len: u32,
    /// Where its page keeps the store-wide fields it shares with its
    /// store's other blocks (set as the page takes the record).
    fields_at: u16,
    has_parent: bool,
}

impl BlockRecord {
    /// The block's parent, as its store named it.
    pub fn parent(&self) -> Option<i64> {
        self.has_parent.then_some(self.parent)
    }

    /// Its place in the rank's store order (parents before children).
    pub fn order(&self) -> u64 {
        self.order
    }

    /// The length of the block `hash` as written, from the record alone
    /// (reading the buffer's own length would fetch the buffer).
    pub fn encoded_block_len(&self, hash: i64) -> usize {
        EncodedBlock::body_len(hash, self.encoded_len as usize)
    }

    /// The block `hash` as written, for a snapshot to copy (a snapshot
    /// writes a million of them).
    pub fn encoded_block(&self, hash: i64) -> EncodedBlock<'_> {
        let rest = self.encoded.as_ref().map_or(&[][..], |encoded| {
            &encoded.slice[..self.encoded_len as usize]
        });
        EncodedBlock { hash, rest }
    }
}

/// The live blocks of one rank, per tier.
#[derive(Clone, Debug, Default)]
pub struct RankBlocks {
    tiers: PerTier<TierBlocks>,
    /// Live copies per tier, kept as blocks come and go (for metrics and
    /// snapshot headers without a walk).
    copies: TierCounts,
    /// The most bytes any block stored on this rank takes in a snapshot as
    /// a one-block store of its own, never lowered while the rank lives: a
    /// bound that lets a snapshot count its chunks instead of walking.
    widest_lone_entry: usize,
}

impl RankBlocks {
    /// Live blocks of `tier`, in store order.
    pub fn tier(&self, tier: Tier) -> impl Iterator<Item = (i64, &BlockRecord)> {
        self.tiers[tier]
            .live()
            .map(|block| (block.entry.0, &block.entry.1))
    }

    /// The blocks of `tier`, for a walk that keeps references into them.
    pub(crate) fn tier_blocks(&self, tier: Tier) -> &TierBlocks {
        &self.tiers[tier]
    }

    /// Live blocks per tier, each copy counted.
    pub fn counts(&self) -> &TierCounts {
        &self.copies
    }

    /// At least as many bytes as any live block takes in a snapshot as a
    /// one-block store of its own.
    pub(crate) fn widest_lone_entry(&self) -> usize {
        self.widest_lone_entry
    }
}

/// A consistent view of every rank's blocks at one instant.
pub type StateCut = BTreeMap<u32, RankBlocks>;

#[derive(Debug, Default)]
/// Every rank's live blocks; only the drain writes.
pub struct LiveState {
    ranks: BTreeMap<u32, RankBlocks>,
    interned: Interner,
    /// Removed records' buffers, for the next new records.
    spare_bytes: SpareBytes,
    /// The `order` the next new block gets.
    next_order: u64,
}

impl LiveState {
    /// Records `event` for `rank`. A store that names neither LoRA nor salt
    /// takes them from its parent's record first (same rank and tier), so
    /// the event itself is completed before it is forwarded.
    pub fn apply(&mut self, rank: u32, event: &mut KvCacheEvent) {
        self.complete(rank, event);
        self.record(rank, event);
    }

    /// Completes a store that names neither LoRA nor salt from its parent's
    /// record (same rank and tier), without recording anything.
    pub fn complete(&self, rank: u32, event: &mut KvCacheEvent) {
        let Some(Data::Stored(stored)) = event.data.as_mut() else {
            return;
        };
        if stored.lora_name.is_some() && stored.cache_salt.is_some() {
            return;
        }
        let tier = Tier::of_event(stored.tier);
        let parent = stored.parent_block_hash.and_then(|hash| {
            self.ranks
                .get(&rank)
                .and_then(|blocks| blocks.tiers[tier].get(hash))
        });
        if let Some(parent) = parent {
            if stored.lora_name.is_none() {
                stored.lora_name = parent.fields.lora_name.clone();
            }
            if stored.cache_salt.is_none() {
                stored.cache_salt = parent.fields.cache_salt.clone();
            }
        }
    }

    /// Brings into the cache what applying `events` to `rank` will read.
    ///
    /// Block hashes are random, so each block's lookup is a chain of cache
    /// misses (its index shard's handle and home line, then the record
    /// and its copy count, then its bytes), and applying events one by one
    /// waits for each chain in turn. Three read-only passes over the
    /// payload's blocks first put many chains in flight at once: one
    /// fetches every block's home line (and its shard's count line, which
    /// a write reads), the next looks every block up and fetches its
    /// record, the last fetches the bytes of each block found (which a
    /// removal frees), while the CPU overlaps
    /// the misses of neighbouring lookups (BENCHMARKS.md, "The block
    /// index: one cache line per lookup"). A hint only: nothing is
    /// written, so no shard a cut shares is copied.
    pub fn prefetch(&self, rank: u32, events: &[KvCacheEvent]) {
        let Some(blocks) = self.ranks.get(&rank) else {
            return;
        };
        prefetch_passes(|visit| for_each_block_touched(blocks, events, visit));
    }

    /// Records `event`, already completed, for `rank`. A clear empties
    /// every rank, as a router takes it (its index pools the ranks): in an
    /// engine of several ranks the drain sends one rank's own clear as
    /// removals instead, so a clear recorded here is always the whole
    /// worker's, live or read back from a state directory.
    pub fn record(&mut self, rank: u32, event: &KvCacheEvent) {
        match event.data.as_ref() {
            Some(Data::Stored(stored)) => self.store(rank, stored),
            Some(Data::Removed(removed)) => self.remove(rank, removed),
            Some(Data::Cleared(_)) => {
                for rank in std::mem::take(&mut self.ranks).into_values() {
                    free(rank);
                }
            }
            None => {}
        }
    }

    /// Forgets every block of `rank` (its engine restarted or cleared).
    /// A large rank's records are freed on a thread of their own: the drain
    /// runs on the worker that serves every stream, and a million frees
    /// there would hold all of them up.
    pub fn reset_rank(&mut self, rank: u32) {
        if let Some(blocks) = self.ranks.remove(&rank) {
            free(blocks);
        }
    }

    /// Takes every block of `rank` out of the state, for its removals to
    /// be sent (`retraction`).
    pub fn take_rank(&mut self, rank: u32) -> Option<RankBlocks> {
        self.ranks.remove(&rank)
    }

    /// A consistent view of every rank now; cheap, the maps are shared until written.
    pub fn cut(&self) -> StateCut {
        self.ranks.clone()
    }

    /// Ranks that hold blocks.
    pub fn ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranks.keys().copied()
    }

    /// Rank `rank`'s live blocks, once it stored any.
    pub fn rank(&self, rank: u32) -> Option<&RankBlocks> {
        self.ranks.get(&rank)
    }

    /// Records a store given as a `KvBlocksStored`, its blocks written here
    /// (the converter writes the drain's).
    fn store(&mut self, rank: u32, stored: &KvBlocksStored) {
        let first = stored.blocks.first();
        let lora_id = first.and_then(|block| block.lora_id);
        let cache_level = first.and_then(|block| block.cache_level);
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(stored.blocks.len());
        for block in &stored.blocks {
            // A record keeps its store's LoRA id and cache level.
            let fields = BlockFields {
                lora_id,
                cache_level,
                ..BlockFields::from(block)
            };
            fields.encode_after_hash(&mut bytes);
            ends.push(bytes.len());
        }
        let mut start = 0;
        let blocks = stored.blocks.iter().zip(ends).map(|(block, end)| {
            let rest = &bytes[start..end];
            start = end;
            EncodedBlock {
                hash: block.block_hash,
                rest,
            }
        });
        self.store_blocks(rank, stored, (lora_id, cache_level), blocks);
    }

    /// Records, for `rank`, the store `stored` (completed, its own `blocks`
    /// ignored) of the blocks `blocks`, each with the LoRA id and cache
    /// level `shared`: a store the drain has as its fields and its blocks'
    /// bytes, not as a `KvBlocksStored` with its blocks.
    pub fn store_blocks<'b>(
        &mut self,
        rank: u32,
        stored: &KvBlocksStored,
        (lora_id, cache_level): (Option<i64>, Option<i32>),
        blocks: impl Iterator<Item = EncodedBlock<'b>>,
    ) {
        let tier = Tier::of_event(stored.tier);
        let rank_blocks = self.ranks.entry(rank).or_default();
        let map = &mut rank_blocks.tiers[tier];
        let copies = &mut rank_blocks.copies[tier];
        let (fields, fields_len) = self
            .interned
            .intern(StoreFieldsRef::of(stored, (lora_id, cache_level)));
        let spare_bytes = &mut self.spare_bytes;
        let mut parent = stored.parent_block_hash;
        let mut widest_block = None;
        for block in blocks {
            let hash = block.hash;
            let order = self.next_order;
            widest_block = widest_block.max(Some(block.encoded_len()));
            let found = map.find_or_insert_with(hash, &fields, || BlockRecord {
                parent: parent.unwrap_or_default(),
                has_parent: parent.is_some(),
                encoded: Some(spare_bytes.filled(block.rest)),
                order,
                encoded_len: u32::try_from(block.rest.len()).expect("a block under 4 GiB"),
                fields_at: 0,
            });
            match found {
                Found::Inserted => *copies += 1,
                Found::Existing(live) if *live < MAX_COPIES => {
                    *live += 1;
                    *copies += 1;
                }
                Found::Existing(_) => {}
            }
            self.next_order += 1;
            parent = Some(hash);
        }
        if let Some(widest_block) = widest_block {
            rank_blocks.widest_lone_entry = rank_blocks
                .widest_lone_entry
                .max(lone_block_entry_len(fields_len, widest_block));
        }
    }

    fn remove(&mut self, rank: u32, removed: &KvBlocksRemoved) {
        self.remove_blocks(rank, removed.tier, &removed.block_hashes);
    }
}

/// Blocks a rank may hold for [`free`] to free them in place (a few
/// milliseconds at most).
const FREED_IN_PLACE: u64 = 65_536;

/// Frees a rank's blocks; a large rank's on a thread of their own.
pub fn free(blocks: RankBlocks) {
    if blocks.copies.total() > FREED_IN_PLACE {
        // Should the thread not start, its closure, and the blocks with
        // it, are dropped here instead.
        let _ = std::thread::Builder::new()
            .name("kvgate-free".into())
            .spawn(move || drop(blocks));
    }
}

/// Calls `visit` with the tier and hash of every block that applying
/// `events` looks up: stored blocks and their store's parent (`complete`
/// reads it), and removed blocks.
fn for_each_block_touched(
    blocks: &RankBlocks,
    events: &[KvCacheEvent],
    mut visit: impl FnMut(&TierBlocks, i64),
) {
    for event in events {
        match &event.data {
            Some(Data::Stored(stored)) => {
                let map = &blocks.tiers[Tier::of_event(stored.tier)];
                if let Some(parent) = stored.parent_block_hash {
                    visit(map, parent);
                }
                for block in &stored.blocks {
                    visit(map, block.block_hash);
                }
            }
            Some(Data::Removed(removed)) => {
                let map = &blocks.tiers[Tier::of_event(removed.tier)];
                for &hash in &removed.block_hashes {
                    visit(map, hash);
                }
            }
            Some(Data::Cleared(_)) | None => {}
        }
    }
}

/// The passes of [`LiveState::prefetch`] over the blocks `for_each_block`
/// visits: what every block's index lookup reads, then every record, then
/// the bytes of each block found. Each pass reads what the one before it
/// fetched, so the lookups of a payload's blocks wait for memory together
/// rather than one after the other.
fn prefetch_passes(for_each_block: impl Fn(&mut dyn FnMut(&TierBlocks, i64))) {
    for_each_block(&mut |tier, hash| tier.prefetch_lookup(hash));
    for_each_block(&mut |tier, hash| tier.prefetch_record(hash));
    for_each_block(&mut |tier, hash| {
        if let Some(encoded) = tier.record(hash).and_then(|record| record.encoded.as_ref()) {
            prefetch::prefetch(encoded.ptr());
        }
    });
}

/// Hands out one shared `Arc` per distinct `StoreFields`, dropping entries no
/// block uses any more once the table has doubled since the last sweep (so
/// per-request values such as session ids cannot grow it without bound).
#[derive(Debug, Default)]
struct Interner {
    /// Each store's fields with a bound on their encoded length as a store
    /// (`StoreFields::store_len_bound`), worked out once per distinct fields.
    /// Looked up by borrowed fields, so a store already shared allocates
    /// nothing. The fields are the engine's, so the hash is seeded at
    /// random (foldhash: std's SipHash showed in the drain's profile).
    table: hashbrown::HashTable<(Arc<StoreFields>, usize)>,
    hasher: foldhash::fast::RandomState,
    sweep_at: usize,
}

impl Interner {
    /// The shared fields and a bound on their encoded length as a store.
    fn intern(&mut self, fields: StoreFieldsRef<'_>) -> (Arc<StoreFields>, usize) {
        let hash = self.hasher.hash_one(fields);
        if let Some((shared, len)) = self
            .table
            .find(hash, |(shared, _)| shared.borrowed() == fields)
        {
            return (Arc::clone(shared), *len);
        }
        if self.table.len() >= self.sweep_at {
            self.table
                .retain(|(shared, _)| Arc::strong_count(shared) > 1);
            self.sweep_at = (self.table.len() * 2).max(64);
        }
        let fields = fields.to_fields();
        let len = fields.store_len_bound();
        let shared = Arc::new(fields);
        let hasher = &self.hasher;
        self.table
            .insert_unique(hash, (Arc::clone(&shared), len), |(shared, _)| {
                hasher.hash_one(shared.borrowed())
            });
        (shared, len)
    }
}

/// A store of `hashes` (a chain under `parent`) of `tokens` tokens each.
#[cfg(test)]
pub(crate) fn stored_event(
    parent: Option<i64>,
    hashes: &[i64],
    tier: Tier,
    tokens: usize,
) -> KvCacheEvent {
    KvCacheEvent {
        event_id: 1,
        data: Some(Data::Stored(KvBlocksStored {
            blocks: hashes
                .iter()
                .map(|&block_hash| crate::proto::common::KvBlock {
                    block_hash,
                    token_ids: vec![3; tokens],
                    block_size: tokens as i32,
                    ..Default::default()
                })
                .collect(),
            parent_block_hash: parent,
            tier: Some(tier as i32),
            ..Default::default()
        })),
    }
}

/// Events as the drain has them from the converter (a removal's `tier` and
/// hashes, the event already encoded; a store's fields and its blocks'):
/// looked up and applied as the built events would be.
impl LiveState {
    /// Brings into the cache what looking up the blocks `lookups` names
    /// (by their events' `tier` and their hashes) will read, in the passes
    /// of [`LiveState::prefetch`].
    pub fn prefetch_lookups<'h>(
        &self,
        rank: u32,
        lookups: impl Iterator<Item = (Option<i32>, &'h [i64])> + Clone,
    ) {
        let Some(blocks) = self.ranks.get(&rank) else {
            return;
        };
        prefetch_passes(|visit| {
            for (tier, hashes) in lookups.clone() {
                let map = &blocks.tiers[Tier::of_event(tier)];
                hashes.iter().for_each(|&hash| visit(map, hash));
            }
        });
    }

    /// Records that `rank`'s blocks `hashes` of tier `tier` were removed.
    pub fn remove_blocks(&mut self, rank: u32, tier: Option<i32>, hashes: &[i64]) {
        let Some(blocks) = self.ranks.get_mut(&rank) else {
            return;
        };
        let tier = Tier::of_event(tier);
        let map = &mut blocks.tiers[tier];
        for &hash in hashes {
            if map.remove_copy(hash, &mut self.spare_bytes) {
                blocks.copies[tier] -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::{KvBlock, KvCacheCleared};

    fn store(parent: Option<i64>, hashes: &[i64], tier: Tier) -> KvCacheEvent {
        stored_event(parent, hashes, tier, 2)
    }

    fn remove(hashes: &[i64], tier: Tier) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 2,
            data: Some(Data::Removed(KvBlocksRemoved {
                block_hashes: hashes.to_vec(),
                tier: Some(tier as i32),
                ..Default::default()
            })),
        }
    }

    fn live(state: &LiveState, rank: u32, tier: Tier) -> Vec<i64> {
        let mut hashes: Vec<i64> = state
            .rank(rank)
            .map(|blocks| blocks.tier(tier).map(|(hash, _)| hash).collect())
            .unwrap_or_default();
        hashes.sort();
        hashes
    }

    #[test]
    fn a_store_s_length_bound_holds_for_any_parent_and_is_exact_at_the_widest() {
        use prost::Message;
        let text = |length: usize| Some("x".repeat(length));
        let widest = StoreFields {
            tier: Some(i32::MIN),
            medium: text(3),
            group_idx: Some(u32::MAX),
            kv_cache_spec_kind: text(200),
            kv_cache_spec_sliding_window: Some(u32::MAX),
            locality: Some(i32::MIN),
            ownership: text(0),
            session_id: text(127),
            lora_name: text(128),
            cache_salt: text(20_000),
            lora_id: Some(-1),
            cache_level: Some(-1),
        };
        let bound = widest.store_len_bound();
        assert_eq!(widest.to_store(Some(i64::MIN)).encoded_len(), bound);
        for fields in [
            StoreFields::default(),
            StoreFieldsRef::of(&KvBlocksStored::default(), (None, None)).to_fields(),
        ] {
            for parent in [None, Some(0), Some(1), Some(-1)] {
                assert!(fields.to_store(parent).encoded_len() <= fields.store_len_bound());
            }
        }
    }

    #[test]
    fn a_record_encodes_exactly_as_prost_encodes_its_block_under_its_store_s_lora_and_level() {
        use crate::proto::common::{KvBlockExtraKey, kv_block_extra_key::Key};
        use prost::Message;
        let mut state = LiveState::default();
        let mut event = store(None, &[0, -9, i64::MAX, 5], Tier::Host);
        let Some(Data::Stored(stored)) = event.data.as_mut() else {
            unreachable!()
        };
        stored.blocks[0].token_ids.clear();
        stored.blocks[0].lora_id = Some(-3);
        stored.blocks[0].cache_level = Some(1);
        stored.blocks[1].lora_id = Some(7);
        stored.blocks[2].extra_keys = vec![KvBlockExtraKey {
            key: Some(Key::Text("img".into())),
        }];
        stored.blocks[2].token_ids = vec![0, 300_000, u32::MAX];
        stored.blocks[3].token_ids = vec![127; 40];
        let as_stored: Vec<KvBlock> = stored
            .blocks
            .iter()
            .map(|block| KvBlock {
                lora_id: Some(-3),
                cache_level: Some(1),
                ..block.clone()
            })
            .collect();
        state.apply(0, &mut event);
        let blocks = state.rank(0).unwrap();
        let walked: Vec<Vec<u8>> = blocks
            .tier(Tier::Host)
            .map(|(hash, record)| {
                let block = record.encoded_block(hash);
                let mut encoded = Vec::new();
                block.encode(&mut encoded);
                assert_eq!(block.encoded_len(), encoded.len());
                encoded
            })
            .collect();
        let expected: Vec<Vec<u8>> = as_stored.iter().map(Message::encode_to_vec).collect();
        assert_eq!(walked, expected);
    }

    #[test]
    fn a_block_record_fits_in_32_bytes() {
        assert!(std::mem::size_of::<BlockRecord>() <= 32);
    }

    #[test]
    fn stores_and_removals_leave_exactly_the_live_blocks_per_rank_and_tier() {
        let mut state = LiveState::default();
        state.apply(0, &mut store(None, &[1, 2, 3], Tier::Device));
        state.apply(0, &mut store(None, &[1], Tier::Host));
        state.apply(1, &mut store(None, &[9], Tier::Device));
        state.apply(0, &mut remove(&[2], Tier::Device));
        assert_eq!(live(&state, 0, Tier::Device), vec![1, 3]);
        assert_eq!(live(&state, 0, Tier::Host), vec![1]);
        assert_eq!(live(&state, 1, Tier::Device), vec![9]);
        let block = state
            .rank(0)
            .unwrap()
            .tier_blocks(Tier::Device)
            .get(3)
            .unwrap();
        assert_eq!(
            block.entry.1.parent(),
            Some(2),
            "a block's parent is the block before it in its store"
        );
    }

    #[test]
    fn a_hash_stored_twice_is_two_copies_and_needs_two_removals() {
        let mut state = LiveState::default();
        state.apply(0, &mut store(None, &[5], Tier::Device));
        state.apply(0, &mut store(None, &[5], Tier::Device));
        assert_eq!(state.rank(0).unwrap().counts().total(), 2);
        state.apply(0, &mut remove(&[5], Tier::Device));
        assert_eq!(live(&state, 0, Tier::Device), vec![5]);
        state.apply(0, &mut remove(&[5], Tier::Device));
        assert!(live(&state, 0, Tier::Device).is_empty());
    }

    #[test]
    fn copies_are_counted_up_to_eight() {
        let mut state = LiveState::default();
        for _ in 0..12 {
            state.apply(0, &mut store(None, &[5], Tier::Device));
        }
        assert_eq!(
            state.rank(0).unwrap().counts().total(),
            u64::from(MAX_COPIES)
        );
    }

    #[test]
    fn a_clear_forgets_every_rank_as_the_router_does() {
        let mut state = LiveState::default();
        state.apply(0, &mut store(None, &[1], Tier::Device));
        state.apply(1, &mut store(None, &[2], Tier::Device));
        let mut clear = KvCacheEvent {
            event_id: 3,
            data: Some(Data::Cleared(KvCacheCleared::default())),
        };
        state.apply(1, &mut clear);
        assert_eq!(state.ranks().count(), 0);
        state.apply(0, &mut store(None, &[4], Tier::Device));
        assert_eq!(live(&state, 0, Tier::Device), vec![4]);
    }

    #[test]
    fn a_store_without_lora_or_salt_inherits_them_from_its_parent_on_the_same_tier() {
        let mut state = LiveState::default();
        let mut root = store(None, &[1], Tier::Device);
        if let Some(Data::Stored(stored)) = root.data.as_mut() {
            stored.lora_name = Some("sql".into());
            stored.cache_salt = Some("tenant-a".into());
        }
        state.apply(0, &mut root);
        let mut child = store(Some(1), &[2], Tier::Device);
        state.apply(0, &mut child);
        let Some(Data::Stored(child)) = child.data else {
            unreachable!()
        };
        assert_eq!(child.lora_name.as_deref(), Some("sql"));
        assert_eq!(child.cache_salt.as_deref(), Some("tenant-a"));

        let mut other_tier = store(Some(1), &[3], Tier::Host);
        state.apply(0, &mut other_tier);
        let Some(Data::Stored(other_tier)) = other_tier.data else {
            unreachable!()
        };
        assert_eq!(
            other_tier.lora_name, None,
            "a parent on another tier is not inherited from"
        );
    }

    #[test]
    fn a_cut_stays_as_it_was_while_the_state_moves_on() {
        let mut state = LiveState::default();
        state.apply(0, &mut store(None, &[1, 2], Tier::Device));
        let cut = state.cut();
        state.apply(0, &mut remove(&[1], Tier::Device));
        state.apply(0, &mut store(None, &[7], Tier::Device));
        let mut in_cut: Vec<i64> = cut[&0].tier(Tier::Device).map(|(h, _)| h).collect();
        in_cut.sort();
        assert_eq!(in_cut, vec![1, 2]);
        assert_eq!(live(&state, 0, Tier::Device), vec![2, 7]);
    }

    #[test]
    fn a_removed_block_s_buffer_serves_the_next_new_block_but_never_while_a_cut_holds_it() {
        let stored_with = |hash: i64, token: u32| {
            let mut event = store(None, &[hash], Tier::Device);
            if let Some(Data::Stored(stored)) = event.data.as_mut() {
                stored.blocks[0].token_ids = vec![token; 2];
            }
            event
        };
        let record = |blocks: &RankBlocks, hash| {
            blocks
                .tier_blocks(Tier::Device)
                .record(hash)
                .unwrap()
                .clone()
        };
        let tokens = |record: &BlockRecord, hash| record.encoded_block(hash).to_block().token_ids;
        let buffer = |record: &BlockRecord| record.encoded.as_ref().unwrap().ptr();
        let mut state = LiveState::default();
        state.apply(0, &mut stored_with(1, 10));
        let cut = state.cut();
        state.apply(0, &mut remove(&[1], Tier::Device));
        state.apply(0, &mut stored_with(2, 20));
        assert_eq!(
            tokens(&record(&cut[&0], 1), 1),
            [10, 10],
            "the cut keeps its block"
        );
        assert_eq!(
            state.spare_bytes.len(),
            0,
            "block 1's buffer stays the cut's"
        );
        let buffer_of_2 = buffer(&record(state.rank(0).unwrap(), 2));
        state.apply(0, &mut remove(&[2], Tier::Device));
        assert_eq!(state.spare_bytes.len(), 1);
        state.apply(0, &mut stored_with(3, 30));
        assert_eq!(state.spare_bytes.len(), 0);
        let record_3 = record(state.rank(0).unwrap(), 3);
        assert_eq!(tokens(&record_3, 3), [30, 30]);
        assert_eq!(buffer(&record_3), buffer_of_2, "block 2's buffer, refilled");
        assert_eq!(tokens(&record(&cut[&0], 1), 1), [10, 10]);
    }

    #[test]
    fn unused_store_fields_are_released() {
        let mut interner = Interner::default();
        let mut kept = Vec::new();
        for session in 0..1000 {
            let session_id = format!("s{session}");
            let (shared, _) = interner.intern(StoreFieldsRef {
                session_id: Some(&session_id),
                ..StoreFields::default().borrowed()
            });
            if session % 100 == 0 {
                kept.push(shared);
            }
        }
        assert!(
            interner.table.len() < 300,
            "table holds {}",
            interner.table.len()
        );
        let (again, _) = interner.intern(StoreFieldsRef {
            session_id: Some("s100"),
            ..StoreFields::default().borrowed()
        });
        assert!(kept.iter().any(|k| Arc::ptr_eq(k, &again)));
    }
}
