//! A batch as subscribers receive it: encoded once, shared by reference
//! with every subscriber and the history; and the builder that encodes it.
//!
//! Events are encoded as they are added; finishing a batch only writes its
//! header around them, so no event is encoded twice. A batch handed to the
//! history is copied once, into an allocation of exactly its size behind
//! gRPC's prefix (`hub::FramedBatch`), so the bytes the history counts are
//! the bytes it holds; the builder's buffers are reused.

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
    /// The data-parallel rank.
    pub rank: u32,
    /// The rank's own sequence number as the router sees it.
    pub sequence: u64,
    /// The protobuf bytes, sent verbatim to every subscriber.
    pub encoded: Bytes,
}

impl Batch {
    /// The memory this batch holds while it is kept.
    pub fn retained_bytes(&self) -> usize {
        let len = self.encoded.len();
        let allocated = if len >= OWN_MAPPING_MIN_BYTES {
            len.next_multiple_of(PAGE_BYTES)
        } else {
            len
        };
        allocated + BATCH_OVERHEAD
    }
}

/// The field number of `KvEventBatch.events`.
pub const EVENTS_FIELD: u32 = 3;

/// The field number of `KvEventBatch.load`.
pub const LOAD_FIELD: u32 = 8;

/// Room kept in front of the events for the header fields written last:
/// `sequence_number` (tag + up to 10 varint bytes) and `timestamp` (tag + 8).
const HEADER_ROOM: usize = 20;

/// Room kept after the events for `dp_rank` (tag + an `int32`, which takes
/// 10 varint bytes when negative).
const RANK_ROOM: usize = 11;

/// The largest message the router accepts (its gRPC decoding limit).
pub const ROUTER_MAX_MESSAGE_BYTES: usize = 4 << 20;

/// The most encoded event bytes one batch may carry and still be a message
/// the router accepts.
pub const MAX_EVENTS_BYTES: usize = ROUTER_MAX_MESSAGE_BYTES - HEADER_ROOM - RANK_ROOM;

/// Batches the hub holds at least this large get a memory mapping of their
/// own rather than a heap allocation (`hub::published`). The history frees batches in age order while the
/// drain's short-lived buffers (decoded tokens, scratch) fill the heap holes
/// they leave, so on the heap a full history stays resident at about 1.6 to
/// 2 times its bytes; an unmapped batch is back with the system at once.
/// The page rounding costs at most 6% at this size.
pub const OWN_MAPPING_MIN_BYTES: usize = 64 << 10;

const PAGE_BYTES: usize = 4096;

/// What one held batch costs besides its encoded bytes, rounded up: the
/// `Arc`'d `Batch`, the `Bytes` header, the header and rank room and the
/// allocator's own headers. The history charges it per batch, so many tiny
/// batches cannot hold more memory than `--history-bytes`.
pub const BATCH_OVERHEAD: usize = 256;

/// An event's encoded body length and its length as one `events` field.
#[derive(Clone, Copy, Debug)]
pub struct EventLen {
    body: usize,
    /// Bytes the event adds to a batch's events (its length-delimited entry).
    pub entry: usize,
}

impl EventLen {
    /// The entry size of `event`.
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
    /// An empty batch stamped `timestamp`.
    pub fn with_timestamp(timestamp: f64) -> Self {
        let mut buffer = Vec::with_capacity(HEADER_ROOM + RANK_ROOM);
        buffer.resize(HEADER_ROOM, 0);
        Self {
            buffer,
            count: 0,
            timestamp,
        }
    }

    /// A batch of the one event whose encoded body is `event`, in an
    /// allocation of its size: an event this large is rare, and its
    /// buffer is not kept as a spare (`Batcher::recycle`).
    pub fn alone(event: &[u8], timestamp: f64) -> Self {
        let entry = EventLen::of_body(event.len()).entry;
        let mut buffer = Vec::with_capacity(HEADER_ROOM + entry + RANK_ROOM);
        buffer.resize(HEADER_ROOM, 0);
        let mut batch = Self {
            buffer,
            count: 0,
            timestamp,
        };
        batch.push_encoded(event, timestamp);
        batch
    }

    /// Hands over the events so far as a batch and starts again empty on
    /// `buffer` (a spare one, emptied here): no byte is copied. The one
    /// copy of a batch's bytes is made when it is framed for the hub
    /// (`hub::FramedBatch`).
    pub fn take(&mut self, mut buffer: Vec<u8>) -> Self {
        buffer.clear();
        buffer.resize(HEADER_ROOM, 0);
        Self {
            buffer: std::mem::replace(&mut self.buffer, buffer),
            count: std::mem::take(&mut self.count),
            timestamp: self.timestamp,
        }
    }

