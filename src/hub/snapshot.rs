//! A snapshot: the state at one cut, as a run of `KvEventBatch` chunks.
//!
//! Invariants (contract section 3, "Snapshots"): one rank per chunk, every
//! known rank has at least one; each rank's first chunk starts with an
//! ownerless clear (so chunk 0 does); blocks follow parents before children,
//! a chain of blocks with the same fields in one store event, each extra
//! physical copy as its own one-block store; `event_id` 0 throughout; a
//! chunk holds at most `MAX_CHUNK_BLOCKS` blocks and about `MAX_CHUNK_BYTES`;
//! rank r's chunks are numbered consecutively and end at rank r's last
//! sequence number at the cut, so its live batches continue with no gap and
//! no duplicate.
//!
//! Rank 0's chunks come last. A router applies each chunk as it comes and
//! resumes from rank 0's cursor alone, so one cut off inside the snapshot
//! must not hold a rank-0 cursor yet: it asks for a new snapshot instead of
//! resuming with the other ranks' chunks missing. (A rank 0 with more than
//! one chunk still leaves a window: a router cut off between them resumes
//! over a partial rank 0. Only a router that waits for `index + 1 == count`
//! can close it.)

use std::collections::BTreeMap;

use bytes::Bytes;
use prost::Message;
use prost::encoding::{self, WireType};
use rustc_hash::FxHashSet;

use super::batch::{EventLen, OpenBatch};
use super::state::{BlockRecord, RankBlocks, StateCut};
use super::wire::{BLOCKS_FIELD, BlockFields, STORED_FIELD};
use crate::proto::common::{KvCacheCleared, KvCacheEvent, KvSnapshotChunk, kv_cache_event::Data};

pub const MAX_CHUNK_BLOCKS: usize = 2048;
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// Everything a snapshot needs, taken by the drain at one instant.
#[derive(Debug)]
pub struct SnapshotCut {
    pub state: StateCut,
    /// Last sequence number of every rank that has one or has blocks.
    pub last_sequences: BTreeMap<u32, u64>,
    /// Position of the last batch published before the cut.
    pub position: u64,
    /// Engine messages sent before kvgate's record of them began.
    pub unknown_before: u64,
}

/// One encoded chunk.
#[derive(Debug)]
pub struct SnapshotChunk {
    pub rank: u32,
    pub sequence: u64,
    pub encoded: Bytes,
}

/// Encodes the whole snapshot; empty when no rank is known.
pub fn encode_snapshot(cut: &SnapshotCut, timestamp: f64) -> Vec<SnapshotChunk> {
    let empty = RankBlocks::default();
    let mut per_rank = Vec::new();
    let mut total_blocks = 0;
    let rank0 = cut.last_sequences.get_key_value(&0);
    let others = cut.last_sequences.range(1..);
    for (&rank, &last_sequence) in others.chain(rank0) {
        let blocks = cut.state.get(&rank).unwrap_or(&empty);
        let mut chunker = Chunker::new(timestamp);
        chunker.push_event(&ownerless_clear(), 0);
        walk(blocks, &mut chunker);
        total_blocks += chunker.blocks_total;
        per_rank.push((rank, last_sequence, chunker.finish()));
    }
    let count: usize = per_rank.iter().map(|(_, _, chunks)| chunks.len()).sum();
    let mut index = 0;
    let mut out = Vec::with_capacity(count);
    for (rank, last_sequence, chunks) in per_rank {
        let first_sequence = last_sequence + 1 - chunks.len() as u64;
        for (offset, chunk) in chunks.into_iter().enumerate() {
            let sequence = first_sequence + offset as u64;
            let header = KvSnapshotChunk {
                index,
                count: count as u32,
                blocks: total_blocks,
                unknown_before: cut.unknown_before,
            };
            out.push(SnapshotChunk {
                rank,
                sequence,
                encoded: chunk.encode(rank, sequence, Some(&header)),
            });
            index += 1;
        }
    }
    out
}

