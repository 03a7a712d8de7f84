//! Pass-through of every RPC kvgate does not serve itself to the engine's
//! own gRPC server, so a router can point at kvgate instead of the engine.
//!
//! Invariant: requests and responses travel as HTTP/2 messages, never
//! decoded: headers (metadata, `grpc-timeout`), body frames and trailers
//! (status) go through as they are, over one shared HTTP/2 connection
//! (hyper's pooled client, straight from the serving task: no queue hop in
//! between). A client that cancels drops the forwarded request, which resets
//! the engine's stream too; an engine that resets ends the client's stream.
//! A method path longer than `--pass-through-max-path-bytes` is refused
//! before it is forwarded, and calls are counted under a label from the
//! closed set of `methods`, never the path a client sent.
//!
//! Invariant: a client that stops reading never holds back another call.
//! Unread response bytes wait in their stream's HTTP/2 receive window, and
//! on a shared connection they also use up the connection's window; so the
//! connection window is the stream window times the most calls forwarded at
//! once (`PassThroughLimits`), and one call over that cap is refused rather
//! than queued behind the stalled ones. What unread calls can hold is
//! therefore at most that product. kvgate's own calls (`GetLoads`) ride a
//! connection of their own, so no forwarded call can delay them.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body::{Body as HttpBody, Frame};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;
use tonic::body::Body;
use tower::Service;
use tracing::debug;

use crate::client::{EngineTransport, TlsFlags, TlsPaths};
use crate::metrics::Metrics;
use crate::server::methods;

/// HTTP/2's largest flow-control window (RFC 9113, section 6.9.1).
const MAX_WINDOW: u64 = (1 << 31) - 1;

/// How much forwarding may hold.
#[derive(Clone, Copy, Debug)]
pub struct PassThroughLimits {
    /// Longer method paths are refused, never forwarded.
    pub max_path_bytes: usize,
    /// Most calls forwarded at once; one more is refused.
    pub max_streams: u32,
    /// Each forwarded call's receive window towards the engine: the most
    /// response bytes it holds while its client does not read.
    pub stream_window: u32,
}

/// Why the limits cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    #[error(
        "{max_streams} streams × {stream_window} bytes of window need a connection window \
         of {needed} bytes, over HTTP/2's largest ({MAX_WINDOW})"
    )]
    WindowTooLarge {
        max_streams: u32,
        stream_window: u32,
        needed: u64,
    },
}

impl PassThroughLimits {
    /// The engine connection's window: room for every stream's window, so
    /// that unread streams never exhaust it.
    pub fn connection_window(&self) -> Result<u32, LimitsError> {
        let needed = u64::from(self.max_streams) * u64::from(self.stream_window);
        u32::try_from(needed)
            .ok()
            .filter(|&window| u64::from(window) <= MAX_WINDOW)
            .ok_or(LimitsError::WindowTooLarge {
                max_streams: self.max_streams,
                stream_window: self.stream_window,
                needed,
            })
    }
}

/// Forwards HTTP/2 gRPC requests to the engine.
#[derive(Clone)]
pub struct PassThrough {
    /// Forwarded calls only.
    client: EngineTransport,
    /// kvgate's own calls, on another connection.
    own_calls: EngineTransport,
    /// Scheme and authority of the engine's server, put on every request.
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// The engine's address and the flag that set it, named in errors so
    /// an operator sees which address failed.
    target: String,
    /// Longer method paths are refused, never forwarded.
    max_path_bytes: usize,
    /// One permit per forwarded call, held until its response ends.
    streams: Arc<Semaphore>,
    max_streams: u32,
    metrics: Metrics,
}

