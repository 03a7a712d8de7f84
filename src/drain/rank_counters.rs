//! One rank's conversion counters, resolved once.
//!
//! Invariant: the drain adds to counters it already holds; a label is
//! looked up when a rank first appears, never per message.

use prometheus_client::metrics::counter::Counter;

use crate::convert::{DropReason, EventKind, Tally};
use crate::metrics::Metrics;

/// The `engine_events` type of events a normalization rule dropped.
pub const DROPPED_EVENTS: &str = "dropped";

#[derive(Clone, Debug)]
pub(super) struct RankCounters {
    /// Forwarded events, in `EventKind::ALL` order.
    forwarded: [Counter; EventKind::ALL.len()],
    dropped: Counter,
}

impl RankCounters {
    pub(super) fn new(metrics: &Metrics, rank: u32) -> Self {
        Self {
            forwarded: EventKind::ALL.map(|kind| metrics.rank_events(rank, kind.as_str())),
            dropped: metrics.rank_events(rank, DROPPED_EVENTS),
        }
    }

    /// Adds one message's conversion counts; drops are also counted by
    /// reason (rare, so looked up then).
    pub(super) fn record(&self, tally: &Tally, metrics: &Metrics) {
        for (kind, counter) in EventKind::ALL.into_iter().zip(&self.forwarded) {
            let forwarded = tally.forwarded(kind);
            if forwarded > 0 {
                counter.inc_by(forwarded);
            }
        }
        for reason in DropReason::ALL {
            let dropped = tally.dropped(reason);
            if dropped > 0 {
                self.dropped.inc_by(dropped);
                metrics.count_dropped_events(reason.as_str(), dropped);
            }
        }
    }
}
