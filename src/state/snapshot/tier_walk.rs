//! One tier's walk in store order, parents first, as stores.
//!
//! Invariant: every live block of the tier is emitted exactly once (each
//! extra copy as a one-block store of its own), a block never before its
//! parent, and what is held besides the cut is one window of the next
//! blocks (16 bytes a block: its order and a reference into the cut; at
//! most an eighth of the tier for the walk a subscriber reads, the whole
//! tier for the planning walk, which never waits), the chain being written
//! and the blocks emitted ahead of their turn.

use std::sync::Arc;

use rustc_hash::FxHashSet;

use super::chunker::{Chunker, StorePiece};
use crate::state::prefetch::prefetch;
use crate::state::tier::Tier;
use crate::state::{BlockRecord, RankBlocks, StoreFields};

/// Fewest blocks fetched into a window; a tier is otherwise scanned at most
/// `WINDOW_SCANS` times.
const MIN_WINDOW: usize = 4096;
const WINDOW_SCANS: usize = 8;

/// How much of a tier's store order a walk holds at once.
#[derive(Clone, Copy, Debug)]
pub(super) enum Reach {
    /// An eighth of the tier (at least `MIN_WINDOW` blocks), found by one
    /// scan each: for the walk that hands chunks out as a subscriber reads
    /// them, which holds its window as long as the subscriber keeps it
    /// waiting.
    Eighth,
    /// The whole tier, found by one scan: for the planning walk, which runs
    /// to its end within one call under an encode slot (at most
    /// `--max-snapshot-encodes` at once) and frees it before returning.
    Whole,
}

/// A block as the cut holds it: its hash beside its record.
type Entry<'cut> = &'cut (i64, BlockRecord);

/// Emits every live block of one tier in store order, parents first.
///
/// Blocks go in store order, which is parents-first except where a parent
/// was evicted and stored again after its child: such a child pulls its
/// later ancestors out ahead of their turn. A block whose parent is the
/// block just emitted extends the current chain without any lookup, so the
/// walk reads the state in order instead of chasing parent links. Store
/// order is read a window at a time (the smallest orders not taken yet, by
/// one scan of the tier), so a walk of `Reach::Eighth` never holds the
/// whole tier's order. The window keeps a reference to each block it took,
/// so no block is looked up again by hash.
pub(super) struct TierWalk<'cut> {
    pub(super) reach: Reach,
    /// The next blocks with their orders, largest first (taken from the end).
    window: Vec<(u64, Entry<'cut>)>,
    /// Largest order taken into a window so far.
    taken_through: Option<u64>,
    /// The last window held every block left.
    exhausted: bool,
    /// Blocks already emitted ahead of their turn.
    early: FxHashSet<i64>,
    /// The chain being emitted: each block the parent of the next.
    run: PathWriter<'cut>,
    /// The chain's last block so far.
    run_last: Option<i64>,
}

/// How far ahead of the walk a window's blocks are fetched into the cache:
/// the records sit in hash order, so each is a cache miss the walk would
/// otherwise wait for, one after the other.
const PREFETCH_RECORDS: usize = 16;
/// Tokens are fetched later than their record, whose pointer names them.
const PREFETCH_TOKENS: usize = 8;

impl<'cut> TierWalk<'cut> {
    pub(super) fn new(reach: Reach) -> Self {
        Self {
            reach,
            window: Vec::new(),
            taken_through: None,
            exhausted: false,
            early: FxHashSet::default(),
            run: PathWriter::default(),
            run_last: None,
        }
    }

    /// Emits the next block in store order; false once the tier is done.
    pub(super) fn step(
        &mut self,
        blocks: &'cut RankBlocks,
        tier: Tier,
        chunker: &mut Chunker,
    ) -> bool {
        let Some((order, entry)) = self.next_in_order(blocks, tier) else {
            self.run.finish(chunker);
            return false;
        };
        let &(hash, ref record) = entry;
        if self.early.remove(&hash) {
            return true;
        }
        let parent = record.parent();
        let continues = parent.is_some() && parent == self.run_last;
        if !continues {
            self.run.finish(chunker);
            // Ancestors stored after this block are not out yet.
            let mut ancestors = Vec::new();
            let mut next = parent;
            while let Some(ancestor) = next {
                match blocks.entry(tier, ancestor) {
                    Some(found) if found.1.order() > order && self.early.insert(ancestor) => {
                        ancestors.push(found);
                        next = found.1.parent();
                    }
                    _ => break,
                }
            }
            let mut early_path = PathWriter::default();
            for &ancestor in ancestors.iter().rev() {
                early_path.add(ancestor, chunker);
            }
            early_path.finish(chunker);
        }
        self.run.add(entry, chunker);
        self.run_last = Some(hash);
        true
    }

