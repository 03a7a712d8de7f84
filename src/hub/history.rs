//! The recent batches, in emission order, for replay and lag refill.
//!
//! Invariant: the drain is the only writer and a batch is in the history
//! before it is broadcast, so any position a subscriber sees live is either
//! readable here or evicted. Readers never lock: each slot is an atomic
//! pointer, and a slot is trusted only if the batch in it carries the
//! position asked for (eviction and reuse can never hand out a wrong batch).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwapOption;

use super::batch::Batch;

/// How much history to keep: whichever bound is hit first.
#[derive(Clone, Copy, Debug)]
pub struct HistoryLimits {
    pub batches: usize,
    pub bytes: usize,
}

/// Shared read side; `HistoryWriter` holds the only write side.
#[derive(Debug)]
pub struct History {
    slots: Box<[ArcSwapOption<Batch>]>,
    /// Position of rank 0's batch, by rank-0 sequence number modulo capacity:
    /// a resuming subscriber's cursor is a rank-0 sequence number.
    rank0_positions: Box<[AtomicU64]>,
    /// Oldest position still held; `newest + 1` when empty.
    oldest: AtomicU64,
    /// Newest position held, 0 before the first batch.
    newest: AtomicU64,
    /// Rank 0's newest sequence number, 0 before its first batch (kvgate
    /// never sends 0): tells a cursor that is ahead from one that is behind.
    rank0_newest: AtomicU64,
    /// (position, sequence) of the batch evicted last, if it was rank 0's:
    /// everything after it is still held, so a cursor naming it can still
    /// be resumed (the contract asks for `c+1` onwards, not `c`). A reader
    /// may see it after more was evicted; the subscription then reports the
    /// loss.
    rank0_evicted: ArcSwapOption<(u64, u64)>,
}

impl History {
    fn slot(&self, position: u64) -> &ArcSwapOption<Batch> {
        &self.slots[(position % self.slots.len() as u64) as usize]
    }

    /// The batch at `position`, unless it was evicted or not written yet.
    pub fn get(&self, position: u64) -> Option<Arc<Batch>> {
        self.slot(position)
            .load_full()
            .filter(|batch| batch.position == position)
    }

    pub fn oldest(&self) -> u64 {
        self.oldest.load(Ordering::Acquire)
    }

    pub fn newest(&self) -> u64 {
        self.newest.load(Ordering::Acquire)
    }

    pub fn rank0_newest_sequence(&self) -> Option<u64> {
        Some(self.rank0_newest.load(Ordering::Acquire)).filter(|&sequence| sequence != 0)
    }

    /// Where rank 0's batch `sequence` stands, if it is still held.
    pub fn rank0_position(&self, sequence: u64) -> Option<u64> {
        let index = (sequence % self.rank0_positions.len() as u64) as usize;
        let position = self.rank0_positions[index].load(Ordering::Acquire);
        self.get(position)
            .filter(|batch| batch.rank == 0 && batch.sequence == sequence)
            .map(|batch| batch.position)
    }

    /// Where rank 0's batch `sequence` stood, if it is the batch evicted
    /// last (see `rank0_evicted`).
    pub fn rank0_just_evicted(&self, sequence: u64) -> Option<u64> {
        self.rank0_evicted
            .load()
            .as_deref()
            .filter(|&&(_, evicted)| evicted == sequence)
            .map(|&(position, _)| position)
    }

    /// The (oldest, newest) positions held, for metrics and status.
    pub fn span(&self) -> (u64, u64) {
        (self.oldest(), self.newest())
    }
}

/// The drain's handle: appends and evicts.
#[derive(Debug)]
pub struct HistoryWriter {
    history: Arc<History>,
    limits: HistoryLimits,
    bytes: usize,
}

impl HistoryWriter {
    pub fn new(limits: HistoryLimits) -> Self {
        let capacity = limits.batches.max(1);
        let history = History {
            slots: (0..capacity).map(|_| ArcSwapOption::empty()).collect(),
            rank0_positions: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            oldest: AtomicU64::new(1),
            newest: AtomicU64::new(0),
            rank0_newest: AtomicU64::new(0),
            rank0_evicted: ArcSwapOption::empty(),
        };
        Self {
            history: Arc::new(history),
            limits,
            bytes: 0,
        }
    }

    pub fn reader(&self) -> Arc<History> {
        Arc::clone(&self.history)
    }