impl PassThrough {
    /// Connects on first use: kvgate starts even when the engine's server is
    /// not up yet, and reconnects when it comes back. TLS files are read
    /// now, so bad ones stop the start; errors name the engine's address
    /// and TLS files as `flags` says the operator gave them.
    pub fn new(
        target: &str,
        tls: &TlsPaths,
        flags: TlsFlags,
        limits: PassThroughLimits,
        metrics: Metrics,
    ) -> anyhow::Result<Self> {
        let connection_window = limits.connection_window()?;
        let uri: http::Uri = target
            .parse()
            .map_err(|error| anyhow::anyhow!("{} {target}: {error}", flags.uri))?;
        let (Some(scheme), Some(authority)) = (uri.scheme().cloned(), uri.authority().cloned())
        else {
            anyhow::bail!(
                "{} {target}: expected http://HOST:PORT or https://HOST:PORT",
                flags.uri
            );
        };
        let connector = crate::client::connector(&uri, tls, flags)?;
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .http2_initial_stream_window_size(limits.stream_window)
            .http2_initial_connection_window_size(connection_window)
            .build(connector.clone());
        // Each client keeps its own connection: the poller never shares one
        // with a forwarded call.
        let own_calls = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build(connector);
        Ok(Self {
            client,
            own_calls,
            scheme,
            authority,
            target: format!("{target} ({})", flags.uri),
            max_path_bytes: limits.max_path_bytes,
            streams: Arc::new(Semaphore::new(limits.max_streams as usize)),
            max_streams: limits.max_streams,
            metrics,
        })
    }

    /// A connection pool to the engine and its origin, for kvgate's own
    /// calls (`GetLoads`): they reach the engine as forwarded ones do, on a
    /// connection no forwarded call uses.
    pub fn engine_transport(&self) -> (EngineTransport, http::Uri) {
        let origin = http::Uri::from_parts({
            let mut parts = http::uri::Parts::default();
            parts.scheme = Some(self.scheme.clone());
            parts.authority = Some(self.authority.clone());
            parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
            parts
        })
        .expect("scheme and authority came from a parsed URI");
        (self.own_calls.clone(), origin)
    }

    /// The request's path on the engine's origin.
    fn engine_uri(&self, uri: &http::Uri) -> http::Uri {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = uri.path_and_query().cloned();
        http::Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
    }
}

impl Service<http::Request<axum::body::Body>> for PassThrough {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        let client = self.client.clone();
        let target = self.target.clone();
        let metrics = self.metrics.clone();
        let path = request.uri().path();
        if path.len() > self.max_path_bytes {
            let status = Status::resource_exhausted(format!(
                "method path of {} bytes is longer than the {} bytes kvgate passes through \
                 (--pass-through-max-path-bytes)",
                path.len(),
                self.max_path_bytes
            ));
            metrics.count_pass_through(methods::OTHER, status.code() as i32);
            return Box::pin(std::future::ready(Ok(status.into_http())));
        }
        let method = methods::label(path);
        let Ok(permit) = Arc::clone(&self.streams).try_acquire_owned() else {
            let status = Status::resource_exhausted(format!(
                "{} calls are already passed through to the engine \
                 (--pass-through-max-streams)",
                self.max_streams
            ));
            metrics.count_pass_through(method, status.code() as i32);
            return Box::pin(std::future::ready(Ok(status.into_http())));
        };
        let (mut parts, body) = request.into_parts();
        parts.uri = self.engine_uri(&parts.uri);
        let request = http::Request::from_parts(parts, Body::new(body));
        Box::pin(async move {
            let response = match client.request(request).await {
                Ok(response) => response,
                Err(error) => {
                    let error = crate::connect_error::describe(&error);
                    debug!(%method, %error, "engine gRPC server unreachable");
                    let status = Status::unavailable(format!(
                        "kvgate could not reach the engine's gRPC server at {target}: {error}"
                    ));
                    metrics.count_pass_through(method, status.code() as i32);
                    return Ok(status.into_http());
                }
            };
            let response = response.map(Body::new);
            // A trailers-only response carries its status in the headers.
            if let Some(code) = grpc_status(response.headers()) {
                metrics.count_pass_through(method, code);
                return Ok(response);
            }
            Ok(response.map(|body| {
                Body::new(CountStatus {
                    inner: body,
                    method,
                    metrics,
                    _permit: permit,
                })
            }))
        })
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<i32> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

/// A response body that passes every frame on and counts the call's status
/// when the trailers go by.
struct CountStatus {
    inner: Body,
    method: &'static str,
    metrics: Metrics,
    /// The call's place under `--pass-through-max-streams`, freed when the
    /// client is done with the body (and the engine's stream is reset).
    _permit: OwnedSemaphorePermit,
}

impl HttpBody for CountStatus {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(code) = frame.trailers_ref().and_then(grpc_status)
        {
            self.metrics.count_pass_through(self.method, code);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
