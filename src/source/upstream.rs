//! An upstream `SubscribeKvEvents` server as the event source: TensorRT-LLM's
//! gRPC server (whose own drain is single-consumer) or another kvgate.
//!
//! Invariant: kvgate is one well-behaved router towards the upstream. It
//! admits batches by the router's rules (contract section 3), keeps its own
//! cursor, resumes after a disconnect with backoff, and when the upstream
//! cannot honour the cursor (OUT_OF_RANGE, DATA_LOSS, a gap it cannot
//! resume over) it starts again from 0: the upstream's snapshot then reaches
//! kvgate's own subscribers as a resync, an ownerless clear of every rank
//! followed by the new state, without dropping any of them. The upstream
//! never decides how many ranks kvgate tracks: a batch for a rank outside
//! `0..dp_size` is counted and dropped before it reaches a cursor, a metric
//! series or the drain, as the ZMQ source's one socket per rank guarantees.
//! The same rules feed `kvgate index` from a sidecar (`index::feed::sidecar`):
//! what a subscription does is told to a [`Watcher`], so the drain's metrics
//! and readiness and the index's per-worker status are two watchers of one
//! implementation. A cursor refused is the ownerless clear the router makes
//! of it: a [`SourceEvent::Resync`] before the call from 0, so nothing the
//! refused numbering described outlives it even when the upstream has
//! nothing to send in a snapshot.

use std::collections::BTreeMap;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tracing::{info, warn};

use super::{DrainGone, SourceEvent, send};
use crate::metrics::Metrics;
use crate::proto::common::KvEventBatch;
use crate::router_rules::{Cursors, FIRST_BACKOFF, MAX_BACKOFF, Verdict};

/// The bad-message reason of an upstream batch kvgate cannot decode.
pub(crate) const UNDECODABLE: &str = "upstream_undecodable";

/// The bad-message reason of an upstream batch for a rank outside
/// `0..dp_size` (or a negative one).
pub(crate) const UNKNOWN_RANK: &str = "upstream_unknown_rank";

/// Where the upstream is, with which credentials, and which of its service
/// names to call.
#[derive(Clone)]
pub struct UpstreamConfig {
    pub target: crate::client::Target,
    pub service: String,
    /// The ranks served are `0..dp_size`.
    pub dp_size: u32,
    /// How long a call may wait for the upstream's answer (its headers)
    /// before it is abandoned and retried; `None` waits as long as the
    /// connection lives (an engine's own server may hold its headers until
    /// its first batch).
    pub answer_timeout: Option<std::time::Duration>,
}

/// What the drain gets of a batch admitted with `verdict`: the reset the
/// verdict calls for (a rank's restart, or every rank's for a snapshot's
/// first chunk), then its events stamped `timestamp`. A stale or load-only
/// batch forwards nothing; a gap is the caller's to handle before.
pub(crate) fn forwarded(
    verdict: Verdict,
    batch: KvEventBatch,
    timestamp: f64,
) -> impl Iterator<Item = SourceEvent> {
    let rank = u32::try_from(batch.dp_rank.unwrap_or(0)).unwrap_or(0);
    let (reset, forward) = match verdict {
        Verdict::Stale | Verdict::LoadOnly | Verdict::Gap => (None, false),
        Verdict::Next | Verdict::Snapshot { first: false } => (None, true),
        Verdict::Restart => (Some(SourceEvent::PublisherRestarted { rank }), true),
        Verdict::Snapshot { first: true } => (Some(SourceEvent::Resync), true),
    };
    let events = forward.then(|| SourceEvent::Events {
        rank,
        timestamp,
        events: batch.events,
    });
    reset.into_iter().chain(events)
}

/// What a subscription to an upstream does, told as it happens.
pub(crate) trait Watcher: Send {
    /// A call from `from` (0: a snapshot) was answered: the stream is open.
    fn subscribed(&mut self, from: u64);
    /// The subscription ended; `refused` when the upstream refused the
    /// cursor (`OUT_OF_RANGE`, `DATA_LOSS`) and the next call is from 0.
    fn interrupted(&mut self, why: &Interruption, refused: bool);
    /// A batch of a served rank arrived and the rules gave it `verdict`.
    fn admitted(&mut self, batch: &KvEventBatch, rank: u32, verdict: Verdict);
    /// A batch was set aside for `reason` (a `kvgate_bad_messages_total` reason).
    fn set_aside(&mut self, reason: &'static str, batch_rank: Option<i32>);
}

/// The drain's watcher: readiness, reconnects and per-rank message counts.
pub(crate) struct DrainWatcher {
    metrics: Metrics,
    ready: watch::Sender<bool>,
    upstream: http::Uri,
    dp_size: u32,
    /// Each rank's message counter, resolved at its first batch.
    messages: BTreeMap<u32, prometheus_client::metrics::counter::Counter>,
}

impl DrainWatcher {
    pub(crate) fn new(
        config: &UpstreamConfig,
        metrics: Metrics,
        ready: watch::Sender<bool>,
    ) -> Self {
        DrainWatcher {
            metrics,
            ready,
            upstream: config.target.uri().clone(),
            dp_size: config.dp_size,
            messages: BTreeMap::new(),
        }
    }
}

impl Watcher for DrainWatcher {
    fn subscribed(&mut self, _from: u64) {
        self.ready.send_replace(true);
    }

