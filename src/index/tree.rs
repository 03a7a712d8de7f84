//! One partition's prefix tree: every live block of every worker rank that
//! serves one (model, routing group), shared where their prefixes agree.
//!
//! Invariants:
//! - A node is one full block reached from the root by the local hashes of
//!   every block before it ([`super::block_hash`]): a child is found under
//!   its parent by its own local hash, so no engine's hash function has to
//!   be known. An only child is its parent's first; [`Children`] indexes
//!   exactly the nodes that have a sibling.
//! - Each worker rank (a [`RankKey`]) maps each engine block hash it holds to
//!   exactly one node, and that node lists the rank as a holder with the
//!   set of tiers it holds the block in; a holder with no tier left is
//!   removed, and so is every engine hash the rank named the node by (an
//!   engine may name the same tokens twice), so no name outlives its node.
//! - A node with no holder and no child does not exist: removing the last
//!   holder frees it and every ancestor left empty, so memory follows the
//!   live blocks and nothing else.
//! - A device-tier store is placed under its parent only if the rank holds
//!   that parent on the device (Dynamo's tree refuses it otherwise); a
//!   lower-tier store's parent may be held in any tier. A store whose parent
//!   is unknown changes nothing.
//! - A query's depth for a rank is how many blocks from the root the rank
//!   holds on the device; each lower tier continues where the tier before it
//!   stopped ([`Tier::WALK`]).

use rustc_hash::{FxBuildHasher, FxHashMap};

use super::children::Children;
use super::nodes::{Held, MAX_MEMBERS, NONE, Node, Nodes};
use super::rank_blocks::RankBlocks;
use super::spilling_table::Rebuilt;
use super::tier::Tier;

/// A worker instance id, as Dynamo's registry names it.
pub type WorkerId = u64;

/// One data-parallel rank of one worker: what holds blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankKey {
    /// The worker instance.
    pub worker: WorkerId,
    /// Its data-parallel rank.
    pub rank: u32,
}

/// The root: the empty prefix, never freed.
const ROOT: u32 = 0;

/// A rank's engine hashes and the nodes they name.
#[derive(Debug)]
struct Member {
    key: RankKey,
    blocks: RankBlocks,
}

/// One rank's progress down a query's path.
#[derive(Clone, Copy)]
struct Walk {
    member: u32,
    /// The tier of [`Tier::WALK`] it is matching in.
    phase: usize,
    blocks: [u32; 4],
}

/// What a store did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreOutcome {
    /// Every block is held (new or already held) in the store's tier.
    Stored {
        /// How many blocks the store named.
        blocks: usize,
    },
    /// The parent is not a block this rank holds (on the device, for a
    /// device store): nothing changed.
    UnknownParent,
}

/// How far a rank's blocks match a query, in blocks per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankMatch {
    /// The rank.
    pub key: RankKey,
    /// Blocks matched in each tier of [`Tier::WALK`], each tier continuing
    /// where the one before it stopped.
    pub blocks: [u32; 4],
}

#[cfg(test)]
impl RankMatch {
    /// `worker`'s rank `rank` matching `blocks` in each tier.
    pub fn of(worker: WorkerId, rank: u32, blocks: [u32; 4]) -> Self {
        RankMatch {
            key: RankKey { worker, rank },
            blocks,
        }
    }
}

/// One live block of one rank, as a dump lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpedBlock {
    /// The rank holding it.
    pub key: RankKey,
    /// The engine's name for it.
    pub engine_hash: i64,
    /// The engine hash of the block before it, as this rank holds it.
    pub parent: Option<i64>,
    /// Its local hash.
    pub local_hash: u64,
    /// The tiers the rank holds it in.
    pub tiers: Vec<Tier>,
}

/// A rank's map built again ([`Tree::rebuilt_map`]).
pub struct RebuiltMap {
    member: u32,
    blocks: Rebuilt<u32>,
}

/// A rank's blocks taken out of its map ([`Tree::detach`]).
#[derive(Debug)]
pub struct Detached {
    member: Option<u32>,
    blocks: RankBlocks,
}

impl Detached {
    /// How many blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The nodes to release (built outside the tree's lock).
    pub fn into_nodes(self) -> DetachedNodes {
        DetachedNodes {
            member: self.member,
            nodes: self.blocks.into_nodes(),
        }
    }
}

/// Detached nodes, released in steps by [`Tree::release_detached`].
#[derive(Debug)]
pub struct DetachedNodes {
    member: Option<u32>,
    nodes: Vec<u32>,
}

