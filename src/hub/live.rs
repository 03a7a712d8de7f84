//! What the live channel carries to every subscriber.
//!
//! Invariant: an item never holds a batch's bytes. A published batch is
//! announced by its position and read from the history, so the history
//! alone bounds the memory of published batches, however many subscribers
//! there are and however far behind they fall; a subscriber that stalls
//! holds a few positions, not batches. The one item that carries bytes is a
//! `load_only` batch, about a hundred of them.

use std::sync::Arc;

use super::LoadOnly;

/// One announcement on the live channel, in publication order.
#[derive(Clone, Debug)]
pub enum Live {
    /// A batch is in the history (until it is evicted).
    Published {
        /// Where: its place in the emission order.
        position: u64,
    },
    /// A load record between two batches: tiny, never in the history (see
    /// `hub::load_only`).
    LoadOnly(Arc<LoadOnly>),
}
