//! The engine's load, pushed by the engine or polled once for every router,
//! and stamped on the stream (contract section 6).
//!
//! `push` reads each rank's load publisher (SGLang's `LoadStat` on its own
//! ZMQ socket, decoded by `stat`); `poller` calls the engine's `GetLoads` on
//! a fixed cadence for the ranks whose push is silent (or for all of them,
//! without a load publisher); both write the latest reading of every rank
//! on one [`board`]. `answer` turns each engine's `GetLoads` answer into
//! `EngineLoad` records, clamping or dropping what does not make sense;
//! `records` is the drain's side: it stamps the latest reading onto every
//! outgoing batch and decides when a `load_only` batch must go out.
//! Invariant: the engine is polled at most once per interval whatever the
//! number of subscribers, never while its pushes are fresh, and a record is
//! never made for a rank kvgate does not serve.

pub(crate) mod answer;
pub mod board;
pub(crate) mod engine;
pub(crate) mod poller;
pub(crate) mod push;
pub mod records;
pub(crate) mod stat;

pub use board::{Board, BoardWriter, LoadSource, Reading};
