//! Prometheus metrics, registered once and shared by every task.
//!
//! Hot paths never touch a labelled family per event: the drain folds a
//! whole drain cycle into plain counts first and adds them here once.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::convert::{DropReason, EventKind, Tally};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankLabel {
    pub rank: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankTypeLabels {
    pub rank: u32,
    pub r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankTierLabels {
    pub rank: u32,
    pub tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubscriberLabel {
    pub subscriber: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub method: String,
    pub code: i32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

/// Every metric kvgate exports. Cloning shares the same underlying values.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// Engine messages accepted from the sockets, per rank.
    pub engine_messages: Family<RankLabel, Counter>,
    /// Decoded engine events per rank and type, forwarded or not.
    pub engine_events: Family<RankTypeLabels, Counter>,
    /// Engine events dropped by a normalization rule.
    pub events_dropped: Family<ReasonLabel, Counter>,
    /// Engine messages that produced no events at all (bad frames, bad msgpack).
    pub bad_messages: Family<ReasonLabel, Counter>,
    /// Engine messages that never arrived (gaps in a publisher's counter).
    pub engine_messages_lost: Counter,
    /// Engine messages fetched from a replay endpoint (gap fills and
    /// priming) rather than received live.
    pub engine_messages_recovered: Counter,
    /// Publisher counters that went backwards (engine restarts).
    pub engine_restarts: Counter,
    /// Batches, events and encoded bytes handed to the hub (each encoded once,
    /// whatever the number of subscribers).
    pub batches_out: Counter,
    pub events_out: Counter,
    pub bytes_out: Counter,
    /// Subscribers currently streaming.
    pub subscribers: Gauge,
    /// Batches published but not yet handed to each connected subscriber.
    pub subscriber_lag: Family<SubscriberLabel, Gauge>,
    /// Live blocks (copies counted) per rank and tier.
    pub state_blocks: Family<RankTierLabels, Gauge>,
    /// Last sequence number sent per rank.
    pub last_sequence: Family<RankLabel, Gauge>,
    /// Encoded bytes the history holds.
    pub history_bytes: Gauge,
    /// Calls passed through to the engine, by method and final gRPC status.
    pub pass_through_calls: Family<CallLabels, Counter>,
    /// Times the upstream gRPC source lost its stream and resumed.
    pub upstream_reconnects: Counter,
    /// Snapshots served to subscribers joining with cursor 0.
    pub snapshots_served: Counter,
    /// Subscriber streams ended because they fell further behind than kvgate
    /// could refill.
    pub subscribers_lost: Counter,
    /// TLS handshakes refused on the gRPC port, by reason.
    pub tls_handshake_failures: Family<ReasonLabel, Counter>,
    /// Calls refused UNAUTHENTICATED, by reason.
    pub auth_failures: Family<ReasonLabel, Counter>,
    /// SIGHUP reloads of certificates and tokens, by result.
    pub credential_reloads: Family<ResultLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvgate");
        let metrics = Self {
            registry: Arc::default(),
            engine_messages: Family::default(),
            engine_events: Family::default(),
            events_dropped: Family::default(),
            bad_messages: Family::default(),
            engine_messages_lost: Counter::default(),
            engine_messages_recovered: Counter::default(),
            engine_restarts: Counter::default(),
            batches_out: Counter::default(),
            events_out: Counter::default(),
            bytes_out: Counter::default(),
            subscribers: Gauge::default(),
            subscriber_lag: Family::default(),
            subscribers_lost: Counter::default(),
            snapshots_served: Counter::default(),
            upstream_reconnects: Counter::default(),
            pass_through_calls: Family::default(),
            state_blocks: Family::default(),
            last_sequence: Family::default(),
            history_bytes: Gauge::default(),
            tls_handshake_failures: Family::default(),
            auth_failures: Family::default(),
            credential_reloads: Family::default(),
        };
        for reason in crate::server::tls::HandshakeFailure::ALL {
            let _ = metrics.tls_handshake_failures.get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            });
        }
        for reason in crate::server::auth::AuthFailure::ALL {
            let _ = metrics.auth_failures.get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            });
        }
        for result in ["ok", "failed"] {
            let _ = metrics
                .credential_reloads
                .get_or_create(&ResultLabel { result });
        }
        registry.register(
            "engine_messages",
            "Engine messages received per data-parallel rank",
            metrics.engine_messages.clone(),
        );
        registry.register(
            "engine_events",
            "Decoded engine events per rank and type (forwarded or dropped)",
            metrics.engine_events.clone(),
        );
        registry.register(
            "events_dropped",
            "Engine events dropped by a normalization rule",
            metrics.events_dropped.clone(),
        );
        registry.register(
            "bad_messages",
            "Engine messages that yielded no events (bad frames or payload)",
            metrics.bad_messages.clone(),
        );
        registry.register(
            "engine_messages_lost",
            "Engine messages missing from a publisher's counter",
            metrics.engine_messages_lost.clone(),
        );
        registry.register(
            "engine_messages_recovered",
            "Engine messages fetched from the replay endpoint (gap fills, priming)",
            metrics.engine_messages_recovered.clone(),
        );
        registry.register(
            "engine_restarts",
            "Engine publisher restarts (counter went backwards)",
            metrics.engine_restarts.clone(),
        );
        registry.register(
            "batches_out",
            "Batches encoded and published",
            metrics.batches_out.clone(),
        );
        registry.register(
            "events_out",
            "Events encoded and published",
            metrics.events_out.clone(),
        );
        registry.register(
            "bytes_out",
            "Encoded batch bytes published (once per batch)",
            metrics.bytes_out.clone(),
        );
        registry.register(
            "subscribers",
            "Subscribers currently streaming",
            metrics.subscribers.clone(),
        );
        registry.register(
            "subscriber_lag",
            "Batches published but not yet handed to each connected subscriber",
            metrics.subscriber_lag.clone(),
        );
        registry.register(
            "subscribers_lost",
            "Subscriber streams ended with DATA_LOSS",
            metrics.subscribers_lost.clone(),
        );
        registry.register(
            "snapshots_served",
            "State snapshots served to subscribers joining with cursor 0",
            metrics.snapshots_served.clone(),
        );
        registry.register(
            "pass_through_calls",
            "RPCs passed through to the engine, by method and gRPC status code",
            metrics.pass_through_calls.clone(),
        );
        registry.register(
            "state_blocks",
            "Live blocks per rank and tier (copies counted)",
            metrics.state_blocks.clone(),
        );
        registry.register(
            "last_sequence",
            "Last sequence number sent per rank",
            metrics.last_sequence.clone(),
        );
        registry.register(
            "history_bytes",
            "Encoded bytes held by the history",
            metrics.history_bytes.clone(),
        );
        registry.register(
            "upstream_reconnects",
            "Times the upstream gRPC source lost its stream and resumed",
            metrics.upstream_reconnects.clone(),
        );
        registry.register(
            "tls_handshake_failures",
            "TLS handshakes refused on the gRPC port, by reason",
            metrics.tls_handshake_failures.clone(),
        );
        registry.register(
            "auth_failures",
            "Calls refused UNAUTHENTICATED (no or unknown bearer token), by reason",
            metrics.auth_failures.clone(),
        );
        registry.register(
            "credential_reloads",
            "Reloads of TLS certificates and bearer tokens on SIGHUP, by result",
            metrics.credential_reloads.clone(),
        );
        Self {
            registry: Arc::new(registry),
            ..metrics
        }
    }

    /// Adds one drain cycle's conversion outcome for `rank`.
    pub fn record_tally(&self, rank: u32, tally: &Tally) {
        for kind in EventKind::ALL {
            let forwarded = tally.forwarded(kind);
            if forwarded > 0 {
                self.engine_events
                    .get_or_create(&RankTypeLabels {
                        rank,
                        r#type: kind.as_str(),
                    })
                    .inc_by(forwarded);
            }
        }
        for reason in DropReason::ALL {
            let dropped = tally.dropped(reason);
            if dropped > 0 {
                self.engine_events
                    .get_or_create(&RankTypeLabels {
                        rank,
                        r#type: "dropped",
                    })
                    .inc_by(dropped);
                self.events_dropped
                    .get_or_create(&ReasonLabel {
                        reason: reason.as_str(),
                    })
                    .inc_by(dropped);
            }
        }
    }

    pub fn count_bad_message(&self, reason: &'static str) {
        self.bad_messages
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Per-rank gauges from the drain's latest report.
    pub fn record_ranks(&self, reports: &[crate::hub::RankReport]) {
        const TIERS: [&str; 4] = ["device", "host", "disk", "external"];
        for report in reports {
            let rank = report.rank;
            self.last_sequence
                .get_or_create(&RankLabel { rank })
                .set(report.last_sequence as i64);
            for (tier, blocks) in TIERS.into_iter().zip(report.blocks) {
                self.state_blocks
                    .get_or_create(&RankTierLabels { rank, tier })
                    .set(blocks as i64);
            }
        }
    }

    pub fn count_pass_through(&self, method: &str, code: i32) {
        self.pass_through_calls
            .get_or_create(&CallLabels {
                method: method.to_owned(),
                code,
            })
            .inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
