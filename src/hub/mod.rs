//! The hub between the drain and the subscribers: live broadcast, history,
//! subscriptions, and the way to ask the drain for a snapshot cut.
//!
//! Invariant: the drain is the only writer. It appends each batch to the
//! history and then announces its position on the live channel, so serving
//! N subscribers costs the drain one history store and one channel push per
//! batch, whatever N. Published batches are held, for every subscriber at
//! once, by the history and by the live window (the newest
//! `live_capacity` batches within the history's byte limit, which keeps a
//! burst readable when the history is short); nothing else holds one, so a
//! subscriber that stalls pins no batch. A subscriber that falls behind
//! loses channel items, never blocks the drain, and refills by position.

pub(crate) mod cursors;
pub(crate) mod history;
pub(crate) mod live;
pub(crate) mod load_only;
pub mod published;
pub mod subscription;

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_broadcast::{InactiveReceiver, Receiver, Sender};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use crate::state::snapshot::SnapshotCut;
use crate::state::tier::TierCounts;
use crate::wire::Batch;

pub use cursors::Cursors;
pub use history::{History, HistoryLimits, HistoryWriter};
pub use live::Live;
pub use load_only::LoadOnly;
pub use published::{FramedBatch, Published};

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
    /// The data-parallel rank.
    pub rank: u32,
    /// The last sequence number sent for it (0 before its first batch).
    pub last_sequence: u64,
    /// Live blocks (copies counted) per tier; `/status` shows the reported
    /// tiers by name.
    #[serde(serialize_with = "blocks_by_tier_name")]
    pub blocks: TierCounts,
    /// Where the rank's latest load reading came from (`push` or `poll`),
    /// while load records are on and the rank has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_source: Option<&'static str>,
}

fn blocks_by_tier_name<S: serde::Serializer>(
    blocks: &TierCounts,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(blocks.reported())
}

/// Snapshot requests that may wait for the drain at once.
const CUT_REQUEST_QUEUE: usize = 64;

/// The drain's side of the hub.
pub struct HubWriter {
    live: Sender<Live>,
    history: HistoryWriter,
    live_window: HistoryWriter,
    next_position: u64,
    cut_requests: mpsc::Receiver<CutRequest>,
    reports: Arc<ArcSwap<Vec<RankReport>>>,
}

/// The serving side of the hub; cheap to clone, one per subscriber.
#[derive(Clone)]
pub struct HubReader {
    /// Keeps the channel open while nobody listens; activated per subscriber.
    live: InactiveReceiver<Live>,
    history: Arc<History>,
    live_window: Arc<History>,
    /// Where every open subscription stands (lag is read from it).
    cursors: Arc<Cursors>,
    cut_requests: mpsc::Sender<CutRequest>,
    reports: Arc<ArcSwap<Vec<RankReport>>>,
}