impl DetachedNodes {
    /// Splits off the last `at_most` nodes, to release in one step.
    pub fn split_step(&mut self, at_most: usize) -> DetachedNodes {
        let keep = self.nodes.len().saturating_sub(at_most);
        DetachedNodes {
            member: self.member,
            nodes: self.nodes.split_off(keep),
        }
    }

    /// Whether every node was split off.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// The tree (see the module's invariants).
#[derive(Debug)]
pub struct Tree {
    nodes: Nodes,
    children: Children,
    members: Vec<Option<Member>>,
    free_members: Vec<u32>,
    member_ids: FxHashMap<RankKey, u32>,
    /// Seeds every rank's map of engine hashes alike, at random per process.
    engine_hasher: foldhash::fast::RandomState,
    /// Engine hashes held, over every rank.
    held: u64,
}

impl Default for Tree {
    fn default() -> Self {
        Self::new()
    }
}

impl Tree {
    /// An empty tree.
    pub fn new() -> Self {
        Tree {
            nodes: Nodes::new(Node::new(NONE, 0, NONE, 0)),
            children: Children::default(),
            members: Vec::new(),
            free_members: Vec::new(),
            member_ids: FxHashMap::with_hasher(FxBuildHasher),
            engine_hasher: foldhash::fast::RandomState::default(),
            held: 0,
        }
    }

    /// Blocks in the tree (not counting the root).
    pub fn nodes(&self) -> usize {
        self.nodes.len() - 1
    }

    /// Engine hashes held, over every rank: the live blocks.
    pub fn held_blocks(&self) -> u64 {
        self.held
    }

    /// The ranks holding at least one block, or once registered and not removed.
    pub fn ranks(&self) -> impl Iterator<Item = RankKey> + '_ {
        self.members.iter().flatten().map(|member| member.key)
    }

    /// Blocks held by `key`.
    pub fn rank_blocks(&self, key: RankKey) -> usize {
        self.member_ids
            .get(&key)
            .map_or(0, |&id| self.member(id).blocks.len())
    }

    fn member(&self, id: u32) -> &Member {
        self.members[id as usize]
            .as_ref()
            .expect("member ids in use name members")
    }

    fn member_mut(&mut self, id: u32) -> &mut Member {
        self.members[id as usize]
            .as_mut()
            .expect("member ids in use name members")
    }

    /// Member `id`'s blocks, beside the nodes they name.
    fn blocks_mut(&mut self, id: u32) -> (&mut RankBlocks, &Nodes) {
        let member = self.members[id as usize]
            .as_mut()
            .expect("member ids in use name members");
        (&mut member.blocks, &self.nodes)
    }

    fn member_id(&mut self, key: RankKey) -> u32 {
        if let Some(&id) = self.member_ids.get(&key) {
            return id;
        }
        let member = Member {
            key,
            blocks: RankBlocks::with_hasher(self.engine_hasher.clone()),
        };
        let id = match self.free_members.pop() {
            Some(id) => {
                self.members[id as usize] = Some(member);
                id
            }
            None => {
                let id = u32::try_from(self.members.len())
                    .ok()
                    .filter(|&id| id < MAX_MEMBERS)
                    .expect("the registry's limit keeps ranks far below 2^28");
                self.members.push(Some(member));
                id
            }
        };
        self.member_ids.insert(key, id);
        id
    }

    /// Stores `blocks` (engine hash, local hash), a chain under `parent`,
    /// held by `key` in `tier`.
    pub fn store(
        &mut self,
        key: RankKey,
        parent: Option<i64>,
        tier: Tier,
        blocks: &[(i64, u64)],
    ) -> StoreOutcome {
        let member = self.member_id(key);
        let mut current = match parent {
            None => ROOT,
            Some(parent) => match self.member(member).blocks.get(&self.nodes, parent) {
                Some(node)
                    if tier != Tier::Device
                        || self.nodes.tiers_of(node, member) & Tier::Device.bit() != 0 =>
                {
                    node
                }
                _ => return StoreOutcome::UnknownParent,
            },
        };
        for &(engine_hash, local) in blocks {
            let node = self.child(current, local, engine_hash);
            self.hold(member, engine_hash, node, tier);
            current = node;
        }
        StoreOutcome::Stored {
            blocks: blocks.len(),
        }
    }

