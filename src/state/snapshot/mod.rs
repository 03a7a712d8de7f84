//! A snapshot: the state at one cut, as a run of `KvEventBatch` chunks.
//!
//! Invariants (contract section 3, "Snapshots"): one rank per chunk, every
//! known rank has at least one; chunk 0 starts with an ownerless clear, the
//! only clear of the snapshot (a router clears the whole worker on any
//! clear, so one in a later rank's chunk would wipe the ranks sent before
//! it); blocks follow parents before children,
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
//! chain being walked and its place in the tier's records, never the whole
//! snapshot. The state keeps each tier's records in store order, so the walk
//! reads them in the order they sit in memory: no sort, and one lookup by
//! hash per chain that does not continue the block before it (its parent,
//! to find one stored again after its child; each lookup is a chain of
//! cache misses). The chunk count goes in every header. For a rank
//! none of whose chunks can fill by bytes before it holds
//! `MAX_CHUNK_BLOCKS` blocks (the state keeps a bound on the bytes of any
//! block a rank stored), every chunk but the rank's last is full, so its
//! count follows from its block count. The other ranks' chunk boundaries
//! are found by a first pass over those ranks alone, counting the blocks'
//! bytes without writing them, before the first chunk is handed out. The
//! encoder owns its cut and the walk borrows from it (`self_cell`).

mod chunker;
mod tier_walk;

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;

use super::tier::Tier;
use super::{RankBlocks, StateCut};
use crate::proto::common::{KvCacheEvent, KvSnapshotChunk};
use crate::wire::OpenBatch;
pub(crate) use chunker::lone_block_entry_len;
use chunker::{Chunker, Output, blocks_alone_end_chunks};
use tier_walk::TierWalk;

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
#[derive(Debug, PartialEq, Eq)]
struct Plan {
    count: u32,
    blocks: u64,
    chunks_per_rank: BTreeMap<u32, u64>,
}

impl Plan {
    /// The plan of `cut`'s snapshot. A rank none of whose blocks can fill a
    /// chunk by bytes first has chunks that are full but for its last, so
    /// they are counted from its blocks; the other ranks' chunks are found
    /// by a walk of those ranks alone. Blocking work when some rank walks.
    fn of(cut: Arc<SnapshotCut>, timestamp: f64) -> Self {
        let walk = ranks_to_walk(&cut);
        let opening = emission_order(&cut).first().copied();
        let mut plan = Plan::walked(Arc::clone(&cut), timestamp, walk, opening);
        for &rank in cut.last_sequences.keys() {
            if plan.chunks_per_rank.contains_key(&rank) {
                continue;
            }
            let blocks = cut
                .state
                .get(&rank)
                .map_or(0, |blocks| blocks.counts().total());
            // A rank with no blocks still has a chunk: its numbering ends
            // at its last sequence.
            let chunks = blocks.div_ceil(MAX_CHUNK_BLOCKS as u64).max(1);
            plan.chunks_per_rank.insert(rank, chunks);
            plan.count += u32::try_from(chunks).expect("fewer than 2^32 chunks");
            plan.blocks += blocks;
        }
        plan
    }

    /// The plan of `ranks` alone, from a walk of them that counts bytes
    /// without writing them.
    /// `opening` is the rank whose first chunk is chunk 0.
    fn walked(
        cut: Arc<SnapshotCut>,
        timestamp: f64,
        ranks: Vec<u32>,
        opening: Option<u32>,
    ) -> Self {
        let mut planning = RawChunks::walk(cut, timestamp, Pass::Planning, ranks, opening);
        let mut chunks_per_rank = BTreeMap::new();
        let mut count = 0u32;
        while let Some((rank, _)) = planning.next() {
            *chunks_per_rank.entry(rank).or_insert(0) += 1;
            count += 1;
        }
        Plan {
            count,
            blocks: planning.blocks(),
            chunks_per_rank,
        }
    }
}

/// The ranks of `cut` whose chunks a plan must walk to find: some block
/// they stored can fill a chunk by bytes before it holds
/// `MAX_CHUNK_BLOCKS` blocks.
fn ranks_to_walk(cut: &SnapshotCut) -> Vec<u32> {
    cut.last_sequences
        .keys()
        .copied()
        .filter(|rank| {
            cut.state
                .get(rank)
                .is_some_and(|blocks| !blocks_alone_end_chunks(blocks.widest_lone_entry()))
        })
        .collect()
}

