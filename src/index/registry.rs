//! The workers the index follows and the partitions they feed.
//!
//! Invariants (Dynamo's registry, plus limits): a worker instance belongs to
//! one partition and registers each of its ranks once; a partition's block
//! size is the first registration's and a registration that disagrees is
//! refused; a partition lives while a worker is registered in it (or, one
//! held for a feed of its own, as long as the registry). Every
//! registered rank has one feed; unregistering a rank stops its feed, waits
//! for it to end and only then removes the rank's blocks (through the
//! writer's queue, after the feed's last events), so nothing it sent
//! before outlives it. The numbers of registered ranks and of partitions
//! are bounded by [`RegistryLimits`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::feed::{self, FeedState, FeedStatus, ZmqFeedConfig};
use super::overlap::{Answer, QueryBlocks};
use super::partition::{Partition, PartitionKey, UnknownPartition};
use super::tree::{RankKey, WorkerId};
use super::writer::IndexInput;

/// The routing group a registration or query without one is in.
pub const DEFAULT_ROUTING_GROUP: &str = "default";

/// How many of each the registry accepts.
#[derive(Clone, Copy, Debug)]
pub struct RegistryLimits {
    /// Registered worker ranks (one feed, one socket each).
    pub max_worker_ranks: usize,
    /// (model, routing group) partitions.
    pub max_partitions: usize,
}

/// What every feed is configured with.
#[derive(Clone, Copy, Debug)]
pub struct FeedSettings {
    pub replay_timeout: Duration,
    pub max_message_bytes: usize,
}

/// One rank to follow.
#[derive(Clone, Debug)]
pub struct Registration {
    pub instance_id: WorkerId,
    pub dp_rank: u32,
    pub partition: PartitionKey,
    pub block_size: u32,
    /// The rank's publisher, `tcp://HOST:PORT`.
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
}

/// Why a registration was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("instance {instance_id} is already registered for model={} routing_group={}", .partition.model_name, .partition.routing_group)]
    OtherPartition {
        instance_id: WorkerId,
        partition: PartitionKey,
    },
    #[error("instance {instance_id} dp_rank {dp_rank} already registered")]
    DuplicateRank { instance_id: WorkerId, dp_rank: u32 },
    #[error("block_size mismatch for model={} routing_group={}: existing={existing}, requested={requested}", .partition.model_name, .partition.routing_group)]
    BlockSizeMismatch {
        partition: PartitionKey,
        existing: u32,
        requested: u32,
    },
    #[error("{0}")]
    BadEndpoint(String),
    #[error("limit reached: --index-max-worker-ranks is {0}")]
    TooManyWorkerRanks(usize),
    #[error("limit reached: --index-max-partitions is {0}")]
    TooManyPartitions(usize),
}

/// Why an unregistration found nothing to remove.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UnregisterError {
    #[error("instance {0} not found")]
    UnknownInstance(WorkerId),
    #[error("instance {instance_id} is registered for model={} routing_group={}", .partition.model_name, .partition.routing_group)]
    OtherPartition {
        instance_id: WorkerId,
        partition: PartitionKey,
    },
    #[error("instance {instance_id} dp_rank {dp_rank} not found")]
    UnknownRank { instance_id: WorkerId, dp_rank: u32 },
}

/// Which of a worker's registrations to remove.
#[derive(Clone, Debug)]
pub enum Unregistration {
    /// One rank, in a named partition.
    Rank {
        partition: PartitionKey,
        dp_rank: u32,
    },
    /// Every rank, in a named partition.
    Worker { partition: PartitionKey },
    /// Every rank, whatever the routing group, of a model.
    Model { model_name: String },
}

/// One registered rank as `/workers` reports it.
#[derive(Clone, Debug)]
pub struct RankReport {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub feed: FeedState,
}

/// One worker as `/workers` reports it.
#[derive(Clone, Debug)]
pub struct WorkerReport {
    pub instance_id: WorkerId,
    pub partition: PartitionKey,
    pub block_size: u32,
    pub ranks: BTreeMap<u32, RankReport>,
}

