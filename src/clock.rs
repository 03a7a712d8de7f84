//! Wall-clock time, read in one place: batch timestamps, recordings' receive
//! times, damaged files' names and the first sequence number of a process
//! incarnation.
//!
//! Invariant: a clock set before 1970 reads as 0 rather than failing; the
//! seed is never 0 (the router reads 0 as "no cursor").

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch, as protobuf batch timestamps carry them.
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs_f64())
        .unwrap_or(0.0)
}

/// Unix microseconds now, as recordings stamp their records (and the
/// state directory names what it sets aside).
pub fn unix_micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The first number of every rank in this process: Unix milliseconds at
/// start × 1000, so a later incarnation starts above anything an earlier one
/// could have reached unless that one averaged over 1000 batches a
/// millisecond on a rank.
pub fn epoch_seed() -> u64 {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as u64)
        .unwrap_or(0);
    millis.saturating_mul(1000).max(1)
}
