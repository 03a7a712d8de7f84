//! The engine side: sockets that receive an engine's KV-event messages and
//! hand them, in each publisher's order, to the drain.
//!
//! A source never decodes payloads (the drain converts them); it checks the
//! framing, follows each publisher's counter and reports what that counter
//! says about lost messages and engine restarts.

pub mod continuity;
pub mod endpoint;
pub mod zmq;

use bytes::Bytes;

/// One engine message as the publisher of rank `rank` sent it.
#[derive(Clone, Debug)]
pub struct EngineMessage {
    pub rank: u32,
    /// The publisher's own counter (not kvgate's sequence number).
    pub engine_sequence: u64,
    /// Frame 3: the msgpack batch.
    pub payload: Bytes,
}

/// What a source tells the drain, in order per rank.
#[derive(Clone, Debug)]
pub enum SourceEvent {
    Message(EngineMessage),
    /// The publisher of `rank` started over: everything known about the
    /// rank's cache is void.
    PublisherRestarted {
        rank: u32,
    },
}
