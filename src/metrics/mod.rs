//! Prometheus metrics, registered once and shared by every task.
//!
//! Metrics take plain figures and `&'static str` labels: they know no stage
//! of the pipeline, and every stage may report into them. Hot paths never
//! look a label up per event: a rank's counters are resolved once and held
//! by whoever counts. Every label value comes from a closed set the app
//! hands over at start ([`ClosedLabels`]), exported at 0 from the start.

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};

mod labels;
mod process;

pub use labels::*;

/// Every metric kvgate exports, shared: a clone is one pointer, so each
/// task holding one (a rank's socket task, a connection) carries 8 bytes
/// rather than every metric's handle.
#[derive(Clone)]
pub struct Metrics(Arc<MetricSet>);

impl std::ops::Deref for Metrics {
    type Target = MetricSet;

    fn deref(&self) -> &MetricSet {
        &self.0
    }
}

/// The metrics themselves ([`Metrics`] shares them).
pub struct MetricSet {
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
    /// Replay fetches cut short by one of their bounds, by bound.
    pub replay_fetches_bounded: Family<BoundLabel, Counter>,
    /// Publisher counters that went backwards (engine restarts).
    pub engine_restarts: Counter,
    /// Publisher counters that leapt further ahead than an engine could
    /// publish: taken as a restart, never as lost messages.
    pub engine_sequence_jumps: Counter,
    /// Batches, events and encoded bytes handed to the hub (each encoded once,
    /// whatever the number of subscribers).
    pub batches_out: Counter,
    /// Events encoded and published.
    pub events_out: Counter,
    /// Encoded batch bytes published (once per batch).
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
    /// Connections open on the admin (metrics) port.
    pub admin_connections: Gauge,
    /// Admin port connections closed at once because
    /// `--metrics-max-connections` were open.
    pub admin_connections_refused: Counter,
    /// Admin port connections kvgate closed itself, by reason.
    pub admin_connections_closed: Family<ReasonLabel, Counter>,
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
    /// of subscribers), by the source of the reading behind them.
    pub load_records_sent: Family<SourceLabel, Counter>,
    /// `load_only` batches encoded (changes and heartbeats).
    pub load_only_batches: Counter,
    /// Seconds since the engine last answered `GetLoads` (0 until it first
    /// does), updated after every poll.
    pub load_poll_age_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Parts of `GetLoads` answers clamped or dropped, by reason.
    pub load_answer_faults: Family<ReasonLabel, Counter>,
    /// Load stats the engine pushed that reached the board.
    pub load_pushes: Counter,
    /// Load publisher messages skipped, or stats repaired, by reason.
    pub load_push_faults: Family<ReasonLabel, Counter>,
    /// TLS handshakes refused on the gRPC port, by reason.
    pub tls_handshake_failures: Family<ReasonLabel, Counter>,
    /// Calls refused UNAUTHENTICATED, by reason.
    pub auth_failures: Family<ReasonLabel, Counter>,
    /// SIGHUP reloads of certificates and tokens, by result.
    pub credential_reloads: Family<ResultLabel, Counter>,
    /// 1 while `--state-dir` persistence is paused by a failing disk.
    pub state_paused: Gauge,
    /// Writes to the state directory that failed (each pauses persistence
    /// or leaves the last checkpoint in place).
    pub state_write_failures: Counter,
    /// Bytes of kvgate's files in the state directory.
    pub state_disk_bytes: Gauge,
    /// Bytes appended to the state directory's log.
    pub state_log_bytes: Counter,
    /// Times the drain stopped taking engine messages because the log
    /// writer thread had its whole queue of cycles still to write.
    pub state_log_queue_full: Counter,
    /// Checkpoints written to the state directory.
    pub state_checkpoints: Counter,
    /// Blocks in the newest checkpoint.
    pub state_checkpoint_blocks: Gauge,
    /// Unix time of the newest checkpoint (0 before the first).
    pub state_checkpoint_timestamp_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Blocks read back from a checkpoint at start.
    pub state_restored_blocks: Gauge,
    /// Logged batches applied to the state at start, after the checkpoint.
    pub state_restored_batches: Gauge,
    /// Files in the state directory set aside because they did not verify,
    /// by kind of damage.
    pub state_damaged: Family<ReasonLabel, Counter>,
    registry: Registry,
    /// Kept for the per-rank series, created once the rank count is known.
    labels: ClosedLabels,
}

