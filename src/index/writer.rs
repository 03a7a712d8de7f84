//! The one writer: applies every worker's converted events to its
//! partition's tree, in each rank's order.
//!
//! Invariant: the writer is the only task that changes a tree, and it holds
//! a tree's write lock for one bounded step at a time: at most
//! [`MAX_BLOCKS_PER_STEP`] blocks of a store (a longer store is applied as a
//! chain of steps, each under the last block of the one before), of a
//! removal, or of a clear (a rank's blocks are taken out of its map in one
//! step and their nodes released in steps; a worker's clear is each of its
//! ranks' clear in turn). A device removal also takes the
//! rank's device blocks under the removed one in the same step.
//! Its input queue is bounded, so a worker's feed waits for it rather than
//! growing memory. Once the queue has stayed dry for
//! [`QUIET_BEFORE_TRIM`] after a burst (at least [`BURST_BEFORE_TRIM`]
//! inputs since the last trim), the heap's free pages go back to the
//! kernel, on a blocking thread: the index's memory is then its trees, not
//! the burst's garbage. A steady flow never trims, so it never faults the
//! same pages in again; nor does a trickle, whose every input would
//! otherwise be followed by a walk of the whole heap.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::block_hash::HashSeed;
use super::partition::{Dropped, Partition};
use super::tier::Tier;
use super::tree::{RankKey, StoreOutcome, WorkerId};
use crate::proto::common::kv_block_extra_key::Key;
use crate::proto::common::{KvBlocksStored, KvCacheEvent, kv_cache_event::Data};

/// The most blocks one step of a store applies under the lock.
pub const MAX_BLOCKS_PER_STEP: usize = 256;

/// Events in the writer's queue before a feed waits.
pub const QUEUE_DEPTH: usize = 1024;

/// What the writer is asked to do.
#[derive(Debug)]
pub enum IndexInput {
    /// One engine payload's converted events, for one rank.
    Events {
        partition: Arc<Partition>,
        key: RankKey,
        events: Vec<KvCacheEvent>,
    },
    /// The rank's publisher restarted (or its source resynchronises): its
    /// cache is void.
    ClearRank {
        partition: Arc<Partition>,
        key: RankKey,
    },
    /// The rank was unregistered.
    RemoveRank {
        partition: Arc<Partition>,
        key: RankKey,
    },
    /// Every rank of the worker starts over (a sidecar's snapshot, a clear
    /// from a sidecar, a refused cursor): its ranks stay known.
    ClearWorker {
        partition: Arc<Partition>,
        worker: WorkerId,
    },
    /// The worker was unregistered: every rank of it is forgotten.
    RemoveWorker {
        partition: Arc<Partition>,
        worker: WorkerId,
    },
}

/// The writer's end of the queue, and a handle to send to it.
pub fn queue() -> (mpsc::Sender<IndexInput>, mpsc::Receiver<IndexInput>) {
    mpsc::channel(QUEUE_DEPTH)
}

/// How long the queue stays dry before the heap's free pages go back.
pub const QUIET_BEFORE_TRIM: Duration = Duration::from_millis(100);

/// Inputs applied since the last trim that make a burst worth trimming
/// after. A trim walks the whole heap (hundreds of megabytes at fleet
/// scale) and holds each arena's lock meanwhile: 256 ranks storing one
/// block a second each (a store every 125 ms) left the queue dry for
/// 100 ms about once a second, and trimming each time cost some 40 ms of
/// CPU a second (BENCHMARKS.md, "The fleet index").
pub const BURST_BEFORE_TRIM: usize = 1024;

