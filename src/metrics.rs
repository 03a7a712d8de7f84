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
use crate::source::peer::{PeerDropReason, PeerSocket};
use crate::state::tier::Tier;

/// One rank's engine counters, looked up once: the hot path adds to them
/// without a label lookup.
#[derive(Clone, Debug)]
pub struct RankCounters {
    /// Engine messages accepted from the rank's socket.
    pub messages: Counter,
    /// Forwarded events, in `EventKind::ALL` order.
    forwarded: [Counter; EventKind::ALL.len()],
    dropped: Counter,
    /// Not per rank; only touched when a rule drops an event.
    dropped_by_reason: Family<ReasonLabel, Counter>,
}

impl RankCounters {
    /// Adds one message's conversion counts.
    pub fn record_tally(&self, tally: &Tally) {
        for (kind, counter) in EventKind::ALL.into_iter().zip(&self.forwarded) {
            let forwarded = tally.forwarded(kind);
            if forwarded > 0 {
                counter.inc_by(forwarded);
            }
        }
        for reason in DropReason::ALL {
            let dropped = tally.dropped(reason);
            if dropped > 0 {
                self.dropped.inc_by(dropped);
                self.dropped_by_reason
                    .get_or_create(&ReasonLabel {
                        reason: reason.as_str(),
                    })
                    .inc_by(dropped);
            }
        }
    }
}

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
    /// From the closed set of `server::methods` (`other` for the rest).
    pub method: &'static str,
    pub code: i32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerDropLabels {
    pub socket: &'static str,
    pub reason: &'static str,
}

impl PeerDropLabels {
    fn new(socket: PeerSocket, reason: PeerDropReason) -> Self {
        Self {
            socket: socket.as_str(),
            reason: reason.as_str(),
        }
    }
}

/// The `events_dropped` reason of an event (or piece of one: a single block)
/// larger than any message the router accepts.
pub const OVERSIZED_EVENT: &str = "oversized_event";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
    pub commit: &'static str,
}

/// The git commit kvgate was built from (`unknown` outside a git checkout).
pub const GIT_COMMIT: &str = env!("KVGATE_GIT_COMMIT");

