//! One subscriber's walk through the stream, by position.
//!
//! A subscription expects one position next and hands out every published
//! position from there in order, each read from the history. Whatever was
//! published before it began is handed out without waiting (the live
//! channel only announces later batches, and an idle engine may send none
//! for a long time); after that, an announcement tells how far the stream
//! has gone. An announcement below the expected position is already
//! delivered (the seam after a replay or snapshot) and changes nothing; one
//! above it after missed announcements is refilled from the history all the
//! same. The same rule gives resume, seam de-duplication and lag refill with
//! no gap and no duplicate; a position the history no longer holds ends the
//! stream. `load_only` items in the live channel
//! are handed on only at the exact position they were published after.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use async_broadcast::{Receiver, RecvError};

use super::cursors::{Cursor, Cursors};
use super::{History, HubReader, Live, LoadOnly, Published};

/// Why a resume cursor cannot be honoured (the call fails with
/// OUT_OF_RANGE), with what would have worked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CursorError {
    /// Some rank-0 batch after it has left the history.
    Behind {
        /// The oldest cursor that can be resumed now; none while rank 0
        /// has no batch left in the history.
        oldest: Option<u64>,
    },
    /// Newer than anything rank 0 was sent.
    Ahead {
        /// Rank 0's newest sequence number.
        newest: u64,
    },
    /// From an earlier kvgate process.
    OtherIncarnation {
        /// Where this process numbered rank 0 from: above anything an
        /// earlier process sent.
        first: u64,
    },
    /// Nothing was sent to rank 0 yet by this kvgate process.
    Empty,
}

impl CursorError {
    /// The OUT_OF_RANGE message: what is wrong with `cursor`, and what
    /// would work.
    pub fn describe(self, cursor: u64) -> String {
        match self {
            Self::Behind {
                oldest: Some(oldest),
            } => format!(
                "start_sequence_number {cursor} is older than kvgate's history: the oldest cursor it can resume is {oldest}; resubscribe with 0 for a snapshot"
            ),
            Self::Behind { oldest: None } => format!(
                "start_sequence_number {cursor} is older than kvgate's history, which holds no batch of rank 0 to resume from; resubscribe with 0 for a snapshot"
            ),
            Self::Ahead { newest } => format!(
                "start_sequence_number {cursor} is newer than anything kvgate sent (rank 0's newest is {newest}); resubscribe with 0 for a snapshot"
            ),
            Self::OtherIncarnation { first } => format!(
                "start_sequence_number {cursor} comes from an earlier kvgate process (this one numbers rank 0 from {first}); resubscribe with 0 for a snapshot"
            ),
            Self::Empty => format!(
                "start_sequence_number {cursor} is unknown: kvgate has sent nothing yet; resubscribe with 0"
            ),
        }
    }
}

/// What the next step of a subscription yields.
#[derive(Debug)]
pub enum Step {
    /// The next batch, in emission order.
    Batch(Arc<Published>),
    /// A rank's load record with no events (never in the history).
    LoadOnly(Arc<LoadOnly>),
    /// The subscriber fell so far behind that the history no longer holds
    /// `position`: the stream must end with DATA_LOSS.
    Lost {
        /// The first position the subscriber missed.
        position: u64,
    },
    /// The hub closed (kvgate is shutting down): end the stream cleanly.
    Closed,
}

/// One subscriber's walk through the batches, by position.
pub struct Subscription {
    live: Receiver<Live>,
    hub: HubReader,
    /// The position handed out next, shared with the lag metric.
    next_position: Cursor,
    /// Every position up to this one is known to be published.
    published_through: u64,
    /// The subscriber takes `load_only` batches numbered 0 before a rank's
    /// first batch (`load_records_before_first_batch`).
    early_load_records: bool,
}