struct RankEntry {
    endpoint: String,
    replay_endpoint: Option<String>,
    status: Arc<FeedStatus>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

struct WorkerEntry {
    partition: Arc<Partition>,
    ranks: BTreeMap<u32, RankEntry>,
}

#[derive(Default)]
struct State {
    partitions: BTreeMap<PartitionKey, Arc<Partition>>,
    workers: BTreeMap<WorkerId, WorkerEntry>,
    ranks: usize,
}

/// The registry (see the module's invariants).
pub struct Registry {
    state: Mutex<State>,
    writer: mpsc::Sender<IndexInput>,
    settings: FeedSettings,
    limits: RegistryLimits,
}

impl Registry {
    /// An empty registry whose feeds send to `writer`.
    pub fn new(
        writer: mpsc::Sender<IndexInput>,
        settings: FeedSettings,
        limits: RegistryLimits,
    ) -> Self {
        Registry {
            state: Mutex::default(),
            writer,
            settings,
            limits,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts following `registration`'s rank (its feed connects in the background).
    pub fn register(&self, registration: Registration) -> Result<(), RegisterError> {
        let endpoint =
            validate_endpoint(&registration.endpoint).map_err(RegisterError::BadEndpoint)?;
        let replay_endpoint = match registration.replay_endpoint.as_deref() {
            Some(replay) => validate_endpoint(replay).map_err(|reason| {
                RegisterError::BadEndpoint(format!("invalid replay endpoint `{replay}`: {reason}"))
            })?,
            None => None,
        };
        let mut state = self.lock();
        let state = &mut *state;
        if let Some(worker) = state.workers.get(&registration.instance_id) {
            if worker.partition.key() != &registration.partition {
                return Err(RegisterError::OtherPartition {
                    instance_id: registration.instance_id,
                    partition: worker.partition.key().clone(),
                });
            }
            if worker.ranks.contains_key(&registration.dp_rank) {
                return Err(RegisterError::DuplicateRank {
                    instance_id: registration.instance_id,
                    dp_rank: registration.dp_rank,
                });
            }
        }
        if state.ranks >= self.limits.max_worker_ranks {
            return Err(RegisterError::TooManyWorkerRanks(
                self.limits.max_worker_ranks,
            ));
        }
        let partition = match state.partitions.get(&registration.partition) {
            Some(partition) if partition.block_size() != registration.block_size => {
                return Err(RegisterError::BlockSizeMismatch {
                    partition: registration.partition,
                    existing: partition.block_size(),
                    requested: registration.block_size,
                });
            }
            Some(partition) => Arc::clone(partition),
            None if state.partitions.len() >= self.limits.max_partitions => {
                return Err(RegisterError::TooManyPartitions(self.limits.max_partitions));
            }
            None => {
                let partition = Arc::new(Partition::new(
                    registration.partition.clone(),
                    registration.block_size,
                ));
                state
                    .partitions
                    .insert(registration.partition.clone(), Arc::clone(&partition));
                partition
            }
        };
        let status = Arc::new(FeedStatus::default());
        let stop = CancellationToken::new();
        let key = RankKey {
            worker: registration.instance_id,
            rank: registration.dp_rank,
        };
        let config = endpoint.map(|endpoint| ZmqFeedConfig {
            endpoint,
            replay_endpoint,
            replay_timeout: self.settings.replay_timeout,
            max_message_bytes: self.settings.max_message_bytes,
        });
        let task = tokio::spawn(feed::run(
            config,
            Arc::clone(&partition),
            key,
            self.writer.clone(),
            Arc::clone(&status),
            stop.clone(),
        ));
        state
            .workers
            .entry(registration.instance_id)
            .or_insert_with(|| WorkerEntry {
                partition,
                ranks: BTreeMap::new(),
            })
            .ranks
            .insert(
                registration.dp_rank,
                RankEntry {
                    endpoint: registration.endpoint,
                    replay_endpoint: registration.replay_endpoint,
                    status,
                    stop,
                    task,
                },
            );
        state.ranks += 1;
        Ok(())
    }

    /// Stops following what `which` names of `instance_id` and removes its blocks.
    pub async fn unregister(
        &self,
        instance_id: WorkerId,
        which: Unregistration,
    ) -> Result<(), UnregisterError> {
        let (partition, removed) = {
            let mut state = self.lock();
            let state = &mut *state;
            let Some(worker) = state.workers.get_mut(&instance_id) else {
                return Err(UnregisterError::UnknownInstance(instance_id));
            };
            let other_partition = |named: &PartitionKey| UnregisterError::OtherPartition {
                instance_id,
                partition: named.clone(),
            };
            let removed: Vec<(u32, RankEntry)> = match which {
                Unregistration::Rank { partition, dp_rank } => {
                    if worker.partition.key() != &partition {
                        return Err(other_partition(worker.partition.key()));
                    }
                    let entry =
                        worker
                            .ranks
                            .remove(&dp_rank)
                            .ok_or(UnregisterError::UnknownRank {
                                instance_id,
                                dp_rank,
                            })?;
                    vec![(dp_rank, entry)]
                }
                Unregistration::Worker { partition } => {
                    if worker.partition.key() != &partition {
                        return Err(other_partition(worker.partition.key()));
                    }
                    std::mem::take(&mut worker.ranks).into_iter().collect()
                }
                Unregistration::Model { model_name } => {
                    if worker.partition.key().model_name != model_name {
                        return Err(other_partition(worker.partition.key()));
                    }
                    std::mem::take(&mut worker.ranks).into_iter().collect()
                }
            };
            let partition = Arc::clone(&worker.partition);
            if worker.ranks.is_empty() {
                state.workers.remove(&instance_id);
            }
            state.ranks -= removed.len();
            let in_use = state
                .workers
                .values()
                .any(|worker| Arc::ptr_eq(&worker.partition, &partition));
            if !in_use {
                state.partitions.remove(partition.key());
            }
            (partition, removed)
        };
        for (dp_rank, entry) in removed {
            entry.stop.cancel();
            // The feed's last events are queued before the removal.
            let _ = entry.task.await;
            let key = RankKey {
                worker: instance_id,
                rank: dp_rank,
            };
            let _ = self
                .writer
                .send(IndexInput::RemoveRank {
                    partition: Arc::clone(&partition),
                    key,
                })
                .await;
        }
        Ok(())
    }

    /// A partition fed from outside the registry (a sidecar's own engine,
    /// `kvgate serve --index`): no worker is registered in it, and it lives
    /// as long as the registry.
    pub fn hold(&self, key: PartitionKey, block_size: u32) -> Arc<Partition> {
        let partition = Arc::new(Partition::new(key.clone(), block_size));
        self.lock().partitions.insert(key, Arc::clone(&partition));
        partition
    }

    /// The partition `key` names, while some worker is registered in it.
    pub fn partition(&self, key: &PartitionKey) -> Option<Arc<Partition>> {
        self.lock().partitions.get(key).cloned()
    }

    /// The answer to a query of `blocks` in the partition `key` names.
    pub fn answer(
        &self,
        key: &PartitionKey,
        blocks: QueryBlocks<'_>,
    ) -> Result<Answer, UnknownPartition> {
        let partition = self
            .partition(key)
            .ok_or_else(|| UnknownPartition(key.clone()))?;
        Ok(Answer::of(&partition, blocks))
    }

    /// Every partition.
    pub fn partitions(&self) -> Vec<Arc<Partition>> {
        self.lock().partitions.values().cloned().collect()
    }

    /// Every worker, filtered by model and routing group when given.
    pub fn workers(
        &self,
        model_name: Option<&str>,
        routing_group: Option<&str>,
    ) -> Vec<WorkerReport> {
        let state = self.lock();
        state
            .workers
            .iter()
            .filter(|(_, worker)| {
                let key = worker.partition.key();
                model_name.is_none_or(|model| key.model_name == model)
                    && routing_group.is_none_or(|group| key.routing_group == group)
            })
            .map(|(&instance_id, worker)| WorkerReport {
                instance_id,
                partition: worker.partition.key().clone(),
                block_size: worker.partition.block_size(),
                ranks: worker
                    .ranks
                    .iter()
                    .map(|(&rank, entry)| {
                        (
                            rank,
                            RankReport {
                                endpoint: entry.endpoint.clone(),
                                replay_endpoint: entry.replay_endpoint.clone(),
                                feed: entry.status.now(),
                            },
                        )
                    })
                    .collect(),
            })
            .collect()
    }

    /// Stops every feed (shutdown).
    pub fn stop_all(&self) {
        for worker in self.lock().workers.values() {
            for entry in worker.ranks.values() {
                entry.stop.cancel();
            }
        }
    }
}

/// A ZMQ endpoint as Dynamo validates one: `tcp://HOST:PORT`, `ipc://PATH`
/// or `inproc://NAME`. Only `tcp://` is followed (the feed reports the
/// others as failed); the text is Dynamo's.
fn validate_endpoint(endpoint: &str) -> Result<Option<kvgate_endpoint::TcpEndpoint>, String> {
    let invalid = |reason: String| format!("invalid ZMQ endpoint `{endpoint}`: {reason}");
    let Some((scheme, rest)) = endpoint.split_once("://") else {
        return Err(invalid("missing scheme".to_owned()));
    };
    match scheme {
        "tcp" => match rest.rsplit_once(':') {
            Some((_, port)) if port.parse::<u16>().is_ok() => endpoint
                .parse()
                .map(Some)
                .map_err(|error: kvgate_endpoint::EndpointError| invalid(error.to_string())),
            Some(_) => Err(invalid("invalid TCP port".to_owned())),
            None => Err(invalid("missing TCP port".to_owned())),
        },
        "ipc" | "inproc" => Ok(None),
        other => Err(invalid(format!("unsupported scheme `{other}`"))),
    }
}
