//! One rank's blocks: each engine hash it holds and the tree node it names.
//!
//! Invariants:
//! - One entry per engine hash. A node records the engine hash the rank
//!   that made it named it by ([`super::nodes::Node::engine_hash`]); a rank
//!   naming the node alike keeps the node's id alone (4 bytes, `by_node`,
//!   in a table that grows by half, not double: [`super::spilling_table`]),
//!   found by that hash read from the node. A rank naming a node otherwise
//!   (an engine that hashes differently, a second name for the same tokens)
//!   keeps the pair itself (`renamed`), and the name in the node's list of
//!   such names (`renamed_of`) at the slot the entry records, so adding,
//!   moving or forgetting a name costs the same however many names a node
//!   has. Every live block of a fleet has one such entry, so its size is
//!   most of the index's memory per block.
//! - Every entry names a node the rank holds: when the rank stops holding a
//!   node, every name it gave the node goes ([`RankBlocks::forget_node`]), as
//!   Dynamo's tree detaches the block from every name. So a node is live
//!   while named, the hash it is found by cannot change under it, and a
//!   freed node's id, reused, is never reached by an old name.
//! - Hashes are found with a per-process random seed so an engine cannot
//!   choose hashes that collide in advance.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::FxHashMap;

use super::nodes::Nodes;
use super::spilling_table::{Rebuilt, SpillingTable};

/// A name that is not its node's own.
#[derive(Clone, Copy, Debug)]
struct Renamed {
    engine_hash: i64,
    node: u32,
    /// Where the name is in its node's list ([`RankBlocks::renamed_of`]).
    slot: u32,
}

/// A rank's engine hashes and their nodes.
#[derive(Clone, Debug, Default)]
pub struct RankBlocks {
    /// Nodes the rank names by their own [`super::nodes::Node::engine_hash`].
    by_node: SpillingTable<u32>,
    /// Names that are not their node's own, found by name.
    renamed: HashTable<Renamed>,
    /// The same names, listed by node.
    renamed_of: FxHashMap<u32, Vec<i64>>,
    hasher: foldhash::fast::RandomState,
}

impl RankBlocks {
    /// An empty map whose hashes are seeded with `hasher`'s seed.
    pub fn with_hasher(hasher: foldhash::fast::RandomState) -> Self {
        RankBlocks {
            by_node: SpillingTable::default(),
            renamed: HashTable::new(),
            renamed_of: FxHashMap::default(),
            hasher,
        }
    }

