//! `load_only` batches: a rank's load record with no events, encoded once by
//! the drain and offered to the subscribers that are caught up.
//!
//! Invariant: a load-only batch takes no position, never enters the history
//! and is admitted to no cursor by a router: it repeats the last sequence
//! number sent for its rank (0 before the rank's first batch, and then only
//! for subscribers that asked for records before the first batch). A
//! subscriber gets it only if it has been handed every batch published
//! before it and nothing after (so its `sample` follows the last one it
//! saw); one that is catching up skips it, the batches ahead carry newer
//! records anyway.

use bytes::Bytes;

use super::published::{PREFIX_BYTES, frame};

#[derive(Debug)]
/// A `load_only` batch, encoded and framed once for every subscriber that
/// takes it.
pub struct LoadOnly {
    /// The position of the last batch published before it.
    pub after_position: u64,
    /// Numbered 0: the rank has had no batch yet.
    pub before_first_batch: bool,
    /// The encoded `KvEventBatch` (a slice of `framed`).
    pub encoded: Bytes,
    framed: Bytes,
}

impl LoadOnly {
    /// The `encoded` record published after `after_position`, framed.
    pub fn new(after_position: u64, before_first_batch: bool, encoded: &[u8]) -> Self {
        let framed = frame(encoded);
        Self {
            after_position,
            before_first_batch,
            encoded: framed.slice(PREFIX_BYTES..),
            framed,
        }
    }

    /// The record as one gRPC message: prefix and bytes.
    pub fn framed(&self) -> &Bytes {
        &self.framed
    }

    /// Whether a subscriber whose next position is `next_position` gets it.
    pub fn is_for(&self, next_position: u64, wants_records_before_first_batch: bool) -> bool {
        self.after_position + 1 == next_position
            && (!self.before_first_batch || wants_records_before_first_batch)
    }
}
