//! The drain's side of load records: which record each outgoing batch
//! carries, and when a `load_only` batch must go out.
//!
//! Invariants: records are stamped as they are encoded, each with the next
//! `sample` (so on any stream, which delivers what was encoded in order,
//! samples only go up) and with `age_ms` measured from the poll or push
//! behind it (a reading that is not refreshed shows its age growing, never
//! a fresh one). Event batches carry the routing core; `load_only` batches
//! carry every field the engine reported. A rank's `load_only` goes out in
//! the drain cycle its core changed in, unless an event batch carried the
//! change, and otherwise as a heartbeat every `heartbeat` after the last
//! one, flat: a router counts a record as fresh only within its own load
//! monitor interval (contract section 6).

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::{Board, LoadSource, Reading};
use crate::proto::common::EngineLoad;

#[derive(Debug, Default)]
struct RankRecord {
    reading: Option<Reading>,
    /// The core changed and no batch carried it yet.
    unsent_change: bool,
    next_heartbeat: Option<Instant>,
}

/// A record as stamped, with the source of the reading behind it.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The record, stamped.
    pub load: EngineLoad,
    /// Where its reading came from.
    pub source: LoadSource,
}

/// The latest readings, as the drain stamps them.
#[derive(Debug)]
pub struct LoadRecords {
    feed: watch::Receiver<Board>,
    /// False once the poller is gone: only heartbeats remain to wait for.
    feed_open: bool,
    ranks: Vec<RankRecord>,
    next_sample: u64,
    heartbeat: Duration,
}

impl LoadRecords {
    /// `--load-heartbeat-ms`'s default: a router polling its engines every
    /// second (`--load-monitor-interval 1`) still sees every one as pushed.
    pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);

    /// Records fed by the board, an unchanged one re-sent every `heartbeat`.
    pub fn new(feed: watch::Receiver<Board>, heartbeat: Duration) -> Self {
        Self {
            feed,
            feed_open: true,
            ranks: Vec::new(),
            next_sample: 1,
            heartbeat,
        }
    }

    /// Returns when a reading was published or a heartbeat is due;
    /// then call [`Self::refresh`] and [`Self::due`].
    pub async fn wake(&mut self) {
        let deadline = self
            .ranks
            .iter()
            .filter_map(|rank| rank.next_heartbeat)
            .min();
        let heartbeat = async move {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        if !self.feed_open {
            return heartbeat.await;
        }
        tokio::select! {
            changed = self.feed.changed() => self.feed_open = changed.is_ok(),
            () = heartbeat => {}
        }
    }

    /// Takes the latest readings.
    pub fn refresh(&mut self, now: Instant) {
        let board = self.feed.borrow_and_update().clone();
        if self.ranks.len() < board.len() {
            self.ranks.resize_with(board.len(), RankRecord::default);
        }
        for (record, reading) in self.ranks.iter_mut().zip(board.iter()) {
            let changed = match (&record.reading, reading) {
                (None, Some(_)) => true,
                (Some(old), Some(new)) => !same_core(&old.load, &new.load),
                (_, None) => false,
            };
            record.reading = reading.clone();
            if record.reading.is_none() {
                *record = RankRecord::default();
            } else if changed {
                record.unsent_change = true;
                let soon = now + self.heartbeat;
                record.next_heartbeat = Some(record.next_heartbeat.map_or(soon, |at| at.min(soon)));
            }
        }
    }

    /// The record an event batch of `rank` carries (the routing core), if
    /// there is a reading for the rank.
    pub fn for_batch(&mut self, rank: u32, now: Instant) -> Option<Record> {
        let record = self.ranks.get_mut(rank as usize)?;
        let reading = record.reading.as_ref()?;
        let core = EngineLoad {
            running_requests: reading.load.running_requests,
            waiting_requests: reading.load.waiting_requests,
            waiting_uncached_tokens: reading.load.waiting_uncached_tokens,
            token_usage: reading.load.token_usage,
            active_token_usage: reading.load.active_token_usage,
            gen_throughput: reading.load.gen_throughput,
            max_running_requests: reading.load.max_running_requests,
            ..EngineLoad::default()
        };
        let (taken_at, source) = (reading.taken_at, reading.source);
        record.unsent_change = false;
        Some(self.stamp(core, taken_at, source, now, false))
    }

    /// The `load_only` records due now, by rank: changes no batch carried,
    /// and heartbeats.
    pub fn due(&mut self, now: Instant) -> Vec<(u32, Record)> {
        let mut due = Vec::new();
        for (rank, record) in self.ranks.iter_mut().enumerate() {
            let Some(reading) = &record.reading else {
                continue;
            };
            if !record.unsent_change && record.next_heartbeat.is_none_or(|at| at > now) {
                continue;
            }
            // A heartbeat keeps its cadence however late the drain woke for
            // it: late wakes must not stretch every later gap past the
            // router's load monitor interval.
            let next = match record.next_heartbeat {
                Some(at) if !record.unsent_change && now < at + self.heartbeat => {
                    at + self.heartbeat
                }
                _ => now + self.heartbeat,
            };
            record.unsent_change = false;
            record.next_heartbeat = Some(next);
            due.push((rank as u32, reading.clone()));
        }
        due.into_iter()
            .map(|(rank, reading)| {
                let record = self.stamp(reading.load, reading.taken_at, reading.source, now, true);
                (rank, record)
            })
            .collect()
    }

    /// Which source fed each rank's latest reading (index = rank).
    pub fn sources(&self) -> impl Iterator<Item = Option<LoadSource>> + '_ {
        (0..self.ranks.len() as u32).map(|rank| self.source(rank))
    }

    /// Which source fed `rank`'s latest reading, if it has one.
    pub fn source(&self, rank: u32) -> Option<LoadSource> {
        let record = self.ranks.get(rank as usize)?;
        record.reading.as_ref().map(|reading| reading.source)
    }

    fn stamp(
        &mut self,
        mut load: EngineLoad,
        taken_at: Instant,
        source: LoadSource,
        now: Instant,
        load_only: bool,
    ) -> Record {
        load.age_ms =
            u32::try_from(now.saturating_duration_since(taken_at).as_millis()).unwrap_or(u32::MAX);
        load.sample = self.next_sample;
        self.next_sample += 1;
        load.load_only = load_only;
        Record { load, source }
    }
}

