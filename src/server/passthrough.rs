//! Pass-through of every RPC kvgate does not serve itself to the engine's
//! own gRPC server, so a router can point at kvgate instead of the engine.
//!
//! Invariant: requests and responses travel as HTTP/2 messages, never
//! decoded: headers (metadata, `grpc-timeout`), body frames and trailers
//! (status) go through as they are, over one shared connection. A client
//! that cancels drops the forwarded request, which resets the engine's
//! stream too; an engine that resets ends the client's stream.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body::{Body as HttpBody, Frame};
use tonic::Status;
use tonic::body::Body;
use tonic::transport::{Channel, Endpoint};
use tower::{Service, ServiceExt};
use tracing::debug;

use crate::metrics::Metrics;

/// Forwards HTTP/2 gRPC requests to the engine.
#[derive(Clone)]
pub struct PassThrough {
    channel: Channel,
    /// Named in errors, so an operator sees which address failed.
    target: String,
    metrics: Metrics,
}

impl PassThrough {
    /// Prepares a lazily connected channel: kvgate starts even when the
    /// engine's server is not up yet, and reconnects when it comes back.
    pub fn new(target: &str, metrics: Metrics) -> anyhow::Result<Self> {
        let endpoint = Endpoint::from_shared(target.to_owned())
            .map_err(|error| anyhow::anyhow!("--engine-grpc {target}: {error}"))?;
        Ok(Self {
            channel: endpoint.connect_lazy(),
            target: target.to_owned(),
            metrics,
        })
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
        let mut channel = self.channel.clone();
        let target = self.target.clone();
        let metrics = self.metrics.clone();
        let method = request.uri().path().to_owned();
        Box::pin(async move {
            let request = request.map(Body::new);
            let forwarded = match channel.ready().await {
                Ok(ready) => ready.call(request).await,
                Err(error) => Err(error),
            };
            let response = match forwarded {
                Ok(response) => response,
                Err(error) => {
                    debug!(%method, %error, "engine gRPC server unreachable");
                    let status = Status::unavailable(format!(
                        "kvgate could not reach the engine's gRPC server at {target}: {error}"
                    ));
                    metrics.count_pass_through(&method, status.code() as i32);
                    return Ok(status.into_http());
                }
            };
            // A trailers-only response carries its status in the headers.
            if let Some(code) = grpc_status(response.headers()) {
                metrics.count_pass_through(&method, code);
                return Ok(response);
            }
            Ok(response.map(|body| {
                Body::new(CountStatus {
                    inner: body,
                    method,
                    metrics,
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
    method: String,
    metrics: Metrics,
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
            self.metrics.count_pass_through(&self.method, code);
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
