//! Cutting one rank's snapshot events into chunks.
//!
//! Invariant: a chunk holds at most `MAX_CHUNK_BLOCKS` blocks and about
//! `MAX_CHUNK_BYTES`, and closes at exactly `MAX_CHUNK_BLOCKS` unless its
//! bytes would overflow first (`Plan::of` relies on it); a store too
//! large for one chunk is split, the next piece naming the last block of
//! the one before as its parent; blocks are copied straight from their
//! records, once, and only by a walk whose chunks are sent.

use std::collections::VecDeque;

use prost::Message;
use prost::encoding::{self, WireType};

use super::{MAX_CHUNK_BLOCKS, MAX_CHUNK_BYTES};
use crate::proto::common::KvCacheEvent;
use crate::state::{BlockRecord, StoreFields};
use crate::wire::batch::{EventLen, OpenBatch};
use crate::wire::event::{BLOCKS_FIELD, STORED_FIELD};

/// What a walk makes of its chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Output {
    /// Every chunk's bytes: the chunks handed to subscribers.
    Encoded,
    /// Only where each chunk ends: the planning pass, which needs the chunk
    /// count for the headers and would drop the bytes unread.
    Boundaries,
}

/// The most bytes a block takes in a chunk as a one-block store of its
/// own: its store's fields, with the widest parent, take `fields_len`, and
/// the block at most `block_len`. A block inside a longer store takes less:
/// it shares the store's fields (at least 11 bytes with a parent) and the
/// event's 4 framing bytes, while the longer store's length varints grow
/// by at most 4 bytes in all.
pub(crate) fn lone_block_entry_len(fields_len: usize, block_len: usize) -> usize {
    let store = fields_len
        + encoding::key_len(BLOCKS_FIELD)
        + encoding::encoded_len_varint(block_len as u64)
        + block_len;
    EventLen::of_body(StorePiece::event_len(store)).entry
}

/// Whether chunks whose blocks each take at most `lone_entry_len` (a
/// [`lone_block_entry_len`]) end by block count alone: a chunk of
/// `MAX_CHUNK_BLOCKS` such blocks after the rank's clear stays within
/// `MAX_CHUNK_BYTES`.
pub(super) fn blocks_alone_end_chunks(lone_entry_len: usize) -> bool {
    let clear = EventLen::of(&KvCacheEvent::ownerless_clear()).entry;
    MAX_CHUNK_BLOCKS
        .checked_mul(lone_entry_len)
        .and_then(|blocks| blocks.checked_add(clear))
        .is_some_and(|chunk| chunk <= MAX_CHUNK_BYTES)
}

/// Room before a store's bytes for the event's key and the store's length,
/// written once the store is complete: the event is handed to the chunk
/// from where it starts, never copied into an event buffer first.
const EVENT_PREFIX_ROOM: usize = encoding::key_len(STORED_FIELD) + 10;

/// One store event being encoded straight from block records: the store's
/// own fields first, then its blocks (field order is free in protobuf).
pub(super) struct StorePiece {
    /// `EVENT_PREFIX_ROOM` bytes, then the store's.
    event: Vec<u8>,
    /// Bytes of blocks counted but not written (`Output::Boundaries`).
    unwritten: usize,
    blocks: usize,
    last_hash: Option<i64>,
}

impl StorePiece {
    /// A store of no blocks yet in `buffer`, whose bytes are dropped.
    fn new(mut buffer: Vec<u8>, fields: &StoreFields, parent: Option<i64>) -> Self {
        buffer.clear();
        buffer.resize(EVENT_PREFIX_ROOM, 0);
        fields.to_store(parent).encode_raw(&mut buffer);
        Self {
            event: buffer,
            unwritten: 0,
            blocks: 0,
            last_hash: None,
        }
    }

    /// Adds block `hash` of `record`, `block_len` bytes; only a walk of
    /// `Output::Encoded` reads the block's bytes.
    fn add(&mut self, hash: i64, record: &BlockRecord, block_len: usize, output: Output) {
        match output {
            Output::Encoded => record
                .encoded_block(hash)
                .encode_entry(block_len, &mut self.event),
            Output::Boundaries => {
                self.unwritten += encoding::key_len(BLOCKS_FIELD)
                    + encoding::encoded_len_varint(block_len as u64)
                    + block_len;
            }
        }
        self.blocks += 1;
        self.last_hash = Some(hash);
    }

    /// The store's encoded length, blocks written or not.
    fn store_len(&self) -> usize {
        self.event.len() - EVENT_PREFIX_ROOM + self.unwritten
    }

    /// The `KvCacheEvent` body's length for a store of `store` bytes.
    fn event_len(store: usize) -> usize {
        encoding::key_len(STORED_FIELD) + encoding::encoded_len_varint(store as u64) + store
    }

    /// The event's length as a batch entry once a block of `block_len` more
    /// is added.
    fn entry_len_with(&self, block_len: usize) -> usize {
        let store = self.store_len()
            + encoding::key_len(BLOCKS_FIELD)
            + encoding::encoded_len_varint(block_len as u64)
            + block_len;
        EventLen::of_body(Self::event_len(store)).entry
    }