/// Applies everything the queue brings until every sender is gone.
pub async fn run(mut inputs: mpsc::Receiver<IndexInput>) {
    let mut applied_since_trim = 0_usize;
    loop {
        let input = if applied_since_trim >= BURST_BEFORE_TRIM {
            match tokio::time::timeout(QUIET_BEFORE_TRIM, inputs.recv()).await {
                Ok(input) => input,
                Err(_quiet) => {
                    applied_since_trim = 0;
                    tokio::task::spawn_blocking(crate::allocator::return_free_pages);
                    continue;
                }
            }
        } else {
            inputs.recv().await
        };
        let Some(input) = input else { break };
        apply(input);
        applied_since_trim += 1;
        // The runtime's thread goes back to queries and feeds after each
        // input: with a queue behind it, tokio's cooperative budget alone
        // (128, two an input) let the writer apply 64 inputs in a row,
        // milliseconds of a fleet's churn, before a query on the same
        // thread was answered.
        tokio::task::yield_now().await;
    }
}

/// Applies one input.
pub fn apply(input: IndexInput) {
    match input {
        IndexInput::Events {
            partition,
            key,
            events,
        } => {
            for event in &events {
                apply_event(&partition, key, event);
            }
        }
        IndexInput::ClearRank { partition, key } => clear_in_steps(&partition, key),
        IndexInput::RemoveRank { partition, key } => {
            clear_in_steps(&partition, key);
            partition.write().remove_rank(key);
        }
        IndexInput::ClearWorker { partition, worker } => {
            for key in ranks_of(&partition, worker) {
                clear_in_steps(&partition, key);
            }
        }
        IndexInput::RemoveWorker { partition, worker } => {
            for key in ranks_of(&partition, worker) {
                clear_in_steps(&partition, key);
                partition.write().remove_rank(key);
            }
        }
    }
}

/// The ranks of `worker` the partition's tree knows.
fn ranks_of(partition: &Partition, worker: WorkerId) -> Vec<RankKey> {
    partition
        .read()
        .ranks()
        .filter(|key| key.worker == worker)
        .collect()
}

/// Media as Dynamo's indexer spells them (exact case); the converter also
/// takes other cases, which Dynamo drops.
const DYNAMO_MEDIA: [&str; 13] = [
    "GPU",
    "DEVICE",
    "CPU",
    "CPU_PINNED",
    "CPU_TIER1",
    "CPU_TIER2",
    "DISK",
    "NVME",
    "STORAGE",
    "EXTERNAL",
    "NETWORK",
    "REMOTE",
    "SHARED",
];

/// The prefix Dynamo's vLLM integration tags a cache salt with in a block's
/// extra keys.
const SALT_TAG: &str = "dynamo-cache-salt:";

fn dynamo_medium(medium: Option<&str>) -> bool {
    medium.is_none_or(|medium| DYNAMO_MEDIA.contains(&medium))
}

/// The salt Dynamo hashes a store with: the event's own `cache_salt`, else a
/// tagged string in the first block's extra keys (one string equal to the
/// LoRA name skipped). The converter also takes an untagged string from the
/// extra keys as the salt; Dynamo does not, so such a salt is not used.
fn dynamo_salt(stored: &KvBlocksStored) -> Option<&str> {
    let texts = || {
        stored
            .blocks
            .first()
            .into_iter()
            .flat_map(|block| &block.extra_keys)
            .filter_map(|key| match &key.key {
                Some(Key::Text(text)) => Some(text.as_str()),
                _ => None,
            })
    };
    let salt = stored.cache_salt.as_deref().filter(|salt| !salt.is_empty());
    if let Some(salt) = salt
        && !texts().any(|text| text == salt)
    {
        return Some(salt);
    }
    let mut lora_skipped = false;
    texts().find_map(|text| {
        if !lora_skipped && stored.lora_name.as_deref() == Some(text) {
            lora_skipped = true;
            return None;
        }
        text.strip_prefix(SALT_TAG)
    })
}

