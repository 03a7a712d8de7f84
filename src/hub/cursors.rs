//! Where every open subscription stands, readable at any time.
//!
//! Invariant: each live `Subscription` owns one entry holding the position it
//! will hand out next, updated as it advances and removed when it is
//! dropped. Lag is computed from these when metrics are scraped, so a
//! stream that is never polled (its client stopped reading) shows its lag
//! growing instead of the value from its last read.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The next position of every open subscription, by subscription id.
#[derive(Debug, Default)]
pub struct Cursors {
    next_id: AtomicU64,
    open: Mutex<BTreeMap<u64, Arc<AtomicU64>>>,
}

/// One subscription's entry; removed from the table when dropped.
#[derive(Debug)]
pub struct Cursor {
    id: u64,
    next_position: Arc<AtomicU64>,
    table: Arc<Cursors>,
}

impl Cursors {
    /// Registers a subscription that will hand out `next_position` next.
    pub fn open(table: &Arc<Self>, next_position: u64) -> Cursor {
        let id = table.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let next_position = Arc::new(AtomicU64::new(next_position));
        table.lock().insert(id, Arc::clone(&next_position));
        Cursor {
            id,
            next_position,
            table: Arc::clone(table),
        }
    }

    /// (subscription id, batches published and not yet handed to it) of
    /// every open subscription, when `newest` is the newest position.
    pub fn lags(&self, newest: u64) -> Vec<(u64, u64)> {
        self.lock()
            .iter()
            .map(|(&id, next)| {
                let lag = (newest + 1).saturating_sub(next.load(Ordering::Relaxed));
                (id, lag)
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<AtomicU64>>> {
        // The table stays consistent whatever a panicking holder was doing:
        // every operation on it is a single insert, remove or read.
        self.open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Cursor {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn get(&self) -> u64 {
        self.next_position.load(Ordering::Relaxed)
    }

    pub fn set(&self, next_position: u64) {
        self.next_position.store(next_position, Ordering::Relaxed);
    }
}

impl Drop for Cursor {
    fn drop(&mut self) {
        self.table.lock().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_is_read_from_where_each_open_subscription_stands() {
        let table = Arc::new(Cursors::default());
        let first = Cursors::open(&table, 5);
        let second = Cursors::open(&table, 11);
        assert_eq!(table.lags(10), vec![(first.id(), 6), (second.id(), 0)]);
        first.set(9);
        assert_eq!(table.lags(12), vec![(first.id(), 4), (second.id(), 2)]);
        drop(first);
        assert_eq!(table.lags(12), vec![(second.id(), 2)]);
    }
}
