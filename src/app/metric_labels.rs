//! The closed label sets of every metric, gathered from the stages that
//! define them, so `metrics` needs to know none of them.

use crate::convert::{DropReason, EventKind, PayloadError};
use crate::drain::{DROPPED_EVENTS, OVERSIZED_EVENT};
use crate::load::LoadSource;
use crate::load::answer::Fault;
use crate::load::poller::PollOutcome;
use crate::load::stat::PushFault;
use crate::metrics::ClosedLabels;
use crate::server::admin_connection::AdminClosure;
use crate::server::auth::AuthFailure;
use crate::server::connection::{Closure, Refusal};
use crate::server::reload::ReloadResult;
use crate::server::tls::HandshakeFailure;
use crate::source::FrameError;
use crate::source::peer::{PeerDropReason, PeerSocket};
use crate::source::replay::FetchBound;
use crate::source::upstream::{UNDECODABLE, UNKNOWN_RANK};
use crate::source::{recorded, trace};
use crate::state::tier::Tier;
use crate::store::Damage;

/// Every label value kvgate can export, by metric family.
pub fn closed_labels() -> ClosedLabels {
    ClosedLabels {
        engine_events: EventKind::ALL
            .map(EventKind::as_str)
            .into_iter()
            .chain([DROPPED_EVENTS])
            .collect(),
        state_block_tiers: Tier::REPORTED.map(Tier::label).into(),
        events_dropped: DropReason::ALL
            .map(DropReason::as_str)
            .into_iter()
            .chain([OVERSIZED_EVENT])
            .collect(),
        bad_messages: FrameError::ALL
            .map(FrameError::as_str)
            .into_iter()
            .chain(PayloadError::REASONS)
            .chain([
                UNDECODABLE,
                UNKNOWN_RANK,
                recorded::UNDECODABLE,
                trace::MALFORMED_LINE,
            ])
            .collect(),
        zmq_peer_sockets: PeerSocket::ALL.map(PeerSocket::as_str).into(),
        zmq_peers_dropped: PeerDropReason::ALL.map(PeerDropReason::as_str).into(),
        tls_handshake_failures: HandshakeFailure::ALL.map(HandshakeFailure::as_str).into(),
        auth_failures: AuthFailure::ALL.map(AuthFailure::as_str).into(),
        connections_refused: Refusal::ALL.map(Refusal::as_str).into(),
        connections_closed: Closure::ALL.map(Closure::as_str).into(),
        admin_connections_closed: AdminClosure::ALL.map(AdminClosure::as_str).into(),
        credential_reloads: ReloadResult::ALL.map(ReloadResult::as_str).into(),
        load_polls: PollOutcome::ALL.map(PollOutcome::as_str).into(),
        load_answer_faults: Fault::ALL.map(Fault::as_str).into(),
        load_push_faults: PushFault::ALL.map(PushFault::as_str).into(),
        load_record_sources: LoadSource::ALL.map(LoadSource::as_str).into(),
        replay_bounds: FetchBound::ALL.map(FetchBound::as_str).into(),
        state_damaged: Damage::ALL.map(Damage::as_str).into(),
    }
}
