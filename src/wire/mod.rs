//! Wire encoding, done once: events into protobuf bytes, events into a
//! `KvEventBatch` (or a snapshot chunk) shared by every subscriber.
//!
//! Invariant: bytes built here decode with any protobuf decoder to exactly
//! the messages given, and no event is encoded twice on its way to a
//! subscriber. The drain and the snapshot encoder are the only callers.

pub mod batch;
pub(crate) mod event;

pub use batch::{Batch, OpenBatch};
pub use event::EncodedBlock;
