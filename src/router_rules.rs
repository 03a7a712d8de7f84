//! The router's rules for admitting batches (contract section 3), as the
//! SMG router keeps them: per-rank cursors, what a batch's number means
//! against them, and how a lost subscription is retried. kvgate follows them
//! wherever it is itself a router: towards an upstream gateway
//! (`source::upstream`), replaying a recording (`source::recorded`) and
//! recording one (`kvgate record`).
//!
//! Invariant: a batch is admitted at most once per incarnation of its
//! rank's numbering: a repeat is stale, a skipped number is a gap (resume
//! from the cursor), and only an ownerless clear, a fresh connection or a
//! far-back number is taken as a restart.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::proto::common::{KvCacheEvent, KvEventBatch};

/// What the router's rules make of one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch of its rank (or the first): forward it.
    Next,
    /// Already applied: drop it.
    Stale,
    /// The upstream started this rank over: clear it, then forward.
    Restart,
    /// Numbers were skipped: resume from the cursor.
    Gap,
    /// A snapshot chunk; `first` is chunk 0 (resync every rank).
    Snapshot {
        /// Chunk 0: every rank starts over.
        first: bool,
    },
    /// A `load_only` batch: no events, admitted to no cursor.
    LoadOnly,
}

/// Per-rank cursors, as a router keeps them.
#[derive(Debug, Default)]
pub struct Cursors {
    last: BTreeMap<i32, u64>,
    /// No batch received yet on the current connection.
    fresh: bool,
}

impl Cursors {
    /// Rank 0's cursor: what to resume from (0 = snapshot).
    pub fn resume_from(&self) -> u64 {
        self.last.get(&0).copied().unwrap_or(0)
    }

    /// A new connection starts: its first batch may be a restart.
    pub fn connected(&mut self) {
        self.fresh = true;
    }

    /// Drops every cursor, as on `OUT_OF_RANGE` or `DATA_LOSS`.
    pub fn forget(&mut self) {
        self.last.clear();
    }

    /// What the rules make of `batch`; the cursor of its rank moves when
    /// it is admitted.
    pub fn admit(&mut self, batch: &KvEventBatch) -> Verdict {
        if batch.load.as_ref().is_some_and(|load| load.load_only) {
            return Verdict::LoadOnly;
        }
        let fresh = std::mem::replace(&mut self.fresh, false);
        let rank = batch.dp_rank.unwrap_or(0);
        let seq = batch.sequence_number;
        if let Some(chunk) = &batch.snapshot {
            self.last.insert(rank, seq);
            return Verdict::Snapshot {
                first: chunk.index == 0,
            };
        }
        let verdict = match self.last.get(&rank).copied() {
            None => Verdict::Next,
            Some(last) if seq == last + 1 => Verdict::Next,
            Some(last) if seq == last => Verdict::Stale,
            Some(last) if seq < last => {
                let restart = batch.events.iter().any(KvCacheEvent::is_ownerless_clear)
                    || fresh
                    || seq <= 1
                    || seq + 1024 <= last;
                if restart {
                    Verdict::Restart
                } else {
                    Verdict::Stale
                }
            }
            Some(_) => Verdict::Gap,
        };
        if matches!(verdict, Verdict::Next | Verdict::Restart) {
            self.last.insert(rank, seq);
        }
        verdict
    }
}

/// The pause before the first retry of a lost subscription; it doubles up
/// to [`MAX_BACKOFF`] (kvgate's upstream source and the recorder).
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(100);
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::{KvCacheCleared, KvSnapshotChunk, kv_cache_event::Data};

    fn batch(rank: i32, seq: u64) -> KvEventBatch {
        KvEventBatch {
            sequence_number: seq,
            dp_rank: Some(rank),
            ..Default::default()
        }
    }

    #[test]
    fn batches_are_admitted_by_the_routers_rules() {
        let mut cursors = Cursors::default();
        cursors.connected();
        assert_eq!(cursors.admit(&batch(0, 100)), Verdict::Next);
        assert_eq!(cursors.admit(&batch(0, 101)), Verdict::Next);
        assert_eq!(cursors.admit(&batch(0, 101)), Verdict::Stale);
        assert_eq!(
            cursors.admit(&batch(0, 99)),
            Verdict::Stale,
            "old, not a restart"
        );
        assert_eq!(cursors.admit(&batch(0, 103)), Verdict::Gap);
        assert_eq!(cursors.admit(&batch(1, 7)), Verdict::Next);
        assert_eq!(cursors.resume_from(), 101);
        let mut clear = batch(0, 50);
        clear.events.push(KvCacheEvent {
            event_id: 0,
            data: Some(Data::Cleared(KvCacheCleared::default())),
        });
        assert_eq!(cursors.admit(&clear), Verdict::Restart);
        assert_eq!(cursors.resume_from(), 50);
    }

    #[test]
    fn a_load_only_batch_moves_no_cursor_and_is_not_forwarded() {
        let mut cursors = Cursors::default();
        cursors.connected();
        let mut heartbeat = batch(0, 0);
        heartbeat.load = Some(crate::proto::common::EngineLoad {
            load_only: true,
            ..Default::default()
        });
        assert_eq!(cursors.admit(&heartbeat), Verdict::LoadOnly);
        assert_eq!(cursors.resume_from(), 0);
        cursors.admit(&batch(0, 100));
        cursors.connected();
        assert_eq!(cursors.admit(&heartbeat), Verdict::LoadOnly);
        assert_eq!(
            cursors.admit(&batch(0, 90)),
            Verdict::Restart,
            "still the connection's first real batch"
        );
    }

    #[test]
    fn an_old_batch_first_on_a_fresh_connection_is_a_restart() {
        let mut cursors = Cursors::default();
        cursors.connected();
        cursors.admit(&batch(0, 100));
        cursors.connected();
        assert_eq!(cursors.admit(&batch(0, 90)), Verdict::Restart);
    }

    #[test]
    fn a_snapshot_sets_the_cursor_of_its_rank_and_chunk_0_resyncs() {
        let mut cursors = Cursors::default();
        let mut chunk = batch(1, 40);
        chunk.snapshot = Some(KvSnapshotChunk {
            index: 0,
            count: 2,
            ..Default::default()
        });
        assert_eq!(cursors.admit(&chunk), Verdict::Snapshot { first: true });
        chunk.snapshot.as_mut().unwrap().index = 1;
        chunk.sequence_number = 41;
        assert_eq!(cursors.admit(&chunk), Verdict::Snapshot { first: false });
        assert_eq!(cursors.admit(&batch(1, 42)), Verdict::Next);
    }
}
