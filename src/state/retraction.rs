//! A rank's blocks taken back from routers as removals.
//!
//! In an engine of several ranks, one rank's restart or own clear must not
//! reach routers as a `KvCacheCleared`: the router clears the whole worker
//! on any clear (its index pools the ranks' copies), so the other ranks'
//! blocks would vanish from it while the engine still holds them (contract
//! section 2). The rank's blocks are taken out of the live state instead,
//! and this walk turns them into `KvBlocksRemoved` events a step at a time.
//!
//! Invariant: every live copy of the blocks taken is named by exactly one
//! removal, with the tier, medium, group, locality, ownership and cache
//! level its store carried; a run of blocks stored with the same fields
//! shares one removal of at most [`MAX_HASHES_PER_REMOVAL`] hashes, and
//! each extra copy is a one-hash removal of its own (as a snapshot sends it
//! as a one-block store). A step names at most its budget of copies, so a
//! rank of millions of blocks never holds the drain longer than a cycle.
//! The walk owns the blocks it takes and holds nothing else but the event
//! being filled.

use super::RankBlocks;
use super::StoreFields;
use super::tier::Tier;
use super::tier_blocks::LiveBlocks;
use crate::proto::common::{KvBlocksRemoved, KvCacheEvent, kv_cache_event::Data};

/// Most hashes in one removal: about 10 kB, a hundred to a batch of 1 MiB.
pub const MAX_HASHES_PER_REMOVAL: usize = 1024;

self_cell::self_cell!(
    /// The blocks a rank held, and where their removals have got to.
    pub struct Retraction {
        owner: RankBlocks,
        #[covariant]
        dependent: RetractionWalk,
    }
);

/// The walk over the taken blocks, tier by tier in store order.
pub struct RetractionWalk<'taken> {
    /// Tiers begun so far, in `Tier::ALL` order.
    tiers_begun: usize,
    blocks: Option<LiveBlocks<'taken>>,
}

impl Retraction {
    /// The removals of every block in `blocks`.
    pub fn of(blocks: RankBlocks) -> Self {
        Self::new(blocks, |_| RetractionWalk {
            tiers_begun: 0,
            blocks: None,
        })
    }

    /// The blocks taken, once their removals are out (to be freed).
    pub fn into_blocks(self) -> RankBlocks {
        self.into_owner()
    }

    /// Hands `emit` removals naming at most `budget` copies (at least one
    /// block's); `true` once every copy has been named.
    pub fn step(&mut self, budget: usize, mut emit: impl FnMut(KvCacheEvent)) -> bool {
        self.with_dependent_mut(|taken, walk| {
            let mut named = 0;
            let mut run: Option<(&StoreFields, Vec<i64>)> = None;
            let done = loop {
                let next = match &mut walk.blocks {
                    Some(blocks) => blocks.next(),
                    None => match Tier::ALL.get(walk.tiers_begun) {
                        Some(&tier) => {
                            walk.tiers_begun += 1;
                            walk.blocks = Some(taken.tier_blocks(tier).live());
                            continue;
                        }
                        None => break true,
                    },
                };
                let Some(block) = next else {
                    walk.blocks = None;
                    continue;
                };
                let fields: &StoreFields = block.fields;
                let same_run = run.as_ref().is_some_and(|(run_fields, hashes)| {
                    std::ptr::eq(*run_fields, fields) && hashes.len() < MAX_HASHES_PER_REMOVAL
                });
                if !same_run && let Some((run_fields, hashes)) = run.take() {
                    emit(removal(run_fields, hashes));
                }
                let hash = block.entry.0;
                run.get_or_insert_with(|| (fields, Vec::new())).1.push(hash);
                for _ in 1..block.copies {
                    emit(removal(fields, vec![hash]));
                }
                named += usize::from(block.copies);
                if named >= budget {
                    break false;
                }
            };
            if let Some((run_fields, hashes)) = run {
                emit(removal(run_fields, hashes));
            }
            done
        })
    }
}

