//! Cutting one rank's snapshot events into chunks.
//!
//! Invariant: a chunk holds at most `MAX_CHUNK_BLOCKS` blocks and about
//! `MAX_CHUNK_BYTES`; a store too large for one chunk is split, the next
//! piece naming the last block of the one before as its parent; blocks are
//! encoded straight from their records, once.

use std::collections::VecDeque;

use prost::Message;
use prost::encoding::{self, WireType};

use super::{MAX_CHUNK_BLOCKS, MAX_CHUNK_BYTES};
use crate::proto::common::KvCacheEvent;
use crate::state::{BlockRecord, StoreFields};
use crate::wire::batch::{EventLen, OpenBatch};
use crate::wire::event::{BLOCKS_FIELD, BlockFields, STORED_FIELD};

/// One store event being encoded straight from block records: the store's
/// own fields first, then its blocks (field order is free in protobuf).
pub(super) struct StorePiece {
    store: Vec<u8>,
    blocks: usize,
    last_hash: Option<i64>,
}

impl StorePiece {
    pub(super) fn new(fields: &StoreFields, parent: Option<i64>) -> Self {
        let mut store = Vec::new();
        fields.to_store(parent).encode_raw(&mut store);
        Self {
            store,
            blocks: 0,
            last_hash: None,
        }
    }

    fn add(&mut self, block: &BlockFields<'_>, block_len: usize) {
        encoding::encode_key(BLOCKS_FIELD, WireType::LengthDelimited, &mut self.store);
        encoding::encode_varint(block_len as u64, &mut self.store);
        block.encode(&mut self.store);
        self.blocks += 1;
        self.last_hash = Some(block.hash);
    }

    /// The event's length as a batch entry once a block of `block_len` more
    /// is added.
    fn entry_len_with(&self, block_len: usize) -> usize {
        let store = self.store.len()
            + encoding::key_len(BLOCKS_FIELD)
            + encoding::encoded_len_varint(block_len as u64)
            + block_len;
        let event =
            encoding::key_len(STORED_FIELD) + encoding::encoded_len_varint(store as u64) + store;
        EventLen::of_body(event).entry
    }

    /// The `KvCacheEvent` body (`event_id` 0 is the default: not written).
    fn into_event(self) -> Vec<u8> {
        let mut event = Vec::with_capacity(self.store.len() + 8);
        encoding::encode_key(STORED_FIELD, WireType::LengthDelimited, &mut event);
        encoding::encode_varint(self.store.len() as u64, &mut event);
        event.extend_from_slice(&self.store);
        event
    }
}

/// Cuts one rank's events into chunks within the block and byte limits.
pub(super) struct Chunker {
    timestamp: f64,
    pub(super) done: VecDeque<OpenBatch>,
    open: OpenBatch,
    open_blocks: usize,
    pub(super) blocks_total: u64,
}

impl Chunker {
    pub(super) fn new(timestamp: f64) -> Self {
        Self {
            timestamp,
            done: VecDeque::new(),
            open: OpenBatch::with_timestamp(timestamp),
            open_blocks: 0,
            blocks_total: 0,
        }
    }

    fn room(&self, blocks: usize, bytes: usize) -> bool {
        self.open_blocks + blocks <= MAX_CHUNK_BLOCKS
            && self.open.fits(usize::MAX, MAX_CHUNK_BYTES, bytes)
    }

    fn next_chunk(&mut self) {
        let full = std::mem::replace(&mut self.open, OpenBatch::with_timestamp(self.timestamp));
        self.done.push_back(full);
        self.open_blocks = 0;
    }

    pub(super) fn push_event(&mut self, event: &KvCacheEvent, blocks: usize) {
        let len = EventLen::of(event);
        if !self.open.is_empty() && !self.room(blocks, len.entry) {
            self.next_chunk();
        }
        self.open.push(event, len, self.timestamp);
        self.open_blocks += blocks;
        self.blocks_total += blocks as u64;
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
        let block = record.block_fields(hash);
        let block_len = block.encoded_len();
        let grown = piece.entry_len_with(block_len);
        if piece.blocks > 0 && !self.room(piece.blocks + 1, grown) {
            let next = StorePiece::new(fields, piece.last_hash);
            self.push_piece(std::mem::replace(piece, next));
        }
        if piece.blocks == 0
            && !self.open.is_empty()
            && !self.room(1, piece.entry_len_with(block_len))
        {
            self.next_chunk();
        }
        piece.add(&block, block_len);
    }

    pub(super) fn push_piece(&mut self, piece: StorePiece) {
        let blocks = piece.blocks;
        let event = piece.into_event();
        let len = EventLen::of_body(event.len());
        if !self.open.is_empty() && !self.room(blocks, len.entry) {
            self.next_chunk();
        }
        self.open.push_encoded(&event, self.timestamp);
        self.open_blocks += blocks;
        self.blocks_total += blocks as u64;
    }

    /// Closes the rank's last chunk.
    pub(super) fn finish(&mut self) {
        let last = std::mem::replace(&mut self.open, OpenBatch::with_timestamp(self.timestamp));
        self.done.push_back(last);
    }
}
