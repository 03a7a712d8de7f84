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
//! before outlives it. A `grpc://` worker (a sidecar) is registered once,
//! with no rank: one feed covers every rank of its engine, and it is
//! unregistered whole. The numbers of registrations (a ZMQ rank or a
//! sidecar each) and of partitions are bounded by [`RegistryLimits`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvgate_endpoint::{EndpointError, ZmqEndpoint};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::feed::sidecar::{self, SidecarSettings};
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
    /// Registrations: worker ranks (one feed, one socket each) and
    /// sidecars (one feed, one connection each).
    pub max_worker_ranks: usize,
    /// (model, routing group) partitions.
    pub max_partitions: usize,
}

/// What every feed is configured with.
#[derive(Clone, Debug)]
pub struct FeedSettings {
    pub replay_timeout: Duration,
    pub max_message_bytes: usize,
    pub sidecar: SidecarSettings,
}

/// One rank to follow.
#[derive(Clone, Debug)]
pub struct Registration {
    pub instance_id: WorkerId,
    /// The rank of a ZMQ publisher (0 when not given); a sidecar takes none.
    pub dp_rank: Option<u32>,
    pub partition: PartitionKey,
    pub block_size: u32,
    /// The rank's publisher, `tcp://HOST:PORT` or `ipc://PATH`, or the
    /// sidecar of every rank of the engine, `grpc://HOST:PORT` or
    /// `grpcs://HOST:PORT`.
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
    #[error(
        "instance {instance_id} is already registered: a grpc:// worker is registered once, for every rank, and no ZMQ rank is added to it"
    )]
    SidecarConflict { instance_id: WorkerId },
    #[error(
        "dp_rank is not taken with a grpc:// endpoint: one registration covers every rank of the engine"
    )]
    RankOfSidecar,
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
    #[error(
        "instance {instance_id} is a grpc:// worker: it is unregistered whole, without dp_rank"
    )]
    RankOfSidecar { instance_id: WorkerId },
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
    /// A `grpc://` worker's one feed (its ranks are in its cursors).
    pub sidecar: Option<RankReport>,
}

