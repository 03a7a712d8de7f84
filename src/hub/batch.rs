//! A batch as subscribers receive it: encoded once, shared by reference
//! with every subscriber and the history; and the builder that encodes it.
//!
//! Events are encoded as they are added; finishing a batch only writes its
//! header around them, so no event is encoded twice.

use bytes::Bytes;
use prost::Message;
use prost::encoding;

use crate::proto::common::{EngineLoad, KvCacheEvent, KvSnapshotChunk};

/// One encoded `KvEventBatch` and where it stands in the stream.
#[derive(Debug)]
pub struct Batch {
    /// Place in kvgate's single emission order across all ranks (from 1).
    /// Subscribers track this, not sequence numbers, to find gaps and seams.
    pub position: u64,
    pub rank: u32,
    /// The rank's own sequence number as the router sees it.
    pub sequence: u64,
    pub event_count: u32,
    /// The protobuf bytes, sent verbatim to every subscriber.
    pub encoded: Bytes,
}

/// The field number of `KvEventBatch.events`.
pub const EVENTS_FIELD: u32 = 3;

/// The field number of `KvEventBatch.load`.
pub const LOAD_FIELD: u32 = 8;

/// Room kept in front of the events for the header fields written last:
/// `sequence_number` (tag + up to 10 varint bytes) and `timestamp` (tag + 8).
const HEADER_ROOM: usize = 20;

/// An event's encoded body length and its length as one `events` field.
#[derive(Clone, Copy, Debug)]
pub struct EventLen {
    body: usize,
    pub entry: usize,
}

impl EventLen {
    pub fn of(event: &KvCacheEvent) -> Self {
        Self::of_body(event.encoded_len())
    }

    /// The lengths of an event whose encoded body takes `body` bytes.
    pub fn of_body(body: usize) -> Self {
        Self {
            body,
            entry: encoding::key_len(EVENTS_FIELD)
                + encoding::encoded_len_varint(body as u64)
                + body,
        }
    }
}

/// A batch being filled, its events already encoded as `events` fields.
///
/// The buffer starts with `HEADER_ROOM` spare bytes so the finished batch is
/// the same allocation: the header goes right-aligned into that room (field
/// order is free in protobuf) and the rest is appended.
#[derive(Debug)]
pub struct OpenBatch {
    buffer: Vec<u8>,
    count: u32,
    /// Engine timestamp of the newest event (Unix seconds).
    timestamp: f64,
}

impl Default for OpenBatch {
    fn default() -> Self {
        Self::with_timestamp(0.0)
    }
}

impl OpenBatch {
    pub fn with_timestamp(timestamp: f64) -> Self {
        Self {
            buffer: vec![0; HEADER_ROOM],
            count: 0,
            timestamp,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn event_count(&self) -> u32 {
        self.count
    }

    /// Encoded bytes of the events so far.
    pub fn events_len(&self) -> usize {
        self.buffer.len() - HEADER_ROOM
    }

    /// Whether one more event of `entry_len` encoded bytes stays within limits.
    pub fn fits(&self, max_events: usize, max_bytes: usize, entry_len: usize) -> bool {
        (self.count as usize) < max_events && self.events_len() + entry_len <= max_bytes
    }

    /// Appends `event`, whose length `len` the caller already measured.
    pub fn push(&mut self, event: &KvCacheEvent, len: EventLen, timestamp: f64) {
        self.buffer.reserve(len.entry);
        encoding::encode_key(
            EVENTS_FIELD,
            encoding::WireType::LengthDelimited,
            &mut self.buffer,
        );
        encoding::encode_varint(len.body as u64, &mut self.buffer);
        event.encode_raw(&mut self.buffer);
        self.count += 1;
        self.timestamp = timestamp;
    }

    /// Appends an event given as its encoded body.
    pub fn push_encoded(&mut self, event: &[u8], timestamp: f64) {
        encoding::encode_key(
            EVENTS_FIELD,
            encoding::WireType::LengthDelimited,
            &mut self.buffer,
        );
        encoding::encode_varint(event.len() as u64, &mut self.buffer);
        self.buffer.extend_from_slice(event);
        self.count += 1;
        self.timestamp = timestamp;
    }

    /// Adds the rank's load record; call it last, just before `encode`
    /// (the record's bytes count as the batch's, not as events).
    pub fn carrying_load(mut self, load: &EngineLoad) -> Self {
        encoding::message::encode(LOAD_FIELD, load, &mut self.buffer);
        self
    }

    /// The complete `KvEventBatch` bytes for `sequence` on `rank`.
    pub fn encode(mut self, rank: u32, sequence: u64, snapshot: Option<&KvSnapshotChunk>) -> Bytes {
        let mut header = Vec::with_capacity(HEADER_ROOM);
        encoding::uint64::encode(1, &sequence, &mut header);
        if self.timestamp != 0.0 {
            encoding::double::encode(2, &self.timestamp, &mut header);
        }
        let start = HEADER_ROOM - header.len();
        self.buffer[start..HEADER_ROOM].copy_from_slice(&header);
        encoding::int32::encode(4, &(rank as i32), &mut self.buffer);
        if let Some(chunk) = snapshot {
            encoding::message::encode(7, chunk, &mut self.buffer);
        }
        Bytes::from(self.buffer).slice(start..)
    }
}
