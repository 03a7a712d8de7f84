//! The engine's load publisher: one SUB per rank (SGLang's
//! `--load-publish-endpoint`), each stat written on the board as it
//! arrives.
//!
//! The sockets are the KV-event source's (`source::zmq::RankSockets`: the
//! same endpoint convention, bind or connect, size limit and peer
//! handling); only what is read differs. Invariants: a malformed message,
//! a stat for a rank kvgate does not serve, or a publisher counter that
//! jumps or goes back is counted by reason and never stops the task; a
//! stat's arrival time is its reading's time, so its records age from
//! then. A lost reading needs no recovery: the engine re-sends its load at
//! least once a second, and the latest reading supersedes every earlier
//! one.

use bytes::Bytes;
use kvgate_endpoint::RankEndpoints;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;
use zeromq::{Socket, SubSocket, ZmqMessage};

use super::BoardWriter;
use super::stat::{self, PushFault};
use crate::metrics::Metrics;
use crate::source::FrameError;
use crate::source::zmq::{RankSocketTask, RankSockets, StartError, next_message, parse_frames};
use crate::supervisor::{Supervisor, TaskName};

/// The topic SGLang's load publisher sends under (`LOAD_TOPIC`).
pub const LOAD_TOPIC: &str = "load";

/// Who is at the other end of the load sockets, for the logs.
const LOAD_PUBLISHER: &str = "the engine's load publisher";

/// How kvgate reaches the engine's load publishers.
#[derive(Clone, Debug)]
pub struct PushConfig {
    /// Each rank's load publisher.
    pub endpoint: RankEndpoints,
    pub dp_size: u32,
    /// Bind instead of connecting (as `--zmq-bind`).
    pub bind: bool,
    /// Largest message accepted (`--zmq-max-message-bytes`).
    pub max_message_bytes: usize,
}

impl PushConfig {
    /// Opens one socket per rank, each read by its own supervised task
    /// writing on `board` until shutdown.
    pub async fn start(
        &self,
        board: BoardWriter,
        metrics: &Metrics,
        supervisor: &Supervisor,
    ) -> Result<(), StartError> {
        let sockets = RankSockets {
            endpoint: &self.endpoint,
            dp_size: self.dp_size,
            topic: LOAD_TOPIC,
            bind: self.bind,
            max_message_bytes: self.max_message_bytes,
            task_name: TaskName::LoadPush,
            peer: LOAD_PUBLISHER,
            link: None,
        };
        sockets
            .open(
                metrics,
                supervisor,
                || {},
                |rank, endpoint| {
                    Ok(PushReceiver {
                        rank,
                        endpoint,
                        board: board.clone(),
                        metrics: metrics.clone(),
                        last_sequence: None,
                    })
                },
            )
            .await
    }
}

/// The receive loop of one rank's load socket.
struct PushReceiver {
    rank: u32,
    /// Where the SUB binds or connects, for the logs.
    endpoint: String,
    board: BoardWriter,
    metrics: Metrics,
    last_sequence: Option<u64>,
}

impl RankSocketTask for PushReceiver {
    async fn run(mut self, mut socket: SubSocket, stop: CancellationToken) {
        loop {
            tokio::select! {
                message = next_message(&mut socket, &self.endpoint, LOAD_PUBLISHER, &self.metrics) => {
                    self.take(message, Instant::now());
                }
                () = stop.cancelled() => break,
            }
        }
        socket.close().await;
    }
}

impl PushReceiver {
    /// Writes the stat in `message`, arrived at `at`, on the board.
    fn take(&mut self, message: ZmqMessage, at: Instant) {
        let mut faults = Vec::new();
        match self.read(message, &mut faults) {
            Ok(load) => {
                self.metrics.load_pushes.inc();
                self.board.pushed(self.rank, load, at);
            }
            Err(fault) => faults.push(fault),
        }
        for fault in faults {
            self.metrics.count_load_push_fault(fault.as_str());
            let rank = self.rank;
            crate::logging::rate_limited(fault.as_str(), || {
                warn!(
                    rank,
                    reason = fault.as_str(),
                    "engine load message repaired or skipped"
                );
            });
        }
    }

    fn read(
        &mut self,
        message: ZmqMessage,
        faults: &mut Vec<PushFault>,
    ) -> Result<crate::proto::common::EngineLoad, PushFault> {
        let (sequence, payload): (u64, Bytes) = parse_frames(message, Some(LOAD_TOPIC.as_bytes()))
            .map_err(|error| match error {
                FrameError::BadSequenceFrame => PushFault::BadSequenceFrame,
                FrameError::TopicMismatch => PushFault::TopicMismatch,
                FrameError::WrongFrameCount | FrameError::MissingDelimiter => {
                    PushFault::WrongFrameCount
                }
            })?;
        match self.last_sequence.replace(sequence) {
            Some(last) if sequence <= last => faults.push(PushFault::SequenceBack),
            Some(last) if sequence > last.saturating_add(1) => faults.push(PushFault::SequenceGap),
            _ => {}
        }
        let stat = stat::decode(&payload, faults)?;
        // SGLang keys by socket: the rank a stat names is informational,
        // but one kvgate does not serve means a misconfigured publisher.
        if stat
            .claimed_rank
            .is_some_and(|claimed| u32::try_from(claimed).map_or(true, |r| r >= self.board.ranks()))
        {
            return Err(PushFault::UnknownRank);
        }
        Ok(stat.load)
    }
}