/// One rank's report gauges, resolved once: the drain sets them after
/// every cycle, so looking their labels up each time would cost it a lock
/// and a hash per gauge.
#[derive(Clone, Debug)]
pub struct RankGauges {
    last_sequence: Gauge,
    /// `state_blocks`, per tier label.
    blocks: Vec<(&'static str, Gauge)>,
}

impl RankGauges {
    /// Sets the last sequence number and each tier's live blocks, the
    /// tiers in the order the gauges were resolved for.
    pub fn set(&self, last_sequence: u64, blocks: impl IntoIterator<Item = (&'static str, u64)>) {
        self.last_sequence
            .set(i64::try_from(last_sequence).unwrap_or(i64::MAX));
        for ((label, gauge), (tier, count)) in self.blocks.iter().zip(blocks) {
            debug_assert_eq!(*label, tier, "state_blocks tiers in another order");
            gauge.set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }
}

/// A value counted at run time must be one the app exported at 0 from the
/// start (metrics built without label sets, in tests, take any).
fn debug_assert_closed(set: &[&'static str], value: &'static str) {
    debug_assert!(
        set.is_empty() || set.contains(&value),
        "{value:?} is missing from its closed label set in app/metric_labels.rs"
    );
}

/// Creates a metric and, for metrics that are exported, registers it
/// under `kvgate_<name>`.
struct Registrar {
    registry: Registry,
    export: bool,
}

impl Registrar {
    fn metric<M: Metric + Clone + Default>(&mut self, name: &str, help: &str) -> M {
        let metric = M::default();
        if self.export {
            self.registry.register(name, help, metric.clone());
        }
        metric
    }
}

impl Default for Metrics {
    /// Metrics without closed label sets (tests and benchmarks): series are
    /// created as they are first counted.
    fn default() -> Self {
        Self::new(ClosedLabels::default())
    }
}

impl Metrics {
    /// Registers every metric and exports each series of `labels` at 0.
    pub fn new(labels: ClosedLabels) -> Self {
        Self::build(labels, true)
    }

    /// Metrics read in process and never scraped (an index feed's sockets
    /// count the peers they drop here for its status): no registry, so no
    /// copy of every metric's name and help per feed.
    pub fn unexported() -> Self {
        Self::build(ClosedLabels::default(), false)
    }

    fn build(labels: ClosedLabels, export: bool) -> Self {
        let mut r = Registrar {
            registry: Registry::with_prefix("kvgate"),
            export,
        };
        if export {
            r.registry
                .register_collector(Box::new(process::ProcessCollector));
        }
        let metrics = Self(Arc::new(MetricSet {
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
            replay_fetches_bounded: r.metric(
                "replay_fetches_bounded",
                "Replay fetches (priming, gap fills) cut short by their message, byte or time bound",
            ),
            engine_restarts: r.metric(
                "engine_restarts",
                "Engine publisher restarts (counter went backwards)",
            ),
            engine_sequence_jumps: r.metric(
                "engine_sequence_jumps",
                "Engine publisher counters that leapt more than 2^32 ahead \
                 (taken as a restart, not counted as lost messages)",
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
            admin_connections: r.metric(
                "admin_connections",
                "Connections open on the admin (metrics) port",
            ),
            admin_connections_refused: r.metric(
                "admin_connections_refused",
                "Admin port connections answered 503 and closed: --metrics-max-connections were open",
            ),
            admin_connections_closed: r.metric(
                "admin_connections_closed",
                "Admin port connections kvgate closed itself, by reason",
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
                "Load records encoded onto outgoing batches (once per batch), by the source of their reading",
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
            load_pushes: r.metric(
                "load_pushes",
                "Load stats the engine's load publisher pushed that were taken",
            ),
            load_push_faults: r.metric(
                "load_push_faults",
                "Load publisher messages skipped, or stats repaired, by reason",
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
                "Reloads of TLS certificates and bearer tokens (on SIGHUP or when --credentials-check-seconds finds a file changed), by result",
            ),
            state_paused: r.metric(
                "state_paused",
                "1 while persistence to --state-dir is paused because writes fail",
            ),
            state_write_failures: r
                .metric("state_write_failures", "Writes to --state-dir that failed"),
            state_disk_bytes: r
                .metric("state_disk_bytes", "Bytes of kvgate's files in --state-dir"),
            state_log_bytes: r.metric("state_log_bytes", "Bytes appended to the --state-dir log"),
            state_log_queue_full: r.metric(
                "state_log_queue_full",
                "Times the drain stopped taking engine messages until the --state-dir log writer caught up (its queue of cycles to write was full: the disk is behind)",
            ),
            state_checkpoints: r.metric(
                "state_checkpoints",
                "Checkpoints of the live state written to --state-dir",
            ),
            state_checkpoint_blocks: r.metric(
                "state_checkpoint_blocks",
                "Blocks in the newest --state-dir checkpoint",
            ),
            state_checkpoint_timestamp_seconds: r.metric(
                "state_checkpoint_timestamp_seconds",
                "Unix time of the newest --state-dir checkpoint (0 before the first)",
            ),
            state_restored_blocks: r.metric(
                "state_restored_blocks",
                "Blocks read back from a --state-dir checkpoint at start",
            ),
            state_restored_batches: r.metric(
                "state_restored_batches",
                "Logged batches applied to the state at start, after the checkpoint",
            ),
            state_damaged: r.metric(
                "state_damaged",
                "Files in --state-dir set aside because they did not verify, by kind",
            ),
            registry: r.registry,
            labels,
        }));
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
        let labels = &self.labels;
        let reasons = |family: &Family<ReasonLabel, Counter>, reasons: &[&'static str]| {
            for &reason in reasons {
                family.get_or_create_owned(&ReasonLabel { reason });
            }
        };
        reasons(&self.events_dropped, &labels.events_dropped);
        reasons(&self.bad_messages, &labels.bad_messages);
        reasons(&self.tls_handshake_failures, &labels.tls_handshake_failures);
        reasons(&self.auth_failures, &labels.auth_failures);
        reasons(&self.connections_refused, &labels.connections_refused);
        reasons(&self.connections_closed, &labels.connections_closed);
        reasons(
            &self.admin_connections_closed,
            &labels.admin_connections_closed,
        );
        reasons(&self.load_answer_faults, &labels.load_answer_faults);
        reasons(&self.load_push_faults, &labels.load_push_faults);
        for &source in &labels.load_record_sources {
            self.load_records_sent
                .get_or_create_owned(&SourceLabel { source });
        }
        reasons(&self.state_damaged, &labels.state_damaged);
        for &result in &labels.credential_reloads {
            self.credential_reloads
                .get_or_create_owned(&ResultLabel { result });
        }
        for &socket in &labels.zmq_peer_sockets {
            for &reason in &labels.zmq_peers_dropped {
                self.zmq_peers_dropped
                    .get_or_create_owned(&PeerDropLabels { socket, reason });
            }
        }
        for &bound in &labels.replay_bounds {
            self.replay_fetches_bounded
                .get_or_create_owned(&BoundLabel { bound });
        }
        for &outcome in &labels.load_polls {
            self.load_polls
                .get_or_create_owned(&OutcomeLabel { outcome });
        }
    }

    /// Counts a state-directory file set aside for `kind` of damage.
    pub fn count_state_damage(&self, kind: &'static str) {
        debug_assert_closed(&self.labels.state_damaged, kind);
        self.state_damaged
            .get_or_create(&ReasonLabel { reason: kind })
            .inc();
    }

    /// Rank `rank`'s accepted engine messages, to hold and add to.
    pub fn rank_messages(&self, rank: u32) -> Counter {
        self.engine_messages
            .get_or_create_owned(&RankLabel { rank })
    }

    /// Rank `rank`'s decoded events of `r#type`, to hold and add to.
    pub fn rank_events(&self, rank: u32, r#type: &'static str) -> Counter {
        self.engine_events
            .get_or_create_owned(&RankTypeLabels { rank, r#type })
    }

    /// `count` events dropped for `reason` (a normalization rule, or an
    /// event too large for the router).
    pub fn count_dropped_events(&self, reason: &'static str, count: u64) {
        debug_assert_closed(&self.labels.events_dropped, reason);
        self.events_dropped
            .get_or_create(&ReasonLabel { reason })
            .inc_by(count);
    }

    /// A ZMQ peer dropped on `socket` for `reason`.
    pub fn count_dropped_peer(&self, socket: &'static str, reason: &'static str) {
        debug_assert_closed(&self.labels.zmq_peer_sockets, socket);
        debug_assert_closed(&self.labels.zmq_peers_dropped, reason);
        self.zmq_peers_dropped
            .get_or_create(&PeerDropLabels { socket, reason })
            .inc();
    }

    /// The ZMQ peers dropped on `socket` for `reason` so far.
    pub fn dropped_peers(&self, socket: &'static str, reason: &'static str) -> u64 {
        self.zmq_peers_dropped
            .get_or_create(&PeerDropLabels { socket, reason })
            .get()
    }

    /// A replay fetch stopped at its `bound`.
    pub fn count_bounded_fetch(&self, bound: &'static str) {
        debug_assert_closed(&self.labels.replay_bounds, bound);
        self.replay_fetches_bounded
            .get_or_create(&BoundLabel { bound })
            .inc();
    }

    /// Pre-creates every per-rank series of `dp_size` ranks, so each one is
    /// exported at 0 before the engine's first message.
    pub fn prepare_ranks(&self, dp_size: u32) {
        for rank in 0..dp_size {
            self.engine_messages
                .get_or_create_owned(&RankLabel { rank });
            for &r#type in &self.labels.engine_events {
                self.engine_events
                    .get_or_create_owned(&RankTypeLabels { rank, r#type });
            }
            self.last_sequence.get_or_create_owned(&RankLabel { rank });
            for &tier in &self.labels.state_block_tiers {
                self.state_blocks
                    .get_or_create_owned(&RankTierLabels { rank, tier });
            }
        }
    }

    /// An engine message that yielded no events, for `reason`.
    pub fn count_bad_message(&self, reason: &'static str) {
        debug_assert_closed(&self.labels.bad_messages, reason);
        self.bad_messages
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Rank `rank`'s gauges (its last sequence number, its live blocks per
    /// tier label, for `tiers` in the order [`RankGauges::set`] will give
    /// them), to hold and set every cycle.
    pub fn rank_gauges(
        &self,
        rank: u32,
        tiers: impl IntoIterator<Item = &'static str>,
    ) -> RankGauges {
        RankGauges {
            last_sequence: self.last_sequence.get_or_create_owned(&RankLabel { rank }),
            blocks: tiers
                .into_iter()
                .map(|tier| {
                    let labels = RankTierLabels { rank, tier };
                    (tier, self.state_blocks.get_or_create_owned(&labels))
                })
                .collect(),
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

    /// A `GetLoads` poll that ended in `outcome`.
    pub fn count_load_poll(&self, outcome: &'static str) {
        debug_assert_closed(&self.labels.load_polls, outcome);
        self.load_polls
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// A part of a `GetLoads` answer clamped or dropped for `reason`.
    pub fn count_load_fault(&self, reason: &'static str) {
        debug_assert_closed(&self.labels.load_answer_faults, reason);
        self.load_answer_faults
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A pushed load message skipped, or a stat repaired, for `reason`.
    pub fn count_load_push_fault(&self, reason: &'static str) {
        debug_assert_closed(&self.labels.load_push_faults, reason);
        self.load_push_faults
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A load record encoded from a reading of `source`.
    pub fn count_load_record(&self, source: &'static str) {
        debug_assert_closed(&self.labels.load_record_sources, source);
        self.load_records_sent
            .get_or_create(&SourceLabel { source })
            .inc();
    }

    /// A pass-through call to `method` that ended with gRPC status `code`.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unexported_metrics_count_and_share_like_exported_ones_but_render_nothing() {
        let unexported = Metrics::unexported();
        let copy = unexported.clone();
        unexported.count_dropped_peer("sub", "bad_greeting");
        copy.count_dropped_peer("sub", "bad_greeting");
        assert_eq!(unexported.dropped_peers("sub", "bad_greeting"), 2);
        assert_eq!(unexported.render().trim(), "# EOF");

        let exported = Metrics::default();
        exported.count_dropped_peer("sub", "bad_greeting");
        assert!(
            exported.render().contains(
                "kvgate_zmq_peers_dropped_total{socket=\"sub\",reason=\"bad_greeting\"} 1"
            ),
            "{}",
            exported.render()
        );
    }
}
