//! The tree's nodes: where they live and which ranks hold each.
//!
//! Invariants:
//! - A node takes 36 bytes: its local hash, the engine hash it was made
//!   under, its parent, its sibling links and one word for its holders:
//!   the one holder most blocks have, inline, or where several are listed.
//! - Nodes live in chunks of [`CHUNK`] that never move, so growing the tree
//!   copies nothing under the writer's lock and leaves no slack past the
//!   last chunk (a vector that doubles would copy every node and, right
//!   after, hold twice what it uses).
//! - A node's holders are sorted by member, a member at most once, each
//!   with at least one tier.

use super::tier::Tier;

/// No node (the end of a sibling list, or no parent).
pub const NONE: u32 = u32::MAX;

/// Nodes per chunk (1.25 MiB of nodes).
const CHUNK_BITS: u32 = 15;
const CHUNK: usize = 1 << CHUNK_BITS;

/// Member ids are below this (28 bits, the rest of a [`Held`] is its tiers).
pub const MAX_MEMBERS: u32 = (1 << 28) - 1;

/// A member and the tiers it holds a node in, in one word: the member in the
/// high 28 bits (so words sort by member), the tiers in the low 4.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Held(u32);

/// A node's holders in one word, of [`Held`]'s type so the one holder
/// most nodes have is borrowed in place. A holder always has a tier, so a
/// word with no tier bits is never one: it is [`NO_HOLDER`], or the index
/// + 1 of the list where several are, above the tier bits.
const NO_HOLDER: Held = Held(0);

/// Holder lists are fewer than this (28 bits, above the tier bits).
const MAX_LISTS: usize = (1 << 28) - 1;

/// What a node's holder word says.
enum HolderWord {
    None,
    One,
    Listed(usize),
}

impl Held {
    /// `member` holding in `tiers` (bits of [`Tier::bit`]).
    pub fn new(member: u32, tiers: u8) -> Self {
        debug_assert!(member < MAX_MEMBERS && tiers != 0 && tiers <= 0xF);
        Held(member << 4 | u32::from(tiers))
    }

    /// Who holds.
    pub fn member(self) -> u32 {
        self.0 >> 4
    }

    /// In which tiers.
    pub fn tiers(self) -> u8 {
        (self.0 & 0xF) as u8
    }

    /// The word of a node whose holders are listed at `list`.
    fn listed(list: usize) -> Self {
        assert!(list < MAX_LISTS, "fewer than 2^28 - 1 holder lists");
        Held(((list + 1) as u32) << 4)
    }

    /// Whether `one` and `other` list the same holders in the same tiers.
    /// Every word is compared, with no early exit, so the comparison runs a
    /// vector register at a time: a prefix the whole fleet shares compares
    /// a list of hundreds of holders at each block of a query's walk.
    pub fn same_lists(one: &[Held], other: &[Held]) -> bool {
        one.len() == other.len()
            && one
                .iter()
                .zip(other)
                .fold(0, |differ, (a, b)| differ | (a.0 ^ b.0))
                == 0
    }

    /// Read as a node's holder word.
    fn word(self) -> HolderWord {
        if self.tiers() != 0 {
            HolderWord::One
        } else if self == NO_HOLDER {
            HolderWord::None
        } else {
            HolderWord::Listed((self.0 >> 4) as usize - 1)
        }
    }
}

const _: () = assert!(Tier::WALK.len() <= 4);

/// One block in the tree. Packed to 4-byte alignment: the two hashes
/// would otherwise pad it to 40 bytes, and a fleet holds millions.
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(4))]
pub struct Node {
    /// This block's local hash (its key under `parent`).
    pub local: u64,
    /// The engine hash the rank that made it named it by: the ranks naming
    /// it alike find it through this ([`super::rank_blocks`]).
    pub engine_hash: i64,
    pub parent: u32,
    /// The first of its children ([`NONE`] for a leaf), linked through
    /// `next` and `previous`, so a removal can reach a rank's blocks under it.
    pub first_child: u32,
    pub next: u32,
    pub previous: u32,
    /// The one holder, or where several are listed ([`HolderWord`]).
    holders: Held,
}

