//! What kvgate accepts from a ZMQ peer, and what it does with one that
//! breaks the rules.
//!
//! Invariant: no frame or message larger than `--zmq-max-message-bytes` is
//! ever buffered, whatever length a peer announces. The (patched) zeromq
//! codec checks each frame's announced length before reserving anything for
//! it and refuses the message; the socket then drops that connection (a
//! connecting SUB reconnects) and serves its other peers. Every dropped
//! connection kvgate learns of is counted by socket and reason, and warned
//! about at most once a second per socket with the endpoint it was on. No
//! peer holds a connection longer than [`HANDSHAKE_TIMEOUT`] without
//! completing the ZMTP handshake.

use tracing::warn;
use zeromq::{CodecError, SocketOptions, ZmqError};

use crate::metrics::Metrics;

/// `--zmq-max-message-bytes`'s default (64MiB), for the socket tests.
#[cfg(test)]
pub const DEFAULT_MAX_MESSAGE_BYTES: u64 = 64 << 20;

/// The range `--zmq-max-message-bytes` accepts: room for a real batch at
/// the bottom, and a bound kvgate can afford per connection at the top.
pub const MAX_MESSAGE_BYTES_RANGE: std::ops::RangeInclusive<u64> = (64 << 10)..=(1 << 30);

/// How long a peer may take to complete the ZMTP handshake. An engine
/// answers on loopback in well under a millisecond; a peer that accepts and
/// then says nothing (a hung process at the port or socket path) would
/// otherwise hold a connecting socket, or its reconnection, for good.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Options for every ZMQ socket kvgate opens towards an engine.
pub fn socket_options(max_message_bytes: usize) -> SocketOptions {
    let mut options = SocketOptions::default();
    options
        .max_message_size(max_message_bytes)
        .handshake_timeout(HANDSHAKE_TIMEOUT);
    options
}

/// Which of kvgate's sockets a dropped peer was on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerSocket {
    /// A rank's SUB, bound or connected to one of the engine's publishers
    /// (KV events or load).
    Sub,
    /// A DEALER asking the engine's replay ROUTER for lost messages.
    Replay,
}

impl PeerSocket {
    pub const ALL: [Self; 2] = [Self::Sub, Self::Replay];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sub => "sub",
            Self::Replay => "replay",
        }
    }
}

/// Why a peer connection was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerDropReason {
    /// It announced a frame or message over `--zmq-max-message-bytes`.
    MessageTooLarge,
    /// It sent something that is not ZMTP (bad greeting, command or frame).
    ProtocolError,
    /// The connection failed under it (reset, truncated frame).
    ConnectionError,
}

impl PeerDropReason {
    pub const ALL: [Self; 3] = [
        Self::MessageTooLarge,
        Self::ProtocolError,
        Self::ConnectionError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::MessageTooLarge => "message_too_large",
            Self::ProtocolError => "protocol_error",
            Self::ConnectionError => "connection_error",
        }
    }

    /// The reason behind a socket error that cost a peer its connection;
    /// `None` for errors that involve no peer (the socket itself).
    pub fn of(error: &ZmqError) -> Option<Self> {
        match error {
            ZmqError::Codec(CodecError::MessageTooLarge { .. }) => Some(Self::MessageTooLarge),
            ZmqError::Codec(CodecError::Io(_)) | ZmqError::Network(_) => {
                Some(Self::ConnectionError)
            }
            ZmqError::Codec(_) | ZmqError::UnsupportedVersion(_) | ZmqError::PeerIdentity => {
                Some(Self::ProtocolError)
            }
            _ => None,
        }
    }
}

/// Counts and (rate-limited) logs a peer connection the socket dropped
/// because of `error`. Returns false when `error` involved no peer.
pub fn record_dropped_peer(
    metrics: &Metrics,
    socket: PeerSocket,
    endpoint: &str,
    error: &ZmqError,
) -> bool {
    let Some(reason) = PeerDropReason::of(error) else {
        return false;
    };
    metrics.count_dropped_peer(socket.as_str(), reason.as_str());
    let key = match socket {
        PeerSocket::Sub => "zmq_sub_peer_dropped",
        PeerSocket::Replay => "zmq_replay_peer_dropped",
    };
    crate::logging::rate_limited(key, || {
        warn!(
            socket = socket.as_str(),
            endpoint,
            reason = reason.as_str(),
            %error,
            "dropped a ZMQ peer connection"
        );
    });
    true
}

/// Every peer connection dropped on the sockets counted in `metrics`,
/// whatever the socket and the reason.
pub fn all_dropped_peers(metrics: &Metrics) -> u64 {
    PeerSocket::ALL
        .into_iter()
        .flat_map(|socket| PeerDropReason::ALL.map(|reason| (socket, reason)))
        .map(|(socket, reason)| metrics.dropped_peers(socket.as_str(), reason.as_str()))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversized_message_is_told_apart_from_other_protocol_errors() {
        let too_large = ZmqError::Codec(CodecError::MessageTooLarge {
            size: 1 << 40,
            max: 1 << 20,
        });
        assert_eq!(
            PeerDropReason::of(&too_large),
            Some(PeerDropReason::MessageTooLarge)
        );
        let garbage = ZmqError::Codec(CodecError::Decode("Bad first byte of greeting"));
        assert_eq!(
            PeerDropReason::of(&garbage),
            Some(PeerDropReason::ProtocolError)
        );
        let reset = ZmqError::Network(std::io::ErrorKind::ConnectionReset.into());
        assert_eq!(
            PeerDropReason::of(&reset),
            Some(PeerDropReason::ConnectionError)
        );
        assert_eq!(PeerDropReason::of(&ZmqError::NoMessage), None);
    }

    #[test]
    fn a_dropped_peer_is_counted_under_its_socket_and_reason() {
        let metrics = Metrics::new(crate::metrics::ClosedLabels {
            zmq_peer_sockets: PeerSocket::ALL.map(PeerSocket::as_str).into(),
            zmq_peers_dropped: PeerDropReason::ALL.map(PeerDropReason::as_str).into(),
            ..Default::default()
        });
        let error = ZmqError::Codec(CodecError::MessageTooLarge {
            size: 1 << 40,
            max: 1 << 20,
        });
        assert!(record_dropped_peer(
            &metrics,
            PeerSocket::Replay,
            "tcp://127.0.0.1:1",
            &error
        ));
        let rendered = metrics.render();
        assert!(rendered.contains(
            r#"kvgate_zmq_peers_dropped_total{socket="replay",reason="message_too_large"} 1"#
        ));
        assert!(rendered.contains(
            r#"kvgate_zmq_peers_dropped_total{socket="sub",reason="message_too_large"} 0"#
        ));
    }
}
