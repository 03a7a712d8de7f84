//! The tree against a naive model: every rank's blocks as full paths of
//! local hashes from the root, matched by comparing prefixes.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::block_hash::HashSeed;
use super::tier::Tier;
use super::tree::{RankKey, RankMatch, StoreOutcome, Tree};

/// A rank's blocks: path of local hashes → (engine hash, tiers).
type ModelRank = BTreeMap<Vec<u64>, (i64, BTreeSet<Tier>)>;

#[derive(Default)]
struct Model {
    ranks: BTreeMap<RankKey, ModelRank>,
}

/// Engines name a block by its whole prefix: workers 1 and 2 alike, so
/// their ranks find shared nodes by the node's own hash, and worker 7 with
/// a hash function of its own, so its names of the others' nodes are kept
/// beside them.
fn engine_hash(key: RankKey, path: &[u64]) -> i64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64 ^ u64::from(key.worker == 7);
    for local in path {
        hash = (hash ^ local).wrapping_mul(0x100_0000_01b3);
    }
    hash as i64
}

impl Model {
    fn path_of(&self, key: RankKey, engine: i64) -> Option<(&Vec<u64>, &BTreeSet<Tier>)> {
        self.ranks
            .get(&key)?
            .iter()
            .find(|(_, (hash, _))| *hash == engine)
            .map(|(path, (_, tiers))| (path, tiers))
    }

    fn store(
        &mut self,
        key: RankKey,
        parent: Option<i64>,
        tier: Tier,
        locals: &[u64],
    ) -> StoreOutcome {
        let mut path = match parent {
            None => Vec::new(),
            Some(parent) => match self.path_of(key, parent) {
                Some((path, tiers)) if tier != Tier::Device || tiers.contains(&Tier::Device) => {
                    path.clone()
                }
                _ => {
                    self.ranks.entry(key).or_default();
                    return StoreOutcome::UnknownParent;
                }
            },
        };
        let rank = self.ranks.entry(key).or_default();
        for local in locals {
            path.push(*local);
            rank.entry(path.clone())
                .or_insert_with(|| (engine_hash(key, &path), BTreeSet::new()))
                .1
                .insert(tier);
        }
        StoreOutcome::Stored {
            blocks: locals.len(),
        }
    }

    fn remove(&mut self, key: RankKey, tier: Tier, engines: &[i64]) -> usize {
        let Some(rank) = self.ranks.get_mut(&key) else {
            return 0;
        };
        let mut removed = 0;
        for engine in engines {
            let Some(path) = rank
                .iter()
                .find(|(_, (hash, _))| hash == engine)
                .map(|(path, _)| path.clone())
            else {
                continue;
            };
            let tiers = &mut rank.get_mut(&path).unwrap().1;
            if !tiers.contains(&tier) {
                continue;
            }
            removed += 1;
            // A device removal takes the rank's device blocks under it too.
            let affected: Vec<Vec<u64>> = rank
                .keys()
                .filter(|held| **held == path || (tier == Tier::Device && held.starts_with(&path)))
                .cloned()
                .collect();
            for held in affected {
                let tiers = &mut rank.get_mut(&held).unwrap().1;
                tiers.remove(&tier);
                if tiers.is_empty() {
                    rank.remove(&held);
                }
            }
        }
        removed
    }

    fn overlap(&self, locals: &[u64]) -> Vec<RankMatch> {
        let mut matches = Vec::new();
        for (key, rank) in &self.ranks {
            let mut blocks = [0u32; 4];
            let mut phase = 0;
            for depth in 0..locals.len() {
                let Some((_, tiers)) = rank.get(&locals[..=depth]) else {
                    break;
                };
                while phase < 4 && !tiers.contains(&Tier::WALK[phase]) {
                    phase += 1;
                }
                if phase == 4 {
                    break;
                }
                blocks[phase] += 1;
            }
            if blocks.iter().any(|&count| count > 0) {
                matches.push(RankMatch { key: *key, blocks });
            }
        }
        matches
    }

    /// Every prefix of every held path: the nodes the tree must have.
    fn nodes(&self) -> usize {
        let mut prefixes = BTreeSet::new();
        for rank in self.ranks.values() {
            for path in rank.keys() {
                for end in 1..=path.len() {
                    prefixes.insert(path[..end].to_vec());
                }
            }
        }
        prefixes.len()
    }