    /// How many engine hashes.
    pub fn len(&self) -> usize {
        self.by_node.len() + self.renamed.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The node `engine_hash` names.
    pub fn get(&self, nodes: &Nodes, engine_hash: i64) -> Option<u32> {
        let hash = self.hasher.hash_one(engine_hash);
        self.by_node
            .find(hash, |&id| nodes[id].engine_hash == engine_hash)
            .copied()
            .or_else(|| {
                self.renamed
                    .find(hash, |entry| entry.engine_hash == engine_hash)
                    .map(|entry| entry.node)
            })
    }

    /// Makes `engine_hash` name `node` (which the rank holds); returns the
    /// node it named before.
    pub fn insert(&mut self, nodes: &Nodes, engine_hash: i64, node: u32) -> Option<u32> {
        let hash = self.hasher.hash_one(engine_hash);
        let old = if let Some(&named) = self
            .by_node
            .find(hash, |&id| nodes[id].engine_hash == engine_hash)
        {
            if named == node {
                return Some(node);
            }
            self.by_node.remove(hash, |&id| id == named);
            Some(named)
        } else if let Ok(named) = self
            .renamed
            .find_entry(hash, |entry| entry.engine_hash == engine_hash)
        {
            if named.get().node == node {
                return Some(node);
            }
            let (entry, _) = named.remove();
            self.unlist(entry);
            Some(entry.node)
        } else {
            None
        };
        let hasher = &self.hasher;
        if nodes[node].engine_hash == engine_hash {
            self.by_node
                .insert_unique(hash, node, |&id| hasher.hash_one(nodes[id].engine_hash));
        } else {
            let names = self.renamed_of.entry(node).or_default();
            let slot = u32::try_from(names.len()).expect("fewer than 2^32 names of a node");
            names.push(engine_hash);
            let entry = Renamed {
                engine_hash,
                node,
                slot,
            };
            self.renamed
                .insert_unique(hash, entry, |entry| hasher.hash_one(entry.engine_hash));
        }
        old
    }

    /// Takes `entry`, no longer in `renamed`, out of its node's list: the
    /// last name moves to its slot.
    fn unlist(&mut self, entry: Renamed) {
        let std::collections::hash_map::Entry::Occupied(mut listed) =
            self.renamed_of.entry(entry.node)
        else {
            unreachable!("every renamed entry is listed under its node");
        };
        let names = listed.get_mut();
        names.swap_remove(entry.slot as usize);
        if let Some(&moved) = names.get(entry.slot as usize) {
            let hash = self.hasher.hash_one(moved);
            if let Some(moved) = self
                .renamed
                .find_mut(hash, |other| other.engine_hash == moved)
            {
                moved.slot = entry.slot;
            }
        } else if names.is_empty() {
            listed.remove();
        }
    }

    /// Forgets every name of `node` (still live), which the rank no longer
    /// holds; returns how many there were.
    pub fn forget_node(&mut self, nodes: &Nodes, node: u32) -> usize {
        let mut forgotten = 0;
        let own_hash = self.hasher.hash_one(nodes[node].engine_hash);
        if self.by_node.remove(own_hash, |&id| id == node).is_some() {
            forgotten += 1;
        }
        for name in self.renamed_of.remove(&node).unwrap_or_default() {
            let hash = self.hasher.hash_one(name);
            if let Ok(named) = self
                .renamed
                .find_entry(hash, |entry| entry.engine_hash == name)
            {
                named.remove();
                forgotten += 1;
            }
        }
        forgotten
    }

    /// The rank's map of nodes built again, when its growth or its
    /// tombstones made that due ([`SpillingTable::rebuilt`]).
    pub fn rebuilt(&self, nodes: &Nodes) -> Option<Rebuilt<u32>> {
        let hasher = &self.hasher;
        self.by_node
            .rebuilt(|&id| hasher.hash_one(nodes[id].engine_hash))
    }

    /// Puts `rebuilt`, made by [`RankBlocks::rebuilt`] with nothing changed
    /// since, in place.
    pub fn install(&mut self, rebuilt: Rebuilt<u32>) {
        self.by_node.install(rebuilt);
    }

    /// Every (engine hash, node), in no order.
    pub fn iter<'a>(&'a self, nodes: &'a Nodes) -> impl Iterator<Item = (i64, u32)> + 'a {
        let by_node = self.by_node.iter().map(|&id| (nodes[id].engine_hash, id));
        let renamed = self
            .renamed
            .iter()
            .map(|entry| (entry.engine_hash, entry.node));
        by_node.chain(renamed)
    }

    /// Every node named, each once (a node the rank named twice is
    /// released once), sorted.
    pub fn into_nodes(self) -> Vec<u32> {
        let mut nodes: Vec<u32> = self
            .by_node
            .into_iter()
            .chain(self.renamed_of.into_keys())
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }
}

#[cfg(test)]
mod tests {
    use super::super::nodes::{NONE, Node};
    use super::*;

    /// Whether every renamed entry is at its slot of its node's list, and
    /// the lists hold nothing else.
    fn listed_at_their_slots(blocks: &RankBlocks) -> bool {
        let listed: usize = blocks.renamed_of.values().map(Vec::len).sum();
        listed == blocks.renamed.len()
            && blocks.renamed.iter().all(|entry| {
                blocks
                    .renamed_of
                    .get(&entry.node)
                    .and_then(|names| names.get(entry.slot as usize))
                    == Some(&entry.engine_hash)
            })
    }

