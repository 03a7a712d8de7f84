//! The board: the latest reading of each rank kvgate serves, and where it
//! came from (the engine's own push, or a `GetLoads` poll).
//!
//! Writers are the push receivers (one per rank) and the poller; the drain
//! reads it through a watch channel. Invariant: push first, poll as
//! fallback. A poll never replaces a rank's pushed reading while that rank's
//! push is fresh (younger than the stale interval), and a rank whose push is
//! expected is not due for a poll until the stale interval has passed
//! without one, from the start on; a push always replaces whatever the rank
//! held.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::proto::common::EngineLoad;

/// Where a reading came from (the `source` label of
/// `kvgate_load_records_sent_total`, and `/status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadSource {
    /// The engine's load publisher (`--zmq-load-endpoint`).
    Push,
    /// The engine's `GetLoads` (`--engine-grpc`).
    Poll,
}

impl LoadSource {
    /// Every source, in label order.
    pub const ALL: [Self; 2] = [Self::Push, Self::Poll];

    /// The label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Push => "push",
            Self::Poll => "poll",
        }
    }
}

/// One rank's load as the engine last reported it.
#[derive(Clone, Debug, PartialEq)]
pub struct Reading {
    /// Every field the engine reported; `age_ms`, `sample` and `load_only`
    /// are left at their defaults (they are stamped per batch).
    pub load: EngineLoad,
    /// When the poll behind it was sent, or the push arrived: records
    /// stamped from it show their age from then.
    pub taken_at: Instant,
    /// Pushed by the engine or polled.
    pub source: LoadSource,
}

/// The latest reading of each rank (index = rank), `None` where there is
/// none: before the first one, and for polled ranks once polling is off.
pub type Board = Arc<Vec<Option<Reading>>>;

/// The writing side of the board, shared by the push receivers and the
/// poller.
#[derive(Clone, Debug)]
pub struct BoardWriter {
    board: watch::Sender<Board>,
    /// With pushes configured: how long a rank's push may be silent before
    /// the poller takes over, and when kvgate started listening.
    push: Option<PushExpected>,
}

#[derive(Clone, Copy, Debug)]
struct PushExpected {
    stale: Duration,
    since: Instant,
}

impl BoardWriter {
    /// A board of `ranks` ranks with no reading; `push_stale` when the
    /// engine pushes its load. Returns the drain's side with it.
    pub fn new(ranks: u32, push_stale: Option<Duration>) -> (Self, watch::Receiver<Board>) {
        let (board, feed) = watch::channel(Arc::new(vec![None; ranks as usize]));
        let push = push_stale.map(|stale| PushExpected {
            stale,
            since: Instant::now(),
        });
        (Self { board, push }, feed)
    }

    /// The ranks on the board.
    pub fn ranks(&self) -> u32 {
        self.board.borrow().len() as u32
    }

    /// Rank `rank`'s engine pushed `load`, arriving at `at`.
    pub fn pushed(&self, rank: u32, load: EngineLoad, at: Instant) {
        self.board.send_modify(|board| {
            if let Some(slot) = Arc::make_mut(board).get_mut(rank as usize) {
                *slot = Some(Reading {
                    load,
                    taken_at: at,
                    source: LoadSource::Push,
                });
            }
        });
    }

    /// Whether any rank is due for a poll at `now`.
    pub fn any_due_for_poll(&self, now: Instant) -> bool {
        self.board
            .borrow()
            .iter()
            .any(|reading| self.due_for_poll(reading.as_ref(), now))
    }

    /// Takes a poll's answer (sent at `polled_at`, one entry per rank) for
    /// every rank due for a poll now; a rank the answer left out keeps its
    /// reading, which ages.
    pub fn polled(&self, answer: Vec<Option<EngineLoad>>, polled_at: Instant) {
        let now = Instant::now();
        self.board.send_modify(|board| {
            let board = Arc::make_mut(board);
            for (slot, load) in board.iter_mut().zip(answer) {
                if let Some(load) = load.filter(|_| self.due_for_poll(slot.as_ref(), now)) {
                    *slot = Some(Reading {
                        load,
                        taken_at: polled_at,
                        source: LoadSource::Poll,
                    });
                }
            }
        });
    }

    /// The engine serves no `GetLoads`: polled readings go, pushed ones stay.
    pub fn polling_off(&self) {
        self.board.send_modify(|board| {
            for slot in Arc::make_mut(board) {
                if slot
                    .as_ref()
                    .is_some_and(|reading| reading.source == LoadSource::Poll)
                {
                    *slot = None;
                }
            }
        });
    }

    fn due_for_poll(&self, reading: Option<&Reading>, now: Instant) -> bool {
        let Some(push) = self.push else {
            return true;
        };
        let last_push = match reading {
            Some(reading) if reading.source == LoadSource::Push => reading.taken_at,
            Some(_) => return true,
            None => push.since,
        };
        now.saturating_duration_since(last_push) > push.stale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(running: u32) -> EngineLoad {
        EngineLoad {
            running_requests: running,
            ..EngineLoad::default()
        }
    }

    fn running(feed: &watch::Receiver<Board>) -> Vec<Option<(u32, LoadSource)>> {
        feed.borrow()
            .iter()
            .map(|r| r.as_ref().map(|r| (r.load.running_requests, r.source)))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_poll_fills_in_only_for_ranks_whose_push_is_stale_and_a_push_takes_over_again() {
        let stale = Duration::from_millis(3000);
        let (board, feed) = BoardWriter::new(2, Some(stale));
        let t0 = Instant::now();
        assert!(
            !board.any_due_for_poll(t0 + stale),
            "pushes get the stale interval from the start"
        );
        board.pushed(0, load(1), t0 + stale);
        let later = t0 + stale + Duration::from_millis(1);
        assert!(board.any_due_for_poll(later), "rank 1 never pushed");
        tokio::time::advance(stale + Duration::from_millis(1)).await;
        board.polled(vec![Some(load(8)), Some(load(9))], later);
        assert_eq!(
            running(&feed),
            [Some((1, LoadSource::Push)), Some((9, LoadSource::Poll))]
        );
        board.pushed(1, load(2), later);
        assert!(!board.any_due_for_poll(later));
        board.polling_off();
        assert_eq!(
            running(&feed),
            [Some((1, LoadSource::Push)), Some((2, LoadSource::Push))]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_pushes_every_rank_is_always_due_for_a_poll() {
        let (board, feed) = BoardWriter::new(1, None);
        assert!(board.any_due_for_poll(Instant::now()));
        board.polled(vec![Some(load(4))], Instant::now());
        assert_eq!(running(&feed), [Some((4, LoadSource::Poll))]);
        board.polling_off();
        assert_eq!(running(&feed), [None]);
    }
}
