//! One registered worker rank, followed through the sidecar's own ZMQ
//! source (priming and gap fills from the replay endpoint included) and its
//! converter, into the writer's queue.
//!
//! Invariant: a feed forwards each engine payload's converted events once,
//! in the publisher's order, attributed to the rank the payload names (the
//! registered rank when it names none, as Dynamo does); a publisher restart
//! clears that rank before anything after it. A payload the converter
//! refuses is counted and changes nothing. What the feed knows of its
//! source is in its [`FeedStatus`], updated as it happens.

use std::pin::pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::FutureExt as _;
use futures::future::{BoxFuture, Fuse, FusedFuture as _};

use kvgate_endpoint::{EndpointError, RankEndpoints, ZmqEndpoint};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::ipc_path::AtPath;
use super::{FeedPhase, FeedStatus};
use crate::convert::{Alignment, Converter, Tally, UnnamedGroups};
use crate::index::partition::Partition;
use crate::index::tree::RankKey;
use crate::index::writer::IndexInput;
use crate::metrics::Metrics;
use crate::source::SourceEvent;
use crate::source::replay::FetchBounds;
use crate::source::zmq::ZmqSourceConfig;
use crate::supervisor::Supervisor;

/// Where one worker rank publishes.
#[derive(Clone, Debug)]
pub struct ZmqFeedConfig {
    /// The engine's PUB socket for this rank.
    pub endpoint: ZmqEndpoint,
    /// Its replay ROUTER, if it has one.
    pub replay_endpoint: Option<ZmqEndpoint>,
    /// How long one replay request may take.
    pub replay_timeout: Duration,
    /// Largest message accepted from the publisher.
    pub max_message_bytes: usize,
}

/// A connected feed's phase: catching up while it fetches from the replay
/// endpoint (priming, or filling a hole).
fn connected(replaying: bool) -> FeedPhase {
    if replaying {
        FeedPhase::CatchingUp
    } else {
        FeedPhase::Connected
    }
}

/// Engine messages a rank's socket task may queue before it waits for the
/// feed. Few: the writer's queue is the index's buffer, and a message holds
/// the whole read buffer it was read into. At 256 a rank, a fleet of 256
/// ranks publishing at once held a gigabyte of payloads waiting for the
/// writer (BENCHMARKS.md, "The fleet index"). Past this, what the engine
/// sends waits in the kernel's socket buffers, then in the engine's own
/// queue up to its high-water mark (vLLM's is 100,000 messages), and only
/// past that is dropped: a gap, filled from the replay endpoint when the
/// rank has one.
const SOURCE_QUEUE_DEPTH: usize = 8;

/// How often an `ipc://` feed that is not connected looks at its socket
/// path again, to say what is there.
const IPC_LOOK_INTERVAL: Duration = Duration::from_millis(500);

/// Why a feed that was connected is not any more.
const PUBLISHER_CLOSED: &str = "the publisher closed the connection";

