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
//!
//! A snapshot is encoded lazily, one chunk per call, from a cut that shares
//! the state: what it holds besides the cut is one chunk being filled, the
//! chain being walked and a window of the next blocks in store order (an
//! eighth of a tier at most, 16 bytes a block), never the whole snapshot. The
//! chunk count goes in every header, so a first pass finds the chunk
//! boundaries (encoding each chunk and dropping it) before the first chunk
//! is handed out.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use prost::Message;
use prost::encoding::{self, WireType};
use rustc_hash::FxHashSet;

use super::tier::Tier;
use super::{BlockRecord, RankBlocks, StateCut, StoreFields};
use crate::proto::common::{KvCacheEvent, KvSnapshotChunk};
use crate::wire::batch::{EventLen, OpenBatch};
use crate::wire::event::{BLOCKS_FIELD, BlockFields, STORED_FIELD};

/// Most blocks in one snapshot chunk.
pub const MAX_CHUNK_BLOCKS: usize = 2048;
/// About the most encoded bytes in one snapshot chunk.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// Everything a snapshot needs, taken by the drain at one instant.
#[derive(Clone, Debug)]
pub struct SnapshotCut {
    /// Every rank's blocks at the cut.
    pub state: StateCut,
    /// Last sequence number of every rank that has one or has blocks.
    pub last_sequences: BTreeMap<u32, u64>,
    /// Position of the last batch published before the cut.
    pub position: u64,
    /// Engine messages sent before kvgate's record of them began.
    pub unknown_before: u64,
}

/// A snapshot's chunks, each encoded when asked for.
pub struct SnapshotEncoder {
    chunks: RawChunks,
    plan: Plan,
    /// Index of the next chunk.
    index: u32,
    /// The rank of the chunk handed out last, and how many of its chunks
    /// came before that one.
    current: Option<(u32, u64)>,
}

/// What every header needs before the first chunk goes out.
struct Plan {
    count: u32,
    blocks: u64,
    chunks_per_rank: BTreeMap<u32, u64>,
}

impl SnapshotEncoder {
    /// Finds the chunk boundaries of `cut`'s snapshot: a whole encoding
    /// pass, keeping one chunk at a time. Blocking work.
    pub fn plan(cut: Arc<SnapshotCut>, timestamp: f64) -> Self {
        let mut planning = RawChunks::new(Arc::clone(&cut), timestamp);
        let mut chunks_per_rank = BTreeMap::new();
        let mut count = 0u32;
        while let Some((rank, _)) = planning.next() {
            *chunks_per_rank.entry(rank).or_insert(0) += 1;
            count += 1;
        }
        let plan = Plan {
            count,
            blocks: planning.blocks,
            chunks_per_rank,
        };
        Self {
            chunks: RawChunks::new(cut, timestamp),
            plan,
            index: 0,
            current: None,
        }
    }
}

impl Iterator for SnapshotEncoder {
    /// One encoded `KvEventBatch`.
    type Item = Bytes;

    /// Encodes the next chunk. Blocking work.
    fn next(&mut self) -> Option<Bytes> {
        let (rank, chunk) = self.chunks.next()?;
        let offset = match self.current {
            Some((current, offset)) if current == rank => offset + 1,
            _ => 0,
        };
        self.current = Some((rank, offset));
        let cut = &self.chunks.cut;
        let rank_chunks = self.plan.chunks_per_rank[&rank];
        let sequence = cut.last_sequences[&rank] + 1 - rank_chunks + offset;
        let header = KvSnapshotChunk {
            index: self.index,
            count: self.plan.count,
            blocks: self.plan.blocks,
            unknown_before: cut.unknown_before,
        };
        self.index += 1;
        Some(chunk.encode(rank, sequence, Some(&header)))
    }
}

/// The snapshot's chunks in order, as filled batches without headers,
/// walked one chunk at a time.
struct RawChunks {
    cut: Arc<SnapshotCut>,
    timestamp: f64,
    /// Ranks in emission order: every other rank, then rank 0.
    ranks: Vec<u32>,
    next_rank: usize,
    walking: Option<RankWalk>,
    /// Blocks (copies counted) of the ranks walked to the end.
    blocks: u64,
}

impl RawChunks {
    fn new(cut: Arc<SnapshotCut>, timestamp: f64) -> Self {
        let rank0 = cut.last_sequences.get_key_value(&0);
        let others = cut.last_sequences.range(1..);
        let ranks = others.chain(rank0).map(|(&rank, _)| rank).collect();
        Self {
            cut,
            timestamp,
            ranks,
            next_rank: 0,
            walking: None,
            blocks: 0,
        }
    }

