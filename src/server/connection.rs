//! The accept loop of the gRPC port: HTTP/2 only, every connection bounded.
//!
//! Invariants:
//! - At most `--max-connections` connections are open; one more is accepted
//!   and closed at once (counted), so it neither waits in the kernel's
//!   backlog nor takes a file descriptor the admin port or the engine
//!   sockets need.
//! - A connection is served only after its handshake (the acceptor's, then
//!   the HTTP/2 preface) completes within `--handshake-timeout-ms`.
//! - A served connection ends when its peer closes it, when it has had no
//!   open stream for `--idle-timeout-ms`, or when its peer leaves a keepalive
//!   PING unanswered for `--http2-keepalive-timeout-ms` (a peer that stopped
//!   reading its socket, or vanished, cannot hold a connection).
//! - On shutdown, accepting stops and every connection is told to finish
//!   (GOAWAY); open streams run to their end (closing the hub ends the
//!   subscriber streams), and the loop returns once every connection is gone.

use std::convert::Infallible;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tower::ServiceExt;
use tracing::debug;

use super::accept::{Acceptor, serve_bounded};
use super::activity::{Activity, Tracked};
use super::preface::{NotServed, expect_preface};
use crate::metrics::{Metrics, ReasonLabel};

/// The bounds every connection of the gRPC port is held to.
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    pub max_connections: u32,
    pub handshake_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_concurrent_streams: u32,
    pub max_header_list_bytes: u32,
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    pub max_pending_accept_reset_streams: u32,
}

impl ConnectionLimits {
    fn http2(&self) -> http2::Builder<TokioExecutor> {
        let mut builder = http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .max_concurrent_streams(self.max_concurrent_streams)
            .max_header_list_size(self.max_header_list_bytes)
            .keep_alive_interval(self.keepalive_interval)
            .keep_alive_timeout(self.keepalive_timeout)
            .max_pending_accept_reset_streams(self.max_pending_accept_reset_streams as usize);
        builder
    }
}

/// Why a connection was closed before it was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `--max-connections` were already open.
    MaxConnections,
    /// The handshake did not complete within `--handshake-timeout-ms`.
    HandshakeTimeout,
    /// The acceptor's handshake failed, or the peer left before the preface.
    HandshakeFailed,
    /// The peer spoke something other than HTTP/2 (HTTP/1.1, most likely).
    NotHttp2,
}

impl Refusal {
    pub const ALL: [Self; 4] = [
        Self::MaxConnections,
        Self::HandshakeTimeout,
        Self::HandshakeFailed,
        Self::NotHttp2,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::MaxConnections => "max_connections",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::HandshakeFailed => "handshake_failed",
            Self::NotHttp2 => "not_http2",
        }
    }
}

/// Why kvgate closed a connection it was serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closure {
    /// No stream was open for `--idle-timeout-ms`.
    Idle,
    /// A keepalive PING went unanswered for `--http2-keepalive-timeout-ms`.
    KeepaliveTimeout,
}

impl Closure {
    pub const ALL: [Self; 2] = [Self::Idle, Self::KeepaliveTimeout];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::KeepaliveTimeout => "keepalive_timeout",
        }
    }
}

/// What every connection task shares.
struct Shared<A> {
    acceptor: A,
    limits: ConnectionLimits,
    http2: http2::Builder<TokioExecutor>,
    routes: axum::Router,
    metrics: Metrics,
}

/// Accepts on `listener` until `shutdown` resolves, then waits for every
/// connection to end.
pub(crate) async fn serve<A: Acceptor>(
    listener: TcpListener,
    acceptor: A,
    limits: ConnectionLimits,
    routes: axum::Router,
    metrics: Metrics,
    shutdown: impl Future<Output = ()>,
) {
    let max_connections = limits.max_connections;
    let shared = Arc::new(Shared {
        acceptor,
        http2: limits.http2(),
        limits,
        routes,
        metrics,
    });
    serve_bounded(
        listener,
        "gRPC port",
        max_connections,
        shutdown,
        |_| refuse(&shared.metrics, Refusal::MaxConnections),
        |stream, stopped| {
            // Small batches must not wait for Nagle's algorithm.
            let _ = stream.set_nodelay(true);
            let shared = Arc::clone(&shared);
            async move { connection(stream, &shared, stopped).await }
        },
    )
    .await;
}