    fn next_in_order(
        &mut self,
        blocks: &'cut RankBlocks,
        tier: Tier,
    ) -> Option<(u64, Entry<'cut>)> {
        if self.window.is_empty() && !self.exhausted {
            self.refill(blocks, tier);
        }
        let next = self.window.pop()?;
        let ahead = |distance: usize| {
            let len = self.window.len();
            (len >= distance).then(|| self.window[len - distance].1)
        };
        if let Some(entry) = ahead(PREFETCH_RECORDS) {
            // Entries are 56 bytes, so most straddle two cache lines.
            let first = std::ptr::from_ref(entry).cast::<u8>();
            prefetch(first);
            prefetch(first.wrapping_add(size_of_val(entry) - 1));
        }
        if let Some(entry) = ahead(PREFETCH_TOKENS) {
            // `ptr`, not the slice: the slice's length is read from the
            // very allocation being fetched.
            prefetch(entry.1.tokens.ptr());
        }
        Some(next)
    }

    /// Takes the next window: the smallest orders above `taken_through`.
    fn refill(&mut self, blocks: &'cut RankBlocks, tier: Tier) {
        let tier_blocks = usize::try_from(blocks.counts()[tier]).unwrap_or(usize::MAX);
        // The most blocks a window may hold; a whole-tier walk takes every
        // block in one scan.
        let limit = match self.reach {
            Reach::Eighth => Some((tier_blocks / WINDOW_SCANS).max(MIN_WINDOW)),
            Reach::Whole => None,
        };
        let keep_smallest = |window: &mut Vec<(u64, Entry<'cut>)>| {
            if let Some(size) = limit
                && window.len() > size
            {
                window.select_nth_unstable_by_key(size - 1, |&(order, _)| order);
                window.truncate(size);
            }
        };
        let mut window = std::mem::take(&mut self.window);
        let after = self.taken_through;
        for entry in blocks.tier_entries(tier) {
            let order = entry.1.order();
            if after.is_some_and(|after| order <= after) {
                continue;
            }
            window.push((order, entry));
            if limit.is_some_and(|size| window.len() == 2 * size) {
                keep_smallest(&mut window);
            }
        }
        keep_smallest(&mut window);
        self.exhausted = limit.is_none_or(|size| window.len() < size);
        if limit.is_some() {
            // Held until it is used up, maybe while a subscriber waits: not
            // the room it took to find it.
            window.shrink_to_fit();
        }
        window.sort_unstable_by_key(|&(order, _)| std::cmp::Reverse(order));
        self.taken_through = window.first().map(|&(order, _)| order).or(after);
        self.window = window;
    }
}

/// Emits a parent-linked path as stores, block by block as the walk
/// reaches them: one store per run of equal fields (split wherever a chunk
/// fills), then each extra copy alone once the path ends. Only the store
/// being filled and the blocks with extra copies are held, so a chain as
/// long as the whole tier costs no more than a short one.
#[derive(Default)]
struct PathWriter<'cut> {
    /// The store being filled and the fields every block of it shares.
    store: Option<(Arc<StoreFields>, StorePiece)>,
    /// Blocks of the path with more than one copy, in path order.
    copied: Vec<Entry<'cut>>,
}

impl<'cut> PathWriter<'cut> {
    fn add(&mut self, entry: Entry<'cut>, chunker: &mut Chunker) {
        let &(hash, ref record) = entry;
        let same_fields =
            matches!(&self.store, Some((fields, _)) if Arc::ptr_eq(fields, record.fields()));
        if !same_fields {
            if let Some((_, piece)) = self.store.take() {
                chunker.push_piece(piece);
            }
            let fields = Arc::clone(record.fields());
            let piece = StorePiece::new(&fields, record.parent());
            self.store = Some((fields, piece));
        }
        let (fields, piece) = self.store.as_mut().expect("a store is open");
        chunker.extend_store(fields, piece, hash, record);
        if record.copies() > 1 {
            self.copied.push(entry);
        }
    }

    /// Ends the path: its last store, then its extra copies.
    fn finish(&mut self, chunker: &mut Chunker) {
        if let Some((_, piece)) = self.store.take() {
            chunker.push_piece(piece);
        }
        for &(hash, ref record) in self.copied.drain(..) {
            for _ in 1..record.copies() {
                let mut piece = StorePiece::new(record.fields(), record.parent());
                chunker.extend_store(record.fields(), &mut piece, hash, record);
                chunker.push_piece(piece);
            }
        }
    }
}
