//! ZMQ SUB sockets, one per data-parallel rank.
//!
//! Each rank has its own task that keeps its socket polled (an idle SUB would
//! miss a restarted publisher's first messages), validates the
//! `[topic, sequence, payload]` framing and forwards messages in arrival
//! order. Malformed messages are counted and skipped; they never stop the task.

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};
use zeromq::{Socket, SocketOptions, SocketRecv, SubSocket, ZmqMessage};

use super::continuity::{Continuity, PublisherCursor};
use super::endpoint::TcpEndpoint;
use super::{EngineMessage, FrameError, SourceEvent, parse_sequence};
use crate::metrics::Metrics;

/// How kvgate reaches the engine's publishers.
#[derive(Clone, Debug)]
pub struct ZmqSourceConfig {
    /// Rank 0's endpoint; rank r uses its port + r.
    pub endpoint: TcpEndpoint,
    /// Rank 0's replay ROUTER, offset per rank like `endpoint`.
    pub replay_endpoint: Option<TcpEndpoint>,
    pub dp_size: u32,
    /// Exact topic every message must carry (SUB filtering is only a prefix match).
    pub topic: String,
    /// Bind instead of connecting (the engine was given a concrete host and
    /// connects out).
    pub bind: bool,
}

/// Splits `[topic, sequence (8 bytes BE), payload]`.
pub fn parse_frames(message: ZmqMessage, topic: &[u8]) -> Result<(u64, Bytes), FrameError> {
    let mut frames = message.into_vecdeque();
    if frames.len() != 3 {
        return Err(FrameError::WrongFrameCount);
    }
    let (Some(received_topic), Some(sequence), Some(payload)) =
        (frames.pop_front(), frames.pop_front(), frames.pop_front())
    else {
        return Err(FrameError::WrongFrameCount);
    };
    if received_topic.as_ref() != topic {
        return Err(FrameError::TopicMismatch);
    }
    Ok((parse_sequence(&sequence)?, payload))
}

/// The running SUB sockets. Dropping it does not stop them: use `shutdown`.
pub struct ZmqSource {
    tasks: JoinSet<()>,
    stop: watch::Sender<bool>,
}

impl ZmqSource {
    /// Opens one socket per rank. Bound sockets are listening when this
    /// returns; connecting sockets keep retrying in the background until the
    /// engine is up. `ready` becomes true once every rank is connected or bound.
    pub async fn start(
        config: ZmqSourceConfig,
        events: mpsc::Sender<SourceEvent>,
        metrics: Metrics,
        ready: watch::Sender<bool>,
    ) -> anyhow::Result<Self> {
        let (stop, _) = watch::channel(false);
        let (connected_tx, mut connected_rx) = mpsc::channel::<u32>(config.dp_size as usize);
        let mut tasks = JoinSet::new();
        for rank in 0..config.dp_size {
            let endpoint = config.endpoint.for_rank(rank).map_err(|error| {
                anyhow::anyhow!("--zmq-endpoint with --dp-size {}: {error}", config.dp_size)
            })?;
            let mut options = SocketOptions::default();
            options.no_connect_timeout();
            let mut socket = SubSocket::with_options(options);
            socket.subscribe(&config.topic).await?;
            let rank_task = RankTask {
                rank,
                topic: Bytes::from(config.topic.clone()),
                events: events.clone(),
                metrics: metrics.clone(),
                cursor: PublisherCursor::default(),
            };
            let mut stop_rx = stop.subscribe();
            if config.bind {
                let address = endpoint.bind_address();
                let bound = socket
                    .bind(&address)
                    .await
                    .map_err(|e| anyhow::anyhow!("--zmq-bind: cannot bind {address}: {e}"))?;
                info!(rank, %bound, "listening for the engine publisher");
                connected_tx.try_send(rank).ok();
                tasks.spawn(async move { rank_task.run(socket, &mut stop_rx).await });
            } else {
                let address = endpoint.connect_address();
                let connected = connected_tx.clone();
                tasks.spawn(async move {
                    tokio::select! {
                        result = socket.connect(&address) => match result {
                            Ok(()) => {
                                info!(rank, %address, "connected to the engine publisher");
                                connected.try_send(rank).ok();
                                rank_task.run(socket, &mut stop_rx).await;
                            }
                            Err(error) => warn!(rank, %address, %error, "cannot connect to the engine publisher"),
                        },
                        _ = stop_rx.changed() => {}
                    }
                });
            }
        }
        drop(connected_tx);
        let dp_size = config.dp_size;
        tasks.spawn(async move {
            let mut up = 0;
            while connected_rx.recv().await.is_some() {
                up += 1;
                if up == dp_size {
                    ready.send_replace(true);
                }
            }
        });
        Ok(Self { tasks, stop })
    }

    /// Stops every socket and waits for the tasks to end.
    pub async fn shutdown(mut self) {
        self.stop.send_replace(true);
        while self.tasks.join_next().await.is_some() {}
    }
}

/// The receive loop of one rank.
struct RankTask {
    rank: u32,
    topic: Bytes,
    events: mpsc::Sender<SourceEvent>,
    metrics: Metrics,
    cursor: PublisherCursor,
}

/// Pause after a socket error so a persistently failing socket cannot spin.
const ERROR_BACKOFF: Duration = Duration::from_millis(50);

impl RankTask {
    async fn run(mut self, mut socket: SubSocket, stop: &mut watch::Receiver<bool>) {
        loop {
            let received = tokio::select! {
                received = socket.recv() => received,
                _ = stop.changed() => break,
            };
            match received {
                Ok(message) => {
                    if !self.forward(message).await {
                        break;
                    }
                }
                Err(error) => {
                    debug!(rank = self.rank, %error, "engine socket error; still listening");
                    tokio::time::sleep(ERROR_BACKOFF).await;
                }
            }
        }
        socket.close().await;
    }

    /// Returns false once the drain is gone.
    async fn forward(&mut self, message: ZmqMessage) -> bool {
        let (engine_sequence, payload) = match parse_frames(message, &self.topic) {
            Ok(parts) => parts,
            Err(error) => {
                self.metrics.count_bad_message(error.as_str());
                warn_limited(self.rank, error.as_str());
                return true;
            }
        };
        self.metrics
            .engine_messages
            .get_or_create(&crate::metrics::RankLabel { rank: self.rank })
            .inc();
        match self.cursor.observe(engine_sequence) {
            Continuity::First | Continuity::Follows => {}
            Continuity::Gap { missing } => {
                self.metrics
                    .engine_messages_lost
                    .inc_by(missing.clone().count() as u64);
                warn!(rank = self.rank, ?missing, "engine messages lost");
            }
            Continuity::Restarted => {
                info!(
                    rank = self.rank,
                    engine_sequence, "engine publisher restarted"
                );
                self.metrics.engine_restarts.inc();
                let restarted = SourceEvent::PublisherRestarted { rank: self.rank };
                if self.events.send(restarted).await.is_err() {
                    return false;
                }
            }
        }
        let message = EngineMessage {
            rank: self.rank,
            engine_sequence,
            payload,
        };
        self.events
            .send(SourceEvent::Message(message))
            .await
            .is_ok()
    }
}

/// Logs a malformed message at most once per second per rank and reason, so a
/// publisher spewing garbage cannot flood the log (the metric counts them all).
fn warn_limited(rank: u32, reason: &'static str) {
    crate::logging::rate_limited(reason, || {
        warn!(rank, reason, "skipped a malformed engine message");
    });
}
