//! A worker's feed: what follows one source of a worker into the writer's
//! queue, and what it knows of that source.
//!
//! Two kinds (`zmq.rs`: one rank's engine publisher, as Dynamo's indexer
//! follows it; `sidecar.rs`: a `SubscribeKvEvents` server, every rank of
//! an engine, by the router's rules). Invariant: both report through one
//! [`FeedStatus`], updated by the feed as it happens and read by `/workers`
//! and `/metrics` without waiting on the feed.

mod ipc_path;
pub mod sidecar;
pub mod zmq;

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use crate::metrics::Metrics;

pub use zmq::ZmqFeedConfig;

/// Where a feed is with its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedPhase {
    /// Connecting to the publisher, never connected yet (Dynamo's `pending`).
    Connecting,
    /// Connected, receiving what came before now: a snapshot, or a replay
    /// filling what the publisher sent before or while the feed was away
    /// (Dynamo's `active`: the listener is up).
    CatchingUp,
    /// Connected; messages flow (Dynamo's `active`).
    Connected,
    /// Was connected; the publisher went away, the socket redials (Dynamo's
    /// `pending`).
    Disconnected,
    /// The source stopped and will not come back (Dynamo's `failed`).
    Failed,
}

impl FeedPhase {
    /// Dynamo's name for it.
    pub const fn dynamo_status(self) -> &'static str {
        match self {
            FeedPhase::Connecting | FeedPhase::Disconnected => "pending",
            FeedPhase::CatchingUp | FeedPhase::Connected => "active",
            FeedPhase::Failed => "failed",
        }
    }

    /// kvgate's own name for it.
    pub const fn as_str(self) -> &'static str {
        match self {
            FeedPhase::Connecting => "connecting",
            FeedPhase::CatchingUp => "catching_up",
            FeedPhase::Connected => "connected",
            FeedPhase::Disconnected => "disconnected",
            FeedPhase::Failed => "failed",
        }
    }
}

/// What a feed reports.
#[derive(Clone, Debug)]
pub struct FeedState {
    /// Where it is.
    pub phase: FeedPhase,
    /// When it entered its phase.
    pub since: SystemTime,
    /// Why it failed or disconnected, or (an `ipc://` endpoint) why it is
    /// not connected yet.
    pub error: Option<String>,
    /// Engine payloads converted and applied (a sidecar's batches applied).
    pub payloads: u64,
    /// Payloads the converter refused (a sidecar's batches set aside).
    pub bad_payloads: u64,
    /// Publisher restarts seen, each clearing the rank (a sidecar's ranks
    /// whose numbering started over).
    pub publisher_restarts: u64,
    /// When the last payload (or batch) arrived.
    pub last_payload: Option<SystemTime>,
    /// ZMQ connections dropped because the peer broke ZMTP or the message
    /// size limit (publisher and replay endpoint alike; a sidecar's: 0).
    pub peers_dropped: u64,
    /// A sidecar's subscription, for a `grpc://` worker.
    pub sidecar: Option<SidecarProgress>,
}

/// How a `grpc://` worker's subscription went, by the router's rules.
#[derive(Clone, Debug, Default)]
pub struct SidecarProgress {
    /// Each rank's cursor: the last sequence number admitted.
    pub cursors: BTreeMap<u32, u64>,
    /// Snapshots received (each began with a whole-worker clear).
    pub snapshots: u64,
    /// Calls answered that resumed from a cursor.
    pub resumes: u64,
    /// Cursors the sidecar refused (`OUT_OF_RANGE`, `DATA_LOSS`): each
    /// cleared the worker and called again from 0.
    pub refused_cursors: u64,
    /// Subscriptions lost and called again (after a backoff).
    pub reconnects: u64,
    /// Batches dropped for a rank past the per-worker rank limit.
    pub unknown_ranks: u64,
}

/// A feed's state, shared with whoever reports it.
pub struct FeedStatus {
    state: Mutex<FeedState>,
    /// Where the feed's ZMQ sockets count the peers they drop.
    sockets: OnceLock<Metrics>,
}

impl Default for FeedStatus {
    fn default() -> Self {
        FeedStatus {
            sockets: OnceLock::new(),
            state: Mutex::new(FeedState {
                phase: FeedPhase::Connecting,
                since: SystemTime::now(),
                error: None,
                payloads: 0,
                bad_payloads: 0,
                publisher_restarts: 0,
                last_payload: None,
                peers_dropped: 0,
                sidecar: None,
            }),
        }
    }
}

impl FeedStatus {
    /// A copy of the state now.
    pub fn now(&self) -> FeedState {
        let mut state = self.lock().clone();
        if let Some(sockets) = self.sockets.get() {
            state.peers_dropped = crate::source::peer::all_dropped_peers(sockets);
        }
        state
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FeedState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn enter(&self, phase: FeedPhase, error: Option<String>) {
        let mut state = self.lock();
        if state.phase == phase && state.error == error {
            return;
        }
        state.phase = phase;
        state.since = SystemTime::now();
        state.error = error;
    }

    /// Has [`Self::now`] report the peers dropped as counted in `sockets`
    /// (the feed's ZMQ sockets count there); only the first call counts.
    fn count_peers_in(&self, sockets: Metrics) {
        let _ = self.sockets.set(sockets);
    }

    /// Says why the feed is in its phase, without changing the phase or
    /// since when it is in it.
    fn explain(&self, reason: String) {
        self.lock().error = Some(reason);
    }
}
