//! `kvgate serve --index`: the sidecar keeps the prefix index's tree for its
//! own engine, fed from its own hub as a router is fed, and answers `/query`,
//! `/query_by_hash` (admin port) and `KvIndex/Match` (gRPC port) from it.
//!
//! Invariant: the tree holds exactly what a router following this sidecar
//! holds. The feed subscribes in process as a router subscribes over gRPC:
//! a snapshot first, then every batch after the snapshot's cut, each
//! admitted by the router's rules (`router_rules`); a restart, a snapshot's
//! first chunk and any `KvCacheCleared` empty the whole worker, as the
//! router empties it; a subscription that falls behind the history (or a
//! gap, which in process only a bug could make) starts over from a new
//! snapshot. The engine is one worker (`--index-worker-id`), its ranks the
//! worker's ranks. The tree's memory is bounded by what the engine holds,
//! and the writer's queue is bounded, so a slow writer holds the feed back,
//! never the drain.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use prost::Message;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cli::ServeArgs;
use crate::clock::unix_now;
use crate::hub::HubReader;
use crate::hub::subscription::{Step, Subscription};
use crate::index::feed::sidecar::{SidecarSettings, SidecarTrust};
use crate::index::partition::{Partition, PartitionKey};
use crate::index::registry::{FeedSettings, Registry, RegistryLimits};
use crate::index::tree::{RankKey, WorkerId};
use crate::index::writer::{self, IndexInput};
use crate::proto::common::KvEventBatch;
use crate::proto::common::kv_cache_event::Data;
use crate::router_rules::{Cursors, Verdict};
use crate::server::subscribe::lazily_encoded;
use crate::state::snapshot::SnapshotEncoder;
use crate::supervisor::{Supervisor, TaskName};
use crate::usage::UsageError;

/// What `--index` and its flags ask for.
pub(super) struct IndexFlags {
    partition: PartitionKey,
    block_size: u32,
    worker: WorkerId,
}

/// `--index`'s flags, checked: `None` without `--index`; with it, the model
/// name and block size are required (a usage error names the one missing).
pub(super) fn flags(args: &ServeArgs) -> Result<Option<IndexFlags>, UsageError> {
    if !args.index {
        return Ok(None);
    }
    let missing = |flag: &str, what: &str| UsageError(format!("--index needs {flag} ({what})"));
    let model_name = args
        .index_model_name
        .clone()
        .ok_or_else(|| missing("--index-model-name", "the model its queries name"))?;
    let block_size = args
        .index_block_size
        .ok_or_else(|| missing("--index-block-size", "the engine's tokens per block"))?;
    Ok(Some(IndexFlags {
        partition: PartitionKey {
            model_name,
            routing_group: args.index_routing_group.clone(),
        },
        block_size,
        worker: args.index_worker_id,
    }))
}

/// Starts the engine's index (writer and feed) under `supervisor`; the
/// registry that answers its queries.
pub(super) fn start(flags: IndexFlags, hub: &HubReader, supervisor: &Supervisor) -> Arc<Registry> {
    let (queue, inputs) = writer::queue();
    let registry = Arc::new(Registry::new(
        queue.clone(),
        // The sidecar's one feed is its hub's, spawned below.
        tokio::runtime::Handle::current(),
        // No worker registers with a sidecar: only its own engine is held.
        FeedSettings {
            replay_timeout: Duration::ZERO,
            max_message_bytes: 0,
            sidecar: SidecarSettings {
                trust: SidecarTrust {
                    ca_file: None,
                    cert_file: None,
                    key_file: None,
                    token_file: None,
                    flags: super::index::WORKER_FLAGS,
                    token_flag: "--worker-token-file",
                },
                service: String::new(),
                max_ranks: 0,
            },
        },
        RegistryLimits {
            max_worker_ranks: 0,
            max_partitions: 1,
        },
    ));
    let partition = registry.hold(flags.partition, flags.block_size);
    supervisor.spawn(TaskName::IndexWriter, async move {
        writer::run(inputs).await;
        Ok(())
    });
    let feed = EngineFeed {
        hub: hub.clone(),
        partition,
        worker: flags.worker,
        writer: queue,
    };
    let stop = supervisor.stopping();
    supervisor.spawn(TaskName::IndexFeed, async move {
        feed.run(stop).await;
        Ok(())
    });
    registry
}

