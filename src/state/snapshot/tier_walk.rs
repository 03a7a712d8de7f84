//! One tier's walk in store order, parents first, as stores.
//!
//! Invariant: every live block of the tier is emitted exactly once (each
//! extra copy as a one-block store of its own), a block never before its
//! parent, and what is held besides the cut is one window of the next
//! orders (at most an eighth of the tier, 16 bytes a block), the chain
//! being written and the blocks emitted ahead of their turn.

use std::sync::Arc;

use rustc_hash::FxHashSet;

use super::chunker::{Chunker, StorePiece};
use crate::state::tier::Tier;
use crate::state::{BlockRecord, RankBlocks, StoreFields};

/// Fewest blocks fetched into a window; a tier is otherwise scanned at most
/// `WINDOW_SCANS` times.
const MIN_WINDOW: usize = 4096;
const WINDOW_SCANS: usize = 8;

/// Emits every live block of one tier in store order, parents first.
///
/// Blocks go in store order, which is parents-first except where a parent
/// was evicted and stored again after its child: such a child pulls its
/// later ancestors out ahead of their turn. A block whose parent is the
/// block just emitted extends the current chain without any lookup, so the
/// walk reads the state in order instead of chasing parent links. Store
/// order is read a window at a time (the smallest orders not taken yet, by
/// one scan of the tier), so the walk never holds the whole tier's order.
#[derive(Default)]
pub(super) struct TierWalk {
    /// The next (order, hash) pairs, largest first (taken from the end).
    window: Vec<(u64, i64)>,
    /// Largest order taken into a window so far.
    taken_through: Option<u64>,
    /// The last window held every block left.
    exhausted: bool,
    /// Blocks already emitted ahead of their turn.
    early: FxHashSet<i64>,
    /// The chain being emitted: each block the parent of the next.
    run: PathWriter,
    /// The chain's last block so far.
    run_last: Option<i64>,
}

impl TierWalk {
    /// Emits the next block in store order; false once the tier is done.
    pub(super) fn step(&mut self, blocks: &RankBlocks, tier: Tier, chunker: &mut Chunker) -> bool {
        let Some((order, hash)) = self.next_in_order(blocks, tier) else {
            self.run.finish(blocks, tier, chunker);
            return false;
        };
        if self.early.remove(&hash) {
            return true;
        }
        let record = record(blocks, tier, hash);
        let parent = record.parent();
        let continues = parent.is_some() && parent == self.run_last;
        if !continues {
            self.run.finish(blocks, tier, chunker);
            // Ancestors stored after this block are not out yet.
            let mut ancestors = Vec::new();
            let mut next = parent;
            while let Some(ancestor) = next {
                match blocks.get(tier, ancestor) {
                    Some(found) if found.order() > order && self.early.insert(ancestor) => {
                        ancestors.push((ancestor, found));
                        next = found.parent();
                    }
                    _ => break,
                }
            }
            let mut early_path = PathWriter::default();
            for &(ancestor, found) in ancestors.iter().rev() {
                early_path.add(ancestor, found, chunker);
            }
            early_path.finish(blocks, tier, chunker);
        }
        self.run.add(hash, record, chunker);
        self.run_last = Some(hash);
        true
    }

    fn next_in_order(&mut self, blocks: &RankBlocks, tier: Tier) -> Option<(u64, i64)> {
        if self.window.is_empty() && !self.exhausted {
            self.refill(blocks, tier);
        }
        self.window.pop()
    }

    /// Takes the next window: the smallest orders above `taken_through`.
    fn refill(&mut self, blocks: &RankBlocks, tier: Tier) {
        let tier_blocks = usize::try_from(blocks.counts()[tier]).unwrap_or(usize::MAX);
        let size = (tier_blocks / WINDOW_SCANS).max(MIN_WINDOW);
        let keep_smallest = |window: &mut Vec<(u64, i64)>| {
            if window.len() > size {
                window.select_nth_unstable(size - 1);
                window.truncate(size);
            }
        };
        let mut window = std::mem::take(&mut self.window);
        let after = self.taken_through;
        for (hash, record) in blocks.tier(tier) {
            let order = record.order();
            if after.is_some_and(|after| order <= after) {
                continue;
            }
            window.push((order, hash));
            if window.len() == 2 * size {
                keep_smallest(&mut window);
            }
        }
        keep_smallest(&mut window);
        self.exhausted = window.len() < size;
        window.sort_unstable_by(|a, b| b.cmp(a));
        self.taken_through = window.first().map(|&(order, _)| order).or(after);
        self.window = window;
    }
}

/// The record of a block the cut holds (the walk only names such blocks).
fn record(blocks: &RankBlocks, tier: Tier, hash: i64) -> &BlockRecord {
    blocks
        .get(tier, hash)
        .expect("the walk only names blocks of its cut")
}

/// Emits a parent-linked path as stores, block by block as the walk
/// reaches them: one store per run of equal fields (split wherever a chunk
/// fills), then each extra copy alone once the path ends. Only the store
/// being filled and the hashes with extra copies are held, so a chain as
/// long as the whole tier costs no more than a short one.
#[derive(Default)]
struct PathWriter {
    /// The store being filled and the fields every block of it shares.
    store: Option<(Arc<StoreFields>, StorePiece)>,
    /// Blocks of the path with more than one copy, in path order.
    copied: Vec<i64>,
}

impl PathWriter {
    fn add(&mut self, hash: i64, record: &BlockRecord, chunker: &mut Chunker) {
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
            self.copied.push(hash);
        }
    }

    /// Ends the path: its last store, then its extra copies.
    fn finish(&mut self, blocks: &RankBlocks, tier: Tier, chunker: &mut Chunker) {
        if let Some((_, piece)) = self.store.take() {
            chunker.push_piece(piece);
        }
        for hash in self.copied.drain(..) {
            let record = record(blocks, tier, hash);
            for _ in 1..record.copies() {
                let mut piece = StorePiece::new(record.fields(), record.parent());
                chunker.extend_store(record.fields(), &mut piece, hash, record);
                chunker.push_piece(piece);
            }
        }
    }
}