/// Follows `config` until `stop`, feeding `writer` for the rank `key`; an
/// endpoint no other process can reach (`inproc://`) fails at once, saying so.
pub async fn run(
    config: Result<ZmqFeedConfig, EndpointError>,
    partition: Arc<Partition>,
    key: RankKey,
    writer: mpsc::Sender<IndexInput>,
    status: Arc<FeedStatus>,
    stop: CancellationToken,
) {
    let config = match config {
        Ok(config) => config,
        Err(unreachable) => {
            status.enter(FeedPhase::Failed, Some(unreachable.to_string()));
            return;
        }
    };
    let ipc_path = match &config.endpoint {
        ZmqEndpoint::Ipc(ipc) => Some(ipc.path().to_owned()),
        ZmqEndpoint::Tcp(_) => None,
    };
    let supervisor = Supervisor::new();
    let (events_tx, mut events) = mpsc::channel(SOURCE_QUEUE_DEPTH);
    let (ready_tx, _) = watch::channel(false);
    let (link_tx, mut link) = watch::channel(false);
    let (replaying_tx, mut replaying) = watch::channel(false);
    let source = ZmqSourceConfig {
        endpoint: RankEndpoints::from(config.endpoint),
        replay_endpoint: config.replay_endpoint.map(RankEndpoints::from),
        replay_timeout: config.replay_timeout,
        replay_bounds: FetchBounds::default(),
        dp_size: 1,
        topic: String::new(),
        bind: false,
        max_message_bytes: config.max_message_bytes,
        resume: Default::default(),
        // The registration names the endpoint; nothing moves it.
        moves: Vec::new(),
        // Dynamo's indexer takes every topic a worker publishes under.
        any_topic: true,
        link: Some(link_tx),
        replaying: Some(replaying_tx),
    };
    let sockets = Metrics::unexported();
    status.count_peers_in(sockets.clone());
    // Boxed: starting takes more room than following, and a future keeps
    // room for its largest step for as long as it runs (one per rank).
    if let Err(error) = Box::pin(source.start(events_tx, sockets, ready_tx, &supervisor)).await {
        status.enter(FeedPhase::Failed, Some(error.to_string()));
        return;
    }
    // Read as Dynamo's indexer reads a worker: partial stores kept, an
    // unnamed group other than 0 not main attention.
    let mut converter = Converter::with_alignment(Alignment::LeadingFullBlocks)
        .with_unnamed_groups(UnnamedGroups::MainOnlyGroupZero);
    let mut tally = Tally::default();
    let failed = supervisor.failed();
    tokio::pin!(failed);
    let mut looks = tokio::time::interval(IPC_LOOK_INTERVAL);
    looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A look in flight is one more branch of the loop, so a file system
    // that hangs (a dead network mount) delays the reason, never the
    // feed's events or its stop.
    let mut look = pin!(Fuse::<BoxFuture<'static, AtPath>>::terminated());
    let mut ever_connected = false;
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            failure = &mut failed => {
                status.enter(FeedPhase::Failed, Some(failure.to_string()));
                break;
            }
            Ok(()) = link.changed() => {
                if *link.borrow_and_update() {
                    ever_connected = true;
                    status.enter(connected(*replaying.borrow()), None);
                } else {
                    status.enter(
                        FeedPhase::Disconnected,
                        Some(format!("{PUBLISHER_CLOSED}; redialling")),
                    );
                }
            }
            _ = looks.tick(), if ipc_path.is_some() && !*link.borrow() && look.is_terminated() => {
                if let Some(path) = ipc_path.clone() {
                    look.set(async move { AtPath::look(&path).await }.boxed().fuse());
                }
            }
            at_path = &mut look => {
                // The link may have come up during the look.
                if !*link.borrow() {
                    status.explain(if ever_connected {
                        format!("{PUBLISHER_CLOSED}; {at_path}; redialling")
                    } else {
                        format!("{at_path}; dialling")
                    });
                }
            }
            Ok(()) = replaying.changed() => {
                let fetching = *replaying.borrow_and_update();
                if *link.borrow() {
                    status.enter(connected(fetching), None);
                }
            }
            event = events.recv() => {
                let Some(event) = event else { break };
                let input = match event {
                    SourceEvent::Message(message) => {
                        match converter.convert(0, &message.payload, &mut tally) {
                            Ok(converted) => {
                                let mut state = status.lock();
                                state.payloads += 1;
                                state.last_payload = Some(SystemTime::now());
                                drop(state);
                                IndexInput::Events {
                                    partition: Arc::clone(&partition),
                                    key: RankKey { worker: key.worker, rank: converted.dp_rank.unwrap_or(key.rank) },
                                    events: converted.events,
                                }
                            }
                            Err(_) => {
                                status.lock().bad_payloads += 1;
                                continue;
                            }
                        }
                    }
                    SourceEvent::PublisherRestarted { .. } => {
                        converter.forget_rank(0);
                        status.lock().publisher_restarts += 1;
                        IndexInput::ClearRank { partition: Arc::clone(&partition), key }
                    }
                    SourceEvent::Events { .. } | SourceEvent::Resync => continue,
                };
                if writer.send(input).await.is_err() {
                    break;
                }
            }
        }
    }
    supervisor.stop();
}