/// The feed from the sidecar's own hub into its tree.
struct EngineFeed {
    hub: HubReader,
    partition: Arc<Partition>,
    worker: WorkerId,
    writer: mpsc::Sender<IndexInput>,
}

/// Why one subscription ended.
enum Ended {
    /// Start over from a new snapshot.
    Resync(&'static str),
    /// The hub closed or the writer is gone: kvgate is stopping.
    Stopped,
}

impl EngineFeed {
    async fn run(mut self, stop: CancellationToken) {
        let mut cursors = Cursors::default();
        loop {
            let ended = tokio::select! {
                ended = self.follow(&mut cursors) => ended,
                () = stop.cancelled() => return,
            };
            match ended {
                Ended::Resync(why) => {
                    info!(why, "engine index: starting over from a snapshot");
                    cursors.forget();
                }
                Ended::Stopped => return,
            }
        }
    }

    /// One subscription: the snapshot, then live batches, until it ends.
    async fn follow(&mut self, cursors: &mut Cursors) -> Ended {
        // Subscribe before the cut so every batch after it reaches us.
        let live = self.hub.subscribe_live();
        let Some(cut) = self.hub.cut().await else {
            return Ended::Stopped;
        };
        cursors.connected();
        let mut subscription = Subscription::after_cut(&self.hub, live, cut.position);
        if cut.last_sequences.is_empty() {
            // Nothing was ever seen: no snapshot, and nothing to hold.
            if !self.empty_the_worker().await {
                return Ended::Stopped;
            }
        } else {
            let cut = Arc::new(cut);
            let timestamp = unix_now();
            let mut chunks = lazily_encoded(
                move || SnapshotEncoder::plan(cut, timestamp),
                Arc::new(Semaphore::new(1)),
            );
            while let Some(chunk) = chunks.next().await {
                let Ok(chunk) = chunk else {
                    return Ended::Resync("the snapshot failed to encode");
                };
                // A chunk is one encoded batch, not framed yet.
                if let Some(ended) = self.admit(cursors, &chunk).await {
                    return ended;
                }
            }
        }
        loop {
            match subscription.next().await {
                Step::Batch(published) => {
                    if let Some(ended) = self.admit(cursors, &published.encoded).await {
                        return ended;
                    }
                }
                Step::LoadOnly(_) => {}
                Step::Lost { .. } => return Ended::Resync("fell behind the history"),
                Step::Closed => return Ended::Stopped,
            }
        }
    }

    /// Applies one batch as the router would; `Some` when the subscription
    /// must end.
    async fn admit(&mut self, cursors: &mut Cursors, message: &[u8]) -> Option<Ended> {
        let Ok(mut batch) = KvEventBatch::decode(message) else {
            // The drain encoded it: undecodable means a bug, not input.
            warn!("engine index: a batch of the hub does not decode; starting over");
            return Some(Ended::Resync("a batch did not decode"));
        };
        let empties_worker = match cursors.admit(&batch) {
            Verdict::Stale | Verdict::LoadOnly => return None,
            Verdict::Gap => return Some(Ended::Resync("a gap in a rank's numbers")),
            Verdict::Restart | Verdict::Snapshot { first: true } => true,
            Verdict::Next | Verdict::Snapshot { first: false } => false,
        };
        // The router empties the whole worker on any clear, and everything
        // before the last clear is gone with it.
        let last_clear = batch
            .events
            .iter()
            .rposition(|event| matches!(event.data, Some(Data::Cleared(_))));
        if (empties_worker || last_clear.is_some()) && !self.empty_the_worker().await {
            return Some(Ended::Stopped);
        }
        if let Some(last_clear) = last_clear {
            batch.events.drain(..=last_clear);
        }
        let rank = u32::try_from(batch.dp_rank.unwrap_or(0)).unwrap_or(0);
        if batch.events.is_empty() {
            return None;
        }
        let input = IndexInput::Events {
            partition: Arc::clone(&self.partition),
            key: self.key(rank),
            events: batch.events,
        };
        match self.writer.send(input).await {
            Ok(()) => None,
            Err(_) => Some(Ended::Stopped),
        }
    }

    /// Clears every rank of the worker; false once the writer is gone.
    async fn empty_the_worker(&mut self) -> bool {
        let input = IndexInput::ClearWorker {
            partition: Arc::clone(&self.partition),
            worker: self.worker,
        };
        self.writer.send(input).await.is_ok()
    }

