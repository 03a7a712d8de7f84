//! An upstream `SubscribeKvEvents` server as the event source: TensorRT-LLM's
//! gRPC server (whose own drain is single-consumer) or another kvgate.
//!
//! Invariant: kvgate is one well-behaved router towards the upstream. It
//! admits batches by the router's rules (contract section 3), keeps its own
//! cursor, resumes after a disconnect with backoff, and when the upstream
//! cannot honour the cursor (OUT_OF_RANGE, DATA_LOSS, a gap it cannot
//! resume over) it starts again from 0: the upstream's snapshot then reaches
//! kvgate's own subscribers as a resync, an ownerless clear of every rank
//! followed by the new state, without dropping any of them.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tracing::{info, warn};

use super::{DrainGone, SourceEvent, send};
use crate::metrics::Metrics;
use crate::proto::common::{KvCacheEvent, KvEventBatch};

/// The bad-message reason of an upstream batch kvgate cannot decode.
pub(crate) const UNDECODABLE: &str = "upstream_undecodable";

/// Where the upstream is, with which credentials, and which of its service
/// names to call.
#[derive(Clone)]
pub struct UpstreamConfig {
    pub target: crate::client::Target,
    pub service: String,
}

/// What the router's rules make of one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch of its rank (or the first): forward it.
    Next,
    /// Already applied: drop it.
    Stale,
    /// The upstream started this rank over: clear it, then forward.
    Restart,
    /// Numbers were skipped: resume from the cursor.
    Gap,
    /// A snapshot chunk; `first` is chunk 0 (resync every rank).
    Snapshot { first: bool },
    /// A `load_only` batch: no events, admitted to no cursor.
    LoadOnly,
}

/// Per-rank cursors, as a router keeps them.
#[derive(Debug, Default)]
pub struct Cursors {
    last: BTreeMap<i32, u64>,
    /// No batch received yet on the current connection.
    fresh: bool,
}

impl Cursors {
    /// Rank 0's cursor: what to resume from (0 = snapshot).
    pub fn resume_from(&self) -> u64 {
        self.last.get(&0).copied().unwrap_or(0)
    }

    pub fn connected(&mut self) {
        self.fresh = true;
    }

    pub fn forget(&mut self) {
        self.last.clear();
    }

    pub fn admit(&mut self, batch: &KvEventBatch) -> Verdict {
        if batch.load.as_ref().is_some_and(|load| load.load_only) {
            return Verdict::LoadOnly;
        }
        let fresh = std::mem::replace(&mut self.fresh, false);
        let rank = batch.dp_rank.unwrap_or(0);
        let seq = batch.sequence_number;
        if let Some(chunk) = &batch.snapshot {
            self.last.insert(rank, seq);
            return Verdict::Snapshot {
                first: chunk.index == 0,
            };
        }
        let verdict = match self.last.get(&rank).copied() {
            None => Verdict::Next,
            Some(last) if seq == last + 1 => Verdict::Next,
            Some(last) if seq == last => Verdict::Stale,
            Some(last) if seq < last => {
                let restart = batch.events.iter().any(KvCacheEvent::is_ownerless_clear)
                    || fresh
                    || seq <= 1
                    || seq + 1024 <= last;
                if restart {
                    Verdict::Restart
                } else {
                    Verdict::Stale
                }
            }
            Some(_) => Verdict::Gap,
        };
        if matches!(verdict, Verdict::Next | Verdict::Restart) {
            self.last.insert(rank, seq);
        }
        verdict
    }
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

/// The pause before the first retry of a lost subscription; it doubles up
/// to [`MAX_BACKOFF`] (the recorder retries the same way).
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(100);
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(5);

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
    #[error("{0}")]
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
        let rank = u32::try_from(batch.dp_rank.unwrap_or(0)).unwrap_or(0);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::{KvCacheCleared, KvSnapshotChunk, kv_cache_event::Data};

    fn batch(rank: i32, seq: u64) -> KvEventBatch {
        KvEventBatch {
            sequence_number: seq,
            dp_rank: Some(rank),
            ..Default::default()
        }
    }

    #[test]
    fn batches_are_admitted_by_the_routers_rules() {
        let mut cursors = Cursors::default();
        cursors.connected();
        assert_eq!(cursors.admit(&batch(0, 100)), Verdict::Next);
        assert_eq!(cursors.admit(&batch(0, 101)), Verdict::Next);
        assert_eq!(cursors.admit(&batch(0, 101)), Verdict::Stale);
        assert_eq!(
            cursors.admit(&batch(0, 99)),
            Verdict::Stale,
            "old, not a restart"
        );
        assert_eq!(cursors.admit(&batch(0, 103)), Verdict::Gap);
        assert_eq!(cursors.admit(&batch(1, 7)), Verdict::Next);
        assert_eq!(cursors.resume_from(), 101);
        let mut clear = batch(0, 50);
        clear.events.push(KvCacheEvent {
            event_id: 0,
            data: Some(Data::Cleared(KvCacheCleared::default())),
        });
        assert_eq!(cursors.admit(&clear), Verdict::Restart);
        assert_eq!(cursors.resume_from(), 50);
    }

    #[test]
    fn a_load_only_batch_moves_no_cursor_and_is_not_forwarded() {
        let mut cursors = Cursors::default();
        cursors.connected();
        let mut heartbeat = batch(0, 0);
        heartbeat.load = Some(crate::proto::common::EngineLoad {
            load_only: true,
            ..Default::default()
        });
        assert_eq!(cursors.admit(&heartbeat), Verdict::LoadOnly);
        assert_eq!(cursors.resume_from(), 0);
        cursors.admit(&batch(0, 100));
        cursors.connected();
        assert_eq!(cursors.admit(&heartbeat), Verdict::LoadOnly);
        assert_eq!(
            cursors.admit(&batch(0, 90)),
            Verdict::Restart,
            "still the connection's first real batch"
        );
    }

    #[test]
    fn an_old_batch_first_on_a_fresh_connection_is_a_restart() {
        let mut cursors = Cursors::default();
        cursors.connected();
        cursors.admit(&batch(0, 100));
        cursors.connected();
        assert_eq!(cursors.admit(&batch(0, 90)), Verdict::Restart);
    }

    #[test]
    fn a_snapshot_sets_the_cursor_of_its_rank_and_chunk_0_resyncs() {
        let mut cursors = Cursors::default();
        let mut chunk = batch(1, 40);
        chunk.snapshot = Some(KvSnapshotChunk {
            index: 0,
            count: 2,
            ..Default::default()
        });
        assert_eq!(cursors.admit(&chunk), Verdict::Snapshot { first: true });
        chunk.snapshot.as_mut().unwrap().index = 1;
        chunk.sequence_number = 41;
        assert_eq!(cursors.admit(&chunk), Verdict::Snapshot { first: false });
        assert_eq!(cursors.admit(&batch(1, 42)), Verdict::Next);
    }
}
