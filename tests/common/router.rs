//! A subscriber that admits batches exactly as the SMG router does
//! (contract section 3) and keeps the block set each rank holds as a result.
//! Like the router, whose index pools a worker's ranks, it clears the whole
//! worker on any `KvCacheCleared`, whichever rank's batch carries it.
//! Every resume, lag, restart and snapshot test goes through it, so a stream
//! that would make the real router clear a worker or see a gap fails here.

use std::collections::{BTreeMap, HashMap};

use kvgate::proto::common::{KvEventBatch, kv_cache_event::Data};

/// How the router treats one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    Applied,
    /// `seq == last`, or an old batch that is not a restart: ignored.
    Stale,
    /// An old batch taken as a restart: the whole worker is cleared first.
    Restart,
    /// A number was skipped: the router would reconnect to resume.
    Gap {
        expected: u64,
        got: u64,
    },
    SnapshotChunk,
    LoadOnly,
}

/// Live blocks of one rank: hash → physical copies.
pub type BlockSet = HashMap<i64, u32>;

#[derive(Debug, Default)]
pub struct RouterView {
    cursors: BTreeMap<i32, u64>,
    blocks: BTreeMap<i32, BlockSet>,
    /// No batch received yet on the current connection.
    fresh_connection: bool,
    pub restarts: usize,
    pub gaps: Vec<(i32, u64, u64)>,
}

impl RouterView {
    pub fn new() -> Self {
        Self {
            fresh_connection: true,
            ..Self::default()
        }
    }

    /// Rank 0's cursor, what the router sends as `start_sequence_number`.
    pub fn resume_cursor(&self) -> u64 {
        self.cursors.get(&0).copied().unwrap_or(0)
    }

    pub fn cursor(&self, rank: i32) -> Option<u64> {
        self.cursors.get(&rank).copied()
    }

    /// A new connection starts (after a disconnect or a refused call).
    pub fn reconnecting(&mut self) {
        self.fresh_connection = true;
    }

    /// What the router does on OUT_OF_RANGE / DATA_LOSS: forget the worker
    /// and resubscribe with 0.
    pub fn clear_worker(&mut self) {
        self.blocks.clear();
        self.cursors.clear();
        self.fresh_connection = true;
    }

    pub fn blocks(&self, rank: i32) -> BlockSet {
        self.blocks
            .get(&rank)
            .map(|set| {
                set.iter()
                    .filter(|(_, copies)| **copies > 0)
                    .map(|(h, c)| (*h, *c))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn admit(&mut self, batch: &KvEventBatch) -> Admission {
        let fresh = std::mem::replace(&mut self.fresh_connection, false);
        if batch.load.as_ref().is_some_and(|load| load.load_only) {
            return Admission::LoadOnly;
        }
        let rank = batch.dp_rank.unwrap_or(0);
        let seq = batch.sequence_number;
        if batch.snapshot.is_some() {
            self.apply(rank, batch);
            self.cursors.insert(rank, seq);
            return Admission::SnapshotChunk;
        }
        let admission = match self.cursors.get(&rank).copied() {
            None => Admission::Applied,
            Some(last) if seq == last + 1 => Admission::Applied,
            Some(last) if seq == last => Admission::Stale,
            Some(last) if seq < last => {
                if has_ownerless_clear(batch) || fresh || seq <= 1 || seq + 1024 <= last {
                    Admission::Restart
                } else {
                    Admission::Stale
                }
            }
            Some(last) => Admission::Gap {
                expected: last + 1,
                got: seq,
            },
        };
        match admission {
            Admission::Applied => {
                self.apply(rank, batch);
                self.cursors.insert(rank, seq);
            }
            Admission::Restart => {
                self.restarts += 1;
                self.blocks.clear();
                self.cursors.clear();
                self.apply(rank, batch);
                self.cursors.insert(rank, seq);
            }
            Admission::Gap { expected, got } => self.gaps.push((rank, expected, got)),
            _ => {}
        }
        admission
    }

    fn apply(&mut self, rank: i32, batch: &KvEventBatch) {
        for event in &batch.events {
            if let Some(Data::Cleared(_)) = &event.data {
                self.blocks.clear();
                continue;
            }
            let blocks = self.blocks.entry(rank).or_default();
            match &event.data {
                Some(Data::Stored(stored)) => {
                    for block in &stored.blocks {
                        *blocks.entry(block.block_hash).or_default() += 1;
                    }
                }
                Some(Data::Removed(removed)) => {
                    for hash in &removed.block_hashes {
                        if let Some(copies) = blocks.get_mut(hash) {
                            *copies = copies.saturating_sub(1);
                            if *copies == 0 {
                                blocks.remove(hash);
                            }
                        }
                    }
                }
                Some(Data::Cleared(_)) | None => {}
            }
        }
    }
}

fn has_ownerless_clear(batch: &KvEventBatch) -> bool {
    batch.events.iter().any(
        |event| matches!(&event.data, Some(Data::Cleared(cleared)) if cleared.ownership.is_none()),
    )
}