impl Subscription {
    /// Everything after rank 0's batch `cursor`, then live.
    pub fn resume(hub: &HubReader, cursor: u64) -> Result<Self, CursorError> {
        // Subscribe before reading the history so nothing published in
        // between can be missed; the position rule drops the overlap.
        let live = hub.subscribe_live();
        let position = locate(hub.history(), cursor)?;
        Ok(Self::at(hub, live, position + 1))
    }

    /// Everything after `position` (a snapshot's cut); `live` must have been
    /// subscribed before the cut was taken.
    pub fn after_cut(hub: &HubReader, live: Receiver<Live>, position: u64) -> Self {
        Self::at(hub, live, position + 1)
    }

    fn at(hub: &HubReader, live: Receiver<Live>, next_position: u64) -> Self {
        Self {
            live,
            hub: hub.clone(),
            next_position: Cursors::open(hub.cursors(), next_position),
            published_through: hub.history().newest(),
            early_load_records: false,
        }
    }

    /// Also hand on `load_only` batches numbered 0, before a rank's first
    /// batch (the subscriber asked with `load_records_before_first_batch`).
    pub fn with_early_load_records(mut self, wanted: bool) -> Self {
        self.early_load_records = wanted;
        self
    }

    /// The id this subscription's lag is reported under.
    pub fn id(&self) -> u64 {
        self.next_position.id()
    }

    /// The next step of the stream: a batch, a loss, or the end.
    pub async fn next(&mut self) -> Step {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// [`Self::next`] for a caller that polls: the subscriber's response
    /// body, polled by its HTTP/2 stream with no future in between.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Step> {
        loop {
            // Shutting down, a lagging subscriber ends now rather than after
            // its backlog: it resumes from its cursor either way, and every
            // stream must end within the shutdown grace.
            if self.live.is_closed() {
                return Poll::Ready(Step::Closed);
            }
            let position = self.next_position.get();
            if position <= self.published_through {
                return Poll::Ready(match self.hub.published(position) {
                    Some(batch) => {
                        self.next_position.set(position + 1);
                        Step::Batch(batch)
                    }
                    None => Step::Lost { position },
                });
            }
            let published = match ready!(Pin::new(&mut self.live).poll_recv(cx)) {
                Some(Ok(Live::Published { position })) => position,
                Some(Ok(Live::LoadOnly(record))) => {
                    if record.is_for(position, self.early_load_records) {
                        return Poll::Ready(Step::LoadOnly(record));
                    }
                    // Batches this subscriber has not had came before it (a
                    // channel overflow may have taken their announcements):
                    // they come from the history without waiting.
                    record.after_position
                }
                // Whatever the skipped announcements named is published, so
                // the history's newest position is a safe bound.
                Some(Err(RecvError::Overflowed(_))) => self.hub.history().newest(),
                Some(Err(RecvError::Closed)) | None => return Poll::Ready(Step::Closed),
            };
            self.published_through = self.published_through.max(published);
        }
    }
}

/// Where a resume cursor (rank 0's last applied sequence number) stands.
fn locate(history: &History, cursor: u64) -> Result<u64, CursorError> {
    if history.newest() == 0 {
        return Err(CursorError::Empty);
    }
    // Newest first: once a sequence shows as sent, its batch is findable.
    let newest = history.rank0_newest_sequence();
    if let Some(position) = history
        .rank0_position(cursor)
        .or_else(|| history.rank0_just_evicted(cursor))
    {
        return Ok(position);
    }
    let (Some(newest), Some(first)) = (newest, history.rank0_first_sequence()) else {
        return Err(CursorError::Empty);
    };
    if cursor > newest {
        Err(CursorError::Ahead { newest })
    } else if cursor < first {
        Err(CursorError::OtherIncarnation { first })
    } else {
        // Evicted since the lookup above, the cursor can be its own
        // "oldest": that names nothing that works.
        let oldest = history
            .rank0_oldest_resumable()
            .filter(|&oldest| oldest > cursor);
        Err(CursorError::Behind { oldest })
    }
}
