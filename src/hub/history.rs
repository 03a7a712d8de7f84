//! The recent batches, in emission order, for replay and lag refill.
//!
//! Invariant: the drain is the only writer and a batch is in the history
//! before it is broadcast, so any position a subscriber sees live is either
//! readable here or evicted. A slot is trusted only if the batch in it
//! carries the position asked for (eviction and reuse can never hand out a
//! wrong batch). Each slot has a lock of its own, held only to clone or
//! swap the batch's handle: a reader never waits for more than that, and
//! the drain, which touches two slots per batch (the one it writes and the
//! one it evicts), contends only with a reader of those two. (Atomic
//! pointer swaps, which readers need not lock, made every write walk the
//! list of threads that ever read: the two writes per batch took 1.8% of
//! kvgate's CPU at one subscriber.)
//!
//! Memory follows what is held, not the limits: slots come in segments
//! allocated when the first position reaching them is written and freed when
//! their last position is evicted, and each batch is charged its encoded
//! bytes plus `BATCH_OVERHEAD` against `--history-bytes`. So the history
//! holds at most `--history-bytes` of batches and 24 bytes of slots per
//! batch held (plus two segments), whatever `--history-batches` says.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use arc_swap::ArcSwapOption;

use super::Published;

/// How much history to keep: whichever bound is hit first.
#[derive(Clone, Copy, Debug)]
pub struct HistoryLimits {
    /// Most batches held (`--history-batches`).
    pub batches: usize,
    /// Most encoded bytes held (`--history-bytes`).
    pub bytes: usize,
}

/// Keys (positions, or rank-0 sequence numbers) per segment.
const SEGMENT_KEYS: u64 = 1024;

/// A run of `SEGMENT_KEYS` slots starting at key `first`.
#[derive(Debug)]
struct Segment<T> {
    first: u64,
    slots: Box<[T]>,
}

/// Slots for a window of at most `window` consecutive growing keys,
/// allocated one segment at a time. Only the drain writes and releases;
/// readers take a segment by atomic load and check it covers their key.
#[derive(Debug)]
struct Segments<T> {
    table: Box<[ArcSwapOption<Segment<T>>]>,
}

impl<T: Default> Segments<T> {
    fn new(window: usize) -> Self {
        // A window of `window` keys touches at most this many segments.
        let segments = (window as u64).div_ceil(SEGMENT_KEYS) + 1;
        Self {
            table: (0..segments).map(|_| ArcSwapOption::empty()).collect(),
        }
    }

    fn entry(&self, key: u64) -> &ArcSwapOption<Segment<T>> {
        &self.table[((key / SEGMENT_KEYS) % self.table.len() as u64) as usize]
    }

    /// Reads the slot of `key`, if its segment is allocated.
    fn read<R>(&self, key: u64, read: impl FnOnce(&T) -> R) -> Option<R> {
        let segment = self.entry(key).load();
        let segment = segment
            .as_ref()
            .filter(|segment| segment.first == key - key % SEGMENT_KEYS)?;
        Some(read(&segment.slots[(key % SEGMENT_KEYS) as usize]))
    }

    /// Writes the slot of `key`, allocating its segment first if needed
    /// (replacing one whose keys have all left the window).
    fn write(&self, key: u64, write: impl FnOnce(&T)) {
        let first = key - key % SEGMENT_KEYS;
        let entry = self.entry(key);
        let slot = (key % SEGMENT_KEYS) as usize;
        if let Some(segment) = entry
            .load()
            .as_ref()
            .filter(|segment| segment.first == first)
        {
            write(&segment.slots[slot]);
            return;
        }
        let segment = Arc::new(Segment {
            first,
            slots: (0..SEGMENT_KEYS).map(|_| T::default()).collect(),
        });
        write(&segment.slots[slot]);
        entry.store(Some(segment));
    }

    /// Frees the segment of `key` once `key`, the last of its keys still
    /// held, has left the window.
    fn left_window(&self, key: u64) {
        if key % SEGMENT_KEYS == SEGMENT_KEYS - 1 {
            self.entry(key).store(None);
        }
    }

    /// Segments currently allocated.
    #[cfg(test)]
    fn allocated(&self) -> usize {
        self.table
            .iter()
            .filter(|entry| entry.load().is_some())
            .count()
    }
}

/// One position's batch, if held.
#[derive(Debug, Default)]
struct Slot(Mutex<Option<Arc<Published>>>);