/// Creates a hub whose live channel holds `live_capacity` announcements.
pub fn hub(live_capacity: usize, limits: HistoryLimits) -> (HubWriter, HubReader) {
    let (mut live, receiver) = async_broadcast::broadcast(live_capacity.max(1));
    live.set_overflow(true);
    live.set_await_active(false);
    let history = HistoryWriter::new(limits);
    let live_window = HistoryWriter::new(HistoryLimits {
        batches: live_capacity,
        bytes: limits.bytes,
    });
    let (cut_sender, cut_requests) = mpsc::channel(CUT_REQUEST_QUEUE);
    let reports = Arc::<ArcSwap<Vec<RankReport>>>::default();
    let reader = HubReader {
        reports: Arc::clone(&reports),
        live: receiver.deactivate(),
        history: history.reader(),
        live_window: live_window.reader(),
        cursors: Arc::default(),
        cut_requests: cut_sender,
    };
    let writer = HubWriter {
        live,
        history,
        live_window,
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

    /// Puts back what a state directory kept: `history` (consecutive
    /// positions, oldest first) and the position the next batch takes.
    /// Only before the first batch is published.
    pub(crate) fn restore(&mut self, next_position: u64, history: Vec<Arc<Batch>>) {
        // Framed one by one, each restored batch let go once copied: the
        // history is not held twice.
        let history = history.into_iter().map(|batch| {
            Arc::new(Published::new(
                batch.position,
                batch.rank,
                batch.sequence,
                FramedBatch::new(&batch.encoded),
            ))
        });
        debug_assert_eq!(self.next_position, 1, "restored before publishing");
        let mut history = history.peekable();
        let first = history.peek().map_or(next_position, |batch| batch.position);
        self.history.start_at(first);
        self.live_window.start_at(first);
        for batch in history {
            self.history.push(Arc::clone(&batch));
            self.live_window.push(batch);
        }
        self.history.start_at(next_position);
        self.live_window.start_at(next_position);
        self.next_position = next_position;
    }

    /// The oldest position the history holds.
    pub fn history_oldest(&self) -> u64 {
        self.history.reader().oldest()
    }

    /// The next snapshot request; pending forever once no reader is left.
    pub async fn next_cut_request(&mut self) -> CutRequest {
        match self.cut_requests.recv().await {
            Some(request) => request,
            None => std::future::pending().await,
        }
    }

    /// Publishes a framed batch to the history and every subscriber.
    pub fn publish(&mut self, rank: u32, sequence: u64, framed: FramedBatch) {
        let position = self.next_position;
        let batch = Arc::new(Published::new(position, rank, sequence, framed));
        self.next_position += 1;
        self.history.push(Arc::clone(&batch));
        self.live_window.push(batch);
        // Overflow mode never reports Full, and the inactive receiver keeps
        // the channel open, so this cannot fail while the hub exists.
        let _ = self.live.try_broadcast(Live::Published { position });
    }

    /// Offers a `load_only` batch to the subscribers that are caught up.
    /// `before_first_batch`: it is numbered 0, its rank having had no batch.
    pub fn publish_load_only(&mut self, before_first_batch: bool, encoded: bytes::Bytes) {
        let item = LoadOnly::new(self.next_position - 1, before_first_batch, &encoded);
        let _ = self.live.try_broadcast(Live::LoadOnly(Arc::new(item)));
    }

    /// Replaces what `/status` shows of each rank; returns what it showed
    /// before, for the caller to refill once no reader holds it.
    pub fn report(&self, reports: Arc<Vec<RankReport>>) -> Arc<Vec<RankReport>> {
        self.reports.swap(reports)
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
    /// A receiver of every announcement from now on.
    pub fn subscribe_live(&self) -> Receiver<Live> {
        self.live.activate_cloned()
    }

    /// The batch at `position`, while the history or the live window
    /// holds it.
    pub fn published(&self, position: u64) -> Option<Arc<Published>> {
        self.history
            .get(position)
            .or_else(|| self.live_window.get(position))
    }

    /// Where every open subscription stands.
    pub fn cursors(&self) -> &Arc<Cursors> {
        &self.cursors
    }

    /// (subscription id, batches published and not yet handed to it) of
    /// every open subscription, as of now.
    pub fn subscriber_lags(&self) -> Vec<(u64, u64)> {
        self.cursors.lags(self.history.newest())
    }

    /// The recent batches, by position.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// Each rank as the drain last reported it.
    pub fn rank_reports(&self) -> Vec<RankReport> {
        self.reports.load().as_ref().clone()
    }

    /// The reports `/status` shows, held as a reader holds them.
    #[cfg(test)]
    pub(crate) fn shown_reports(&self) -> Arc<Vec<RankReport>> {
        self.reports.load_full()
    }

    /// Asks the drain for a cut of the state; `None` once the drain is gone.
    pub async fn cut(&self) -> Option<SnapshotCut> {
        let (reply, cut) = oneshot::channel();
        self.cut_requests.send(CutRequest(reply)).await.ok()?;
        cut.await.ok()
    }
}