    fn next(&mut self) -> Option<(u32, OpenBatch)> {
        loop {
            let Some(walking) = &mut self.walking else {
                let &rank = self.ranks.get(self.next_rank)?;
                self.next_rank += 1;
                self.walking = Some(RankWalk::new(rank, self.timestamp));
                continue;
            };
            if let Some(chunk) = walking.chunker.done.pop_front() {
                return Some((walking.rank, chunk));
            }
            if walking.finished {
                self.blocks += walking.chunker.blocks_total;
                self.walking = None;
                continue;
            }
            walking.advance(self.cut.state.get(&walking.rank));
        }
    }
}

/// One rank's walk: an ownerless clear, then every live block, tier by tier.
struct RankWalk {
    rank: u32,
    /// Tiers walked so far, in `Tier::ALL` order.
    tiers_done: usize,
    tier_walk: TierWalk,
    chunker: Chunker,
    finished: bool,
}

impl RankWalk {
    fn new(rank: u32, timestamp: f64) -> Self {
        let mut chunker = Chunker::new(timestamp);
        chunker.push_event(&KvCacheEvent::ownerless_clear(), 0);
        Self {
            rank,
            tiers_done: 0,
            tier_walk: TierWalk::default(),
            chunker,
            finished: false,
        }
    }

    /// Walks on until a chunk is full or the rank is done.
    fn advance(&mut self, blocks: Option<&RankBlocks>) {
        while self.chunker.done.is_empty() {
            match (blocks, Tier::ALL.get(self.tiers_done)) {
                (Some(blocks), Some(&tier)) => {
                    if !self.tier_walk.step(blocks, tier, &mut self.chunker) {
                        self.tiers_done += 1;
                        self.tier_walk = TierWalk::default();
                    }
                }
                _ => {
                    self.chunker.finish();
                    self.finished = true;
                }
            }
        }
    }
}

/// Fewest blocks fetched into a window; a tier is otherwise scanned at most
/// `WINDOW_SCANS` times.
const MIN_WINDOW: usize = 4096;
const WINDOW_SCANS: usize = 8;

/// Emits every live block of one tier in store order, parents first.
///
/// Blocks go in store order, which is parents-first except where a parent
/// was evicted and stored again after its child: such a child pulls its
/// later ancestors out ahead of their turn. A block whose parent is the
/// block just emitted extends the current chain without any lookup, so the
/// walk reads the state in order instead of chasing parent links. Store
/// order is read a window at a time (the smallest orders not taken yet, by
/// one scan of the tier), so the walk never holds the whole tier's order.
#[derive(Default)]
struct TierWalk {
    /// The next (order, hash) pairs, largest first (taken from the end).
    window: Vec<(u64, i64)>,
    /// Largest order taken into a window so far.
    taken_through: Option<u64>,
    /// The last window held every block left.
    exhausted: bool,
    /// Blocks already emitted ahead of their turn.
    early: FxHashSet<i64>,
    /// The chain being emitted: each block the parent of the next.
    run: PathWriter,
    /// The chain's last block so far.
    run_last: Option<i64>,
}

impl TierWalk {
    /// Emits the next block in store order; false once the tier is done.
    fn step(&mut self, blocks: &RankBlocks, tier: Tier, chunker: &mut Chunker) -> bool {
        let Some((order, hash)) = self.next_in_order(blocks, tier) else {
            self.run.finish(blocks, tier, chunker);
            return false;
        };
        if self.early.remove(&hash) {
            return true;
        }
        let record = record(blocks, tier, hash);
        let parent = record.parent();
        let continues = parent.is_some() && parent == self.run_last;
        if !continues {
            self.run.finish(blocks, tier, chunker);
            // Ancestors stored after this block are not out yet.
            let mut ancestors = Vec::new();
            let mut next = parent;
            while let Some(ancestor) = next {
                match blocks.get(tier, ancestor) {
                    Some(found) if found.order() > order && self.early.insert(ancestor) => {
                        ancestors.push((ancestor, found));
                        next = found.parent();
                    }
                    _ => break,
                }
            }
            let mut early_path = PathWriter::default();
            for &(ancestor, found) in ancestors.iter().rev() {
                early_path.add(ancestor, found, chunker);
            }
            early_path.finish(blocks, tier, chunker);
        }
        self.run.add(hash, record, chunker);
        self.run_last = Some(hash);
        true
    }

    fn next_in_order(&mut self, blocks: &RankBlocks, tier: Tier) -> Option<(u64, i64)> {
        if self.window.is_empty() && !self.exhausted {
            self.refill(blocks, tier);
        }
        self.window.pop()
    }