    /// Removes `key`'s blocks `engine_hashes` from `tier`; returns how many
    /// it held there.
    pub fn remove(&mut self, key: RankKey, tier: Tier, engine_hashes: &[i64]) -> usize {
        let Some(&member) = self.member_ids.get(&key) else {
            return 0;
        };
        let mut removed = 0;
        for engine_hash in engine_hashes {
            let Some(node) = self.member(member).blocks.get(&self.nodes, *engine_hash) else {
                continue;
            };
            let Some(at) = self.held_in(node, member, tier) else {
                continue;
            };
            removed += 1;
            if tier == Tier::Device {
                // Dynamo's device tree drops the rank's blocks under it too
                // (which leaves this node's holders as they are).
                self.drop_device_subtree(member, node);
            }
            self.drop_tier(member, node, at, tier);
        }
        removed
    }

    /// Where `member` is in `node`'s holders, if it holds the node in `tier`.
    fn held_in(&self, node: u32, member: u32, tier: Tier) -> Option<usize> {
        let at = self.nodes.find_holder(node, member).ok()?;
        (self.nodes.holders(node)[at].tiers() & tier.bit() != 0).then_some(at)
    }

    /// Takes `tier` from `member`'s hold of `node` (the holder at `at`),
    /// releasing the hold when no tier is left.
    fn drop_tier(&mut self, member: u32, node: u32, at: usize, tier: Tier) {
        let tiers = self.nodes.holders(node)[at].tiers() & !tier.bit();
        if tiers != 0 {
            self.nodes.set_holder(node, at, Held::new(member, tiers));
        } else {
            self.release_at(node, member, at);
        }
    }

    /// Takes the device tier from `member`'s holds strictly under `node`
    /// (device holds are prefix-closed: only held children are descended).
    fn drop_device_subtree(&mut self, member: u32, node: u32) {
        let mut held_under = Vec::new();
        let mut stack = vec![node];
        while let Some(parent) = stack.pop() {
            let mut child = self.nodes[parent].first_child;
            while child != NONE {
                if let Some(at) = self.held_in(child, member, Tier::Device) {
                    held_under.push((child, at));
                    stack.push(child);
                }
                child = self.nodes[child].next;
            }
        }
        // Leaves first, so no node is freed while a descendant is still held
        // (and a node's holders stay where they were found until its turn).
        for &(under, at) in held_under.iter().rev() {
            self.drop_tier(member, under, at, Tier::Device);
        }
    }

    /// Forgets every block `key` holds, in every tier (the engine cleared
    /// its cache, or restarted); the rank stays known.
    pub fn clear(&mut self, key: RankKey) -> usize {
        let detached = self.detach(key);
        let cleared = detached.len();
        let nodes = detached.into_nodes();
        self.release_detached(&nodes);
        cleared
    }

    /// Takes `key`'s blocks out of its map at once (O(1)); the nodes still
    /// list the rank until [`Tree::release_detached`] releases them, a
    /// bounded number at a time, so a clear of a million blocks never holds
    /// the tree for all of them.
    pub fn detach(&mut self, key: RankKey) -> Detached {
        match self.member_ids.get(&key) {
            Some(&member) => {
                let blocks = std::mem::take(&mut self.member_mut(member).blocks);
                // Its names are gone now, whenever the holds go.
                self.held -= blocks.len() as u64;
                Detached {
                    member: Some(member),
                    blocks,
                }
            }
            None => Detached {
                member: None,
                blocks: RankBlocks::default(),
            },
        }
    }

    /// Releases detached nodes (from [`Detached::into_nodes`]).
    pub fn release_detached(&mut self, nodes: &DetachedNodes) {
        let Some(member) = nodes.member else { return };
        for &node in &nodes.nodes {
            self.release(node, member);
        }
    }

    /// `key`'s map built again, when its growth or its tombstones made that
    /// due: a pass over every entry, made while the tree is only read.
    pub fn rebuilt_map(&self, key: RankKey) -> Option<RebuiltMap> {
        let &member = self.member_ids.get(&key)?;
        let blocks = self.member(member).blocks.rebuilt(&self.nodes)?;
        Some(RebuiltMap { member, blocks })
    }

    /// Puts `map`, made by [`Tree::rebuilt_map`] with nothing changed since,
    /// in place.
    pub fn install_map(&mut self, map: RebuiltMap) {
        self.member_mut(map.member).blocks.install(map.blocks);
    }

    /// Forgets `key` altogether (unregistered).
    pub fn remove_rank(&mut self, key: RankKey) -> usize {
        let cleared = self.clear(key);
        if let Some(member) = self.member_ids.remove(&key) {
            self.members[member as usize] = None;
            self.free_members.push(member);
        }
        cleared
    }