    /// The `KvCacheEvent` body (`event_id` 0 is the default: not written),
    /// its prefix written into the room left for it.
    fn event(&mut self) -> &[u8] {
        let store = self.store_len();
        let start = EVENT_PREFIX_ROOM - (Self::event_len(store) - store);
        let mut prefix = &mut self.event[start..EVENT_PREFIX_ROOM];
        encoding::encode_key(STORED_FIELD, WireType::LengthDelimited, &mut prefix);
        encoding::encode_varint(store as u64, &mut prefix);
        &self.event[start..]
    }
}

/// Cuts one rank's events into chunks within the block and byte limits.
///
/// Where a chunk ends depends only on the lengths counted here, never on
/// the bytes, so a walk of `Output::Boundaries` ends its chunks exactly
/// where one of `Output::Encoded` does.
pub(super) struct Chunker {
    output: Output,
    timestamp: f64,
    /// Closed chunks (empty ones for `Output::Boundaries`).
    pub(super) done: VecDeque<OpenBatch>,
    open: OpenBatch,
    /// Events in the open chunk.
    open_events: usize,
    /// Encoded bytes of the open chunk's events.
    open_len: usize,
    open_blocks: usize,
    pub(super) blocks_total: u64,
    /// The buffer of the store pushed last, for the next one: a store can
    /// grow to a whole chunk, and a new buffer of that size each time costs
    /// the kernel's page faults. Cut back to `KEPT_SPARE_PIECE` as each
    /// chunk closes, so a snapshot whose reader stalls holds no more.
    spare_piece: Vec<u8>,
}

/// Bytes of store buffer a chunker keeps between chunks: stores of
/// ordinary blocks are a few kB.
const KEPT_SPARE_PIECE: usize = 64 << 10;

impl Chunker {
    pub(super) fn new(timestamp: f64, output: Output) -> Self {
        Self {
            output,
            timestamp,
            done: VecDeque::new(),
            open: OpenBatch::with_timestamp(timestamp),
            open_events: 0,
            open_len: 0,
            open_blocks: 0,
            blocks_total: 0,
            spare_piece: Vec::new(),
        }
    }

    /// A store of `fields` under `parent`, with no blocks yet.
    pub(super) fn piece(&mut self, fields: &StoreFields, parent: Option<i64>) -> StorePiece {
        StorePiece::new(std::mem::take(&mut self.spare_piece), fields, parent)
    }

    fn room(&self, blocks: usize, bytes: usize) -> bool {
        self.open_blocks + blocks <= MAX_CHUNK_BLOCKS && self.open_len + bytes <= MAX_CHUNK_BYTES
    }

    fn next_chunk(&mut self) {
        debug_assert!(
            self.output == Output::Boundaries || self.open.events_len() == self.open_len,
            "a chunk's counted length is its encoded length"
        );
        let full = std::mem::replace(&mut self.open, OpenBatch::with_timestamp(self.timestamp));
        self.done.push_back(full);
        self.spare_piece.shrink_to(KEPT_SPARE_PIECE);
        self.open_events = 0;
        self.open_len = 0;
        self.open_blocks = 0;
    }

    /// Counts an event of `len` and `blocks` into the open chunk, after
    /// closing it if the event does not fit.
    fn admit(&mut self, len: EventLen, blocks: usize) {
        if self.open_events > 0 && !self.room(blocks, len.entry) {
            self.next_chunk();
        }
        self.open_events += 1;
        self.open_len += len.entry;
        self.open_blocks += blocks;
        self.blocks_total += blocks as u64;
    }

    pub(super) fn push_event(&mut self, event: &KvCacheEvent, blocks: usize) {
        let len = EventLen::of(event);
        self.admit(len, blocks);
        if self.output == Output::Encoded {
            self.open.push(event, len, self.timestamp);
        }
    }

    /// Adds a block to `piece`, a store of blocks with `fields`, each the
    /// parent of the next; when the chunk fills, the piece so far is pushed
    /// and the next one names its last block as parent.
    pub(super) fn extend_store(
        &mut self,
        fields: &StoreFields,
        piece: &mut StorePiece,
        hash: i64,
        record: &BlockRecord,
    ) {
        let block_len = record.encoded_block_len(hash);
        let grown = piece.entry_len_with(block_len);
        if piece.blocks > 0 && !self.room(piece.blocks + 1, grown) {
            let next = self.piece(fields, piece.last_hash);
            self.push_piece(std::mem::replace(piece, next));
        }
        if piece.blocks == 0
            && self.open_events > 0
            && !self.room(1, piece.entry_len_with(block_len))
        {
            self.next_chunk();
        }
        piece.add(hash, record, block_len, self.output);
    }

    pub(super) fn push_piece(&mut self, mut piece: StorePiece) {
        let len = EventLen::of_body(StorePiece::event_len(piece.store_len()));
        self.admit(len, piece.blocks);
        if self.output == Output::Encoded {
            self.open.push_encoded(piece.event(), self.timestamp);
        }
        if piece.event.capacity() > self.spare_piece.capacity() {
            self.spare_piece = piece.event;
        }
    }

    /// Closes the rank's last chunk.
    pub(super) fn finish(&mut self) {
        self.next_chunk();
    }
}