const _: () = assert!(std::mem::size_of::<Node>() == 36);

impl Node {
    /// A node with no holder and no child.
    pub fn new(parent: u32, local: u64, next: u32, engine_hash: i64) -> Self {
        Node {
            local,
            engine_hash,
            parent,
            first_child: NONE,
            next,
            previous: NONE,
            holders: NO_HOLDER,
        }
    }
}

/// Every node, and the holder lists of those held by several ranks.
#[derive(Debug)]
pub struct Nodes {
    chunks: Vec<Vec<Node>>,
    free: Vec<u32>,
    lists: Vec<Vec<Held>>,
    free_lists: Vec<u32>,
}

impl Nodes {
    /// Storage holding `root` as node 0.
    pub fn new(root: Node) -> Self {
        let mut first = Vec::with_capacity(CHUNK);
        first.push(root);
        Nodes {
            chunks: vec![first],
            free: Vec::new(),
            lists: Vec::new(),
            free_lists: Vec::new(),
        }
    }

    /// Nodes in use, the root included.
    pub fn len(&self) -> usize {
        (self.chunks.len() - 1) * CHUNK + self.chunks.last().map_or(0, Vec::len) - self.free.len()
    }

    /// Stores `node`; returns its id.
    pub fn add(&mut self, node: Node) -> u32 {
        if let Some(id) = self.free.pop() {
            self[id] = node;
            return id;
        }
        if self.chunks.last().is_none_or(|chunk| chunk.len() == CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        let chunk_count = self.chunks.len();
        let chunk = self.chunks.last_mut().expect("a chunk was just ensured");
        chunk.push(node);
        u32::try_from((chunk_count - 1) * CHUNK + chunk.len() - 1)
            .ok()
            .filter(|&id| id != NONE)
            .expect("fewer than 2^32 - 1 nodes")
    }

    /// Frees `id` (which has no holder left) for reuse.
    pub fn free(&mut self, id: u32) {
        debug_assert!(self.holders(id).is_empty());
        self.free.push(id);
    }

    /// `id`'s holders, sorted by member.
    pub fn holders(&self, id: u32) -> &[Held] {
        let node = &self[id];
        match node.holders.word() {
            HolderWord::None => &[],
            HolderWord::One => std::slice::from_ref(&node.holders),
            HolderWord::Listed(list) => &self.lists[list],
        }
    }

    /// Where `member` is (or would go) in `id`'s holders.
    pub fn find_holder(&self, id: u32, member: u32) -> Result<usize, usize> {
        self.holders(id)
            .binary_search_by_key(&member, |held| held.member())
    }

    /// The tiers `member` holds `id` in (0 for none).
    pub fn tiers_of(&self, id: u32, member: u32) -> u8 {
        self.find_holder(id, member)
            .map_or(0, |at| self.holders(id)[at].tiers())
    }

    /// Replaces the holder at `at` (same member).
    pub fn set_holder(&mut self, id: u32, at: usize, held: Held) {
        match self[id].holders.word() {
            HolderWord::Listed(list) => self.lists[list][at] = held,
            HolderWord::None | HolderWord::One => self[id].holders = held,
        }
    }

    /// Inserts `held` at `at` (from [`Nodes::find_holder`]'s `Err`).
    pub fn insert_holder(&mut self, id: u32, at: usize, held: Held) {
        let word = self[id].holders;
        match word.word() {
            HolderWord::None => self[id].holders = held,
            HolderWord::Listed(list) => {
                let list = &mut self.lists[list];
                if list.len() == list.capacity() {
                    // A quarter more, not twice: a block every rank of a
                    // fleet holds keeps about as many slots as ranks.
                    list.reserve_exact(list.len() / 4 + 1);
                }
                list.insert(at, held);
            }
            HolderWord::One => {
                let mut several = Vec::with_capacity(2);
                several.push(word);
                several.insert(at, held);
                let list = match self.free_lists.pop() {
                    Some(list) => {
                        self.lists[list as usize] = several;
                        list as usize
                    }
                    None => {
                        self.lists.push(several);
                        self.lists.len() - 1
                    }
                };
                self[id].holders = Held::listed(list);
            }
        }
    }

    /// Removes the holder at `at`.
    pub fn remove_holder(&mut self, id: u32, at: usize) {
        let HolderWord::Listed(list) = self[id].holders.word() else {
            self[id].holders = NO_HOLDER;
            return;
        };
        let several = &mut self.lists[list];
        several.remove(at);
        if several.len() == 1 {
            let last = several[0];
            self.lists[list] = Vec::new();
            self.free_lists
                .push(u32::try_from(list).expect("list indexes fit 28 bits"));
            self[id].holders = last;
        }
    }
}

impl std::ops::Index<u32> for Nodes {
    type Output = Node;