fn apply_event(partition: &Partition, key: RankKey, event: &KvCacheEvent) {
    partition.count_event();
    match &event.data {
        Some(Data::Stored(stored)) if !dynamo_medium(stored.medium.as_deref()) => {
            partition.count_dropped(Dropped::UnknownMedium);
        }
        Some(Data::Removed(removed)) if !dynamo_medium(removed.medium.as_deref()) => {
            partition.count_dropped(Dropped::UnknownMedium);
        }
        Some(Data::Stored(stored)) => {
            if let Err(reason) = apply_store(partition, key, stored) {
                partition.count_dropped(reason);
            }
        }
        Some(Data::Removed(removed)) => {
            let tier = Tier::from_proto(removed.tier);
            for step in removed.block_hashes.chunks(MAX_BLOCKS_PER_STEP) {
                partition.write().remove(key, tier, step);
            }
        }
        Some(Data::Cleared(_)) => clear_in_steps(partition, key),
        None => {}
    }
}

/// Forgets `key`'s blocks: taken out of its map in one step, their nodes
/// released [`MAX_BLOCKS_PER_STEP`] at a time.
fn clear_in_steps(partition: &Partition, key: RankKey) {
    let detached = partition.write().detach(key);
    let mut nodes = detached.into_nodes();
    while !nodes.is_empty() {
        let step = nodes.split_step(MAX_BLOCKS_PER_STEP);
        partition.write().release_detached(&step);
    }
}

/// Builds `key`'s map again if the step's inserts made that due, under
/// the read lock queries share, and swaps it in under the write lock; the
/// writer, the only one to change the tree, changes nothing in between.
fn rebuild_map_if_due(partition: &Partition, key: RankKey) {
    let rebuilt = partition.read().rebuilt_map(key);
    if let Some(rebuilt) = rebuilt {
        partition.write().install_map(rebuilt);
    }
}

fn apply_store(
    partition: &Partition,
    key: RankKey,
    stored: &KvBlocksStored,
) -> Result<(), Dropped> {
    let block_size = partition.block_size();
    if stored.blocks.iter().any(|block| {
        u32::try_from(block.block_size).ok() != Some(block_size)
            || block.token_ids.len() != block_size as usize
    }) {
        return Err(Dropped::BlockSizeMismatch);
    }
    let seed = HashSeed::new(stored.lora_name.as_deref(), dynamo_salt(stored));
    let tier = Tier::from_proto(stored.tier);
    let mut parent = stored.parent_block_hash;
    let mut step = Vec::with_capacity(stored.blocks.len().min(MAX_BLOCKS_PER_STEP));
    for blocks in stored.blocks.chunks(MAX_BLOCKS_PER_STEP) {
        step.clear();
        step.extend(
            blocks
                .iter()
                .map(|block| (block.block_hash, seed.block(&block.token_ids))),
        );
        if partition.write().store(key, parent, tier, &step) == StoreOutcome::UnknownParent {
            return Err(Dropped::UnknownParent);
        }
        rebuild_map_if_due(partition, key);
        parent = step.last().map(|&(engine_hash, _)| engine_hash);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::partition::PartitionKey;
    use crate::proto::common::KvBlock;

    #[test]
    fn a_store_leaves_no_rank_map_due_for_a_merge() {
        let partition = Arc::new(Partition::new(
            PartitionKey {
                model_name: "m".to_owned(),
                routing_group: "g".to_owned(),
            },
            2,
        ));
        let key = RankKey { worker: 1, rank: 0 };
        let blocks = (0..3_000_u32)
            .map(|block| KvBlock {
                block_hash: i64::from(block) + 1,
                token_ids: vec![block, block],
                block_size: 2,
                ..Default::default()
            })
            .collect();
        let store = KvCacheEvent {
            event_id: 1,
            data: Some(Data::Stored(KvBlocksStored {
                blocks,
                ..Default::default()
            })),
        };
        apply(IndexInput::Events {
            partition: Arc::clone(&partition),
            key,
            events: vec![store],
        });
        let tree = partition.read();
        assert_eq!(tree.rank_blocks(key), 3_000);
        // The map grew by merges the writer made after its steps, not by a
        // spill that was never merged.
        assert!(tree.rebuilt_map(key).is_none());
    }
}
