//! The accept loop of the admin port (`/metrics`, `/healthz`, `/status`)
//! and of `kvgate index`'s port: HTTP/1.1 (and on the index's port also
//! gRPC, HTTP/2 with prior knowledge, told apart by the connection's first
//! bytes), every connection bounded, as the gRPC port's are.
//!
//! Invariants:
//! - At most `--metrics-max-connections` connections are open; one more is
//!   accepted, answered `503` and closed at once (counted), so a flood never
//!   holds more descriptors than that and never waits in the kernel's
//!   backlog. `fd_limit` reserves those descriptors beside the gRPC port's.
//! - A request's headers must arrive whole within
//!   `--metrics-header-timeout-ms` of the connection's turn to read them
//!   (at its start, or after the previous response), so a half-sent request
//!   or an idle keep-alive connection cannot hold a slot; at most
//!   `MAX_REQUEST_HEAD_BYTES` of them are buffered. The connection's first
//!   bytes (at most the HTTP/2 preface's 24, which choose the protocol)
//!   are held to the same timeout, so a peer that stalls before its
//!   protocol is known is closed as soon. An HTTP/2 connection's streams
//!   are bounded by hyper's defaults and the idle timeout.
//! - A connection that moves no byte either way for
//!   `--metrics-idle-timeout-ms` (a client that stopped reading its
//!   response) is closed.
//! - On shutdown, accepting stops and every connection finishes its
//!   response, then closes.

use std::convert::Infallible;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tower::ServiceExt;
use tracing::debug;

use super::accept::serve_bounded;
use super::connection::Open;
use super::preface::sniff;
use super::progress::{Progress, Watched};
use crate::metrics::{Metrics, ReasonLabel};

/// Request line and headers buffered per connection (hyper's smallest
/// buffer); a Prometheus scrape or a probe sends a few hundred bytes.
pub const MAX_REQUEST_HEAD_BYTES: usize = 8192;

/// The answer to a connection over `--metrics-max-connections`.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
    connection: close\r\ncontent-type: text/plain\r\ncontent-length: 49\r\n\r\n\
    kvgate: too many connections on the metrics port\n";

/// The bounds every connection of the admin port is held to.
#[derive(Clone, Debug)]
pub struct AdminLimits {
    pub max_connections: u32,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

/// What a port's connections may speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocols {
    /// HTTP/1.1 only (the admin port).
    Http1,
    /// HTTP/1.1, or gRPC over HTTP/2 with prior knowledge (h2c), chosen by
    /// the connection's first bytes (`kvgate index`'s port).
    Http1AndGrpc,
}

/// Why kvgate closed an admin connection before its client did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdminClosure {
    /// A request's headers did not arrive within `--metrics-header-timeout-ms`.
    HeaderTimeout,
    /// No byte moved for `--metrics-idle-timeout-ms`.
    Idle,
}

impl AdminClosure {
    pub const ALL: [Self; 2] = [Self::HeaderTimeout, Self::Idle];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::HeaderTimeout => "header_timeout",
            Self::Idle => "idle",
        }
    }
}

/// Serves `routes` on `listener` until `shutdown` resolves, then waits for
/// every connection to end.
pub(crate) async fn serve(
    listener: TcpListener,
    routes: axum::Router,
    protocols: Protocols,
    limits: AdminLimits,
    metrics: Metrics,
    shutdown: impl Future<Output = ()>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_REQUEST_HEAD_BYTES);
    builder.http2().timer(TokioTimer::new());
    if protocols == Protocols::Http1 {
        builder = builder.http1_only();
    }
    let shared = Arc::new(Shared {
        builder,
        header_timeout: limits.header_timeout,
        routes,
        idle_timeout: limits.idle_timeout,
        metrics,
    });
    serve_bounded(
        listener,
        "metrics port",
        limits.max_connections,
        shutdown,
        |stream| refuse(&stream, &shared.metrics),
        |stream, stopped| {
            // An answer written in several parts (HTTP/2's headers, data
            // and trailers) must not wait for Nagle's algorithm.
            let _ = stream.set_nodelay(true);
            let shared = Arc::clone(&shared);
            async move { connection(stream, &shared, stopped).await }
        },
    )
    .await;
}

/// What every connection task shares.
struct Shared {
    builder: auto::Builder<TokioExecutor>,
    /// Also the bound on the first bytes, which tell HTTP/1.1 from gRPC.
    header_timeout: Duration,
    routes: axum::Router,
    idle_timeout: Duration,
    metrics: Metrics,
}

/// Answers `503` without waiting (a peer that does not read gets nothing)
/// and closes the connection.
fn refuse(stream: &TcpStream, metrics: &Metrics) {
    debug!("metrics port: connection refused, --metrics-max-connections are open");
    metrics.admin_connections_refused.inc();
    let _ = stream.try_write(BUSY);
}

/// Serves one accepted connection to its end.
async fn connection(stream: TcpStream, shared: &Shared, mut stopped: watch::Receiver<bool>) {
    let metrics = &shared.metrics;
    let _open = Open::count(&metrics.admin_connections);
    // The first bytes must come within the header timeout whichever
    // protocol they turn out to be (hyper's own timeout starts after them).
    let sniffed = tokio::select! {
        sniffed = tokio::time::timeout(shared.header_timeout, sniff(stream)) => sniffed,
        _ = stopped.wait_for(|stopped| *stopped) => return,
    };
    let stream = match sniffed {
        Ok(Ok((_, replayed))) => replayed,
        Ok(Err(error)) => {
            debug!(%error, "metrics port: peer left before its first request");
            return;
        }
        Err(_) => return close(metrics, AdminClosure::HeaderTimeout),
    };
    let progress = Progress::new();
    let io = Watched {
        io: stream,
        progress: progress.clone(),
    };
    let routes = shared.routes.clone();
    let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
        let call = routes.clone().oneshot(request);
        async move { Ok::<_, Infallible>(call.await.unwrap_or_else(|never| match never {})) }
    });
    let mut served = pin!(shared.builder.serve_connection(TokioIo::new(io), service));
    let ended = tokio::select! {
        ended = served.as_mut() => Some(ended),
        _ = stopped.wait_for(|stopped| *stopped) => None,
        () = progress.stalled_for(shared.idle_timeout) => {
            return close(metrics, AdminClosure::Idle);
        }
    };
    let ended = match ended {
        Some(ended) => ended,
        None => {
            served.as_mut().graceful_shutdown();
            tokio::select! {
                ended = served.as_mut() => ended,
                () = progress.stalled_for(shared.idle_timeout) => Ok(()),
            }
        }
    };
    if let Err(error) = ended {
        let timed_out = error
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_timeout);
        if timed_out {
            close(metrics, AdminClosure::HeaderTimeout);
        }
        debug!(%error, "metrics port: connection ended with an error");
    }
}

fn close(metrics: &Metrics, closure: AdminClosure) {
    debug!(
        reason = closure.as_str(),
        "metrics port: closing a connection"
    );
    metrics
        .admin_connections_closed
        .get_or_create(&ReasonLabel {
            reason: closure.as_str(),
        })
        .inc();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busy_answer_states_the_length_of_its_body() {
        let answer = std::str::from_utf8(BUSY).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        let length = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length: "))
            .unwrap();
        assert_eq!(length.parse::<usize>().unwrap(), body.len());
    }
}
