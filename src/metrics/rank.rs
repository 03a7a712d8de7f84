//! One rank's engine counters, resolved once.
//!
//! Invariant: the hot path adds to counters it already holds; a label is
//! looked up when a rank first appears, never per message or per cycle.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::labels::ReasonLabel;
use crate::convert::{DropReason, EventKind, Tally};

#[derive(Clone, Debug)]
pub struct RankCounters {
    /// Engine messages accepted from the rank's socket.
    pub messages: Counter,
    /// Forwarded events, in `EventKind::ALL` order.
    pub(super) forwarded: [Counter; EventKind::ALL.len()],
    pub(super) dropped: Counter,
    /// Not per rank; only touched when a rule drops an event.
    pub(super) dropped_by_reason: Family<ReasonLabel, Counter>,
}

impl RankCounters {
    /// Adds one message's conversion counts.
    pub fn record_tally(&self, tally: &Tally) {
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
                self.dropped_by_reason
                    .get_or_create(&ReasonLabel {
                        reason: reason.as_str(),
                    })
                    .inc_by(dropped);
            }
        }
    }
}
