//! The engine side: sockets that receive an engine's KV-event messages and
//! hand them, in each publisher's order, to the drain.
//!
//! A source never decodes payloads (the drain converts them); it checks the
//! framing, follows each publisher's counter and reports what that counter
//! says about lost messages and engine restarts. Besides live engines, a
//! recording (`recorded`) or a Mooncake trace played through a simulated
//! prefix cache (`trace`, `prefix_cache`) can stand in for one, paced by
//! `pace`. Where an engine publishes can be asked of the engine itself
//! (`discovery`).

pub(crate) mod continuity;
pub mod discovery;
pub mod pace;
pub(crate) mod peer;
pub mod prefix_cache;
pub mod recorded;
pub(crate) mod replay;
pub mod trace;
pub(crate) mod upstream;
pub(crate) mod zmq;

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::proto::common::KvCacheEvent;

/// The drain dropped its end of the queue: kvgate is stopping, and a source
/// stops with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainGone;

/// Hands `event` to the drain, waiting while its queue is full.
pub(crate) async fn send(
    events: &mpsc::Sender<SourceEvent>,
    event: SourceEvent,
) -> Result<(), DrainGone> {
    events.send(event).await.map_err(|_| DrainGone)
}

/// One engine message as the publisher of rank `rank` sent it.
#[derive(Clone, Debug)]
pub struct EngineMessage {
    /// The data-parallel rank whose publisher sent it.
    pub rank: u32,
    /// The publisher's own counter (not kvgate's sequence number).
    pub engine_sequence: u64,
    /// Frame 3: the msgpack batch.
    pub payload: Bytes,
}

/// What a source tells the drain, in order per rank.
#[derive(Clone, Debug)]
pub enum SourceEvent {
    /// A message from a publisher, in its order.
    Message(EngineMessage),
    /// The publisher of `rank` started over: everything known about the
    /// rank's cache is void.
    PublisherRestarted {
        /// The rank whose publisher restarted.
        rank: u32,
    },
    /// Events already in proto form (from an upstream gRPC server).
    Events {
        /// The rank they belong to.
        rank: u32,
        /// The upstream batch's timestamp.
        timestamp: f64,
        /// The events, in order.
        events: Vec<KvCacheEvent>,
    },
    /// The upstream starts over with a snapshot: every rank's cache is void.
    Resync,
}

/// Why an engine message or replay reply was skipped before decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Not the three frames `[topic, sequence, payload]`.
    WrongFrameCount,
    /// A sequence frame that is not 8 bytes.
    BadSequenceFrame,
    /// A topic other than the configured one.
    TopicMismatch,
    /// A replay reply that does not start with the empty delimiter frame.
    MissingDelimiter,
}

impl FrameError {
    /// Every reason, in label order.
    pub const ALL: [FrameError; 4] = [
        Self::WrongFrameCount,
        Self::BadSequenceFrame,
        Self::TopicMismatch,
        Self::MissingDelimiter,
    ];

    /// The `reason` label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::WrongFrameCount => "wrong_frame_count",
            Self::BadSequenceFrame => "bad_sequence_frame",
            Self::TopicMismatch => "topic_mismatch",
            Self::MissingDelimiter => "missing_delimiter",
        }
    }
}

/// Reads a sequence frame: exactly 8 bytes, big-endian.
pub fn parse_sequence(frame: &[u8]) -> Result<u64, FrameError> {
    let frame: [u8; 8] = frame.try_into().map_err(|_| FrameError::BadSequenceFrame)?;
    Ok(u64::from_be_bytes(frame))
}