/// Emits every live block of one rank, tier by tier, parents first.
///
/// Blocks go in store order, which is parents-first except where a parent
/// was evicted and stored again after its child: such a child pulls its
/// later ancestors out ahead of their turn. A block whose parent is the
/// block just emitted extends the current chain without any lookup, so the
/// walk reads the state in order instead of chasing parent links.
fn walk(blocks: &RankBlocks, chunker: &mut Chunker) {
    for tier in 0..5 {
        let mut ordered: Vec<(u64, i64, &BlockRecord)> = blocks
            .tier(tier)
            .map(|(hash, record)| (record.order(), hash, record))
            .collect();
        ordered.sort_unstable_by_key(|&(order, ..)| order);
        let mut early = FxHashSet::default();
        let mut run: Vec<(i64, &BlockRecord)> = Vec::new();
        for &(order, hash, record) in &ordered {
            if early.remove(&hash) {
                continue;
            }
            let parent = record.parent();
            let continues = parent.is_some() && parent == run.last().map(|&(last, _)| last);
            if !continues {
                emit_path(&run, chunker);
                run.clear();
                // Ancestors stored after this block are not out yet.
                let mut ancestors = Vec::new();
                let mut next = parent;
                while let Some(ancestor) = next {
                    match blocks.get(tier, ancestor) {
                        Some(found) if found.order() > order && early.insert(ancestor) => {
                            ancestors.push((ancestor, found));
                            next = found.parent();
                        }
                        _ => break,
                    }
                }
                ancestors.reverse();
                emit_path(&ancestors, chunker);
            }
            run.push((hash, record));
        }
        emit_path(&run, chunker);
    }
}

/// Emits a parent-linked path as stores: one per run of equal fields, then
/// each extra copy alone.
fn emit_path(path: &[(i64, &BlockRecord)], chunker: &mut Chunker) {
    let mut start = 0;
    while start < path.len() {
        let fields = path[start].1.fields();
        let end = path[start..]
            .iter()
            .position(|(_, record)| !std::sync::Arc::ptr_eq(record.fields(), fields))
            .map_or(path.len(), |offset| start + offset);
        chunker.push_chain(&path[start..end]);
        start = end;
    }
    for &(hash, record) in path {
        for _ in 1..record.copies() {
            chunker.push_chain(&[(hash, record)]);
        }
    }
}

/// One store event being encoded straight from block records: the store's
/// own fields first, then its blocks (field order is free in protobuf).
struct StorePiece {
    store: Vec<u8>,
    blocks: usize,
    last_hash: Option<i64>,
}

