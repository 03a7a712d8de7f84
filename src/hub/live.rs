//! What the live channel carries to every subscriber.
//!
//! Invariant: an item never holds a batch's bytes. A published batch is
//! announced by its position and read from the history, so the history
//! alone bounds the memory of published batches, however many subscribers
//! there are and however far behind they fall; a subscriber that stalls
//! holds a few positions, not batches.

/// One announcement on the live channel, in publication order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Live {
    /// The batch at `position` is in the history (until it is evicted).
    Published { position: u64 },
}
