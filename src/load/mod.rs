//! The engine's load, polled once for every router and pushed on the stream
//! (contract section 6).
//!
//! `poller` calls the engine's `GetLoads` on a fixed cadence and publishes
//! one [`Board`] (the latest reading of every rank kvgate serves) on a watch
//! channel; `answer` turns each engine's answer into `EngineLoad` records,
//! clamping or dropping what does not make sense; `records` is the drain's
//! side: it stamps the latest reading onto every outgoing batch and decides
//! when a `load_only` batch must go out. Invariant: the engine is polled once
//! per interval whatever the number of subscribers, and a record is never
//! made for a rank kvgate does not serve.

pub(crate) mod answer;
pub(crate) mod engine;
pub(crate) mod poller;
pub mod records;

use std::sync::Arc;

use tokio::time::Instant;

use crate::proto::common::EngineLoad;

/// One rank's load as the engine last answered it.
#[derive(Clone, Debug, PartialEq)]
pub struct Reading {
    /// Every field the engine reported; `age_ms`, `sample` and `load_only`
    /// are left at their defaults (they are stamped per batch).
    pub load: EngineLoad,
    /// When the poll behind it was sent.
    pub polled_at: Instant,
}

/// The latest reading of each rank (index = rank), `None` where there is
/// none: before the first answer, and for every rank once records are off.
pub type Board = Arc<Vec<Option<Reading>>>;

/// A board with no reading for any of `ranks`.
pub fn empty_board(ranks: u32) -> Board {
    Arc::new(vec![None; ranks as usize])
}
