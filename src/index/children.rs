//! How a child is found under its parent among its siblings: every node
//! that has a sibling, keyed by (parent, local hash). An only child (most
//! blocks of a chain) is its parent's first child and is found there
//! (`Tree::find_child`), so it costs the index no entry and a lookup no
//! probe.
//!
//! Invariants:
//! - An entry is the node's id alone (4 bytes); its key is read from the
//!   node itself.
//! - Keys are hashed with a per-process random seed, so blocks crafted to
//!   collide cannot be chosen in advance.
//! - The entries are spread over [`SHARDS`] tables by their hash, so a
//!   table that grows rehashes a 64th of the tree under the writer's lock,
//!   never the whole of it (8.4 million blocks rehashed at once held the
//!   tree for tens of milliseconds).

use std::hash::BuildHasher;

use hashbrown::HashTable;

use super::nodes::Nodes;

/// Tables the entries are spread over.
const SHARDS: usize = 64;

/// The index (see the module's invariants).
#[derive(Debug)]
pub struct Children {
    shards: Box<[HashTable<u32>]>,
    hasher: foldhash::fast::RandomState,
}

impl Default for Children {
    fn default() -> Self {
        Children {
            shards: (0..SHARDS).map(|_| HashTable::new()).collect(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }
}

impl Children {
    fn hash(&self, parent: u32, local: u64) -> u64 {
        self.hasher.hash_one((parent, local))
    }

    fn shard(hash: u64) -> usize {
        (hash >> (64 - SHARDS.trailing_zeros())) as usize
    }

    /// The child of `parent` with `local`.
    pub fn find(&self, nodes: &Nodes, parent: u32, local: u64) -> Option<u32> {
        let hash = self.hash(parent, local);
        self.shards[Self::shard(hash)]
            .find(hash, |&id| {
                let node = &nodes[id];
                node.parent == parent && node.local == local
            })
            .copied()
    }

    /// Adds `id`, a node not yet in the index.
    pub fn insert(&mut self, nodes: &Nodes, id: u32) {
        let hash = self.hash(nodes[id].parent, nodes[id].local);
        let hasher = &self.hasher;
        self.shards[Self::shard(hash)].insert_unique(hash, id, |&id| {
            hasher.hash_one((nodes[id].parent, nodes[id].local))
        });
    }

    /// How many nodes are indexed.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.iter().map(HashTable::len).sum()
    }

    /// Removes `id`.
    pub fn remove(&mut self, nodes: &Nodes, id: u32) {
        let hash = self.hash(nodes[id].parent, nodes[id].local);
        if let Ok(entry) = self.shards[Self::shard(hash)].find_entry(hash, |&entry| entry == id) {
            entry.remove();
        }
    }
}
