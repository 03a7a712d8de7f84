//! One subscriber's walk through the stream, by position.
//!
//! A subscription expects one position next. Whatever was published before
//! it began comes from the history (the live channel only carries later
//! batches, and an idle engine may send none for a long time). Live batches
//! below the expected position are already delivered (the seam after a
//! replay or snapshot) and are skipped; a live batch above it means the
//! subscriber fell behind, and the missing positions come from the history
//! first. The same rule gives resume, seam de-duplication and lag refill
//! with no gap and no duplicate. `load_only` batches in the live channel are
//! handed on only at the exact position they were published after.

use std::sync::Arc;

use async_broadcast::{Receiver, RecvError};

use super::{Batch, History, HubReader, LiveItem, LoadOnly};

/// Why a resume cursor cannot be honoured (the call fails with OUT_OF_RANGE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CursorError {
    /// Some batch after it has left the history, or from an earlier kvgate
    /// process (whose numbers are all below this one's).
    Behind,
    /// Newer than anything rank 0 was sent.
    Ahead,
    /// Nothing was sent yet by this kvgate process.
    Empty,
}

impl CursorError {
    pub fn describe(self, cursor: u64) -> String {
        match self {
            Self::Behind => format!(
                "start_sequence_number {cursor} is older than kvgate's history; resubscribe with 0 for a snapshot"
            ),
            Self::Ahead => format!(
                "start_sequence_number {cursor} is newer than anything kvgate sent; resubscribe with 0 for a snapshot"
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
    Batch(Arc<Batch>),
    /// A rank's load record with no events (never in the history).
    LoadOnly(Arc<LoadOnly>),
    /// The subscriber fell so far behind that the history no longer holds
    /// `position`: the stream must end with DATA_LOSS.
    Lost {
        position: u64,
    },
    /// The hub closed (kvgate is shutting down): end the stream cleanly.
    Closed,
}

pub struct Subscription {
    live: Receiver<LiveItem>,
    history: HubReader,
    next_position: u64,
    /// A live batch ahead of `next_position`, held until the gap before it
    /// is refilled from the history.
    held: Option<Arc<Batch>>,
    /// The newest position when the subscription began, or that a
    /// `load_only` item showed was published: up to it, batches come from
    /// the history without waiting for a live one.
    replay_through: u64,
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
    pub fn after_cut(hub: &HubReader, live: Receiver<LiveItem>, position: u64) -> Self {
        Self::at(hub, live, position + 1)
    }

    fn at(hub: &HubReader, live: Receiver<LiveItem>, next_position: u64) -> Self {
        Self {
            live,
            history: hub.clone(),
            next_position,
            held: None,
            replay_through: hub.history().newest(),
            early_load_records: false,
        }
    }

    /// Also hand on `load_only` batches numbered 0, before a rank's first
    /// batch (the subscriber asked with `load_records_before_first_batch`).
    pub fn with_early_load_records(mut self, wanted: bool) -> Self {
        self.early_load_records = wanted;
        self
    }

    /// How many batches the live channel holds for this subscriber.
    pub fn backlog(&self) -> usize {
        self.live.len()
    }

    /// Batches published that this subscriber has not been handed yet.
    pub fn lag(&self) -> u64 {
        (self.history.history().newest() + 1).saturating_sub(self.next_position)
    }

    pub async fn next(&mut self) -> Step {
        loop {
            if self.held.is_some() || self.next_position <= self.replay_through {
                let batch = match self
                    .held
                    .take_if(|held| held.position == self.next_position)
                {
                    Some(held) => Some(held),
                    None => self.history.history().get(self.next_position),
                };
                return match batch {
                    Some(batch) => {
                        self.next_position += 1;
                        Step::Batch(batch)
                    }
                    None => Step::Lost {
                        position: self.next_position,
                    },
                };
            }
            match self.live.recv_direct().await {
                Ok(LiveItem::Batch(batch)) if batch.position < self.next_position => continue,
                Ok(LiveItem::Batch(batch)) => self.held = Some(batch),
                Ok(LiveItem::LoadOnly(record)) => {
                    if record.is_for(self.next_position, self.early_load_records) {
                        return Step::LoadOnly(record);
                    }
                    // Batches this subscriber has not had came before it
                    // (a channel overflow may have taken their items): they
                    // come from the history, without waiting for a live one.
                    self.replay_through = self.replay_through.max(record.after_position);
                }
                // The skipped batches are in the history; the next live one
                // reveals how many to refill.
                Err(RecvError::Overflowed(_)) => continue,
                Err(RecvError::Closed) => return Step::Closed,
            }
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
    match newest {
        Some(newest) if cursor > newest => Err(CursorError::Ahead),
        Some(_) => Err(CursorError::Behind),
        None => Err(CursorError::Empty),
    }
}
