//! One `grpc://` (or `grpcs://`) worker: a kvgate sidecar, or any
//! `SubscribeKvEvents` server, followed as the SMG router follows it, every
//! rank of its engine through one subscription, into the writer's queue.
//!
//! Invariant: the worker's blocks in the index are what the router's rules
//! make of the stream, applied by the one implementation of those rules
//! (`source::upstream` and `router_rules`): a snapshot on first contact, the
//! cursor on every reconnect, a refused cursor (`OUT_OF_RANGE`, `DATA_LOSS`)
//! or a snapshot's first chunk clears the whole worker before anything
//! after it, a rank's restart (`Verdict::Restart`) clears that rank, and a
//! `KvCacheCleared` from the sidecar clears the whole worker, as the router
//! takes every clear. A rank at or past the worker's rank limit, an
//! undecodable or oversized batch, or a call that is never answered is
//! counted and changes nothing in the index. A server that does not serve
//! `SubscribeKvEvents` (`UNIMPLEMENTED`, which makes the router give the
//! worker up) is reported failed and asked again with the backoff.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{FeedPhase, FeedStatus, SidecarProgress};
use crate::client::{Target, TlsFlags, TlsPaths};
use crate::index::partition::Partition;
use crate::index::tree::{RankKey, WorkerId};
use crate::index::writer::IndexInput;
use crate::pem::FlagFile;
use crate::proto::common::kv_cache_event::Data;
use crate::proto::common::{KvCacheEvent, KvEventBatch};
use crate::router_rules::Verdict;
use crate::source::SourceEvent;
use crate::source::upstream::{self, Interruption, UNKNOWN_RANK, UpstreamConfig, Watcher};

/// How the index reaches every `grpc://` worker.
#[derive(Clone, Debug)]
pub struct SidecarTrust {
    /// The CA that signed `grpcs://` workers' certificates.
    pub ca_file: Option<PathBuf>,
    /// A client certificate and its key, for `grpcs://` workers that
    /// require one.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// A file whose first token is sent to every `grpc://` worker as a
    /// bearer token.
    pub token_file: Option<PathBuf>,
    /// The flags the files come from, for errors.
    pub flags: TlsFlags,
    /// The flag of `token_file`.
    pub token_flag: &'static str,
}

/// What every sidecar feed is configured with.
#[derive(Clone, Debug)]
pub struct SidecarSettings {
    pub trust: SidecarTrust,
    /// The service name `SubscribeKvEvents` is called on.
    pub service: String,
    /// A worker's ranks are `0..max_ranks`; a batch for another is counted
    /// and dropped.
    pub max_ranks: u32,
}

/// Whether `endpoint` names a sidecar (`grpc://`, `grpcs://`) rather than a
/// ZMQ publisher.
pub fn is_sidecar(endpoint: &str) -> bool {
    endpoint.starts_with("grpc://") || endpoint.starts_with("grpcs://")
}

/// The client target for `endpoint` (`grpc://HOST:PORT`: plaintext;
/// `grpcs://HOST:PORT`: TLS verified against the trusted CA), with the
/// bearer token if one is configured; why not, in one line naming the flag.
pub fn target(endpoint: &str, trust: &SidecarTrust) -> Result<Target, String> {
    let (uri, paths) = if let Some(rest) = endpoint.strip_prefix("grpc://") {
        (format!("http://{rest}"), TlsPaths::default())
    } else if let Some(rest) = endpoint.strip_prefix("grpcs://") {
        let paths = TlsPaths {
            ca: trust.ca_file.clone(),
            cert: trust.cert_file.clone(),
            key: trust.key_file.clone(),
        };
        (format!("https://{rest}"), paths)
    } else {
        return Err(format!(
            "invalid sidecar endpoint `{endpoint}`: expected grpc://HOST:PORT or grpcs://HOST:PORT"
        ));
    };
    let parsed: http::Uri = uri
        .parse()
        .map_err(|error| format!("invalid sidecar endpoint `{endpoint}`: {error}"))?;
    if parsed.port_u16().is_none() || parsed.path() != "/" {
        return Err(format!(
            "invalid sidecar endpoint `{endpoint}`: expected grpc://HOST:PORT or grpcs://HOST:PORT"
        ));
    }
    let token = trust
        .token_file
        .as_ref()
        .map(|path| FlagFile::new(trust.token_flag, path));
    Target::new(&uri, &paths, trust.flags, token).map_err(|error| format!("{error:#}"))
}

/// How long a sidecar may take to answer a call with its headers (the
/// contract asks for 2 s): past it the call is abandoned and retried, so a
/// peer that accepts connections and never answers shows as such.
pub const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Events a subscription may queue before it waits for the writer.
const SOURCE_QUEUE_DEPTH: usize = 256;