/// A removal of `hashes`, stored with `fields`.
fn removal(fields: &StoreFields, hashes: Vec<i64>) -> KvCacheEvent {
    KvCacheEvent {
        // Synthesized, as a snapshot's events are.
        event_id: 0,
        data: Some(Data::Removed(KvBlocksRemoved {
            block_hashes: hashes,
            cache_level: fields.cache_level,
            tier: fields.tier,
            medium: fields.medium.clone(),
            group_idx: fields.group_idx,
            locality: fields.locality,
            ownership: fields.ownership.clone(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::proto::common::KvCacheTier;
    use crate::state::{LiveState, stored_event};

    /// Copies named per (tier, hash) by the whole walk, `budget` a step.
    fn named(blocks: RankBlocks, budget: usize) -> (HashMap<(i32, i64), u32>, usize) {
        let mut retraction = Retraction::of(blocks);
        let mut named = HashMap::new();
        let mut steps = 0;
        loop {
            steps += 1;
            let mut in_step = 0;
            let done = retraction.step(budget, |event| {
                let Some(Data::Removed(removed)) = event.data else {
                    panic!("only removals")
                };
                assert!(removed.block_hashes.len() <= MAX_HASHES_PER_REMOVAL);
                for hash in removed.block_hashes {
                    in_step += 1;
                    *named.entry((removed.tier.unwrap(), hash)).or_default() += 1;
                }
            });
            assert!(
                in_step < budget + MAX_COPIES_OF_ONE,
                "{in_step} past {budget}"
            );
            if done {
                return (named, steps);
            }
            assert!(steps < 10_000, "the walk ends");
        }
    }

    /// A step may end past its budget by the copies of its last block.
    const MAX_COPIES_OF_ONE: usize = crate::state::MAX_COPIES as usize;

    #[test]
    fn every_copy_of_every_tier_is_named_once_within_each_steps_budget() {
        let mut state = LiveState::default();
        let chain: Vec<i64> = (1..=3000).collect();
        state.apply(0, &mut stored_event(None, &chain, KvCacheTier::Device, 4));
        state.apply(
            0,
            &mut stored_event(Some(3000), &[3001], KvCacheTier::Device, 4),
        );
        // A second and third copy of block 7.
        state.apply(0, &mut stored_event(None, &[7], KvCacheTier::Device, 4));
        state.apply(0, &mut stored_event(None, &[7], KvCacheTier::Device, 4));
        state.apply(0, &mut stored_event(None, &[10, 11], KvCacheTier::Host, 4));
        state.apply(0, &mut stored_event(None, &[10], KvCacheTier::Disk, 4));
        let blocks = state.rank(0).unwrap().clone();
        let total = blocks.counts().total();
        assert_eq!(total, 3001 + 2 + 2 + 1);

        for budget in [1, 5, 1000, 100_000] {
            let (named, steps) = named(blocks.clone(), budget);
            assert_eq!(named.values().map(|&c| u64::from(c)).sum::<u64>(), total);
            assert_eq!(named[&(KvCacheTier::Device as i32, 7)], 3);
            assert_eq!(named[&(KvCacheTier::Host as i32, 10)], 1);
            assert_eq!(named[&(KvCacheTier::Disk as i32, 10)], 1);
            assert!(named.values().all(|&copies| copies <= 3));
            if budget == 100_000 {
                assert_eq!(steps, 1);
            } else {
                let most_per_step = (budget + MAX_COPIES_OF_ONE) as u64;
                assert!(
                    steps as u64 >= total / most_per_step,
                    "{steps} steps at {budget}"
                );
            }
        }
    }

    #[test]
    fn a_removal_carries_the_fields_its_blocks_were_stored_with() {
        let mut state = LiveState::default();
        let mut stored = stored_event(None, &[1, 2], KvCacheTier::Host, 4);
        if let Some(Data::Stored(store)) = &mut stored.data {
            store.medium = Some("CPU".into());
            store.group_idx = Some(3);
            store.ownership = Some("tier-a".into());
        }
        state.apply(2, &mut stored);
        let mut events = Vec::new();
        assert!(Retraction::of(state.rank(2).unwrap().clone()).step(10, |e| events.push(e)));
        let [event] = events.as_slice() else {
            panic!("one removal: {events:?}")
        };
        let Some(Data::Removed(removed)) = &event.data else {
            panic!()
        };
        assert_eq!(removed.block_hashes, [1, 2]);
        assert_eq!(removed.tier, Some(KvCacheTier::Host as i32));
        assert_eq!(removed.medium.as_deref(), Some("CPU"));
        assert_eq!(removed.group_idx, Some(3));
        assert_eq!(removed.ownership.as_deref(), Some("tier-a"));
        assert_eq!(event.event_id, 0);
    }

    #[test]
    fn an_empty_rank_is_done_at_once() {
        let mut events = 0;
        assert!(Retraction::of(RankBlocks::default()).step(1, |_| events += 1));
        assert_eq!(events, 0);
    }
}