    fn index(&self, id: u32) -> &Node {
        &self.chunks[(id >> CHUNK_BITS) as usize][id as usize & (CHUNK - 1)]
    }
}

impl std::ops::IndexMut<u32> for Nodes {
    fn index_mut(&mut self, id: u32) -> &mut Node {
        &mut self.chunks[(id >> CHUNK_BITS) as usize][id as usize & (CHUNK - 1)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_stay_sorted_by_member_from_one_to_several_and_back() {
        let mut nodes = Nodes::new(Node::new(NONE, 0, NONE, 0));
        let id = nodes.add(Node::new(0, 9, NONE, 0));
        for member in [5, 1, 9, 3] {
            let at = nodes.find_holder(id, member).unwrap_err();
            nodes.insert_holder(id, at, Held::new(member, 1));
        }
        let members = |nodes: &Nodes| -> Vec<u32> {
            nodes.holders(id).iter().map(|held| held.member()).collect()
        };
        assert_eq!(members(&nodes), [1, 3, 5, 9]);
        let at = nodes.find_holder(id, 5).unwrap();
        nodes.set_holder(id, at, Held::new(5, 0b1010));
        assert_eq!(nodes.tiers_of(id, 5), 0b1010);
        for member in [1, 9, 3] {
            let at = nodes.find_holder(id, member).unwrap();
            nodes.remove_holder(id, at);
        }
        assert_eq!(members(&nodes), [5]);
        assert_eq!(nodes.tiers_of(id, 5), 0b1010);
        nodes.remove_holder(id, 0);
        assert!(nodes.holders(id).is_empty());
    }

    #[test]
    fn a_holder_word_tells_member_0_from_none_and_from_a_reused_list() {
        let mut nodes = Nodes::new(Node::new(NONE, 0, NONE, 0));
        let first = nodes.add(Node::new(0, 1, NONE, 0));
        let second = nodes.add(Node::new(0, 2, NONE, 0));
        nodes.insert_holder(first, 0, Held::new(0, 1));
        assert_eq!(nodes.holders(first), [Held::new(0, 1)]);
        nodes.insert_holder(first, 1, Held::new(1, 2));
        nodes.remove_holder(first, 1);
        // The first node's list (index 0) is free again; the second takes it.
        for member in [0, 7] {
            let at = nodes.find_holder(second, member).unwrap_err();
            nodes.insert_holder(second, at, Held::new(member, 4));
        }
        assert_eq!(nodes.holders(first), [Held::new(0, 1)]);
        assert_eq!(nodes.holders(second), [Held::new(0, 4), Held::new(7, 4)]);
        nodes.remove_holder(first, 0);
        assert!(nodes.holders(first).is_empty());
        assert_eq!(nodes.tiers_of(second, 7), 4);
    }

    #[test]
    fn ids_cross_chunks_and_freed_ids_are_reused() {
        let mut nodes = Nodes::new(Node::new(NONE, 0, NONE, 0));
        let ids: Vec<u32> = (0..CHUNK as u64 + 10)
            .map(|local| nodes.add(Node::new(0, local, NONE, 0)))
            .collect();
        assert_eq!(nodes.len(), CHUNK + 11);
        assert_eq!({ nodes[ids[CHUNK + 5]].local }, CHUNK as u64 + 5);
        nodes.free(ids[3]);
        assert_eq!(nodes.len(), CHUNK + 10);
        assert_eq!(nodes.add(Node::new(0, 77, NONE, 0)), ids[3]);
        assert_eq!({ nodes[ids[3]].local }, 77);
    }
}
