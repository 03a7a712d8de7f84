//! One tier's walk in store order, parents first, as stores.
//!
//! Invariant: every live block of the tier is emitted exactly once (each
//! extra copy as a one-block store of its own), a block never before its
//! parent, and what is held besides the cut is the walk's place in the
//! tier's records, the chain being written and the blocks emitted ahead of
//! their turn.

use std::sync::Arc;

use super::chunker::{Chunker, StorePiece};
use crate::state::StoreFields;
use crate::state::tier_blocks::{LiveBlock, LiveBlocks, TierBlocks};

/// Emits every live block of one tier in store order, parents first.
///
/// Blocks go in store order, which is parents-first except where a parent
/// was evicted and stored again after its child: such a child pulls its
/// later ancestors out ahead of their turn. A block whose parent is the
/// block just emitted extends the current chain without any lookup, so the
/// walk reads the tier's records in the order they sit in memory instead
/// of chasing parent links.
pub(super) struct TierWalk<'cut> {
    tier: &'cut TierBlocks,
    blocks: LiveBlocks<'cut>,
    /// Blocks already emitted ahead of their turn. Their hashes are the
    /// engine's, so the set's hash is seeded at random, unlike FxHash's.
    early: foldhash::HashSet<i64>,
    /// The chain being emitted: each block the parent of the next.
    run: PathWriter<'cut>,
    /// The chain's last block so far.
    run_last: Option<i64>,
}

impl<'cut> TierWalk<'cut> {
    pub(super) fn new(tier: &'cut TierBlocks) -> Self {
        Self {
            tier,
            blocks: tier.live(),
            early: foldhash::HashSet::default(),
            run: PathWriter::default(),
            run_last: None,
        }
    }

    /// Emits the next block in store order; false once the tier is done.
    pub(super) fn step(&mut self, chunker: &mut Chunker) -> bool {
        let Some(block) = self.blocks.next() else {
            self.run.finish(chunker);
            return false;
        };
        let &(hash, ref record) = block.entry;
        if !self.early.is_empty() && self.early.remove(&hash) {
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
                match self.tier.get(ancestor) {
                    Some(found)
                        if found.entry.1.order() > record.order()
                            && self.early.insert(ancestor) =>
                    {
                        ancestors.push(found);
                        next = found.entry.1.parent();
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
        self.run.add(block, chunker);
        self.run_last = Some(hash);
        true
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
    copied: Vec<LiveBlock<'cut>>,
}

impl<'cut> PathWriter<'cut> {
    fn add(&mut self, block: LiveBlock<'cut>, chunker: &mut Chunker) {
        let &(hash, ref record) = block.entry;
        let same_fields =
            matches!(&self.store, Some((fields, _)) if Arc::ptr_eq(fields, block.fields));
        if !same_fields {
            if let Some((_, piece)) = self.store.take() {
                chunker.push_piece(piece);
            }
            let fields = Arc::clone(block.fields);
            let piece = chunker.piece(&fields, record.parent());
            self.store = Some((fields, piece));
        }
        let (fields, piece) = self.store.as_mut().expect("a store is open");
        chunker.extend_store(fields, piece, hash, record);
        if block.copies > 1 {
            self.copied.push(block);
        }
    }

    /// Ends the path: its last store, then its extra copies.
    fn finish(&mut self, chunker: &mut Chunker) {
        if let Some((_, piece)) = self.store.take() {
            chunker.push_piece(piece);
        }
        for block in self.copied.drain(..) {
            let &(hash, ref record) = block.entry;
            for _ in 1..block.copies {
                let mut piece = chunker.piece(block.fields, record.parent());
                chunker.extend_store(block.fields, &mut piece, hash, record);
                chunker.push_piece(piece);
            }
        }
    }
}
