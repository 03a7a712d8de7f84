//! A batch as subscribers receive it: encoded once, shared by reference
//! with every subscriber and the history; and the builder that encodes it.
//!
//! Events are encoded as they are added; finishing a batch only writes its
//! header around them, so no event is encoded twice.

use bytes::{Bytes, BytesMut};
use prost::encoding;

use crate::proto::common::{KvCacheEvent, KvSnapshotChunk};

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

/// A batch being filled, its events already encoded as `events` fields.
#[derive(Debug, Default)]
pub struct OpenBatch {
    events: BytesMut,
    count: u32,
    /// Engine timestamp of the newest event (Unix seconds).
    timestamp: f64,
}

impl OpenBatch {
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn event_count(&self) -> u32 {
        self.count
    }

    /// Encoded bytes of the events so far.
    pub fn events_len(&self) -> usize {
        self.events.len()
    }

    /// Whether one more event of `entry_len` encoded bytes stays within limits.
    pub fn fits(&self, max_events: usize, max_bytes: usize, entry_len: usize) -> bool {
        (self.count as usize) < max_events && self.events.len() + entry_len <= max_bytes
    }

    pub fn push(&mut self, event: &KvCacheEvent, timestamp: f64) {
        encoding::message::encode(EVENTS_FIELD, event, &mut self.events);
        self.count += 1;
        self.timestamp = timestamp;
    }

    /// The complete `KvEventBatch` bytes for `sequence` on `rank`.
    pub fn encode(&self, rank: u32, sequence: u64, snapshot: Option<&KvSnapshotChunk>) -> Bytes {
        let mut out = BytesMut::with_capacity(self.events.len() + 32);
        encoding::uint64::encode(1, &sequence, &mut out);
        if self.timestamp != 0.0 {
            encoding::double::encode(2, &self.timestamp, &mut out);
        }
        out.extend_from_slice(&self.events);
        encoding::int32::encode(4, &(rank as i32), &mut out);
        if let Some(chunk) = snapshot {
            encoding::message::encode(7, chunk, &mut out);
        }
        out.freeze()
    }

    pub fn with_timestamp(timestamp: f64) -> Self {
        Self {
            timestamp,
            ..Self::default()
        }
    }
}