/// The order a snapshot sends `cut`'s ranks in: every other rank, then
/// rank 0.
fn emission_order(cut: &SnapshotCut) -> Vec<u32> {
    let rank0 = cut.last_sequences.get_key_value(&0);
    let others = cut.last_sequences.range(1..);
    others.chain(rank0).map(|(&rank, _)| rank).collect()
}

impl SnapshotEncoder {
    /// Finds the chunk boundaries of `cut`'s snapshot: from each rank's
    /// block counts when none of its chunks can fill by bytes first (at
    /// once), otherwise by a walk of that rank. Blocking work.
    pub fn plan(cut: Arc<SnapshotCut>, timestamp: f64) -> Self {
        let plan = Plan::of(Arc::clone(&cut), timestamp);
        let ranks = emission_order(&cut);
        let opening = ranks.first().copied();
        Self {
            chunks: RawChunks::walk(cut, timestamp, Pass::Reading, ranks, opening),
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
    ///
    /// Panics if the walk makes more or fewer chunks than the plan counted:
    /// headers and sequence numbers built on a wrong count would overlap the
    /// live stream, while a panic ends the stream with INTERNAL and the
    /// router asks for a new snapshot.
    fn next(&mut self) -> Option<Bytes> {
        let Some((rank, chunk)) = self.chunks.next() else {
            assert_eq!(self.index, self.plan.count, "the plan counted every chunk");
            return None;
        };
        let offset = match self.current {
            Some((current, offset)) if current == rank => offset + 1,
            _ => 0,
        };
        self.current = Some((rank, offset));
        let cut = self.chunks.cut();
        let rank_chunks = self.plan.chunks_per_rank[&rank];
        assert!(
            offset < rank_chunks,
            "the plan counted rank {rank}'s chunks"
        );
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

self_cell::self_cell!(
    /// The snapshot's chunks in order, as filled batches without headers,
    /// walked one chunk at a time over the cut it owns.
    struct RawChunks {
        owner: Arc<SnapshotCut>,
        #[covariant]
        dependent: ChunkWalk,
    }
);

impl RawChunks {
    /// Walks `ranks` of `cut`, in that order; `opening`'s walk starts
    /// with the snapshot's clear.
    fn walk(
        cut: Arc<SnapshotCut>,
        timestamp: f64,
        pass: Pass,
        ranks: Vec<u32>,
        opening: Option<u32>,
    ) -> Self {
        Self::new(cut, |_| ChunkWalk::new(ranks, opening, timestamp, pass))
    }

    fn next(&mut self) -> Option<(u32, OpenBatch)> {
        self.with_dependent_mut(|cut, walk| walk.next(cut))
    }

    fn cut(&self) -> &SnapshotCut {
        self.borrow_owner()
    }

    /// Blocks (copies counted) of the ranks walked to the end.
    fn blocks(&self) -> u64 {
        self.borrow_dependent().blocks
    }
}

/// Which of a snapshot's two walks of its cut this is.
#[derive(Clone, Copy, Debug)]
enum Pass {
    /// Finds where every chunk ends, for the headers' count: runs to its
    /// end within one call, under an encode slot, and writes no bytes.
    Planning,
    /// Encodes the chunks one at a time as a subscriber reads them.
    Reading,
}

impl Pass {
    fn output(self) -> Output {
        match self {
            Pass::Planning => Output::Boundaries,
            Pass::Reading => Output::Encoded,
        }
    }
}

/// Where the walk of a cut has got to, borrowing the tier it walks from the
/// cut.
struct ChunkWalk<'cut> {
    timestamp: f64,
    pass: Pass,
    /// The ranks to walk, in order.
    ranks: Vec<u32>,
    /// The rank whose first chunk is the snapshot's chunk 0.
    opening: Option<u32>,
    next_rank: usize,
    walking: Option<RankWalk<'cut>>,
    /// Blocks (copies counted) of the ranks walked to the end.
    blocks: u64,
}

impl<'cut> ChunkWalk<'cut> {
    fn new(ranks: Vec<u32>, opening: Option<u32>, timestamp: f64, pass: Pass) -> Self {
        Self {
            timestamp,
            pass,
            ranks,
            opening,
            next_rank: 0,
            walking: None,
            blocks: 0,
        }
    }

    fn next(&mut self, cut: &'cut SnapshotCut) -> Option<(u32, OpenBatch)> {
        loop {
            let Some(walking) = &mut self.walking else {
                let &rank = self.ranks.get(self.next_rank)?;
                self.next_rank += 1;
                let opens = self.opening == Some(rank);
                self.walking = Some(RankWalk::new(rank, opens, self.timestamp, self.pass));
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
            walking.advance(cut.state.get(&walking.rank));
        }
    }
}

/// One rank's walk: the snapshot's clear if the rank opens the snapshot,
/// then every live block, tier by tier.
struct RankWalk<'cut> {
    rank: u32,
    /// Tiers begun so far, in `Tier::ALL` order.
    tiers_begun: usize,
    tier_walk: Option<TierWalk<'cut>>,
    chunker: Chunker,
    finished: bool,
}

impl RankWalk<'_> {
    fn new(rank: u32, opens: bool, timestamp: f64, pass: Pass) -> Self {
        let mut chunker = Chunker::new(timestamp, pass.output());
        if opens {
            chunker.push_event(&KvCacheEvent::ownerless_clear(), 0);
        }
        Self {
            rank,
            tiers_begun: 0,
            tier_walk: None,
            chunker,
            finished: false,
        }
    }
}

impl<'cut> RankWalk<'cut> {
    /// Walks on until a chunk is full or the rank is done.
    fn advance(&mut self, blocks: Option<&'cut RankBlocks>) {
        while self.chunker.done.is_empty() {
            if let Some(walk) = &mut self.tier_walk {
                if !walk.step(&mut self.chunker) {
                    self.tier_walk = None;
                }
                continue;
            }
            match (blocks, Tier::ALL.get(self.tiers_begun)) {
                (Some(blocks), Some(&tier)) => {
                    self.tier_walk = Some(TierWalk::new(blocks.tier_blocks(tier)));
                    self.tiers_begun += 1;
                }
                _ => {
                    self.chunker.finish();
                    self.finished = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::proto::common::{KvCacheTier, KvEventBatch, kv_cache_event::Data};
    use crate::state::{LiveState, stored_event};

    fn store(state: &mut LiveState, rank: u32, parent: Option<i64>, hashes: &[i64], tokens: usize) {
        state.apply(
            rank,
            &mut stored_event(parent, hashes, KvCacheTier::Device, tokens),
        );
    }

    /// Evicts device block `hash` of `rank`.
    fn evict(state: &mut LiveState, rank: u32, hash: i64) {
        let mut removed = KvCacheEvent {
            event_id: 1,
            data: Some(Data::Removed(crate::proto::common::KvBlocksRemoved {
                block_hashes: vec![hash],
                tier: Some(KvCacheTier::Device as i32),
                ..Default::default()
            })),
        };
        state.apply(rank, &mut removed);
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
        evict(&mut state, 0, 1);
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

    /// Every chunk `output` makes of rank 0's device tier.
    fn tier_chunks(state: &LiveState, output: Output) -> Vec<Bytes> {
        let blocks = state.rank(0).unwrap();
        let mut chunker = Chunker::new(1.0, output);
        let mut walk = TierWalk::new(blocks.tier_blocks(KvCacheTier::Device));
        while walk.step(&mut chunker) {}
        chunker.finish();
        chunker
            .done
            .into_iter()
            .map(|chunk| chunk.encode(0, 1, None))
            .collect()
    }

    #[test]
    fn the_planning_walk_ends_its_chunks_exactly_where_the_reading_walk_does() {
        let mut state = LiveState::default();
        // 400 chains of 50: many chunks, over several pages of records.
        let chains: Vec<i64> = (0..400).map(|chain| chain * 100).collect();
        for &first in &chains {
            let hashes: Vec<i64> = (first..first + 50).collect();
            store(&mut state, 0, None, &hashes, 4);
        }
        // Roots evicted and stored again after their chains (their
        // children pull them out ahead of their turn), across pages; and
        // extra copies.
        for &first in chains.iter().step_by(7) {
            evict(&mut state, 0, first);
            store(&mut state, 0, None, &[first], 4);
        }
        for &first in chains.iter().step_by(5) {
            store(&mut state, 0, None, &[first + 10], 4);
        }
        let encoded = tier_chunks(&state, Output::Encoded);
        assert!(encoded.len() > 5, "{} chunks", encoded.len());
        let planned = tier_chunks(&state, Output::Boundaries);
        assert_eq!(planned.len(), encoded.len());

        let batches = snapshot_of(&state, &[(0, 100_000)]);
        assert_eq!(batches.len(), encoded.len());
        let blocks: usize = batches
            .iter()
            .flat_map(stored_hashes)
            .map(|(_, hashes)| hashes.len())
            .sum();
        assert_eq!(blocks, 400 * 50 + 80);
        for (index, batch) in batches.iter().enumerate() {
            let header = batch.snapshot.unwrap();
            assert_eq!(header.index as usize, index);
            assert_eq!(header.count as usize, batches.len());
            assert_eq!(header.blocks, blocks as u64);
        }
        assert_eq!(batches.last().unwrap().sequence_number, 100_000);
    }

    /// `state` with extra copies, parents stored again after their
    /// children, a second tier and other fields beside its chains.
    fn mixed_state(state: &mut LiveState, rank: u32, blocks: i64, tokens: usize) {
        let hashes: Vec<i64> = (1..=blocks).collect();
        store(state, rank, None, &hashes, tokens);
        evict(state, rank, 1);
        store(state, rank, None, &[1], tokens);
        store(state, rank, None, &[2, 3], tokens);
        let mut host = stored_event(None, &[-5, -6], KvCacheTier::Host, tokens);
        if let Some(Data::Stored(stored)) = host.data.as_mut() {
            stored.lora_name = Some("adapter".into());
            stored.cache_salt = Some("tenant".into());
        }
        state.apply(rank, &mut host);
    }

    /// The plan a walk of every rank of `cut` finds.
    fn walked_whole(cut: &Arc<SnapshotCut>) -> Plan {
        let ranks = cut.last_sequences.keys().copied().collect();
        let opening = emission_order(cut).first().copied();
        Plan::walked(Arc::clone(cut), 1.0, ranks, opening)
    }

    fn cut_of(state: &LiveState, ranks: &[u32]) -> Arc<SnapshotCut> {
        Arc::new(SnapshotCut {
            state: state.cut(),
            last_sequences: ranks.iter().map(|&rank| (rank, 100_000)).collect(),
            position: 1,
            unknown_before: 0,
        })
    }

    #[test]
    fn a_plan_counted_from_blocks_is_the_plan_a_walk_finds() {
        // 2043, 2044, 2045 and 4090 blocks, to which `mixed_state` adds 4
        // (a block evicted and stored again, 2 stored again as copies, 2 on
        // the host tier): one short of a full chunk, full, one over, two.
        let mut state = LiveState::default();
        for (rank, blocks) in [(0, 2043), (1, 2044), (2, 2045), (3, 4090)] {
            mixed_state(&mut state, rank, blocks, 16);
        }
        let cut = cut_of(&state, &[0, 1, 2, 3, 4]);
        assert!(
            ranks_to_walk(&cut).is_empty(),
            "16-token blocks end chunks by count"
        );
        let counted = Plan::of(Arc::clone(&cut), 1.0);
        assert_eq!(counted, walked_whole(&cut));
        assert_eq!(
            counted.chunks_per_rank,
            BTreeMap::from([(0, 1), (1, 1), (2, 2), (3, 2), (4, 1)])
        );
        assert_eq!(decode(&cut).len(), 7);
    }

    #[test]
    fn a_plan_is_counted_only_when_no_chunk_can_fill_by_bytes_first() {
        let mut counted = Vec::new();
        for tokens in [16, 64, 128, 420, 440, 460, 480, 500, 4096] {
            let mut state = LiveState::default();
            mixed_state(&mut state, 0, 2100, tokens);
            let cut = cut_of(&state, &[0]);
            counted.push(ranks_to_walk(&cut).is_empty());
            assert_eq!(
                Plan::of(Arc::clone(&cut), 1.0),
                walked_whole(&cut),
                "{tokens} tokens"
            );
        }
        // 2048 lone blocks of about 500 one-byte tokens fill 1 MiB: narrower
        // blocks are counted, wider ones walked, and the line lies between.
        let walked_from = counted.iter().position(|&counted| !counted);
        assert!(
            matches!(walked_from, Some(first) if first >= 3 && counted[first..].iter().all(|&c| !c)),
            "{counted:?}"
        );
        let mut state = LiveState::default();
        let mut long_fields = stored_event(None, &[1, 2], KvCacheTier::Device, 16);
        if let Some(Data::Stored(stored)) = long_fields.data.as_mut() {
            stored.session_id = Some("s".repeat(600));
        }
        state.apply(0, &mut long_fields);
        assert_eq!(ranks_to_walk(&cut_of(&state, &[0])), [0]);
    }

    /// `blocks` blocks of `tokens` tokens with every field at its widest,
    /// chained, each a store of its own (alternating sessions keep
    /// neighbours from sharing a store).
    fn widest_lone_blocks(blocks: i64, tokens: usize) -> LiveState {
        use crate::proto::common::kv_block_extra_key::Key;
        use crate::proto::common::{KvBlock, KvBlockExtraKey, KvBlocksStored};
        let mut state = LiveState::default();
        let text = |letter: &str| Some(letter.repeat(8));
        for index in 0..blocks {
            let hash = -(index + 1);
            let mut stored = KvCacheEvent {
                event_id: 1,
                data: Some(Data::Stored(KvBlocksStored {
                    blocks: vec![KvBlock {
                        block_hash: hash,
                        token_ids: vec![u32::MAX; tokens],
                        block_size: -1,
                        lora_id: Some(-1),
                        cache_level: Some(-1),
                        extra_keys: vec![KvBlockExtraKey {
                            key: Some(Key::Text("img".into())),
                        }],
                    }],
                    parent_block_hash: (index > 0).then_some(hash + 1),
                    // Unknown, so kept as the device's tier, and written
                    // back as it came: at its widest.
                    tier: Some(i32::MIN),
                    medium: text("m"),
                    group_idx: Some(u32::MAX),
                    kv_cache_spec_kind: text("k"),
                    kv_cache_spec_sliding_window: Some(u32::MAX),
                    locality: Some(i32::MIN),
                    ownership: text("o"),
                    session_id: text(if index % 2 == 0 { "a" } else { "b" }),
                    lora_name: text("l"),
                    cache_salt: text("c"),
                })),
            };
            state.apply(0, &mut stored);
        }
        state
    }

    /// Blocks in each chunk of `batches`.
    fn blocks_per_chunk(batches: &[KvEventBatch]) -> Vec<usize> {
        batches
            .iter()
            .map(|batch| stored_hashes(batch).iter().map(|(_, h)| h.len()).sum())
            .collect()
    }

    #[test]
    fn the_widest_blocks_a_counted_plan_accepts_fill_a_chunk_to_its_byte_limit() {
        let counted_at =
            |tokens| ranks_to_walk(&cut_of(&widest_lone_blocks(1, tokens), &[0])).is_empty();
        let widest = (1..512)
            .take_while(|&tokens| counted_at(tokens))
            .last()
            .expect("narrow blocks are counted");

        let cut = cut_of(&widest_lone_blocks(2049, widest), &[0]);
        assert!(ranks_to_walk(&cut).is_empty(), "counted at its widest");
        assert_eq!(Plan::of(Arc::clone(&cut), 1.0), walked_whole(&cut));
        let batches = decode(&cut);
        assert_eq!(blocks_per_chunk(&batches), vec![2048, 1]);
        // Tight: the bound leaves less than 1% of a chunk unused.
        assert!(
            batches[0].encoded_len() > MAX_CHUNK_BYTES / 100 * 99,
            "{} bytes",
            batches[0].encoded_len()
        );

        // One token more and bytes end the first chunk early: the walk plans.
        let cut = cut_of(&widest_lone_blocks(2049, widest + 1), &[0]);
        assert_eq!(ranks_to_walk(&cut), [0]);
        assert!(blocks_per_chunk(&decode(&cut))[0] < MAX_CHUNK_BLOCKS);
    }

    #[test]
    fn one_wide_block_ever_stored_on_a_rank_keeps_its_plans_walked() {
        let mut state = widest_lone_blocks(1, 4096);
        evict(&mut state, 0, -1);
        store(&mut state, 0, None, &[1, 2, 3], 16);
        assert_eq!(ranks_to_walk(&cut_of(&state, &[0])), [0]);
    }

    #[test]
    fn a_plan_walks_only_the_ranks_whose_blocks_can_fill_a_chunk_by_bytes() {
        // Rank 0: 1000-token blocks, about a thousand to a chunk, so bytes
        // end its chunks; rank 1: 2 chunks of 16-token blocks, counted;
        // rank 2: only its clear.
        let mut state = LiveState::default();
        let wide: Vec<i64> = (1..=2100).collect();
        store(&mut state, 0, None, &wide, 1000);
        mixed_state(&mut state, 1, 2100, 16);
        let cut = cut_of(&state, &[0, 1, 2]);
        assert_eq!(ranks_to_walk(&cut), [0]);
        let plan = Plan::of(Arc::clone(&cut), 1.0);
        assert_eq!(plan, walked_whole(&cut));
        assert_eq!(plan.chunks_per_rank[&1], 2);
        assert_eq!(plan.chunks_per_rank[&0], 3, "bytes end rank 0's chunks");
        assert_eq!(plan.chunks_per_rank[&2], 1);
        assert_eq!(decode(&cut).len() as u32, plan.count);
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