    /// How far each rank's blocks match `locals` (a query's local hashes,
    /// in order), for every rank that matches at least one block in some tier.
    ///
    /// One pass down the path: the ranks still matching and each node's
    /// holders are both sorted by member, so each step merges the two in
    /// time linear in their lengths, and a rank that holds a node in no tier
    /// it can still continue in leaves the walk for good.
    pub fn overlap(&self, locals: &[u64]) -> Vec<RankMatch> {
        /// Past the last tier: the rank's match has ended.
        const ENDED: usize = Tier::WALK.len();
        let mut walking: Vec<Walk> = Vec::new();
        let mut ended: Vec<Walk> = Vec::new();
        let mut current = ROOT;
        // The holders of the node before, and how many nodes in a row since
        // had the same ones: every rank still walking went on in its phase
        // through each, credited once the holders change (a prefix the whole
        // fleet shares is then one comparison a block, not a merge).
        let mut previous_holders: &[Held] = &[];
        let mut same_holders_run = 0;
        let credit_run = |walking: &mut Vec<Walk>, run: &mut u32| {
            for walk in walking.iter_mut() {
                walk.blocks[walk.phase] += *run;
            }
            *run = 0;
        };
        for (depth, local) in locals.iter().enumerate() {
            let Some(node) = self.find_child(current, *local) else {
                break;
            };
            let holders = self.nodes.holders(node);
            current = node;
            if depth > 0 && Held::same_lists(holders, previous_holders) {
                same_holders_run += 1;
                continue;
            }
            credit_run(&mut walking, &mut same_holders_run);
            previous_holders = holders;
            if depth == 0 {
                // Every rank that ends its walk goes here: room for all at
                // once rather than a copy at each doubling.
                ended.reserve(holders.len());
                walking.extend(holders.iter().map(|held| Walk {
                    member: held.member(),
                    phase: 0,
                    blocks: [0; 4],
                }));
            }
            let mut kept = 0;
            let mut at = 0;
            for index in 0..walking.len() {
                // Updated in place: a copy updated and stored back stalled
                // on each store's forwarding to the next load.
                let walk = &mut walking[index];
                while at < holders.len() && holders[at].member() < walk.member {
                    at += 1;
                }
                let tiers = match holders.get(at) {
                    Some(held) if held.member() == walk.member => held.tiers(),
                    _ => 0,
                };
                // Counted in a local and stored only while the walk goes
                // on: an ended walk is copied whole right after, and a copy
                // that read a field just stored stalled as the count did.
                let mut phase = walk.phase;
                while phase < ENDED && tiers & (1 << phase) == 0 {
                    phase += 1;
                }
                if phase < ENDED {
                    walk.phase = phase;
                    walk.blocks[phase] += 1;
                    if kept != index {
                        walking[kept] = walking[index];
                    }
                    kept += 1;
                } else {
                    ended.push(*walk);
                }
            }
            walking.truncate(kept);
            if walking.is_empty() {
                break;
            }
        }
        credit_run(&mut walking, &mut same_holders_run);
        ended.append(&mut walking);
        ended
            .into_iter()
            .filter(|walk| walk.blocks.iter().any(|&count| count > 0))
            .map(|walk| RankMatch {
                key: self.member(walk.member).key,
                blocks: walk.blocks,
            })
            .collect()
    }

    /// Every live block of every rank, each rank's blocks parents first.
    pub fn dump(&self) -> Vec<DumpedBlock> {
        let mut dumped = Vec::new();
        let mut ranks: Vec<(RankKey, u32)> = self
            .member_ids
            .iter()
            .map(|(&key, &id)| (key, id))
            .collect();
        ranks.sort_unstable();
        for (key, member) in ranks {
            let blocks = &self.member(member).blocks;
            let engine_hash_of: FxHashMap<u32, i64> = blocks
                .iter(&self.nodes)
                .map(|(engine, node)| (node, engine))
                .collect();
            let mut rows: Vec<(u32, i64, u32)> = blocks
                .iter(&self.nodes)
                .map(|(engine, node)| (self.depth(node), engine, node))
                .collect();
            rows.sort_unstable();
            for (_, engine_hash, node) in rows {
                let parent_node = self.nodes[node].parent;
                let tiers = self.nodes.tiers_of(node, member);
                dumped.push(DumpedBlock {
                    key,
                    engine_hash,
                    parent: engine_hash_of.get(&parent_node).copied(),
                    local_hash: self.nodes[node].local,
                    tiers: Tier::WALK
                        .into_iter()
                        .filter(|tier| tiers & tier.bit() != 0)
                        .collect(),
                });
            }
        }
        dumped
    }