    /// Takes the next window: the smallest orders above `taken_through`.
    fn refill(&mut self, blocks: &RankBlocks, tier: Tier) {
        let tier_blocks = usize::try_from(blocks.counts()[tier]).unwrap_or(usize::MAX);
        let size = (tier_blocks / WINDOW_SCANS).max(MIN_WINDOW);
        let keep_smallest = |window: &mut Vec<(u64, i64)>| {
            if window.len() > size {
                window.select_nth_unstable(size - 1);
                window.truncate(size);
            }
        };
        let mut window = std::mem::take(&mut self.window);
        let after = self.taken_through;
        for (hash, record) in blocks.tier(tier) {
            let order = record.order();
            if after.is_some_and(|after| order <= after) {
                continue;
            }
            window.push((order, hash));
            if window.len() == 2 * size {
                keep_smallest(&mut window);
            }
        }
        keep_smallest(&mut window);
        self.exhausted = window.len() < size;
        window.sort_unstable_by(|a, b| b.cmp(a));
        self.taken_through = window.first().map(|&(order, _)| order).or(after);
        self.window = window;
    }
}

/// The record of a block the cut holds (the walk only names such blocks).
fn record(blocks: &RankBlocks, tier: Tier, hash: i64) -> &BlockRecord {
    blocks
        .get(tier, hash)
        .expect("the walk only names blocks of its cut")
}

/// Emits a parent-linked path as stores, block by block as the walk
/// reaches them: one store per run of equal fields (split wherever a chunk
/// fills), then each extra copy alone once the path ends. Only the store
/// being filled and the hashes with extra copies are held, so a chain as
/// long as the whole tier costs no more than a short one.
#[derive(Default)]
struct PathWriter {
    /// The store being filled and the fields every block of it shares.
    store: Option<(Arc<StoreFields>, StorePiece)>,
    /// Blocks of the path with more than one copy, in path order.
    copied: Vec<i64>,
}

impl PathWriter {
    fn add(&mut self, hash: i64, record: &BlockRecord, chunker: &mut Chunker) {
        let same_fields =
            matches!(&self.store, Some((fields, _)) if Arc::ptr_eq(fields, record.fields()));
        if !same_fields {
            if let Some((_, piece)) = self.store.take() {
                chunker.push_piece(piece);
            }
            let fields = Arc::clone(record.fields());
            let piece = StorePiece::new(&fields, record.parent());
            self.store = Some((fields, piece));
        }
        let (fields, piece) = self.store.as_mut().expect("a store is open");
        chunker.extend_store(fields, piece, hash, record);
        if record.copies() > 1 {
            self.copied.push(hash);
        }
    }

    /// Ends the path: its last store, then its extra copies.
    fn finish(&mut self, blocks: &RankBlocks, tier: Tier, chunker: &mut Chunker) {
        if let Some((_, piece)) = self.store.take() {
            chunker.push_piece(piece);
        }
        for hash in self.copied.drain(..) {
            let record = record(blocks, tier, hash);
            for _ in 1..record.copies() {
                let mut piece = StorePiece::new(record.fields(), record.parent());
                chunker.extend_store(record.fields(), &mut piece, hash, record);
                chunker.push_piece(piece);
            }
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
    fn new(fields: &StoreFields, parent: Option<i64>) -> Self {
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
struct Chunker {
    timestamp: f64,
    done: VecDeque<OpenBatch>,
    open: OpenBatch,
    open_blocks: usize,
    blocks_total: u64,
}

impl Chunker {
    fn new(timestamp: f64) -> Self {
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

    fn push_event(&mut self, event: &KvCacheEvent, blocks: usize) {
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
    fn extend_store(
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

    /// Closes the rank's last chunk.
    fn finish(&mut self) {
        let last = std::mem::replace(&mut self.open, OpenBatch::with_timestamp(self.timestamp));
        self.done.push_back(last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::{KvCacheTier, KvEventBatch, kv_cache_event::Data};
    use crate::state::{LiveState, stored_event};

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
        decode(&cut)
    }

    fn decode(cut: &SnapshotCut) -> Vec<KvEventBatch> {
        SnapshotEncoder::plan(Arc::new(cut.clone()), 1.0)
            .map(|chunk| KvEventBatch::decode(chunk).unwrap())
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
        let batches = decode(&cut);
        assert_eq!(batches.len(), 1);
        let batch = &batches[0];
        assert_eq!(batch.sequence_number, 500);
        assert_eq!(batch.dp_rank, Some(0));
        let header = batch.snapshot.unwrap();
        assert_eq!((header.index, header.count, header.blocks), (0, 1, 3));
        assert!(batch.events[0].is_ownerless_clear());
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
        let batches = decode(&cut);
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
        let batches = decode(&cut);
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].sequence_number, 20);
        assert_eq!(batches[0].events.len(), 1);
    }
}