    /// Node `i + 1` made under engine hash `hashes[i]`.
    fn nodes_named(hashes: &[i64]) -> (Nodes, Vec<u32>) {
        let mut nodes = Nodes::new(Node::new(NONE, 0, NONE, 0));
        let ids = hashes
            .iter()
            .map(|&engine_hash| nodes.add(Node::new(0, 1, NONE, engine_hash)))
            .collect();
        (nodes, ids)
    }

    #[test]
    fn a_hash_names_the_node_it_was_last_given_until_its_node_is_forgotten() {
        let (nodes, ids) = nodes_named(&[-5, i64::MAX, 7]);
        let mut blocks = RankBlocks::default();
        assert_eq!(blocks.insert(&nodes, -5, ids[0]), None);
        assert_eq!(blocks.insert(&nodes, i64::MAX, ids[1]), None);
        // -5 now names a node made under another hash: kept as renamed.
        assert_eq!(blocks.insert(&nodes, -5, ids[2]), Some(ids[0]));
        assert_eq!(
            (
                blocks.get(&nodes, -5),
                blocks.get(&nodes, i64::MAX),
                blocks.len()
            ),
            (Some(ids[2]), Some(ids[1]), 2)
        );
        assert_eq!((blocks.by_node.len(), blocks.renamed.len()), (1, 1));
        assert!(listed_at_their_slots(&blocks));
        assert_eq!(blocks.forget_node(&nodes, ids[2]), 1);
        assert_eq!(
            (
                blocks.get(&nodes, -5),
                blocks.len(),
                blocks.renamed_of.len()
            ),
            (None, 1, 0)
        );
        let mut left: Vec<(i64, u32)> = blocks.iter(&nodes).collect();
        left.sort_unstable();
        assert_eq!(left, [(i64::MAX, ids[1])]);
        assert_eq!(blocks.into_nodes(), [ids[1]]);
    }

    #[test]
    fn forgetting_a_node_forgets_every_name_of_it_and_no_other() {
        let (nodes, ids) = nodes_named(&[40, 41]);
        let mut blocks = RankBlocks::default();
        blocks.insert(&nodes, 40, ids[0]);
        blocks.insert(&nodes, 90, ids[0]);
        blocks.insert(&nodes, 91, ids[0]);
        blocks.insert(&nodes, 41, ids[1]);
        blocks.insert(&nodes, 92, ids[1]);
        assert_eq!(blocks.forget_node(&nodes, ids[0]), 3);
        assert_eq!(blocks.forget_node(&nodes, ids[0]), 0);
        let mut left: Vec<(i64, u32)> = blocks.iter(&nodes).collect();
        left.sort_unstable();
        assert_eq!(left, [(41, ids[1]), (92, ids[1])]);
        assert!(listed_at_their_slots(&blocks));
    }

    #[test]
    fn names_moved_off_a_node_one_by_one_keep_every_other_name_at_its_slot() {
        let (nodes, ids) = nodes_named(&[1, 2]);
        let mut blocks = RankBlocks::default();
        let names: Vec<i64> = (100..600).collect();
        for &name in &names {
            blocks.insert(&nodes, name, ids[0]);
        }
        // Every third name moves to the other node, from the middle out.
        for &name in names.iter().rev().step_by(3) {
            assert_eq!(blocks.insert(&nodes, name, ids[1]), Some(ids[0]));
            assert!(listed_at_their_slots(&blocks));
        }
        let moved = names.iter().rev().step_by(3).count();
        assert_eq!(blocks.forget_node(&nodes, ids[0]), names.len() - moved);
        assert_eq!(blocks.forget_node(&nodes, ids[1]), moved);
        assert!(blocks.is_empty() && blocks.renamed_of.is_empty());
    }
}