    fn depth(&self, mut node: u32) -> u32 {
        let mut depth = 0;
        while node != ROOT {
            node = self.nodes[node].parent;
            depth += 1;
        }
        depth
    }

    /// The child of `parent` with `local`, if the tree has it.
    fn find_child(&self, parent: u32, local: u64) -> Option<u32> {
        let first = self.nodes[parent].first_child;
        if first == NONE {
            return None;
        }
        let child = &self.nodes[first];
        if child.next == NONE {
            return (child.local == local).then_some(first);
        }
        self.children.find(&self.nodes, parent, local)
    }

    /// Whether [`Children`] indexes exactly the nodes that have a sibling,
    /// each under its own key.
    #[cfg(test)]
    pub(super) fn indexes_exactly_the_siblings(&self) -> bool {
        let mut with_siblings = 0;
        let mut stack = vec![ROOT];
        while let Some(parent) = stack.pop() {
            let first = self.nodes[parent].first_child;
            let mut child = first;
            while child != NONE {
                stack.push(child);
                if first != child || self.nodes[child].next != NONE {
                    with_siblings += 1;
                    let local = self.nodes[child].local;
                    if self.children.find(&self.nodes, parent, local) != Some(child) {
                        return false;
                    }
                }
                child = self.nodes[child].next;
            }
        }
        with_siblings == self.children.len()
    }

    /// The child of `parent` with `local`, made under `engine_hash` if missing.
    fn child(&mut self, parent: u32, local: u64, engine_hash: i64) -> u32 {
        if let Some(node) = self.find_child(parent, local) {
            return node;
        }
        let next = self.nodes[parent].first_child;
        let id = self.nodes.add(Node::new(parent, local, next, engine_hash));
        if next != NONE {
            self.nodes[next].previous = id;
            if self.nodes[next].next == NONE {
                // No longer an only child.
                self.children.insert(&self.nodes, next);
            }
            self.children.insert(&self.nodes, id);
        }
        self.nodes[parent].first_child = id;
        id
    }

    /// Makes `member` hold `node` in `tier` under `engine_hash`; a hash that
    /// named another node leaves it (after the new one is held, so the
    /// freeing of the old one cannot reach the new one).
    fn hold(&mut self, member: u32, engine_hash: i64, node: u32, tier: Tier) {
        match self.nodes.find_holder(node, member) {
            Ok(at) => {
                let tiers = self.nodes.holders(node)[at].tiers() | tier.bit();
                self.nodes.set_holder(node, at, Held::new(member, tiers));
            }
            Err(at) => self
                .nodes
                .insert_holder(node, at, Held::new(member, tier.bit())),
        }
        let (blocks, nodes) = self.blocks_mut(member);
        match blocks.insert(nodes, engine_hash, node) {
            None => self.held += 1,
            Some(old) if old != node => self.release(old, member),
            Some(_) => {}
        }
    }

    /// Drops `member` from `node`'s holders (every tier), freeing what is left empty.
    fn release(&mut self, node: u32, member: u32) {
        if let Ok(at) = self.nodes.find_holder(node, member) {
            self.release_at(node, member, at);
        }
    }

    /// [`Tree::release`], `member` found at `at` in `node`'s holders: every
    /// name the rank gave the node goes with the hold.
    fn release_at(&mut self, node: u32, member: u32, at: usize) {
        self.nodes.remove_holder(node, at);
        let (blocks, nodes) = self.blocks_mut(member);
        let forgotten = blocks.forget_node(nodes, node);
        self.held -= forgotten as u64;
        self.free_if_empty(node);
    }

    /// Frees `node` and then each ancestor while it has no holder and no child.
    fn free_if_empty(&mut self, mut node: u32) {
        while node != ROOT {
            if !self.nodes.holders(node).is_empty() || self.nodes[node].first_child != NONE {
                return;
            }
            let empty = &self.nodes[node];
            let (parent, next, previous) = (empty.parent, empty.next, empty.previous);
            if previous != NONE || next != NONE {
                self.children.remove(&self.nodes, node);
            }
            if previous == NONE {
                self.nodes[parent].first_child = next;
            } else {
                self.nodes[previous].next = next;
            }
            if next != NONE {
                self.nodes[next].previous = previous;
            }
            let first = self.nodes[parent].first_child;
            if (previous != NONE || next != NONE) && self.nodes[first].next == NONE {
                // Now an only child.
                self.children.remove(&self.nodes, first);
            }
            self.nodes.free(node);
            node = parent;
        }
    }
}
