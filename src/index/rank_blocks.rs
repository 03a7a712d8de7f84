//! One rank's blocks: each engine hash it holds and the tree node it names.
//!
//! Invariant: one entry per engine hash, 12 bytes each (the hash and the
//! node, packed), found with a per-process random seed so an engine cannot
//! choose hashes that collide in advance. Every live block of a fleet has
//! one such entry, so its size is the index's memory per block.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

/// A packed (engine hash, node) pair: 12 bytes, not 16.
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(4))]
struct Block {
    engine_hash: i64,
    node: u32,
}

/// A rank's engine hashes and their nodes.
#[derive(Clone, Debug, Default)]
pub struct RankBlocks {
    blocks: HashTable<Block>,
    hasher: foldhash::fast::RandomState,
}

impl RankBlocks {
    /// An empty map whose hashes are seeded with `hasher`'s seed.
    pub fn with_hasher(hasher: foldhash::fast::RandomState) -> Self {
        RankBlocks {
            blocks: HashTable::new(),
            hasher,
        }
    }

    /// How many engine hashes.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The node `engine_hash` names.
    pub fn get(&self, engine_hash: i64) -> Option<u32> {
        let hash = self.hasher.hash_one(engine_hash);
        self.blocks
            .find(hash, |block| block.engine_hash == engine_hash)
            .map(|block| block.node)
    }

    /// Makes `engine_hash` name `node`; returns the node it named before.
    pub fn insert(&mut self, engine_hash: i64, node: u32) -> Option<u32> {
        let hash = self.hasher.hash_one(engine_hash);
        let hasher = &self.hasher;
        match self.blocks.entry(
            hash,
            |block| block.engine_hash == engine_hash,
            |block| hasher.hash_one(block.engine_hash),
        ) {
            Entry::Occupied(mut occupied) => {
                let old = occupied.get().node;
                occupied.get_mut().node = node;
                Some(old)
            }
            Entry::Vacant(vacant) => {
                vacant.insert(Block { engine_hash, node });
                None
            }
        }
    }

    /// Forgets `engine_hash`; returns the node it named.
    pub fn remove(&mut self, engine_hash: i64) -> Option<u32> {
        let hash = self.hasher.hash_one(engine_hash);
        self.blocks
            .find_entry(hash, |block| block.engine_hash == engine_hash)
            .ok()
            .map(|entry| entry.remove().0.node)
    }

    /// Every (engine hash, node), in no order.
    pub fn iter(&self) -> impl Iterator<Item = (i64, u32)> + '_ {
        self.blocks
            .iter()
            .map(|block| (block.engine_hash, block.node))
    }

    /// Every node, in no order.
    pub fn into_nodes(self) -> impl Iterator<Item = u32> {
        self.blocks.into_iter().map(|block| block.node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_takes_twelve_bytes() {
        assert_eq!(std::mem::size_of::<Block>(), 12);
    }

    #[test]
    fn a_hash_names_the_node_it_was_last_given_until_removed() {
        let mut blocks = RankBlocks::default();
        assert_eq!(blocks.insert(-5, 1), None);
        assert_eq!(blocks.insert(i64::MAX, 2), None);
        assert_eq!(blocks.insert(-5, 3), Some(1));
        assert_eq!(
            (blocks.get(-5), blocks.get(i64::MAX), blocks.len()),
            (Some(3), Some(2), 2)
        );
        assert_eq!(blocks.remove(-5), Some(3));
        assert_eq!(
            (blocks.get(-5), blocks.remove(-5), blocks.len()),
            (None, None, 1)
        );
        let mut left: Vec<(i64, u32)> = blocks.iter().collect();
        left.sort_unstable();
        assert_eq!(left, [(i64::MAX, 2)]);
        assert_eq!(blocks.into_nodes().collect::<Vec<_>>(), [2]);
    }
}
