//! A query's answer per worker and rank, in Dynamo's terms and in tokens.
//!
//! Invariant (Dynamo's `scores` and Mooncake RFC #1403's `instances`):
//! a rank's score is its device depth × block size and is listed only when
//! it is not 0; a worker's `gpu` is the most any of its ranks holds on the
//! device, `cpu` adds the host tier's continuation, `disk` adds the disk's
//! and the external store's after that, each the most over the worker's
//! ranks, and `longest_matched` is the greatest of the three. Every query
//! (HTTP's `/query` and `/query_by_hash`, gRPC's `Match`) is answered by
//! [`Answer::of`]; the servers only translate it.

use std::collections::BTreeMap;

use super::block_hash::HashSeed;
use super::partition::Partition;
use super::tree::{RankMatch, WorkerId};

/// What a query asks to match.
#[derive(Clone, Copy, Debug)]
pub enum QueryBlocks<'a> {
    /// Token ids, hashed per full block.
    Tokens {
        /// The request's tokens.
        token_ids: &'a [u32],
        /// The seed of the request's LoRA name and cache salt.
        seed: HashSeed,
    },
    /// Dynamo's local block hashes, already seeded, as i64.
    Hashes(&'a [i64]),
}

/// A query's answer: each rank's depth per tier, and the summary in tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Tokens per block in the partition asked.
    pub block_size: u32,
    /// Every rank that matched a block in some tier, by worker then rank.
    pub ranks: Vec<RankMatch>,
    /// The same, in Dynamo's terms.
    pub overlap: Overlap,
}

impl Answer {
    /// `blocks` matched against `partition` (its tree read for the walk only).
    pub fn of(partition: &Partition, blocks: QueryBlocks<'_>) -> Self {
        let block_size = partition.block_size();
        let locals: Vec<u64> = match blocks {
            QueryBlocks::Tokens { token_ids, seed } => seed.blocks(token_ids, block_size),
            QueryBlocks::Hashes(hashes) => hashes.iter().map(|&hash| hash as u64).collect(),
        };
        let mut ranks = partition.overlap(&locals);
        ranks.sort_unstable_by_key(|found| found.key);
        let overlap = Overlap::new(&ranks, block_size);
        Answer {
            block_size,
            ranks,
            overlap,
        }
    }
}

/// One worker's summary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerOverlap {
    /// The most tokens matched through any tier.
    pub longest_matched: u32,
    /// Tokens matched on the device, the most over the ranks.
    pub gpu: u32,
    /// Each rank's device tokens (0 for a rank that matched only lower tiers).
    pub dp: BTreeMap<u32, u32>,
    /// Device plus host tokens.
    pub cpu: u32,
    /// Device, host, disk and external tokens.
    pub disk: u32,
}

/// The whole answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Device tokens per worker and rank, for the ranks that matched some.
    pub scores: BTreeMap<WorkerId, BTreeMap<u32, u32>>,
    /// Per worker, every tier.
    pub instances: BTreeMap<WorkerId, WorkerOverlap>,
}

impl Overlap {
    /// The answer for `matches` in a partition of `block_size` tokens per block.
    pub fn new(matches: &[RankMatch], block_size: u32) -> Self {
        let mut overlap = Overlap::default();
        for found in matches {
            let [device, host, disk, external] = found.blocks;
            let tokens = |blocks: u32| blocks.saturating_mul(block_size);
            let gpu = tokens(device);
            let cpu = tokens(device.saturating_add(host));
            let all = tokens(
                device
                    .saturating_add(host)
                    .saturating_add(disk)
                    .saturating_add(external),
            );
            if device > 0 {
                overlap
                    .scores
                    .entry(found.key.worker)
                    .or_default()
                    .insert(found.key.rank, gpu);
            }
            let worker = overlap.instances.entry(found.key.worker).or_default();
            worker.dp.insert(found.key.rank, gpu);
            worker.gpu = worker.gpu.max(gpu);
            worker.cpu = worker.cpu.max(cpu);
            worker.disk = worker.disk.max(all);
            worker.longest_matched = worker.gpu.max(worker.cpu).max(worker.disk);
        }
        overlap
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::tree::RankKey;

    #[test]
    fn lower_tiers_add_to_the_device_and_each_figure_is_the_most_over_ranks() {
        let rank = |rank, blocks| RankMatch {
            key: RankKey { worker: 7, rank },
            blocks,
        };
        let overlap = Overlap::new(
            &[
                rank(0, [2, 1, 2, 0]),
                rank(1, [1, 0, 1, 0]),
                rank(2, [0, 3, 0, 0]),
            ],
            16,
        );
        assert_eq!(overlap.scores[&7], BTreeMap::from([(0, 32), (1, 16)]));
        let worker = &overlap.instances[&7];
        assert_eq!(worker.dp, BTreeMap::from([(0, 32), (1, 16), (2, 0)]));
        assert_eq!(
            (worker.gpu, worker.cpu, worker.disk, worker.longest_matched),
            (32, 48, 80, 80)
        );
    }
}