impl Slot {
    fn lock(&self) -> MutexGuard<'_, Option<Arc<Published>>> {
        // Nothing that holds the lock can panic (it clones or moves a
        // handle), so a poisoned lock still holds a whole value.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Shared read side; `HistoryWriter` holds the only write side.
#[derive(Debug)]
pub struct History {
    /// The batch at each position (from 1).
    slots: Segments<Slot>,
    /// Position of rank 0's batch, by rank-0 sequence number: a resuming
    /// subscriber's cursor is a rank-0 sequence number.
    rank0_positions: Segments<AtomicU64>,
    /// Most batches held (`--history-batches`).
    capacity: u64,
    /// Oldest position still held; `newest + 1` when empty.
    oldest: AtomicU64,
    /// Newest position held, 0 before the first batch.
    newest: AtomicU64,
    /// Rank 0's newest sequence number, 0 before its first batch (kvgate
    /// never sends 0): tells a cursor that is ahead from one that is behind.
    rank0_newest: AtomicU64,
    /// Rank 0's first sequence number in this process, 0 before its first
    /// batch: a cursor below it comes from another kvgate process.
    rank0_first: AtomicU64,
    /// Rank 0's newest sequence number evicted, 0 before the first such
    /// eviction. Rank 0's numbers go up by one a batch, so every rank-0
    /// batch after it is still held.
    rank0_evicted_through: AtomicU64,
    /// Rank 0's sequence number of the batch evicted last, if it was rank
    /// 0's (else 0): everything after it is still held, so a cursor naming
    /// it can still be resumed (the contract asks for `c+1` onwards, not
    /// `c`). Its position stays in `rank0_positions` until the next rank-0
    /// batch is evicted. A reader may see it after more was evicted; the
    /// subscription then reports the loss.
    rank0_just_evicted: AtomicU64,
}

impl History {
    /// The batch at `position`, unless it was evicted or not written yet.
    pub fn get(&self, position: u64) -> Option<Arc<Published>> {
        self.slots
            .read(position, |slot| slot.lock().clone())
            .flatten()
            .filter(|batch| batch.position == position)
    }

    /// Oldest position held; `newest + 1` when empty.
    pub fn oldest(&self) -> u64 {
        self.oldest.load(Ordering::Acquire)
    }

    /// Newest position held, 0 before the first batch.
    pub fn newest(&self) -> u64 {
        self.newest.load(Ordering::Acquire)
    }

    /// Rank 0's newest sequence number, once rank 0 sent a batch.
    pub fn rank0_newest_sequence(&self) -> Option<u64> {
        Some(self.rank0_newest.load(Ordering::Acquire)).filter(|&sequence| sequence != 0)
    }

    /// Rank 0's first sequence number in this process.
    pub fn rank0_first_sequence(&self) -> Option<u64> {
        Some(self.rank0_first.load(Ordering::Acquire)).filter(|&sequence| sequence != 0)
    }

    /// The oldest rank-0 cursor a subscriber can resume from now: the batch
    /// evicted last if it was rank 0's, else the oldest rank-0 batch held;
    /// none when rank 0 has no batch left in the history.
    pub fn rank0_oldest_resumable(&self) -> Option<u64> {
        // `rank0_evicted_through` is stored during eviction and
        // `rank0_just_evicted` after it: read in the other order, a stale
        // `rank0_just_evicted` shows as older than `through` and is ignored.
        let through = self.rank0_evicted_through.load(Ordering::Acquire);
        let newest = self.rank0_newest_sequence()?;
        let just_evicted = Some(self.rank0_just_evicted.load(Ordering::Acquire))
            .filter(|&sequence| sequence >= through && through != 0);
        let oldest = match (just_evicted, through) {
            (Some(sequence), _) => sequence,
            (None, 0) => self.rank0_first_sequence()?,
            (None, through) => through + 1,
        };
        (oldest <= newest).then_some(oldest)
    }

    /// Where rank 0's batch `sequence` stands, if it is still held.
    pub fn rank0_position(&self, sequence: u64) -> Option<u64> {
        let position = self
            .rank0_positions
            .read(sequence, |position| position.load(Ordering::Acquire))?;
        self.get(position)
            .filter(|batch| batch.rank == 0 && batch.sequence == sequence)
            .map(|batch| batch.position)
    }

