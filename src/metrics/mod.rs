//! Prometheus metrics, registered once and shared by every task.
//!
//! Hot paths never touch a labelled family per event: each rank's counters
//! are resolved once ([`RankCounters`]), and the drain folds a message's
//! conversion into plain counts before adding them. Every label value comes
//! from a closed set ([`labels`]) and is exported at 0 from the start.

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};

use crate::convert::{DropReason, EventKind};
use crate::source::peer::{PeerDropReason, PeerSocket};
use crate::state::tier::Tier;

mod labels;
mod rank;

pub use labels::*;
pub use rank::RankCounters;

/// Every metric kvgate exports. Cloning shares the same underlying values.
#[derive(Clone)]
pub struct Metrics {
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
    registry: Arc<Registry>,
}

/// Creates a metric and registers it under `kvgate_<name>`.
struct Registrar(Registry);

impl Registrar {
    fn metric<M: Metric + Clone + Default>(&mut self, name: &str, help: &str) -> M {
        let metric = M::default();
        self.0.register(name, help, metric.clone());
        metric
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registrar(Registry::with_prefix("kvgate"));
        r.0.register_collector(Box::new(crate::process_metrics::ProcessCollector));
        let metrics = Self {
            engine_messages: r.metric(
                "engine_messages",
                "Engine messages received per data-parallel rank",
            ),
            engine_events: r.metric(
                "engine_events",
                "Decoded engine events per rank and type (forwarded or dropped)",
            ),
            events_dropped: r.metric(
                "events_dropped",
                "Engine events dropped, by normalization rule or as oversized_event",
            ),
            bad_messages: r.metric(
                "bad_messages",
                "Engine messages that yielded no events (bad frames or payload)",
            ),
            engine_messages_lost: r.metric(
                "engine_messages_lost",
                "Engine messages missing from a publisher's counter",
            ),
            engine_messages_recovered: r.metric(
                "engine_messages_recovered",
                "Engine messages fetched from the replay endpoint (gap fills, priming)",
            ),
            engine_restarts: r.metric(
                "engine_restarts",
                "Engine publisher restarts (counter went backwards)",
            ),
            batches_out: r.metric("batches_out", "Batches encoded and published"),
            events_out: r.metric("events_out", "Events encoded and published"),
            bytes_out: r.metric(
                "bytes_out",
                "Encoded batch bytes published (once per batch)",
            ),
            subscribers: r.metric("subscribers", "Subscribers currently streaming"),
            subscriber_lag: r.metric(
                "subscriber_lag",
                "Batches published but not yet handed to each connected subscriber",
            ),
            subscribers_refused: r.metric(
                "subscribers_refused",
                "Subscriber streams refused with RESOURCE_EXHAUSTED at --max-subscribers",
            ),
            state_blocks: r.metric(
                "state_blocks",
                "Live blocks per rank and tier (copies counted)",
            ),
            last_sequence: r.metric("last_sequence", "Last sequence number sent per rank"),
            history_bytes: r.metric("history_bytes", "Encoded bytes held by the history"),
            pass_through_calls: r.metric(
                "pass_through_calls",
                "RPCs passed through to the engine, by method and gRPC status code",
            ),
            upstream_reconnects: r.metric(
                "upstream_reconnects",
                "Times the upstream gRPC source lost its stream and resumed",
            ),
            connections: r.metric("connections", "Connections open on the gRPC port"),
            connections_refused: r.metric(
                "connections_refused",
                "Connections to the gRPC port closed before serving, by reason",
            ),
            connections_closed: r.metric(
                "connections_closed",
                "Served gRPC connections kvgate closed itself, by reason",
            ),
            snapshots_served: r.metric(
                "snapshots_served",
                "State snapshots served to subscribers joining with cursor 0",
            ),
            subscribers_lost: r.metric(
                "subscribers_lost",
                "Subscriber streams ended with DATA_LOSS",
            ),
            zmq_peers_dropped: r.metric(
                "zmq_peers_dropped",
                "ZMQ peer connections dropped (oversized message, protocol or connection error)",
            ),
            build_info: r.metric(
                "build_info",
                "kvgate's version and the git commit it was built from (always 1)",
            ),
            load_polls: r.metric("load_polls", "GetLoads polls of the engine, by outcome"),
            load_records_sent: r.metric(
                "load_records_sent",
                "Load records encoded onto outgoing batches (once per batch)",
            ),
            load_only_batches: r.metric(
                "load_only_batches",
                "load_only batches encoded (record changes and heartbeats)",
            ),
            load_poll_age_seconds: r.metric(
                "load_poll_age_seconds",
                "Seconds since the engine last answered GetLoads",
            ),
            load_answer_faults: r.metric(
                "load_answer_faults",
                "Parts of GetLoads answers clamped or dropped, by reason",
            ),
            tls_handshake_failures: r.metric(
                "tls_handshake_failures",
                "TLS handshakes refused on the gRPC port, by reason",
            ),
            auth_failures: r.metric(
                "auth_failures",
                "Calls refused UNAUTHENTICATED (no or unknown bearer token), by reason",
            ),
            credential_reloads: r.metric(
                "credential_reloads",
                "Reloads of TLS certificates and bearer tokens on SIGHUP, by result",
            ),
            registry: Arc::new(r.0),
        };
        metrics
            .build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                commit: GIT_COMMIT,
            })
            .set(1);
        metrics.export_closed_label_sets();
        metrics
    }

    /// Creates every series of a closed label set, so each is exported at 0
    /// from the start (a rate over a series that appears late is wrong).
    fn export_closed_label_sets(&self) {
        let reasons = |family: &Family<ReasonLabel, Counter>, reasons: &[&'static str]| {
            for &reason in reasons {
                family.get_or_create_owned(&ReasonLabel { reason });
            }
        };
        reasons(
            &self.events_dropped,
            &DropReason::ALL.map(DropReason::as_str),
        );
        reasons(&self.events_dropped, &[OVERSIZED_EVENT]);
        reasons(&self.bad_messages, &BAD_MESSAGE_REASONS);
        reasons(
            &self.tls_handshake_failures,
            &crate::server::tls::HandshakeFailure::ALL.map(|reason| reason.as_str()),
        );
        reasons(
            &self.auth_failures,
            &crate::server::auth::AuthFailure::ALL.map(|reason| reason.as_str()),
        );
        reasons(
            &self.connections_refused,
            &crate::server::connection::Refusal::ALL.map(|reason| reason.as_str()),
        );
        reasons(
            &self.connections_closed,
            &crate::server::connection::Closure::ALL.map(|reason| reason.as_str()),
        );
        reasons(
            &self.load_answer_faults,
            &crate::load::answer::Fault::ALL.map(|fault| fault.as_str()),
        );
        for result in ["ok", "failed"] {
            self.credential_reloads
                .get_or_create_owned(&ResultLabel { result });
        }
        for socket in PeerSocket::ALL {
            for reason in PeerDropReason::ALL {
                self.zmq_peers_dropped
                    .get_or_create_owned(&PeerDropLabels::new(socket, reason));
            }
        }
        for outcome in crate::load::poller::PollOutcome::ALL {
            self.count_load_poll_by(outcome, 0);
        }
    }

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
