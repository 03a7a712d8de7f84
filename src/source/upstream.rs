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

/// Subscribes to the upstream until `stop` is cancelled (or the drain is
/// gone), forwarding admitted events to the drain.
pub async fn run(
    config: UpstreamConfig,
    events: mpsc::Sender<SourceEvent>,
    metrics: Metrics,
    ready: watch::Sender<bool>,
    stop: CancellationToken,
) {
    let mut cursors = Cursors::default();
    let mut backoff = FIRST_BACKOFF;
    loop {
        let outcome = tokio::select! {
            outcome = follow(&config, &mut cursors, &events, &metrics, &ready) => outcome,
            () = stop.cancelled() => return,
        };
        ready.send_replace(false);
        match outcome {
            Outcome::DrainGone(DrainGone) => return,
            Outcome::Resync(reason) => {
                info!(upstream = %config.target.uri(), %reason, "resubscribing from 0 for a snapshot");
                cursors.forget();
                backoff = FIRST_BACKOFF;
            }
            Outcome::Retry(reason) => {
                metrics.upstream_reconnects.inc();
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
enum Interruption {
    #[error("{0:#}")]
    Connect(anyhow::Error),
    #[error("{}", crate::connect_error::describe_status(.0))]
    Refused(tonic::Status),
    #[error("the upstream ended the stream")]
    Ended,
    #[error("a gap in the upstream's numbers")]
    Gap,
}

async fn follow(
    config: &UpstreamConfig,
    cursors: &mut Cursors,
    events: &mpsc::Sender<SourceEvent>,
    metrics: &Metrics,
    ready: &watch::Sender<bool>,
) -> Outcome {
    let channel = match config.target.connect().await {
        Ok(channel) => channel,
        Err(error) => return Outcome::Retry(Interruption::Connect(error)),
    };
    let mut stream =
        match crate::client::subscribe(channel, &config.service, cursors.resume_from()).await {
            Ok(stream) => stream,
            Err(status) if matches!(status.code(), Code::OutOfRange | Code::DataLoss) => {
                return Outcome::Resync(Interruption::Refused(status));
            }
            Err(status) => return Outcome::Retry(Interruption::Refused(status)),
        };
    cursors.connected();
    ready.send_replace(true);
    // Each rank's message counter, resolved at its first batch.
    let mut messages = BTreeMap::new();
    loop {
        let batch = match stream.message().await {
            Ok(Some(batch)) => batch,
            Ok(None) => return Outcome::Retry(Interruption::Ended),
            Err(status) if status.code() == Code::DataLoss => {
                return Outcome::Resync(Interruption::Refused(status));
            }
            Err(status) => {
                if status.code() == Code::Internal {
                    metrics.count_bad_message(UNDECODABLE);
                }
                return Outcome::Retry(Interruption::Refused(status));
            }
        };
        let Some(rank) = served_rank(&batch, config.dp_size) else {
            metrics.count_bad_message(UNKNOWN_RANK);
            crate::logging::rate_limited(UNKNOWN_RANK, || {
                warn!(
                    upstream = %config.target.uri(),
                    dp_rank = batch.dp_rank,
                    dp_size = config.dp_size,
                    "dropped an upstream batch for a rank kvgate does not serve \
                     (logged at most once a second; kvgate_bad_messages_total counts them all)"
                );
            });
            continue;
        };
        messages
            .entry(rank)
            .or_insert_with(|| metrics.rank_messages(rank))
            .inc();
        let verdict = cursors.admit(&batch);
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