/// Every reason an engine message can be counted as bad: a closed set, so
/// each series exists from the start at 0.
pub const BAD_MESSAGE_REASONS: [&str; 7] = [
    crate::source::FrameError::ALL[0].as_str(),
    crate::source::FrameError::ALL[1].as_str(),
    crate::source::FrameError::ALL[2].as_str(),
    crate::source::FrameError::ALL[3].as_str(),
    crate::convert::PayloadError::REASONS[0],
    crate::convert::PayloadError::REASONS[1],
    crate::source::upstream::UNDECODABLE,
];

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
    /// Engine events dropped by a normalization rule, and events (or pieces
    /// of one) too large for the router (`oversized_event`).
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
    /// Batches published but not yet handed to each connected subscriber
    /// (set when scraped, see `set_subscriber_lags`).
    pub subscriber_lag: Family<SubscriberLabel, Gauge>,
    /// Subscriber streams refused because `--max-subscribers` were open.
    pub subscribers_refused: Counter,
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
    /// Connections open on the gRPC port.
    pub connections: Gauge,
    /// Connections to the gRPC port closed before serving, by reason.
    pub connections_refused: Family<ReasonLabel, Counter>,
    /// Served connections kvgate closed itself, by reason.
    pub connections_closed: Family<ReasonLabel, Counter>,
    /// Snapshots served to subscribers joining with cursor 0.
    pub snapshots_served: Counter,
    /// Subscriber streams ended because they fell further behind than kvgate
    /// could refill.
    pub subscribers_lost: Counter,
    /// ZMQ peer connections dropped for breaking the protocol or the size
    /// limit, by socket and reason.
    pub zmq_peers_dropped: Family<PeerDropLabels, Counter>,
    /// Always 1, labelled with the version and git commit.
    pub build_info: Family<BuildLabels, Gauge>,
    /// `GetLoads` polls of the engine, by outcome.
    pub load_polls: Family<OutcomeLabel, Counter>,
    /// Load records encoded onto batches (once each, whatever the number
    /// of subscribers).
    pub load_records_sent: Counter,
    /// `load_only` batches encoded (changes and heartbeats).
    pub load_only_batches: Counter,
    /// Seconds since the engine last answered `GetLoads` (0 until it first
    /// does), updated after every poll.
    pub load_poll_age_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Parts of `GetLoads` answers clamped or dropped, by reason.
    pub load_answer_faults: Family<ReasonLabel, Counter>,
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
            subscribers_refused: Counter::default(),
            subscribers_lost: Counter::default(),
            snapshots_served: Counter::default(),
            upstream_reconnects: Counter::default(),
            connections: Gauge::default(),
            connections_refused: Family::default(),
            connections_closed: Family::default(),
            pass_through_calls: Family::default(),
            state_blocks: Family::default(),
            last_sequence: Family::default(),
            history_bytes: Gauge::default(),
            zmq_peers_dropped: Family::default(),
            build_info: Family::default(),
            load_polls: Family::default(),
            load_records_sent: Counter::default(),
            load_only_batches: Counter::default(),
            load_poll_age_seconds: Gauge::default(),
            load_answer_faults: Family::default(),
            tls_handshake_failures: Family::default(),
            auth_failures: Family::default(),
            credential_reloads: Family::default(),
        };
        metrics
            .build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                commit: GIT_COMMIT,
            })
            .set(1);
        for reason in DropReason::ALL {
            metrics.events_dropped.get_or_create_owned(&ReasonLabel {
                reason: reason.as_str(),
            });
        }
        for reason in BAD_MESSAGE_REASONS {
            metrics
                .bad_messages
                .get_or_create_owned(&ReasonLabel { reason });
        }
        registry.register(
            "build_info",
            "kvgate's version and the git commit it was built from (always 1)",
            metrics.build_info.clone(),
        );
        registry.register_collector(Box::new(crate::process_metrics::ProcessCollector));
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
        let _ = metrics.events_dropped.get_or_create(&ReasonLabel {
            reason: OVERSIZED_EVENT,
        });
        registry.register(
            "events_dropped",
            "Engine events dropped, by normalization rule or as oversized_event",
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
            "subscribers_refused",
            "Subscriber streams refused with RESOURCE_EXHAUSTED at --max-subscribers",
            metrics.subscribers_refused.clone(),
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
            "connections",
            "Connections open on the gRPC port",
            metrics.connections.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections to the gRPC port closed before serving, by reason",
            metrics.connections_refused.clone(),
        );
        registry.register(
            "connections_closed",
            "Served gRPC connections kvgate closed itself, by reason",
            metrics.connections_closed.clone(),
        );
        for reason in crate::server::connection::Refusal::ALL {
            let _ = metrics.connections_refused.get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            });
        }
        for reason in crate::server::connection::Closure::ALL {
            let _ = metrics.connections_closed.get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            });
        }
        registry.register(
            "zmq_peers_dropped",
            "ZMQ peer connections dropped (oversized message, protocol or connection error)",
            metrics.zmq_peers_dropped.clone(),
        );
        // Every series exists from the start, at 0.
        for socket in PeerSocket::ALL {
            for reason in PeerDropReason::ALL {
                drop(
                    metrics
                        .zmq_peers_dropped
                        .get_or_create(&PeerDropLabels::new(socket, reason)),
                );
            }
        }
        registry.register(
            "load_polls",
            "GetLoads polls of the engine, by outcome",
            metrics.load_polls.clone(),
        );
        registry.register(
            "load_records_sent",
            "Load records encoded onto outgoing batches (once per batch)",
            metrics.load_records_sent.clone(),
        );
        registry.register(
            "load_only_batches",
            "load_only batches encoded (record changes and heartbeats)",
            metrics.load_only_batches.clone(),
        );
        registry.register(
            "load_poll_age_seconds",
            "Seconds since the engine last answered GetLoads",
            metrics.load_poll_age_seconds.clone(),
        );
        registry.register(
            "load_answer_faults",
            "Parts of GetLoads answers clamped or dropped, by reason",
            metrics.load_answer_faults.clone(),
        );
        for outcome in crate::load::poller::PollOutcome::ALL {
            metrics.count_load_poll_by(outcome, 0);
        }
        for fault in crate::load::answer::Fault::ALL {
            let _ = metrics.load_answer_faults.get_or_create(&ReasonLabel {
                reason: fault.as_str(),
            });
        }
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
    /// Rank `rank`'s engine counters, resolved once for its whole life.
    pub fn rank_counters(&self, rank: u32) -> RankCounters {
        let events = |r#type| {
            self.engine_events
                .get_or_create_owned(&RankTypeLabels { rank, r#type })
        };
        RankCounters {
            messages: self
                .engine_messages
                .get_or_create_owned(&RankLabel { rank }),
            forwarded: EventKind::ALL.map(|kind| events(kind.as_str())),
            dropped: events("dropped"),
            dropped_by_reason: self.events_dropped.clone(),
        }
    }

    pub fn count_dropped_peer(&self, socket: PeerSocket, reason: PeerDropReason) {
        self.zmq_peers_dropped
            .get_or_create(&PeerDropLabels::new(socket, reason))
            .inc();
    }

    /// An event (or piece) too large for the router was not sent.
    pub fn count_oversized_event(&self) {
        self.events_dropped
            .get_or_create(&ReasonLabel {
                reason: OVERSIZED_EVENT,
            })
            .inc();
    }

    /// Pre-creates every per-rank series of `dp_size` ranks, so each one is
    /// exported at 0 before the engine's first message.
    pub fn prepare_ranks(&self, dp_size: u32) {
        for rank in 0..dp_size {
            self.engine_messages
                .get_or_create_owned(&RankLabel { rank });
            for r#type in EventKind::ALL
                .map(EventKind::as_str)
                .into_iter()
                .chain(["dropped"])
            {
                self.engine_events
                    .get_or_create_owned(&RankTypeLabels { rank, r#type });
            }
            self.last_sequence.get_or_create_owned(&RankLabel { rank });
            for tier in Tier::REPORTED.map(Tier::label) {
                self.state_blocks
                    .get_or_create_owned(&RankTierLabels { rank, tier });
            }
        }
    }

    /// `reason` is one of [`BAD_MESSAGE_REASONS`].
    pub fn count_bad_message(&self, reason: &'static str) {
        debug_assert!(
            BAD_MESSAGE_REASONS.contains(&reason),
            "{reason} is missing from BAD_MESSAGE_REASONS"
        );
        self.bad_messages
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A rank's gauges: its last sequence number and its live blocks per
    /// tier label (one of `Tier::REPORTED`'s).
    pub fn set_rank_figures(
        &self,
        rank: u32,
        last_sequence: u64,
        blocks: impl IntoIterator<Item = (&'static str, u64)>,
    ) {
        self.last_sequence
            .get_or_create(&RankLabel { rank })
            .set(i64::try_from(last_sequence).unwrap_or(i64::MAX));
        for (tier, count) in blocks {
            self.state_blocks
                .get_or_create(&RankTierLabels { rank, tier })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }

    /// Replaces every subscriber's lag with `lags` (subscription id, lag):
    /// subscribers that ended disappear, and a stream that stalled shows
    /// its lag as of now.
    pub fn set_subscriber_lags(&self, lags: &[(u64, u64)]) {
        self.subscriber_lag.clear();
        for &(subscriber, lag) in lags {
            self.subscriber_lag
                .get_or_create(&SubscriberLabel { subscriber })
                .set(i64::try_from(lag).unwrap_or(i64::MAX));
        }
    }

    pub fn count_load_poll(&self, outcome: crate::load::poller::PollOutcome) {
        self.count_load_poll_by(outcome, 1);
    }

    fn count_load_poll_by(&self, outcome: crate::load::poller::PollOutcome, by: u64) {
        self.load_polls
            .get_or_create(&OutcomeLabel {
                outcome: outcome.as_str(),
            })
            .inc_by(by);
    }

    pub fn count_load_fault(&self, fault: crate::load::answer::Fault) {
        self.load_answer_faults
            .get_or_create(&ReasonLabel {
                reason: fault.as_str(),
            })
            .inc();
    }

    pub fn count_pass_through(&self, method: &'static str, code: i32) {
        self.pass_through_calls
            .get_or_create(&CallLabels { method, code })
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