    fn interrupted(&mut self, _why: &Interruption, refused: bool) {
        self.ready.send_replace(false);
        if !refused {
            self.metrics.upstream_reconnects.inc();
        }
    }

    fn admitted(&mut self, _batch: &KvEventBatch, rank: u32, _verdict: Verdict) {
        let metrics = &self.metrics;
        self.messages
            .entry(rank)
            .or_insert_with(|| metrics.rank_messages(rank))
            .inc();
    }

    fn set_aside(&mut self, reason: &'static str, batch_rank: Option<i32>) {
        self.metrics.count_bad_message(reason);
        if reason == UNKNOWN_RANK {
            crate::logging::rate_limited(UNKNOWN_RANK, || {
                warn!(
                    upstream = %self.upstream,
                    dp_rank = batch_rank,
                    dp_size = self.dp_size,
                    "dropped an upstream batch for a rank kvgate does not serve \
                     (logged at most once a second; kvgate_bad_messages_total counts them all)"
                );
            });
        }
    }
}

/// Subscribes to the upstream until `stop` is cancelled (or the drain is
/// gone), forwarding admitted events to the drain.
pub(crate) async fn run(
    config: UpstreamConfig,
    events: mpsc::Sender<SourceEvent>,
    watcher: &mut impl Watcher,
    stop: CancellationToken,
) {
    let mut cursors = Cursors::default();
    let mut backoff = FIRST_BACKOFF;
    loop {
        let outcome = tokio::select! {
            outcome = follow(&config, &mut cursors, &events, watcher) => outcome,
            () = stop.cancelled() => return,
        };
        match outcome {
            Outcome::DrainGone(DrainGone) => return,
            Outcome::Resync(reason) => {
                watcher.interrupted(&reason, true);
                info!(upstream = %config.target.uri(), %reason, "resubscribing from 0 for a snapshot");
                cursors.forget();
                backoff = FIRST_BACKOFF;
                tokio::select! {
                    sent = send(&events, SourceEvent::Resync) => if sent.is_err() { return },
                    () = stop.cancelled() => return,
                }
            }
            Outcome::Retry(reason) => {
                watcher.interrupted(&reason, false);
                warn!(upstream = %config.target.uri(), %reason, ?backoff, "upstream stream lost; resuming");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    () = stop.cancelled() => return,
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Why one subscription ended.
enum Outcome {
    /// Resume from the cursor after a pause.
    Retry(Interruption),
    /// The cursor is worthless: start over with a snapshot.
    Resync(Interruption),
    DrainGone(DrainGone),
}

/// What broke a subscription to the upstream.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Interruption {
    #[error("{0:#}")]
    Connect(anyhow::Error),
    #[error("{}", crate::connect_error::describe_status(.0))]
    Refused(tonic::Status),
    #[error("the upstream ended the stream")]
    Ended,
    #[error("a gap in the upstream's numbers")]
    Gap,
    #[error("the upstream did not answer the call in time")]
    Unanswered,
}

async fn follow(
    config: &UpstreamConfig,
    cursors: &mut Cursors,
    events: &mpsc::Sender<SourceEvent>,
    watcher: &mut impl Watcher,
) -> Outcome {
    let from = cursors.resume_from();
    let call = async {
        let channel = config
            .target
            .connect()
            .await
            .map_err(Interruption::Connect)?;
        crate::client::subscribe(channel, &config.service, from)
            .await
            .map_err(Interruption::Refused)
    };
    let answered = match config.answer_timeout {
        Some(timeout) => tokio::time::timeout(timeout, call).await,
        None => Ok(call.await),
    };
    let mut stream = match answered {
        Ok(Ok(stream)) => stream,
        Ok(Err(Interruption::Refused(status)))
            if matches!(status.code(), Code::OutOfRange | Code::DataLoss) =>
        {
            return Outcome::Resync(Interruption::Refused(status));
        }
        Ok(Err(interruption)) => return Outcome::Retry(interruption),
        Err(_) => return Outcome::Retry(Interruption::Unanswered),
    };
    cursors.connected();
    watcher.subscribed(from);
    loop {
        let batch = match stream.message().await {
            Ok(Some(batch)) => batch,
            Ok(None) => return Outcome::Retry(Interruption::Ended),
            Err(status) if status.code() == Code::DataLoss => {
                return Outcome::Resync(Interruption::Refused(status));
            }
            Err(status) => {
                // Undecodable, or larger than the decoder takes.
                if matches!(status.code(), Code::Internal | Code::OutOfRange) {
                    watcher.set_aside(UNDECODABLE, None);
                }
                return Outcome::Retry(Interruption::Refused(status));
            }
        };
        let Some(rank) = served_rank(&batch, config.dp_size) else {
            watcher.set_aside(UNKNOWN_RANK, batch.dp_rank);
            continue;
        };
        let verdict = cursors.admit(&batch);
        watcher.admitted(&batch, rank, verdict);
        if verdict == Verdict::Gap {
            return Outcome::Retry(Interruption::Gap);
        }
        let timestamp = batch.timestamp;
        for event in forwarded(verdict, batch, timestamp) {
            if let Err(gone) = send(events, event).await {
                return Outcome::DrainGone(gone);
            }
        }
    }
}

/// The batch's rank, if it is one of `0..dp_size` (no rank is rank 0).
fn served_rank(batch: &KvEventBatch, dp_size: u32) -> Option<u32> {
    u32::try_from(batch.dp_rank.unwrap_or(0))
        .ok()
        .filter(|&rank| rank < dp_size)
}