    /// Its buffer, for the next [`OpenBatch::take`].
    pub fn into_buffer(self) -> Vec<u8> {
        self.buffer
    }

    /// Bytes a buffer needs to hold this batch again, room around the
    /// events included.
    pub fn buffer_len(&self) -> usize {
        self.buffer.len() + RANK_ROOM
    }

    /// Whether no event was added.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Events added.
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

    /// Adds the rank's load record; call it last, just before `encode` or
    /// `finish` (the record's bytes count as the batch's, not as events).
    pub fn carrying_load(mut self, load: &EngineLoad) -> Self {
        encoding::message::encode(LOAD_FIELD, load, &mut self.buffer);
        self
    }

    /// The complete `KvEventBatch` bytes for `sequence` on `rank`.
    pub fn encode(mut self, rank: u32, sequence: u64, snapshot: Option<&KvSnapshotChunk>) -> Bytes {
        let start = self.close(rank, sequence, snapshot);
        // Short-lived: snapshot chunks and `load_only` batches are sent and
        // dropped.
        Bytes::from(self.buffer).slice(start..)
    }

    /// The complete `KvEventBatch` bytes for `sequence` on `rank`, left in
    /// this batch's buffer for the caller to copy. Call it once: it appends
    /// the rank after the events.
    pub fn finish(&mut self, rank: u32, sequence: u64) -> &[u8] {
        let start = self.close(rank, sequence, None);
        &self.buffer[start..]
    }

    /// Writes the header right-aligned into its room and the trailing
    /// fields after the events; returns where the message starts.
    fn close(&mut self, rank: u32, sequence: u64, snapshot: Option<&KvSnapshotChunk>) -> usize {
        let mut header = [0; HEADER_ROOM];
        let mut room = &mut header[..];
        encoding::uint64::encode(1, &sequence, &mut room);
        if self.timestamp != 0.0 {
            encoding::double::encode(2, &self.timestamp, &mut room);
        }
        let header_len = HEADER_ROOM - room.len();
        let start = HEADER_ROOM - header_len;
        self.buffer[start..HEADER_ROOM].copy_from_slice(&header[..header_len]);
        encoding::int32::encode(4, &(rank as i32), &mut self.buffer);
        if let Some(chunk) = snapshot {
            encoding::message::encode(7, chunk, &mut self.buffer);
        }
        start
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::KvEventBatch;

    #[test]
    fn the_overhead_charged_per_batch_covers_what_a_held_batch_allocates_besides_its_bytes() {
        // The `Arc` counts, the `Bytes` shared header (a pointer, a capacity
        // and a count), the room around the events, and an allocator header
        // for each of the three allocations.
        let held = size_of::<Batch>()
            + 2 * size_of::<usize>()
            + 3 * size_of::<usize>()
            + HEADER_ROOM
            + RANK_ROOM
            + 3 * 16;
        assert!(held <= BATCH_OVERHEAD, "{held} bytes");
    }

    #[test]
    fn a_taken_batch_keeps_its_bytes_and_the_batcher_goes_on_with_the_spare_buffer() {
        let mut open = OpenBatch::default();
        for _ in 0..1000 {
            open.push_encoded(&[8, 1], 1.0);
        }
        let spare = vec![7; 100];
        let spare_at = spare.as_ptr();
        let mut taken = open.take(spare);
        assert!(open.is_empty());
        open.push_encoded(&[8, 2], 2.0);
        assert_eq!(open.buffer.as_ptr(), spare_at, "filled on the spare");
        let decoded = KvEventBatch::decode(open.finish(0, 1)).unwrap();
        assert_eq!(decoded.events.len(), 1);
        assert_eq!(decoded.dp_rank, Some(0));
        let decoded = KvEventBatch::decode(taken.finish(3, 9)).unwrap();
        assert_eq!(decoded.events.len(), 1000);
        assert_eq!((decoded.dp_rank, decoded.sequence_number), (Some(3), 9));
        assert_eq!(decoded.timestamp, 1.0);
    }

    #[test]
    fn finish_and_encode_write_the_same_message() {
        let mut finished = OpenBatch::with_timestamp(1.5);
        let mut encoded = OpenBatch::with_timestamp(1.5);
        for batch in [&mut finished, &mut encoded] {
            batch.push_encoded(&[8, 1], 1.5);
        }
        assert_eq!(
            finished.finish(2, u64::MAX),
            &encoded.encode(2, u64::MAX, None)[..]
        );
    }
}