    fn key(&self, rank: u32) -> RankKey {
        RankKey {
            worker: self.worker,
            rank,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::{HistoryLimits, hub};
    use crate::proto::common::{
        KvBlock, KvBlocksStored, KvCacheCleared, KvCacheEvent, KvSnapshotChunk,
    };

    fn stored(hash: i64, token: u32) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 1,
            data: Some(Data::Stored(KvBlocksStored {
                blocks: vec![KvBlock {
                    block_hash: hash,
                    token_ids: vec![token, token],
                    block_size: 2,
                    ..Default::default()
                }],
                ..Default::default()
            })),
        }
    }

    fn batch(rank: i32, sequence: u64, events: Vec<KvCacheEvent>) -> Vec<u8> {
        KvEventBatch {
            sequence_number: sequence,
            dp_rank: Some(rank),
            events,
            ..Default::default()
        }
        .encode_to_vec()
    }

    /// A feed on a hub nothing publishes to (`admit` is fed by hand), and
    /// the writer's queue.
    fn feed() -> (EngineFeed, mpsc::Receiver<IndexInput>) {
        let (_, reader) = hub(
            1,
            HistoryLimits {
                batches: 1,
                bytes: 1,
            },
        );
        let (writer, inputs) = writer::queue();
        let key = PartitionKey {
            model_name: "m".into(),
            routing_group: "default".into(),
        };
        let feed = EngineFeed {
            hub: reader,
            partition: Arc::new(Partition::new(key, 2)),
            worker: 9,
            writer,
        };
        (feed, inputs)
    }

    /// Admits `message`, applies what it queued, and answers each rank's
    /// blocks.
    async fn admit(
        feed: &mut EngineFeed,
        cursors: &mut Cursors,
        inputs: &mut mpsc::Receiver<IndexInput>,
        message: Vec<u8>,
    ) -> [usize; 2] {
        assert!(feed.admit(cursors, &message).await.is_none());
        while let Ok(input) = inputs.try_recv() {
            writer::apply(input);
        }
        let tree = feed.partition.read();
        [0, 1].map(|rank| tree.rank_blocks(feed.key(rank)))
    }

    #[tokio::test]
    async fn any_clear_a_restart_or_a_snapshot_empties_every_rank_as_the_router_does() {
        let (mut feed, mut inputs) = feed();
        let mut cursors = Cursors::default();
        cursors.connected();
        let rank0 = batch(0, 10, vec![stored(1, 1)]);
        assert_eq!(
            admit(&mut feed, &mut cursors, &mut inputs, rank0).await,
            [1, 0]
        );
        let rank1 = batch(1, 20, vec![stored(2, 2), stored(3, 3)]);
        assert_eq!(
            admit(&mut feed, &mut cursors, &mut inputs, rank1).await,
            [1, 2]
        );
        // A clear in rank 1's batch: the router empties the whole worker,
        // and keeps what follows the clear.
        let clear = KvCacheEvent {
            event_id: 0,
            data: Some(Data::Cleared(KvCacheCleared { ownership: None })),
        };
        let cleared = batch(1, 21, vec![stored(4, 4), clear, stored(5, 5)]);
        assert_eq!(
            admit(&mut feed, &mut cursors, &mut inputs, cleared).await,
            [0, 1]
        );
        let rank0 = batch(0, 11, vec![stored(6, 6)]);
        assert_eq!(
            admit(&mut feed, &mut cursors, &mut inputs, rank0).await,
            [1, 1]
        );
        // Stale: nothing changes.
        let stale = batch(0, 11, vec![stored(7, 7)]);
        assert_eq!(
            admit(&mut feed, &mut cursors, &mut inputs, stale).await,
            [1, 1]
        );
        // A snapshot's first chunk starts every rank over.
        let mut chunk = KvEventBatch::decode(&batch(1, 40, vec![stored(8, 8)])[..]).unwrap();
        chunk.snapshot = Some(KvSnapshotChunk {
            index: 0,
            count: 1,
            ..Default::default()
        });
        let chunk = chunk.encode_to_vec();
        assert_eq!(
            admit(&mut feed, &mut cursors, &mut inputs, chunk).await,
            [0, 1]
        );
        // A gap ends the subscription (a new snapshot follows).
        let gap = batch(1, 45, vec![stored(9, 9)]);
        assert!(matches!(
            feed.admit(&mut cursors, &gap).await,
            Some(Ended::Resync(_))
        ));
    }
}