/// Whether two readings agree on every field a router balances on.
fn same_core(a: &EngineLoad, b: &EngineLoad) -> bool {
    a.running_requests == b.running_requests
        && a.waiting_requests == b.waiting_requests
        && a.waiting_uncached_tokens == b.waiting_uncached_tokens
        && a.token_usage == b.token_usage
        && a.active_token_usage == b.active_token_usage
        && a.gen_throughput == b.gen_throughput
        && a.max_running_requests == b.max_running_requests
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn load(running: u32) -> EngineLoad {
        EngineLoad {
            running_requests: running,
            cache_hit_rate: Some(0.5),
            ..Default::default()
        }
    }

    const HEARTBEAT: Duration = LoadRecords::DEFAULT_HEARTBEAT;

    fn board(loads: &[Option<u32>], taken_at: Instant) -> Board {
        Arc::new(
            loads
                .iter()
                .map(|l| {
                    l.map(|running| Reading {
                        load: load(running),
                        taken_at,
                        source: LoadSource::Poll,
                    })
                })
                .collect(),
        )
    }

    #[test]
    fn a_change_no_batch_carried_goes_out_once_then_heartbeats_every_second_flat() {
        let t0 = Instant::now();
        let (tx, rx) = watch::channel(board(&[None], t0));
        let mut records = LoadRecords::new(rx, HEARTBEAT);
        records.refresh(t0);
        assert!(records.due(t0).is_empty(), "no reading, no record");
        tx.send_replace(board(&[Some(3)], t0));
        records.refresh(t0);
        let first = records.due(t0);
        assert_eq!(first.len(), 1);
        assert!(first[0].1.load.load_only);
        assert_eq!(first[0].1.source, LoadSource::Poll);
        assert_eq!(
            first[0].1.load.cache_hit_rate,
            Some(0.5),
            "load-only batches carry everything"
        );
        assert!(records.due(t0).is_empty(), "sent once");
        let mut at = t0;
        let mut gaps = Vec::new();
        for _ in 0..6 {
            let next = records.ranks[0].next_heartbeat.unwrap();
            assert!(records.due(next - Duration::from_millis(1)).is_empty());
            assert_eq!(records.due(next).len(), 1);
            gaps.push((next - at).as_secs());
            at = next;
        }
        assert_eq!(gaps, vec![1; 6]);
    }

    #[test]
    fn a_late_heartbeat_does_not_delay_the_ones_after_it() {
        let t0 = Instant::now();
        let (_tx, rx) = watch::channel(board(&[Some(1)], t0));
        let mut records = LoadRecords::new(rx, HEARTBEAT);
        records.refresh(t0);
        records.due(t0);
        let late = Duration::from_millis(30);
        assert_eq!(records.due(t0 + HEARTBEAT + late).len(), 1);
        assert!(
            records
                .due(t0 + HEARTBEAT * 2 - Duration::from_millis(1))
                .is_empty()
        );
        assert_eq!(records.due(t0 + HEARTBEAT * 2).len(), 1, "on its cadence");
        // Woken later than a whole interval: the cadence starts again.
        assert_eq!(records.due(t0 + HEARTBEAT * 5).len(), 1);
        assert!(
            records
                .due(t0 + HEARTBEAT * 6 - Duration::from_millis(1))
                .is_empty()
        );
        assert_eq!(records.due(t0 + HEARTBEAT * 6).len(), 1);
    }

    #[test]
    fn the_heartbeat_interval_is_the_one_configured() {
        let t0 = Instant::now();
        let (_tx, rx) = watch::channel(board(&[Some(1)], t0));
        let every = Duration::from_millis(250);
        let mut records = LoadRecords::new(rx, every);
        records.refresh(t0);
        assert_eq!(records.due(t0).len(), 1);
        for beat in 1..=4 {
            let at = t0 + every * beat;
            assert!(records.due(at - Duration::from_millis(1)).is_empty());
            let due = records.due(at);
            assert_eq!(due.len(), 1);
            assert_eq!(due[0].1.load.age_ms, 250 * beat, "aged from the reading");
        }
    }

    #[test]
    fn an_event_batch_carries_the_core_with_a_growing_age_and_spares_the_load_only() {
        let t0 = Instant::now();
        let (_tx, rx) = watch::channel(board(&[Some(1), Some(2)], t0));
        let mut records = LoadRecords::new(rx, HEARTBEAT);
        records.refresh(t0);
        let later = t0 + Duration::from_millis(250);
        let carried = records.for_batch(1, later).unwrap().load;
        assert_eq!(carried.running_requests, 2);
        assert_eq!(carried.age_ms, 250);
        assert!(!carried.load_only);
        assert_eq!(
            carried.cache_hit_rate, None,
            "telemetry rides on load-only batches"
        );
        let due = records.due(later);
        assert_eq!(
            due.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(),
            vec![0]
        );
        assert!(due[0].1.load.sample > carried.sample, "samples only go up");
        assert_eq!(
            records.for_batch(5, later),
            None,
            "a rank kvgate does not serve"
        );
    }

    #[test]
    fn a_fresher_poll_with_the_same_numbers_is_no_change_and_records_stop_when_readings_go() {
        let t0 = Instant::now();
        let (tx, rx) = watch::channel(board(&[Some(1)], t0));
        let mut records = LoadRecords::new(rx, HEARTBEAT);
        records.refresh(t0);
        records.due(t0);
        let t1 = t0 + Duration::from_millis(100);
        tx.send_replace(board(&[Some(1)], t1));
        records.refresh(t1);
        assert!(records.due(t1).is_empty());
        assert_eq!(records.for_batch(0, t1).unwrap().load.age_ms, 0);
        tx.send_replace(board(&[None], t1));
        records.refresh(t1);
        assert_eq!(records.for_batch(0, t1), None);
        assert!(records.due(t1 + HEARTBEAT).is_empty());
    }
}