    /// Where rank 0's batch `sequence` stood, if it is the batch evicted
    /// last (see `rank0_just_evicted`).
    pub fn rank0_just_evicted(&self, sequence: u64) -> Option<u64> {
        if sequence == 0 || self.rank0_just_evicted.load(Ordering::Acquire) != sequence {
            return None;
        }
        self.rank0_positions
            .read(sequence, |position| position.load(Ordering::Acquire))
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
    /// What the held batches retain (`Batch::retained_bytes`).
    bytes: usize,
    /// Rank 0's batch evicted last, whose position `rank0_positions` still
    /// holds for `History::rank0_just_evicted`.
    rank0_evicted_last: Option<u64>,
}

impl HistoryWriter {
    /// An empty history held to `limits`.
    pub fn new(limits: HistoryLimits) -> Self {
        let capacity = limits.batches.max(1);
        let history = History {
            slots: Segments::new(capacity),
            // One more: the rank-0 batch evicted last keeps its slot.
            rank0_positions: Segments::new(capacity + 1),
            capacity: capacity as u64,
            oldest: AtomicU64::new(1),
            newest: AtomicU64::new(0),
            rank0_newest: AtomicU64::new(0),
            rank0_first: AtomicU64::new(0),
            rank0_evicted_through: AtomicU64::new(0),
            rank0_just_evicted: AtomicU64::new(0),
        };
        Self {
            history: Arc::new(history),
            limits,
            bytes: 0,
            rank0_evicted_last: None,
        }
    }

    /// The read side, shared with every subscriber.
    pub fn reader(&self) -> Arc<History> {
        Arc::clone(&self.history)
    }

    /// Bytes the held batches retain, overhead included.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Makes `position` the next one pushed: when nothing is held yet (a
    /// history being restored), or when it already is.
    pub fn start_at(&mut self, position: u64) {
        let history = &self.history;
        if history.newest() + 1 == position {
            return;
        }
        debug_assert!(
            history.oldest() > history.newest(),
            "only an empty history moves"
        );
        history.newest.store(position - 1, Ordering::Release);
        history.oldest.store(position, Ordering::Release);
    }

    /// Appends the next batch (its position must be `newest + 1`), evicting
    /// the oldest ones beyond the limits. The newest batch is always kept.
    pub fn push(&mut self, batch: Arc<Published>) {
        let history = &self.history;
        let position = batch.position;
        debug_assert_eq!(position, history.newest() + 1);
        let capacity = history.capacity;
        let mut oldest = history.oldest();
        let incoming = batch.retained_bytes();
        // Rank 0's sequence number of the last batch evicted, or 0 if it
        // was another rank's; `None` while nothing was evicted.
        let mut just_evicted = None;
        while oldest < position
            && (position - oldest >= capacity || self.bytes + incoming > self.limits.bytes)
        {
            let evicted = history
                .slots
                .read(oldest, |slot| slot.lock().take())
                .flatten();
            if let Some(evicted) = evicted {
                self.bytes -= evicted.retained_bytes();
                if evicted.rank == 0 {
                    if let Some(earlier) = self.rank0_evicted_last.replace(evicted.sequence) {
                        history.rank0_positions.left_window(earlier);
                    }
                    history
                        .rank0_evicted_through
                        .store(evicted.sequence, Ordering::Release);
                }
                just_evicted = Some(if evicted.rank == 0 {
                    evicted.sequence
                } else {
                    0
                });
            }
            history.slots.left_window(oldest);
            oldest += 1;
            history.oldest.store(oldest, Ordering::Release);
        }
        if let Some(sequence) = just_evicted {
            history
                .rank0_just_evicted
                .store(sequence, Ordering::Release);
        }
        self.bytes += incoming;
        let rank0_sequence = (batch.rank == 0).then_some(batch.sequence);
        history
            .slots
            .write(position, |slot| *slot.lock() = Some(batch));
        history.newest.store(position, Ordering::Release);
        // Published after the slot, and `rank0_newest` last: a reader that
        // sees a rank-0 sequence as sent also finds its batch.
        if let Some(sequence) = rank0_sequence {
            history
                .rank0_positions
                .write(sequence, |slot| slot.store(position, Ordering::Release));
            if history.rank0_first_sequence().is_none() {
                history.rank0_first.store(sequence, Ordering::Release);
            }
            history.rank0_newest.store(sequence, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::batch::BATCH_OVERHEAD;

    #[test]
    fn a_batch_held_costs_24_bytes_of_slots_as_the_help_says() {
        assert_eq!(
            std::mem::size_of::<Slot>() + std::mem::size_of::<AtomicU64>(),
            24
        );
    }

    fn batch(position: u64, rank: u32, sequence: u64, size: usize) -> Arc<Published> {
        Arc::new(Published::new(
            position,
            rank,
            sequence,
            crate::hub::FramedBatch::new(&vec![0u8; size]),
        ))
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
        assert_eq!(writer.bytes(), 3 * (10 + BATCH_OVERHEAD));
    }

    #[test]
    fn the_history_keeps_at_most_the_configured_bytes_but_always_the_newest_batch() {
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 100,
            bytes: 2 * (10 + BATCH_OVERHEAD) + 5,
        });
        let history = writer.reader();
        writer.push(batch(1, 0, 1, 10));
        writer.push(batch(2, 0, 2, 10));
        writer.push(batch(3, 0, 3, 10));
        assert_eq!(history.span(), (2, 3));
        writer.push(batch(4, 0, 4, 1000));
        assert_eq!(history.span(), (4, 4));
        assert_eq!(writer.bytes(), 1000 + BATCH_OVERHEAD);
    }

    #[test]
    fn the_oldest_resumable_rank0_cursor_follows_eviction_and_is_none_once_rank0_has_nothing_held()
    {
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 2,
            bytes: usize::MAX,
        });
        let history = writer.reader();
        assert_eq!(history.rank0_oldest_resumable(), None, "nothing sent");
        writer.push(batch(1, 0, 50, 1));
        writer.push(batch(2, 0, 51, 1));
        assert_eq!(history.rank0_oldest_resumable(), Some(50), "all held");
        writer.push(batch(3, 1, 80, 1));
        assert_eq!(
            history.rank0_oldest_resumable(),
            Some(50),
            "50 was evicted last: everything after it is held"
        );
        writer.push(batch(4, 1, 81, 1));
        assert_eq!(history.rank0_oldest_resumable(), Some(51));
        writer.push(batch(5, 1, 82, 1));
        assert_eq!(
            history.rank0_oldest_resumable(),
            None,
            "rank 0's batches are gone and a rank-1 batch was evicted last"
        );
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

