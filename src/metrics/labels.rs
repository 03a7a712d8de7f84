//! The label sets of kvgate's metrics and the closed sets of their values.
//!
//! Invariant: every label value comes from a closed set known at build time
//! (never a client-supplied string), so the series count is bounded.

use prometheus_client::encoding::EncodeLabelSet;

use crate::source::peer::{PeerDropReason, PeerSocket};

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
    pub(super) fn new(socket: PeerSocket, reason: PeerDropReason) -> Self {
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
