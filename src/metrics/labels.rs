//! The label sets of kvgate's metrics and the closed sets of their values.
//!
//! Invariant: every label value comes from a closed set known at build time
//! (never a client-supplied string), so the series count is bounded; the
//! stages define the sets, the app hands them over as [`ClosedLabels`].

use prometheus_client::encoding::EncodeLabelSet;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A per-rank series.
pub struct RankLabel {
    /// The data-parallel rank.
    pub rank: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A per-rank series of one event type.
pub struct RankTypeLabels {
    /// The data-parallel rank.
    pub rank: u32,
    /// The event type (`stored`, `removed`, `cleared`, `dropped`).
    pub r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A per-rank series of one tier.
pub struct RankTierLabels {
    /// The data-parallel rank.
    pub rank: u32,
    /// The tier label (`device`, `host`, `disk`, `external`).
    pub tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A per-subscriber series, removed when the subscriber ends.
pub struct SubscriberLabel {
    /// The subscription id.
    pub subscriber: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A pass-through call series.
pub struct CallLabels {
    /// From the closed set of `server::methods` (`other` for the rest).
    pub method: &'static str,
    /// The gRPC status code the call ended with.
    pub code: i32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A series per outcome.
pub struct OutcomeLabel {
    /// The outcome, from its closed set.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A series per source.
pub struct SourceLabel {
    /// The source, from its closed set.
    pub source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A series per bound of a replay fetch.
pub struct BoundLabel {
    /// The bound (`messages`, `bytes`, `time`), from its closed set.
    pub bound: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A series per reason.
pub struct ReasonLabel {
    /// The reason, from its closed set.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A dropped ZMQ peer series.
pub struct PeerDropLabels {
    /// The socket (`sub`, `replay`).
    pub socket: &'static str,
    /// Why the peer was dropped.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// The build-info series.
pub struct BuildLabels {
    /// The crate version.
    pub version: &'static str,
    /// The git commit.
    pub commit: &'static str,
}

/// The git commit kvgate was built from (`unknown` outside a git checkout).
pub const GIT_COMMIT: &str = env!("KVGATE_GIT_COMMIT");

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// A series per result.
pub struct ResultLabel {
    /// The result (`ok`, `failed`).
    pub result: &'static str,
}

/// Every value of every closed label set, per metric family: each series
/// is exported at 0 from the start. The app builds it from the stages' own
/// outcome enums, so metrics need not know them.
#[derive(Clone, Debug, Default)]
pub struct ClosedLabels {
    /// `engine_events{type}`, per rank.
    pub engine_events: Vec<&'static str>,
    /// `state_blocks{tier}`, per rank.
    pub state_block_tiers: Vec<&'static str>,
    /// `events_dropped{reason}`.
    pub events_dropped: Vec<&'static str>,
    /// `bad_messages{reason}`.
    pub bad_messages: Vec<&'static str>,
    /// `zmq_peers_dropped{socket, reason}`: every socket with every reason.
    pub zmq_peer_sockets: Vec<&'static str>,
    /// The reasons of `zmq_peers_dropped{socket, reason}`.
    pub zmq_peers_dropped: Vec<&'static str>,
    /// `tls_handshake_failures{reason}`.
    pub tls_handshake_failures: Vec<&'static str>,
    /// `auth_failures{reason}`.
    pub auth_failures: Vec<&'static str>,
    /// `connections_refused{reason}`.
    pub connections_refused: Vec<&'static str>,
    /// `connections_closed{reason}`.
    pub connections_closed: Vec<&'static str>,
    /// `admin_connections_closed{reason}`.
    pub admin_connections_closed: Vec<&'static str>,
    /// `credential_reloads{result}`.
    pub credential_reloads: Vec<&'static str>,
    /// `load_polls{outcome}`.
    pub load_polls: Vec<&'static str>,
    /// `load_answer_faults{reason}`.
    pub load_answer_faults: Vec<&'static str>,
    /// `load_push_faults{reason}`.
    pub load_push_faults: Vec<&'static str>,
    /// `load_records_sent{source}`.
    pub load_record_sources: Vec<&'static str>,
    /// `replay_fetches_bounded{bound}`.
    pub replay_bounds: Vec<&'static str>,
}