fn refuse(metrics: &Metrics, refusal: Refusal) {
    debug!(reason = refusal.as_str(), "gRPC port: connection refused");
    metrics
        .connections_refused
        .get_or_create(&ReasonLabel {
            reason: refusal.as_str(),
        })
        .inc();
}

/// Serves one accepted connection to its end.
async fn connection<A: Acceptor>(
    stream: TcpStream,
    shared: &Shared<A>,
    mut stopped: watch::Receiver<bool>,
) {
    let metrics = &shared.metrics;
    let _open = Open::count(&metrics.connections);
    let handshake = async {
        let io = shared.acceptor.accept(stream).await.map_err(|error| {
            debug!(%error, "gRPC port: handshake failed");
            Refusal::HandshakeFailed
        })?;
        expect_preface(io)
            .await
            .map_err(|not_served| match not_served {
                NotServed::NotHttp2 => Refusal::NotHttp2,
                NotServed::Closed(error) => {
                    debug!(%error, "gRPC port: peer left before the HTTP/2 preface");
                    Refusal::HandshakeFailed
                }
            })
    };
    let io = tokio::select! {
        shaken = tokio::time::timeout(shared.limits.handshake_timeout, handshake) => {
            match shaken {
                Ok(Ok(io)) => io,
                Ok(Err(refusal)) => return refuse(metrics, refusal),
                Err(_) => return refuse(metrics, Refusal::HandshakeTimeout),
            }
        }
        _ = stopped.wait_for(|stopped| *stopped) => return,
    };

    let activity = Activity::default();
    let service = {
        let activity = activity.clone();
        let routes = shared.routes.clone();
        hyper::service::service_fn(move |request: http::Request<Incoming>| {
            let stream = activity.stream_opened();
            let call = routes.clone().oneshot(request);
            async move {
                let response = call.await?;
                Ok::<_, Infallible>(response.map(|body| Tracked {
                    body,
                    _stream: stream,
                }))
            }
        })
    };
    let mut served = pin!(shared.http2.serve_connection(TokioIo::new(io), service));
    let ended = tokio::select! {
        ended = served.as_mut() => Some(ended),
        _ = stopped.wait_for(|stopped| *stopped) => None,
        () = activity.idle_for(shared.limits.idle_timeout) => {
            close(metrics, Closure::Idle);
            None
        }
    };
    let ended = match ended {
        Some(ended) => ended,
        None => {
            served.as_mut().graceful_shutdown();
            served.await
        }
    };
    if let Err(error) = ended {
        if is_keepalive_timeout(&error) {
            close(metrics, Closure::KeepaliveTimeout);
        }
        debug!(%error, "gRPC port: connection ended with an error");
    }
}

fn close(metrics: &Metrics, closure: Closure) {
    debug!(reason = closure.as_str(), "gRPC port: closing a connection");
    metrics
        .connections_closed
        .get_or_create(&ReasonLabel {
            reason: closure.as_str(),
        })
        .inc();
}

/// hyper reports an unanswered keepalive PING only through its error's
/// source, a private type whose message is all there is to match.
fn is_keepalive_timeout(error: &hyper::Error) -> bool {
    std::error::Error::source(error)
        .is_some_and(|source| source.to_string() == "keep-alive timed out")
}

/// Keeps an open-connections gauge right however the task ends.
pub(super) struct Open<'a>(&'a Gauge);

impl<'a> Open<'a> {
    /// Counts one more connection open in `gauge` until dropped.
    pub(super) fn count(gauge: &'a Gauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}