    /// Bytes of encoded batches currently held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Appends the next batch (its position must be `newest + 1`), evicting
    /// the oldest ones beyond the limits. The newest batch is always kept.
    pub fn push(&mut self, batch: Arc<Batch>) {
        let history = &self.history;
        let position = batch.position;
        debug_assert_eq!(position, history.newest() + 1);
        let capacity = history.slots.len() as u64;
        let mut oldest = history.oldest();
        let incoming = batch.encoded.len();
        let mut last_evicted = None;
        while oldest < position
            && (position - oldest >= capacity || self.bytes + incoming > self.limits.bytes)
        {
            if let Some(evicted) = history.slot(oldest).swap(None) {
                self.bytes -= evicted.encoded.len();
                last_evicted = Some(evicted);
            }
            oldest += 1;
            history.oldest.store(oldest, Ordering::Release);
        }
        if let Some(evicted) = last_evicted {
            let rank0 = (evicted.rank == 0).then(|| Arc::new((evicted.position, evicted.sequence)));
            history.rank0_evicted.store(rank0);
        }
        self.bytes += incoming;
        let rank0_sequence = (batch.rank == 0).then_some(batch.sequence);
        history.slot(position).store(Some(batch));
        history.newest.store(position, Ordering::Release);
        // Published after the slot, and `rank0_newest` last: a reader that
        // sees a rank-0 sequence as sent also finds its batch.
        if let Some(sequence) = rank0_sequence {
            let index = (sequence % capacity) as usize;
            history.rank0_positions[index].store(position, Ordering::Release);
            history.rank0_newest.store(sequence, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn batch(position: u64, rank: u32, sequence: u64, size: usize) -> Arc<Batch> {
        Arc::new(Batch {
            position,
            rank,
            sequence,
            event_count: 1,
            encoded: Bytes::from(vec![0u8; size]),
        })
    }

    #[test]
    fn the_history_keeps_at_most_the_configured_number_of_batches() {
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 3,
            bytes: usize::MAX,
        });
        let history = writer.reader();
        for position in 1..=5 {
            writer.push(batch(position, 0, 100 + position, 10));
        }
        assert_eq!(history.span(), (3, 5));
        assert!(history.get(2).is_none());
        assert_eq!(history.get(3).unwrap().sequence, 103);
        assert_eq!(writer.bytes(), 30);
    }

    #[test]
    fn the_history_keeps_at_most_the_configured_bytes_but_always_the_newest_batch() {
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 100,
            bytes: 25,
        });
        let history = writer.reader();
        writer.push(batch(1, 0, 1, 10));
        writer.push(batch(2, 0, 2, 10));
        writer.push(batch(3, 0, 3, 10));
        assert_eq!(history.span(), (2, 3));
        writer.push(batch(4, 0, 4, 100));
        assert_eq!(history.span(), (4, 4));
        assert_eq!(writer.bytes(), 100);
    }

    #[test]
    fn a_rank0_sequence_number_leads_to_its_position_while_held() {
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 4,
            bytes: usize::MAX,
        });
        let history = writer.reader();
        writer.push(batch(1, 0, 50, 1));
        writer.push(batch(2, 1, 80, 1));
        writer.push(batch(3, 0, 51, 1));
        assert_eq!(history.rank0_position(50), Some(1));
        assert_eq!(history.rank0_position(51), Some(3));
        assert_eq!(
            history.rank0_position(80),
            None,
            "rank 1's numbers are not rank 0's"
        );
        for position in 4..=8 {
            writer.push(batch(position, 1, 77 + position, 1));
        }
        assert_eq!(history.rank0_position(50), None, "evicted");
    }

    #[test]
    fn a_rank0_batch_is_still_found_while_only_it_has_been_evicted() {
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 2,
            bytes: usize::MAX,
        });
        let history = writer.reader();
        writer.push(batch(1, 0, 50, 1));
        writer.push(batch(2, 1, 80, 1));
        writer.push(batch(3, 0, 51, 1));
        assert_eq!(history.rank0_position(50), None);
        assert_eq!(history.rank0_just_evicted(50), Some(1));
        writer.push(batch(4, 0, 52, 1));
        assert_eq!(
            history.rank0_just_evicted(50),
            None,
            "rank 1's batch after it is gone too"
        );
        writer.push(batch(5, 1, 81, 1));
        assert_eq!(history.rank0_just_evicted(51), Some(3));
    }
}