    #[test]
    fn tiny_batches_are_charged_their_overhead_so_they_cannot_outgrow_the_byte_limit() {
        let limit = 100 * (1 + BATCH_OVERHEAD);
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 1_000_000,
            bytes: limit,
        });
        for position in 1..=10_000 {
            writer.push(batch(position, 0, position, 1));
        }
        assert_eq!(writer.reader().span(), (9_901, 10_000));
        assert_eq!(writer.bytes(), limit);
    }

    #[test]
    fn slots_are_allocated_as_positions_reach_them_and_freed_once_evicted() {
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 4_000_000_000,
            bytes: usize::MAX,
        });
        let history = writer.reader();
        assert_eq!(
            history.slots.allocated(),
            0,
            "nothing before the first batch"
        );
        writer.push(batch(1, 0, 1, 1));
        assert_eq!(history.slots.allocated(), 1);
        assert_eq!(history.rank0_positions.allocated(), 1);

        // A window of 3 000 batches moving over 20 000 positions never
        // holds more than the segments it spans.
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 3_000,
            bytes: usize::MAX,
        });
        let history = writer.reader();
        for position in 1..=20_000u64 {
            writer.push(batch(position, (position % 2) as u32, 7 + position / 2, 1));
            assert!(history.slots.allocated() <= 4);
            assert!(history.rank0_positions.allocated() <= 3);
            // Even positions are rank 0's: the one just evicted keeps its
            // slot, across every segment boundary of rank 0's numbers.
            if let Some(evicted) = position.checked_sub(3_000).filter(|p| p % 2 == 0 && *p > 0) {
                assert_eq!(history.rank0_just_evicted(7 + evicted / 2), Some(evicted));
            }
        }
        assert_eq!(history.span(), (17_001, 20_000));
        for position in 17_001..=20_000 {
            assert_eq!(history.get(position).unwrap().position, position);
        }
        assert!(history.get(17_000).is_none());
        assert_eq!(history.rank0_position(7 + 10_000), Some(20_000));
        assert_eq!(history.rank0_position(7 + 8_501), Some(17_002));
        assert_eq!(history.rank0_position(7 + 8_500), None, "evicted");
    }

    #[test]
    fn a_reader_racing_the_writer_finds_every_position_between_oldest_and_newest() {
        let mut writer = HistoryWriter::new(HistoryLimits {
            batches: 3_000,
            bytes: 1_500 * (100 + BATCH_OVERHEAD),
        });
        let history = writer.reader();
        const PUSHES: u64 = 50_000;
        let reader = std::thread::spawn(move || {
            let (mut found, mut position) = (0u64, 1u64);
            while position <= PUSHES {
                if history.newest() < position {
                    std::thread::yield_now();
                    continue;
                }
                match history.get(position) {
                    Some(batch) => {
                        assert_eq!(batch.position, position);
                        found += 1;
                    }
                    // The writer empties a slot just before it moves
                    // `oldest` past it.
                    None => assert!(
                        history.oldest() >= position,
                        "position {position} is held but not found"
                    ),
                }
                // Skip ahead now and then, as a lagging subscriber would.
                position += 1 + (position % 7 == 0) as u64 * 500;
            }
            found
        });
        for position in 1..=PUSHES {
            let size = 1 + (position * 37 % 200) as usize;
            writer.push(batch(
                position,
                (position % 3) as u32,
                1 + position / 3,
                size,
            ));
        }
        assert!(reader.join().unwrap() > 0);
    }
}