struct RankEntry {
    endpoint: String,
    replay_endpoint: Option<String>,
    status: Arc<FeedStatus>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl RankEntry {
    fn report(&self) -> RankReport {
        RankReport {
            endpoint: self.endpoint.clone(),
            replay_endpoint: self.replay_endpoint.clone(),
            feed: self.status.now(),
        }
    }
}

struct WorkerEntry {
    partition: Arc<Partition>,
    ranks: BTreeMap<u32, RankEntry>,
    /// A `grpc://` worker's feed (then `ranks` is empty).
    sidecar: Option<RankEntry>,
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
    /// Where feeds run: ingest's own runtime, apart from the queries'.
    ingest: Handle,
    settings: FeedSettings,
    limits: RegistryLimits,
}

impl Registry {
    /// An empty registry whose feeds run on `ingest` and send to `writer`.
    pub fn new(
        writer: mpsc::Sender<IndexInput>,
        ingest: Handle,
        settings: FeedSettings,
        limits: RegistryLimits,
    ) -> Self {
        Registry {
            state: Mutex::default(),
            writer,
            ingest,
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
        let source = if sidecar::is_sidecar(&registration.endpoint) {
            if registration.dp_rank.is_some() {
                return Err(RegisterError::RankOfSidecar);
            }
            if registration.replay_endpoint.is_some() {
                return Err(RegisterError::BadEndpoint(
                    "replay_endpoint is not taken with a grpc:// endpoint: the sidecar replays itself"
                        .to_owned(),
                ));
            }
            let target = sidecar::target(&registration.endpoint, &self.settings.sidecar.trust)
                .map_err(RegisterError::BadEndpoint)?;
            Source::Sidecar(target)
        } else {
            let endpoint =
                validate_endpoint(&registration.endpoint).map_err(RegisterError::BadEndpoint)?;
            let replay_endpoint = registration
                .replay_endpoint
                .as_deref()
                .map(|replay| {
                    validate_endpoint(replay).map_err(|reason| {
                        RegisterError::BadEndpoint(format!(
                            "invalid replay endpoint `{replay}`: {reason}"
                        ))
                    })
                })
                .transpose()?;
            Source::Zmq(endpoint.map(|endpoint| {
                ZmqFeedConfig {
                    endpoint,
                    // A replay endpoint kvgate cannot reach (`inproc://`)
                    // leaves the rank followed without gap fills, as if
                    // registered without one.
                    replay_endpoint: replay_endpoint.and_then(|replay| {
                        replay
                            .inspect_err(|reason| {
                                warn!(
                                    instance_id = registration.instance_id,
                                    dp_rank = registration.dp_rank.unwrap_or(0),
                                    %reason,
                                    "replay endpoint not followed; the rank is followed without gap fills"
                                );
                            })
                            .ok()
                    }),
                    replay_timeout: self.settings.replay_timeout,
                    max_message_bytes: self.settings.max_message_bytes,
                }
            }))
        };
        let dp_rank = registration.dp_rank.unwrap_or(0);
        let mut state = self.lock();
        let state = &mut *state;
        if let Some(worker) = state.workers.get(&registration.instance_id) {
            if worker.partition.key() != &registration.partition {
                return Err(RegisterError::OtherPartition {
                    instance_id: registration.instance_id,
                    partition: worker.partition.key().clone(),
                });
            }
            if worker.sidecar.is_some() || matches!(source, Source::Sidecar(_)) {
                return Err(RegisterError::SidecarConflict {
                    instance_id: registration.instance_id,
                });
            }
            if worker.ranks.contains_key(&dp_rank) {
                return Err(RegisterError::DuplicateRank {
                    instance_id: registration.instance_id,
                    dp_rank,
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
        let task = match source {
            Source::Zmq(config) => self.ingest.spawn(feed::zmq::run(
                config,
                Arc::clone(&partition),
                RankKey {
                    worker: registration.instance_id,
                    rank: dp_rank,
                },
                self.writer.clone(),
                Arc::clone(&status),
                stop.clone(),
            )),
            Source::Sidecar(target) => self.ingest.spawn(sidecar::run(
                target,
                self.settings.sidecar.clone(),
                Arc::clone(&partition),
                registration.instance_id,
                self.writer.clone(),
                Arc::clone(&status),
                stop.clone(),
            )),
        };
        let entry = RankEntry {
            endpoint: registration.endpoint.clone(),
            replay_endpoint: registration.replay_endpoint,
            status,
            stop,
            task,
        };
        let worker = state
            .workers
            .entry(registration.instance_id)
            .or_insert_with(|| WorkerEntry {
                partition,
                ranks: BTreeMap::new(),
                sidecar: None,
            });
        if sidecar::is_sidecar(&registration.endpoint) {
            worker.sidecar = Some(entry);
        } else {
            worker.ranks.insert(dp_rank, entry);
        }
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
            let removed: Vec<(Option<u32>, RankEntry)> = match which {
                Unregistration::Rank { partition, dp_rank } => {
                    if worker.partition.key() != &partition {
                        return Err(other_partition(worker.partition.key()));
                    }
                    if worker.sidecar.is_some() {
                        return Err(UnregisterError::RankOfSidecar { instance_id });
                    }
                    let entry =
                        worker
                            .ranks
                            .remove(&dp_rank)
                            .ok_or(UnregisterError::UnknownRank {
                                instance_id,
                                dp_rank,
                            })?;
                    vec![(Some(dp_rank), entry)]
                }
                Unregistration::Worker { partition } => {
                    if worker.partition.key() != &partition {
                        return Err(other_partition(worker.partition.key()));
                    }
                    worker.take_all()
                }
                Unregistration::Model { model_name } => {
                    if worker.partition.key().model_name != model_name {
                        return Err(other_partition(worker.partition.key()));
                    }
                    worker.take_all()
                }
            };
            let partition = Arc::clone(&worker.partition);
            if worker.ranks.is_empty() && worker.sidecar.is_none() {
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
            let partition = Arc::clone(&partition);
            let removal = match dp_rank {
                Some(rank) => IndexInput::RemoveRank {
                    partition,
                    key: RankKey {
                        worker: instance_id,
                        rank,
                    },
                },
                None => IndexInput::RemoveWorker {
                    partition,
                    worker: instance_id,
                },
            };
            let _ = self.writer.send(removal).await;
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
                    .map(|(&rank, entry)| (rank, entry.report()))
                    .collect(),
                sidecar: worker.sidecar.as_ref().map(RankEntry::report),
            })
            .collect()
    }

    /// Stops every feed (shutdown).
    pub fn stop_all(&self) {
        for worker in self.lock().workers.values() {
            for entry in worker.ranks.values().chain(&worker.sidecar) {
                entry.stop.cancel();
            }
        }
    }
}

/// What a registration follows.
enum Source {
    /// A rank's publisher, or why no other process can reach it.
    Zmq(Result<ZmqFeedConfig, EndpointError>),
    /// A sidecar, every rank.
    Sidecar(crate::client::Target),
}

impl WorkerEntry {
    /// Every feed of the worker, each with its rank (`None`: the sidecar's).
    fn take_all(&mut self) -> Vec<(Option<u32>, RankEntry)> {
        let ranks = std::mem::take(&mut self.ranks)
            .into_iter()
            .map(|(rank, entry)| (Some(rank), entry));
        ranks
            .chain(self.sidecar.take().map(|entry| (None, entry)))
            .collect()
    }
}

/// A ZMQ endpoint as Dynamo validates one: `tcp://HOST:PORT`, `ipc://PATH`
/// or `inproc://NAME` (the texts of its refusals are Dynamo's). kvgate
/// also refuses an `ipc://` path no socket address can hold. Dynamo
/// registers an `inproc://` endpoint, which no other process can reach:
/// so does kvgate, and its feed fails with that reason (the inner `Err`).
fn validate_endpoint(endpoint: &str) -> Result<Result<ZmqEndpoint, EndpointError>, String> {
    let invalid = |reason: String| format!("invalid ZMQ endpoint `{endpoint}`: {reason}");
    let Some((scheme, rest)) = endpoint.split_once("://") else {
        return Err(invalid("missing scheme".to_owned()));
    };
    match scheme {
        "tcp" => match rest.rsplit_once(':') {
            Some((_, port)) if port.parse::<u16>().is_ok() => {}
            Some(_) => return Err(invalid("invalid TCP port".to_owned())),
            None => return Err(invalid("missing TCP port".to_owned())),
        },
        "ipc" | "inproc" => {}
        other => return Err(invalid(format!("unsupported scheme `{other}`"))),
    }
    match endpoint.parse::<ZmqEndpoint>() {
        Ok(endpoint) => Ok(Ok(endpoint)),
        Err(unreachable @ EndpointError::Inproc(_)) => Ok(Err(unreachable)),
        Err(error) => Err(invalid(error.to_string())),
    }
}
