//! The hub between the drain and the subscribers: live broadcast, history
//! and (through the drain) state snapshots.
//!
//! Invariant: the drain is the only writer. It appends each batch to the
//! history and then broadcasts the same `Arc`, so serving N subscribers costs
//! the drain one history store and one channel push per batch, whatever N.
//! A subscriber that falls behind loses channel items, never blocks the drain,
//! and refills from the history by position.

pub mod batch;
pub mod cow_map;
pub mod history;
pub mod load_only;
pub mod snapshot;
pub mod state;
pub mod subscription;
pub mod wire;

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_broadcast::{InactiveReceiver, Receiver, Sender};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

pub use batch::{Batch, OpenBatch};
pub use history::{History, HistoryLimits, HistoryWriter};
pub use load_only::LoadOnly;

/// What the live channel carries.
#[derive(Clone, Debug)]
pub enum LiveItem {
    /// A batch, also in the history.
    Batch(Arc<Batch>),
    /// A load record between two batches (see [`load_only`]).
    LoadOnly(Arc<LoadOnly>),
}
pub use snapshot::SnapshotCut;

/// A subscriber asking the drain for a snapshot cut.
pub struct CutRequest(oneshot::Sender<SnapshotCut>);

impl CutRequest {
    /// Hands the cut to the subscriber that asked (if it is still there).
    pub fn answer(self, cut: SnapshotCut) {
        let _ = self.0.send(cut);
    }
}

/// One rank as the drain last reported it (for `/status` and metrics).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RankReport {
    pub rank: u32,
    pub last_sequence: u64,
    /// Live blocks (copies counted) per tier: device, host, disk, external.
    pub blocks: [u64; 4],
}

/// Snapshot requests that may wait for the drain at once.
const CUT_REQUEST_QUEUE: usize = 64;

/// The drain's side of the hub.
pub struct HubWriter {
    live: Sender<LiveItem>,
    history: HistoryWriter,
    next_position: u64,
    cut_requests: mpsc::Receiver<CutRequest>,
    reports: Arc<ArcSwap<Vec<RankReport>>>,
}

/// The serving side of the hub; cheap to clone, one per subscriber.
#[derive(Clone)]
pub struct HubReader {
    /// Keeps the channel open while nobody listens; activated per subscriber.
    live: InactiveReceiver<LiveItem>,
    history: Arc<History>,
    cut_requests: mpsc::Sender<CutRequest>,
    reports: Arc<ArcSwap<Vec<RankReport>>>,
}

/// Creates a hub whose live channel holds `live_capacity` batches.
pub fn hub(live_capacity: usize, limits: HistoryLimits) -> (HubWriter, HubReader) {
    let (mut live, receiver) = async_broadcast::broadcast(live_capacity.max(1));
    live.set_overflow(true);
    live.set_await_active(false);
    let history = HistoryWriter::new(limits);
    let (cut_sender, cut_requests) = mpsc::channel(CUT_REQUEST_QUEUE);
    let reports = Arc::<ArcSwap<Vec<RankReport>>>::default();
    let reader = HubReader {
        reports: Arc::clone(&reports),
        live: receiver.deactivate(),
        history: history.reader(),
        cut_requests: cut_sender,
    };
    let writer = HubWriter {
        live,
        history,
        next_position: 1,
        cut_requests,
        reports,
    };
    (writer, reader)
}

impl HubWriter {
    /// The position the next published batch will take.
    pub fn next_position(&self) -> u64 {
        self.next_position
    }

    /// The next snapshot request; pending forever once no reader is left.
    pub async fn next_cut_request(&mut self) -> CutRequest {
        match self.cut_requests.recv().await {
            Some(request) => request,
            None => std::future::pending().await,
        }
    }

    /// Publishes an encoded batch to the history and every subscriber.
    pub fn publish(&mut self, rank: u32, sequence: u64, event_count: u32, encoded: bytes::Bytes) {
        let batch = Arc::new(Batch {
            position: self.next_position,
            rank,
            sequence,
            event_count,
            encoded,
        });
        self.next_position += 1;
        self.history.push(Arc::clone(&batch));
        // Overflow mode never reports Full, and the inactive receiver keeps
        // the channel open, so this cannot fail while the hub exists.
        let _ = self.live.try_broadcast(LiveItem::Batch(batch));
    }

    /// Offers a `load_only` batch to the subscribers that are caught up.
    /// `before_first_batch`: it is numbered 0, its rank having had no batch.
    pub fn publish_load_only(&mut self, before_first_batch: bool, encoded: bytes::Bytes) {
        let item = LoadOnly {
            after_position: self.next_position - 1,
            before_first_batch,
            encoded,
        };
        let _ = self.live.try_broadcast(LiveItem::LoadOnly(Arc::new(item)));
    }

    /// Replaces what `/status` shows of each rank.
    pub fn report(&self, reports: Vec<RankReport>) {
        self.reports.store(Arc::new(reports));
    }

    /// Bytes the history currently holds.
    pub fn history_bytes(&self) -> usize {
        self.history.bytes()
    }

    /// Ends every subscriber's stream cleanly (kvgate is shutting down).
    pub fn close(&self) {
        self.live.close();
    }
}

impl HubReader {
    /// A receiver of every batch published from now on.
    pub fn subscribe_live(&self) -> Receiver<LiveItem> {
        self.live.activate_cloned()
    }

    pub fn history(&self) -> &History {
        &self.history
    }

    /// Each rank as the drain last reported it.
    pub fn rank_reports(&self) -> Vec<RankReport> {
        self.reports.load().as_ref().clone()
    }

    /// Asks the drain for a cut of the state; `None` once the drain is gone.
    pub async fn cut(&self) -> Option<SnapshotCut> {
        let (reply, cut) = oneshot::channel();
        self.cut_requests.send(CutRequest(reply)).await.ok()?;
        cut.await.ok()
    }
}