    fn held(&self) -> u64 {
        self.ranks.values().map(|rank| rank.len() as u64).sum()
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Blocks of tokens (each block 2 tokens from a tiny alphabet, so
    /// prefixes are shared), under the parent picked from the rank's blocks.
    Store {
        rank: usize,
        lora: bool,
        tier: usize,
        parent: Option<usize>,
        blocks: Vec<[u32; 2]>,
    },
    Remove {
        rank: usize,
        tier: usize,
        picks: Vec<usize>,
    },
    Clear {
        rank: usize,
    },
    RemoveRank {
        rank: usize,
    },
}

const RANKS: [RankKey; 4] = [
    RankKey { worker: 1, rank: 0 },
    RankKey { worker: 1, rank: 1 },
    RankKey { worker: 2, rank: 0 },
    RankKey { worker: 7, rank: 3 },
];

fn op() -> impl Strategy<Value = Op> {
    let block = prop::array::uniform2(0u32..2);
    prop_oneof![
        6 => (0..4usize, any::<bool>(), 0..4usize, prop::option::weighted(0.7, 0..64usize), prop::collection::vec(block, 1..5))
            .prop_map(|(rank, lora, tier, parent, blocks)| Op::Store { rank, lora, tier, parent, blocks }),
        3 => (0..4usize, 0..4usize, prop::collection::vec(0..64usize, 1..4))
            .prop_map(|(rank, tier, picks)| Op::Remove { rank, tier, picks }),
        1 => (0..4usize).prop_map(|rank| Op::Clear { rank }),
        1 => (0..4usize).prop_map(|rank| Op::RemoveRank { rank }),
    ]
}

/// Every path some rank holds, and its extension by one unknown block.
fn queries(model: &Model) -> Vec<Vec<u64>> {
    let mut queries: Vec<Vec<u64>> = model
        .ranks
        .values()
        .flat_map(|rank| rank.keys().cloned())
        .collect();
    let longer: Vec<Vec<u64>> = queries
        .iter()
        .map(|path| {
            let mut path = path.clone();
            path.push(12345);
            path
        })
        .collect();
    queries.extend(longer);
    queries.push(Vec::new());
    queries
}

fn sorted(mut matches: Vec<RankMatch>) -> Vec<RankMatch> {
    matches.sort_by_key(|found| found.key);
    matches
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_tree_answers_every_query_as_the_naive_model_does(ops in prop::collection::vec(op(), 1..40)) {
        let mut tree = Tree::new();
        let mut model = Model::default();
        for op in ops {
            match op {
                Op::Store { rank, lora, tier, parent, blocks } => {
                    let key = RANKS[rank];
                    let seed = HashSeed::new(lora.then_some("adapter"), None);
                    let locals: Vec<u64> = blocks.iter().map(|tokens| seed.block(tokens)).collect();
                    // A parent among the rank's blocks (any tier), or an unknown one.
                    let held: Vec<Vec<u64>> = model.ranks.get(&key).map(|rank| rank.keys().cloned().collect()).unwrap_or_default();
                    let parent_path: Option<Vec<u64>> = parent.map(|pick| {
                        if held.is_empty() || pick % 5 == 4 { vec![999, pick as u64] } else { held[pick % held.len()].clone() }
                    });
                    let parent = parent_path.as_deref().map(|path| engine_hash(key, path));
                    let mut path = parent_path.unwrap_or_default();
                    let blocks: Vec<(i64, u64)> = locals.iter().map(|&local| { path.push(local); (engine_hash(key, &path), local) }).collect();
                    let expected = model.store(key, parent, Tier::WALK[tier], &locals);
                    prop_assert_eq!(tree.store(key, parent, Tier::WALK[tier], &blocks), expected);
                    // As the writer does after each step.
                    if let Some(rebuilt) = tree.rebuilt_map(key) {
                        tree.install_map(rebuilt);
                    }
                }
                Op::Remove { rank, tier, picks } => {
                    let key = RANKS[rank];
                    let held: Vec<i64> = model.ranks.get(&key).map(|rank| rank.values().map(|(hash, _)| *hash).collect()).unwrap_or_default();
                    // Removals leaf-first or not: any held block, or an unknown hash.
                    let engines: Vec<i64> = picks.iter().map(|pick| if held.is_empty() || pick % 7 == 6 { -1 - *pick as i64 } else { held[pick % held.len()] }).collect();
                    let expected = model.remove(key, Tier::WALK[tier], &engines);
                    prop_assert_eq!(tree.remove(key, Tier::WALK[tier], &engines), expected);
                }
                Op::Clear { rank } => {
                    let key = RANKS[rank];
                    let expected = model.ranks.get_mut(&key).map_or(0, |rank| std::mem::take(rank).len());
                    prop_assert_eq!(tree.clear(key), expected);
                }
                Op::RemoveRank { rank } => {
                    let key = RANKS[rank];
                    let expected = model.ranks.remove(&key).map_or(0, |rank| rank.len());
                    prop_assert_eq!(tree.remove_rank(key), expected);
                }
            }
            prop_assert_eq!(tree.nodes(), model.nodes());
            prop_assert_eq!(tree.held_blocks(), model.held());
            prop_assert!(tree.indexes_exactly_the_siblings());
            for query in queries(&model) {
                prop_assert_eq!(sorted(tree.overlap(&query)), model.overlap(&query), "query {:?}", query);
            }
        }
    }
}

#[test]
fn a_lower_tier_continues_where_the_device_stopped() {
    let mut tree = Tree::new();
    let key = RankKey { worker: 3, rank: 0 };
    tree.store(key, None, Tier::Device, &[(10, 1), (11, 2)]);
    tree.store(key, Some(11), Tier::Host, &[(12, 3)]);
    tree.store(key, Some(12), Tier::Disk, &[(13, 4)]);
    tree.store(key, Some(13), Tier::External, &[(14, 5)]);
    let found = tree.overlap(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(
        found,
        [RankMatch {
            key,
            blocks: [2, 1, 1, 1]
        }]
    );
}

#[test]
fn a_device_store_under_a_parent_held_only_on_the_host_changes_nothing() {
    let mut tree = Tree::new();
    let key = RankKey { worker: 3, rank: 0 };
    tree.store(key, None, Tier::Host, &[(10, 1)]);
    assert_eq!(
        tree.store(key, Some(10), Tier::Device, &[(11, 2)]),
        StoreOutcome::UnknownParent
    );
    assert_eq!(
        tree.store(key, Some(10), Tier::Host, &[(11, 2)]),
        StoreOutcome::Stored { blocks: 1 }
    );
}

#[test]
fn a_device_removal_takes_the_ranks_device_blocks_under_it() {
    let mut tree = Tree::new();
    let key = RankKey { worker: 1, rank: 0 };
    let other = RankKey { worker: 2, rank: 0 };
    tree.store(key, None, Tier::Device, &[(1, 1), (2, 2), (3, 3)]);
    tree.store(other, None, Tier::Device, &[(1, 1), (2, 2), (3, 3)]);
    assert_eq!(tree.remove(key, Tier::Device, &[2]), 1);
    tree.store(key, Some(1), Tier::Device, &[(2, 2)]);
    let mut found = tree.overlap(&[1, 2, 3]);
    found.sort_by_key(|found| found.key);
    assert_eq!(
        found,
        [
            RankMatch {
                key,
                blocks: [2, 0, 0, 0]
            },
            RankMatch {
                key: other,
                blocks: [3, 0, 0, 0]
            }
        ]
    );
}

#[test]
fn removing_the_last_holder_frees_the_node_and_its_empty_ancestors() {
    let mut tree = Tree::new();
    let key = RankKey { worker: 1, rank: 0 };
    tree.store(key, None, Tier::Device, &[(1, 1), (2, 2), (3, 3)]);
    tree.store(key, Some(2), Tier::Host, &[(4, 4)]);
    assert_eq!(tree.nodes(), 4);
    assert_eq!(tree.remove(key, Tier::Device, &[3]), 1);
    assert_eq!(tree.nodes(), 3, "a leaf goes, a held sibling stays");
    assert_eq!(tree.remove(key, Tier::Device, &[1]), 1);
    assert_eq!(tree.nodes(), 3, "a host block keeps its ancestors");
    assert_eq!(tree.remove(key, Tier::Host, &[4]), 1);
    assert_eq!(tree.nodes(), 0);
    assert_eq!(tree.held_blocks(), 0);
}

#[test]
fn a_clear_released_in_steps_leaves_what_a_whole_clear_leaves() {
    let mut tree = Tree::new();
    let key = RankKey { worker: 1, rank: 0 };
    let other = RankKey { worker: 2, rank: 0 };
    let chain: Vec<(i64, u64)> = (1..=10).map(|n| (n, n as u64)).collect();
    tree.store(key, None, Tier::Device, &chain);
    tree.store(other, None, Tier::Device, &chain[..3]);
    let mut nodes = tree.detach(key).into_nodes();
    while !nodes.is_empty() {
        let step = nodes.split_step(3);
        tree.release_detached(&step);
    }
    assert_eq!(tree.nodes(), 3, "the other rank's blocks stay");
    assert_eq!(tree.held_blocks(), 3);
    assert_eq!(
        tree.overlap(&[1, 2, 3, 4]),
        [RankMatch {
            key: other,
            blocks: [3, 0, 0, 0]
        }]
    );
    // The rank stays known and stores again.
    tree.store(key, None, Tier::Device, &chain[..1]);
    assert_eq!(tree.rank_blocks(key), 1);
}

#[test]
fn a_block_held_by_two_names_goes_with_either_and_its_id_reused_is_never_reached_by_the_other() {
    let mut tree = Tree::new();
    let key = RankKey { worker: 1, rank: 0 };
    let other = RankKey { worker: 2, rank: 0 };
    // The same tokens named twice by one rank (as two multimodal requests
    // whose placeholders match), and once by another rank.
    tree.store(key, None, Tier::Device, &[(10, 7)]);
    tree.store(key, None, Tier::Device, &[(20, 7)]);
    tree.store(other, None, Tier::Device, &[(30, 7)]);
    assert_eq!((tree.nodes(), tree.held_blocks()), (1, 3));
    assert_eq!(tree.remove(key, Tier::Device, &[20]), 1);
    assert_eq!(
        tree.overlap(&[7]),
        [RankMatch {
            key: other,
            blocks: [1, 0, 0, 0]
        }],
        "the rank holds it no more, by either name"
    );
    assert_eq!(tree.held_blocks(), 1, "both of its names went");
    assert_eq!(tree.remove(other, Tier::Device, &[30]), 1);
    assert_eq!(tree.nodes(), 0);
    // The freed node's id is reused by other tokens the rank stores.
    tree.store(key, None, Tier::Device, &[(40, 8)]);
    assert_eq!(tree.remove(key, Tier::Device, &[10]), 0);
    assert_eq!(
        tree.store(key, Some(10), Tier::Device, &[(50, 9)]),
        StoreOutcome::UnknownParent
    );
    assert_eq!(
        tree.overlap(&[8]),
        [RankMatch {
            key,
            blocks: [1, 0, 0, 0]
        }]
    );
    assert_eq!(tree.clear(key), 1);
    assert_eq!((tree.nodes(), tree.held_blocks()), (0, 0));
}

#[test]
fn a_clear_releases_a_block_the_rank_named_twice_once() {
    for step in [1, 3, usize::MAX] {
        let mut tree = Tree::new();
        let key = RankKey { worker: 1, rank: 0 };
        tree.store(key, None, Tier::Device, &[(10, 7), (11, 8)]);
        tree.store(key, None, Tier::Device, &[(20, 7)]);
        assert_eq!((tree.nodes(), tree.held_blocks()), (2, 3));
        let mut nodes = tree.detach(key).into_nodes();
        assert_eq!(tree.held_blocks(), 0);
        while !nodes.is_empty() {
            let step = nodes.split_step(step);
            tree.release_detached(&step);
        }
        assert_eq!(tree.nodes(), 0);
        // Freed once each: the next two blocks get two ids.
        tree.store(key, None, Tier::Device, &[(30, 1), (31, 2)]);
        assert_eq!((tree.nodes(), tree.held_blocks()), (2, 2));
        assert_eq!(
            tree.overlap(&[1, 2]),
            [RankMatch {
                key,
                blocks: [2, 0, 0, 0]
            }]
        );
    }
}