impl StorePiece {
    fn new(first: &BlockRecord, parent: Option<i64>) -> Self {
        let mut store = Vec::new();
        first.fields().to_store(parent).encode_raw(&mut store);
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
struct Chunker {
    timestamp: f64,
    done: Vec<OpenBatch>,
    open: OpenBatch,
    open_blocks: usize,
    blocks_total: u64,
}

impl Chunker {
    fn new(timestamp: f64) -> Self {
        Self {
            timestamp,
            done: Vec::new(),
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
        self.done.push(full);
        self.open_blocks = 0;
    }

    fn push_event(&mut self, event: &KvCacheEvent, blocks: usize) {
        let len = EventLen::of(event);
        if !self.open.is_empty() && !self.room(blocks, len.entry) {
            self.next_chunk();
        }
        self.open.push(event, len, self.timestamp);
        self.open_blocks += blocks;
        self.blocks_total += blocks as u64;
    }

    /// Stores a chain (each block the parent of the next, equal fields),
    /// split wherever a chunk fills; each piece names the previous piece's
    /// last block as its parent.
    fn push_chain(&mut self, chain: &[(i64, &BlockRecord)]) {
        let Some(&(_, first)) = chain.first() else {
            return;
        };
        let mut piece = StorePiece::new(first, first.parent());
        for &(hash, record) in chain {
            let block = record.block_fields(hash);
            let block_len = block.encoded_len();
            let grown = piece.entry_len_with(block_len);
            if piece.blocks > 0 && !self.room(piece.blocks + 1, grown) {
                let next = StorePiece::new(first, piece.last_hash);
                self.push_piece(std::mem::replace(&mut piece, next));
            }
            if piece.blocks == 0
                && !self.open.is_empty()
                && !self.room(1, piece.entry_len_with(block_len))
            {
                self.next_chunk();
            }
            piece.add(&block, block_len);
        }
        self.push_piece(piece);
    }

    fn push_piece(&mut self, piece: StorePiece) {
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

    fn finish(mut self) -> Vec<OpenBatch> {
        self.done.push(self.open);
        self.done
    }
}

fn ownerless_clear() -> KvCacheEvent {
    KvCacheEvent {
        event_id: 0,
        data: Some(Data::Cleared(KvCacheCleared { ownership: None })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::state::{LiveState, stored_event};
    use crate::proto::common::{KvCacheTier, KvEventBatch};

    fn store(state: &mut LiveState, rank: u32, parent: Option<i64>, hashes: &[i64], tokens: usize) {
        state.apply(
            rank,
            &mut stored_event(parent, hashes, KvCacheTier::Device, tokens),
        );
    }

    /// The snapshot of `state` with these last sequence numbers.
    fn snapshot_of(state: &LiveState, last_sequences: &[(u32, u64)]) -> Vec<KvEventBatch> {
        let cut = SnapshotCut {
            state: state.cut(),
            last_sequences: last_sequences.iter().copied().collect(),
            position: 1,
            unknown_before: 0,
        };
        decode(&encode_snapshot(&cut, 1.0))
    }

    fn decode(chunks: &[SnapshotChunk]) -> Vec<KvEventBatch> {
        chunks
            .iter()
            .map(|chunk| KvEventBatch::decode(chunk.encoded.clone()).unwrap())
            .collect()
    }

    fn stored_hashes(batch: &KvEventBatch) -> Vec<(Option<i64>, Vec<i64>)> {
        batch
            .events
            .iter()
            .filter_map(|event| match &event.data {
                Some(Data::Stored(stored)) => Some((
                    stored.parent_block_hash,
                    stored.blocks.iter().map(|b| b.block_hash).collect(),
                )),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_chain_is_one_store_after_an_ownerless_clear_ending_at_the_ranks_last_sequence() {
        let mut state = LiveState::default();
        store(&mut state, 0, None, &[1, 2], 4);
        store(&mut state, 0, Some(2), &[3], 4);
        let cut = SnapshotCut {
            state: state.cut(),
            last_sequences: BTreeMap::from([(0, 500)]),
            position: 7,
            unknown_before: 0,
        };
        let batches = decode(&encode_snapshot(&cut, 1.0));
        assert_eq!(batches.len(), 1);
        let batch = &batches[0];
        assert_eq!(batch.sequence_number, 500);
        assert_eq!(batch.dp_rank, Some(0));
        let header = batch.snapshot.unwrap();
        assert_eq!((header.index, header.count, header.blocks), (0, 1, 3));
        assert!(matches!(
            batch.events[0].data,
            Some(Data::Cleared(KvCacheCleared { ownership: None }))
        ));
        assert!(batch.events.iter().all(|event| event.event_id == 0));
        let stores = stored_hashes(batch);
        // Map order decides whether 3 is reached before 1 and 2; either way
        // parents come first.
        let flat: Vec<i64> = stores
            .iter()
            .flat_map(|(_, hashes)| hashes.clone())
            .collect();
        assert_eq!(flat, vec![1, 2, 3]);
        assert_eq!(stores[0].0, None);
    }

    #[test]
    fn chunks_hold_at_most_2048_blocks_and_number_up_to_the_last_sequence() {
        let mut state = LiveState::default();
        let hashes: Vec<i64> = (1..=5000).collect();
        store(&mut state, 0, None, &hashes, 16);
        store(&mut state, 1, None, &[42], 16);
        let cut = SnapshotCut {
            state: state.cut(),
            last_sequences: BTreeMap::from([(0, 1000), (1, 2000)]),
            position: 9,
            unknown_before: 3,
        };
        let batches = decode(&encode_snapshot(&cut, 1.0));
        assert_eq!(batches.len(), 4);
        let rank0: Vec<_> = batches.iter().filter(|b| b.dp_rank == Some(0)).collect();
        assert_eq!(
            rank0.iter().map(|b| b.sequence_number).collect::<Vec<_>>(),
            vec![998, 999, 1000]
        );
        assert_eq!(batches[0].sequence_number, 2000);
        for (index, batch) in batches.iter().enumerate() {
            let header = batch.snapshot.unwrap();
            assert_eq!(header.index as usize, index);
            assert_eq!(header.count, 4);
            assert_eq!(header.blocks, 5001);
            assert_eq!(header.unknown_before, 3);
            let blocks: usize = stored_hashes(batch).iter().map(|(_, h)| h.len()).sum();
            assert!(blocks <= MAX_CHUNK_BLOCKS);
            assert!(batch.encoded_len() <= MAX_CHUNK_BYTES + 64);
        }
        // The chain continues across chunks: each piece's parent is the
        // previous piece's last block.
        let mut previous_last = None;
        for batch in &rank0 {
            for (parent, hashes) in stored_hashes(batch) {
                assert_eq!(parent, previous_last);
                previous_last = hashes.last().copied();
            }
        }
        assert_eq!(previous_last, Some(5000));
    }

    #[test]
    fn large_blocks_split_chunks_by_bytes() {
        let mut state = LiveState::default();
        let hashes: Vec<i64> = (1..=400).collect();
        store(&mut state, 0, None, &hashes, 4096);
        let batches = snapshot_of(&state, &[(0, 400)]);
        assert!(batches.len() > 1);
        assert!(
            batches
                .iter()
                .all(|b| b.encoded_len() <= MAX_CHUNK_BYTES + 64)
        );
    }

    #[test]
    fn a_parent_stored_again_after_its_child_still_comes_first() {
        let mut state = LiveState::default();
        store(&mut state, 0, None, &[1], 2);
        store(&mut state, 0, Some(1), &[2], 2);
        let mut evict = KvCacheEvent {
            event_id: 1,
            data: Some(Data::Removed(crate::proto::common::KvBlocksRemoved {
                block_hashes: vec![1],
                tier: Some(KvCacheTier::Device as i32),
                ..Default::default()
            })),
        };
        state.apply(0, &mut evict);
        store(&mut state, 0, None, &[1], 2);
        let batches = snapshot_of(&state, &[(0, 10)]);
        let flat: Vec<i64> = stored_hashes(&batches[0])
            .into_iter()
            .flat_map(|(_, hashes)| hashes)
            .collect();
        assert_eq!(flat, vec![1, 2]);
    }

    #[test]
    fn each_extra_copy_is_its_own_one_block_store() {
        let mut state = LiveState::default();
        store(&mut state, 0, None, &[7], 2);
        store(&mut state, 0, None, &[7], 2);
        store(&mut state, 0, None, &[7], 2);
        let batches = snapshot_of(&state, &[(0, 10)]);
        let stores = stored_hashes(&batches[0]);
        assert_eq!(stores.len(), 3);
        assert!(stores.iter().all(|(_, hashes)| hashes == &vec![7]));
        assert_eq!(batches[0].snapshot.unwrap().blocks, 3);
    }

    #[test]
    fn a_known_rank_without_blocks_still_gets_a_chunk() {
        let cut = SnapshotCut {
            state: StateCut::new(),
            last_sequences: BTreeMap::from([(0, 10), (1, 20)]),
            position: 1,
            unknown_before: 0,
        };
        let batches = decode(&encode_snapshot(&cut, 1.0));
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].sequence_number, 20);
        assert_eq!(batches[0].events.len(), 1);
    }
}
