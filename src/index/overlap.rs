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

use std::ops::Range;

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
        // Mostly in runs already sorted (the ranks that ended at one depth,
        // by member, and members are numbered as ranks first appear), which
        // a stable sort finds and merges where an unstable one sorts anew.
        ranks.sort_by_key(|found| found.key);
        let overlap = Overlap::new(&ranks, block_size);
        Answer {
            block_size,
            ranks,
            overlap,
        }
    }
}

/// One rank's depths in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankTokens {
    /// On the device.
    pub device: u32,
    /// The device's and the host's continuation.
    pub host: u32,
    /// Through every tier: device, host, disk, external.
    pub all: u32,
}

impl RankTokens {
    /// `found`'s depths in a partition of `block_size` tokens per block.
    pub fn of(found: &RankMatch, block_size: u32) -> Self {
        let [device, host, disk, external] = found.blocks;
        let tokens = |blocks: u32| blocks.saturating_mul(block_size);
        RankTokens {
            device: tokens(device),
            host: tokens(device.saturating_add(host)),
            all: tokens(
                device
                    .saturating_add(host)
                    .saturating_add(disk)
                    .saturating_add(external),
            ),
        }
    }
}

/// One worker's summary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerOverlap {
    /// The worker.
    pub worker: WorkerId,
    /// The most tokens matched through any tier.
    pub longest_matched: u32,
    /// Tokens matched on the device, the most over the ranks.
    pub gpu: u32,
    /// Device plus host tokens.
    pub cpu: u32,
    /// Device, host, disk and external tokens.
    pub disk: u32,
    /// Where its ranks are among the matches the overlap was made of (each
    /// rank's own device tokens are Dynamo's `dp`, and its `scores` where
    /// not 0).
    pub ranks: Range<usize>,
    /// Whether its ranks matched as the previous worker's did (the same
    /// ranks, the same blocks in every tier), so its answer is that
    /// worker's but for the id: a fleet sharing a system prompt is mostly
    /// runs of such workers, whose answer is then written once a run.
    pub alike_previous: bool,
}

/// The whole answer: every worker with a rank that matched, in order. Built
/// without a map: an answer names every matching worker (all 256 of a fleet
/// sharing a system prompt), and maps of maps took more CPU than the walk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Each worker's summary, by worker id.
    pub workers: Vec<WorkerOverlap>,
}

impl Overlap {
    /// The summary of `matches` (sorted by worker, then rank) in a partition
    /// of `block_size` tokens per block.
    pub fn new(matches: &[RankMatch], block_size: u32) -> Self {
        let mut workers = Vec::new();
        let mut start = 0;
        let mut previous: &[RankMatch] = &[];
        for ranks in matches.chunk_by(|one, other| one.key.worker == other.key.worker) {
            let mut summary = WorkerOverlap {
                worker: ranks[0].key.worker,
                ranks: start..start + ranks.len(),
                alike_previous: matched_alike(previous, ranks),
                ..WorkerOverlap::default()
            };
            previous = ranks;
            for found in ranks {
                let tokens = RankTokens::of(found, block_size);
                summary.gpu = summary.gpu.max(tokens.device);
                summary.cpu = summary.cpu.max(tokens.host);
                summary.disk = summary.disk.max(tokens.all);
            }
            summary.longest_matched = summary.gpu.max(summary.cpu).max(summary.disk);
            start += ranks.len();
            workers.push(summary);
        }
        Overlap { workers }
    }
}

/// Whether two workers' ranks matched alike: the same rank numbers, each
/// with the same blocks in every tier.
fn matched_alike(one: &[RankMatch], other: &[RankMatch]) -> bool {
    one.len() == other.len()
        && one
            .iter()
            .zip(other)
            .all(|(a, b)| a.key.rank == b.key.rank && a.blocks == b.blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_tiers_add_to_the_device_and_each_figure_is_the_most_over_ranks() {
        let rank = RankMatch::of;
        let matches = [
            rank(3, 0, [1, 0, 0, 0]),
            rank(7, 0, [2, 1, 2, 0]),
            rank(7, 1, [1, 0, 1, 0]),
            rank(7, 2, [0, 3, 0, 0]),
        ];
        let overlap = Overlap::new(&matches, 16);
        assert_eq!(overlap.workers.len(), 2);
        let worker = &overlap.workers[1];
        assert_eq!((worker.worker, worker.ranks.clone()), (7, 1..4));
        assert_eq!(
            (worker.gpu, worker.cpu, worker.disk, worker.longest_matched),
            (32, 48, 80, 80)
        );
        let devices: Vec<u32> = matches[worker.ranks.clone()]
            .iter()
            .map(|found| RankTokens::of(found, 16).device)
            .collect();
        assert_eq!(devices, [32, 16, 0]);
        assert_eq!(overlap.workers[0].longest_matched, 16);
    }

    #[test]
    fn a_worker_is_alike_the_previous_only_with_the_same_ranks_and_blocks_in_every_tier() {
        let rank = RankMatch::of;
        let matches = [
            rank(1, 0, [2, 0, 0, 0]),
            rank(2, 0, [2, 0, 0, 0]),
            rank(3, 0, [2, 0, 1, 0]),
            rank(4, 1, [2, 0, 1, 0]),
            rank(5, 1, [2, 0, 1, 0]),
            rank(5, 2, [1, 0, 0, 0]),
            rank(6, 1, [2, 0, 1, 0]),
            rank(6, 2, [1, 0, 0, 0]),
        ];
        let alike: Vec<(WorkerId, bool)> = Overlap::new(&matches, 16)
            .workers
            .iter()
            .map(|worker| (worker.worker, worker.alike_previous))
            .collect();
        assert_eq!(
            alike,
            [
                (1, false),
                (2, true),
                (3, false),
                (4, false),
                (5, false),
                (6, true)
            ]
        );
    }
}
