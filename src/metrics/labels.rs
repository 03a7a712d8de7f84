//! The label sets of kvgate's metrics and the closed sets of their values.
//!
//! Invariant: every label value comes from a closed set known at build time
//! (never a client-supplied string), so the series count is bounded; the
//! stages define the sets, the app hands them over as [`ClosedLabels`].

use prometheus_client::encoding::EncodeLabelSet;

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
    pub commit: &'static str,
}

/// The git commit kvgate was built from (`unknown` outside a git checkout).
pub const GIT_COMMIT: &str = env!("KVGATE_GIT_COMMIT");

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
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
    pub events_dropped: Vec<&'static str>,
    pub bad_messages: Vec<&'static str>,
    /// `zmq_peers_dropped{socket, reason}`: every socket with every reason.
    pub zmq_peer_sockets: Vec<&'static str>,
    pub zmq_peers_dropped: Vec<&'static str>,
    pub tls_handshake_failures: Vec<&'static str>,
    pub auth_failures: Vec<&'static str>,
    pub connections_refused: Vec<&'static str>,
    pub connections_closed: Vec<&'static str>,
    pub credential_reloads: Vec<&'static str>,
    pub load_polls: Vec<&'static str>,
    pub load_answer_faults: Vec<&'static str>,
}