/// Follows the sidecar at `target` until `stop`, feeding `writer` with the
/// blocks of every rank of `worker`.
pub async fn run(
    target: Target,
    settings: SidecarSettings,
    partition: Arc<Partition>,
    worker: WorkerId,
    writer: mpsc::Sender<IndexInput>,
    status: Arc<FeedStatus>,
    stop: CancellationToken,
) {
    status.lock().sidecar = Some(SidecarProgress::default());
    let (events_tx, mut events) = mpsc::channel(SOURCE_QUEUE_DEPTH);
    let config = UpstreamConfig {
        target,
        service: settings.service,
        dp_size: settings.max_ranks,
        answer_timeout: Some(ANSWER_TIMEOUT),
    };
    let mut watcher = StatusWatcher {
        status: Arc::clone(&status),
    };
    let follow = upstream::run(config, events_tx, &mut watcher, stop);
    // The receiver is the apply loop's own: once the writer is gone it is
    // dropped, and the subscription ends as a source does when its drain is.
    let apply = async move {
        while let Some(event) = events.recv().await {
            if matches!(event, SourceEvent::Events { .. }) {
                let mut state = status.lock();
                state.payloads += 1;
                state.last_payload = Some(SystemTime::now());
            }
            for input in inputs(event, &partition, worker) {
                if writer.send(input).await.is_err() {
                    return;
                }
            }
        }
    };
    tokio::join!(follow, apply);
}

/// What the writer is asked to do for one event of the subscription: a
/// clear anywhere in a batch is the whole worker's, between the events
/// before and after it.
fn inputs(event: SourceEvent, partition: &Arc<Partition>, worker: WorkerId) -> Vec<IndexInput> {
    let clear_worker = || IndexInput::ClearWorker {
        partition: Arc::clone(partition),
        worker,
    };
    match event {
        SourceEvent::Events { rank, events, .. } => {
            let key = RankKey { worker, rank };
            let mut inputs = Vec::new();
            let mut run: Vec<KvCacheEvent> = Vec::new();
            for event in events {
                if matches!(event.data, Some(Data::Cleared(_))) {
                    if !run.is_empty() {
                        inputs.push(IndexInput::Events {
                            partition: Arc::clone(partition),
                            key,
                            events: std::mem::take(&mut run),
                        });
                    }
                    inputs.push(clear_worker());
                } else {
                    run.push(event);
                }
            }
            if !run.is_empty() {
                inputs.push(IndexInput::Events {
                    partition: Arc::clone(partition),
                    key,
                    events: run,
                });
            }
            inputs
        }
        SourceEvent::PublisherRestarted { rank } => vec![IndexInput::ClearRank {
            partition: Arc::clone(partition),
            key: RankKey { worker, rank },
        }],
        SourceEvent::Resync => vec![clear_worker()],
        // A subscription forwards converted events only.
        SourceEvent::Message(_) => Vec::new(),
    }
}

/// Tells the feed's status what the subscription does.
struct StatusWatcher {
    status: Arc<FeedStatus>,
}

impl StatusWatcher {
    fn progress(&self, change: impl FnOnce(&mut SidecarProgress)) {
        if let Some(progress) = self.status.lock().sidecar.as_mut() {
            change(progress);
        }
    }
}

impl Watcher for StatusWatcher {
    fn subscribed(&mut self, from: u64) {
        self.status.enter(FeedPhase::Connected, None);
        if from > 0 {
            self.progress(|progress| progress.resumes += 1);
        }
    }

    fn interrupted(&mut self, why: &Interruption, refused: bool) {
        let phase = match (why, self.status.now().phase) {
            // The router gives such a worker up; the index says so, and
            // keeps asking in case the server is fixed.
            (Interruption::Refused(status), _) if status.code() == tonic::Code::Unimplemented => {
                FeedPhase::Failed
            }
            (_, FeedPhase::Connecting) => FeedPhase::Connecting,
            _ => FeedPhase::Disconnected,
        };
        self.status.enter(phase, Some(why.to_string()));
        self.progress(|progress| {
            if refused {
                progress.refused_cursors += 1;
                progress.cursors.clear();
            } else {
                progress.reconnects += 1;
            }
        });
    }

    fn admitted(&mut self, batch: &KvEventBatch, rank: u32, verdict: Verdict) {
        let sequence = batch.sequence_number;
        match verdict {
            Verdict::Snapshot { first } => {
                let last = batch
                    .snapshot
                    .as_ref()
                    .is_none_or(|chunk| chunk.index + 1 >= chunk.count);
                self.status.enter(
                    if last {
                        FeedPhase::Connected
                    } else {
                        FeedPhase::CatchingUp
                    },
                    None,
                );
                self.progress(|progress| {
                    if first {
                        progress.snapshots += 1;
                        progress.cursors.clear();
                    }
                    progress.cursors.insert(rank, sequence);
                });
            }
            Verdict::Next | Verdict::Restart => {
                if verdict == Verdict::Restart {
                    self.status.lock().publisher_restarts += 1;
                }
                self.progress(|progress| {
                    progress.cursors.insert(rank, sequence);
                });
            }
            Verdict::Stale | Verdict::Gap | Verdict::LoadOnly => {}
        }
    }

    fn set_aside(&mut self, reason: &'static str, _batch_rank: Option<i32>) {
        self.status.lock().bad_payloads += 1;
        if reason == UNKNOWN_RANK {
            self.progress(|progress| progress.unknown_ranks += 1);
        }
    }
}
