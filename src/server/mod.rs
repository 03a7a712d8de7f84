//! The gRPC front: `SubscribeKvEvents` under every service name, health,
//! reflection, and every other RPC passed through to the engine (or
//! answered UNIMPLEMENTED when there is no engine server to pass it to).

pub mod admin;
pub mod auth;
pub mod codec;
pub mod passthrough;
pub mod reload;
pub mod subscribe;
pub mod tls;
pub mod tls_listener;

use std::future::Future;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::service::Routes;
use tonic_health::ServingStatus;

use crate::hub::HubReader;
use crate::metrics::Metrics;
use subscribe::SubscribeService;

/// Every fully-qualified service that serves `SubscribeKvEvents` (contract
/// section 1), all backed by the same hub.
pub const SUBSCRIBE_SERVICES: [&str; 5] = [
    "sglang.grpc.scheduler.SglangScheduler",
    "vllm.grpc.engine.VllmEngine",
    "trtllm.TrtllmService",
    "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
    "kvgate.v1.KvGate",
];

/// What the gRPC server needs from the rest of kvgate.
pub struct ServerParts {
    pub hub: HubReader,
    pub metrics: Metrics,
    /// Becomes true once the event source is up; health reports SERVING then.
    pub source_ready: watch::Receiver<bool>,
    /// Where RPCs other than `SubscribeKvEvents` go, if anywhere.
    pub pass_through: Option<passthrough::PassThrough>,
    /// TLS on the gRPC port, when configured.
    pub tls: Option<tls::TlsAcceptor>,
    /// The bearer tokens every call but health needs, when configured.
    pub tokens: Option<auth::Tokens>,
}

/// Builds every route of the server.
pub fn routes(
    parts: &ServerParts,
) -> anyhow::Result<(axum::Router, tonic_health::server::HealthReporter)> {
    let (health, health_service) = tonic_health::server::health_reporter();
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let mut router = Routes::default()
        .add_service(health_service)
        .add_service(reflection().build_v1()?)
        .add_service(reflection().build_v1alpha()?)
        .into_axum_router();
    let subscribe = SubscribeService::new(parts.hub.clone(), parts.metrics.clone());
    for service in SUBSCRIBE_SERVICES {
        let subscribe = subscribe.clone();
        router = router.route_service(
            &format!("/{service}/SubscribeKvEvents"),
            tower::ServiceExt::map_request(
                subscribe,
                |request: http::Request<axum::body::Body>| request.map(tonic::body::Body::new),
            ),
        );
    }
    if let Some(pass_through) = parts.pass_through.clone() {
        router = router.fallback_service(pass_through);
    }
    if let Some(tokens) = parts.tokens.clone() {
        router = router.layer(auth::RequireToken::new(tokens, parts.metrics.clone()));
    }
    Ok((router, health))
}

/// Serves until `shutdown` resolves, then waits for open streams to end
/// (closing the hub ends them).
///
/// Served by hyper through `axum::serve` rather than tonic's `Server`: tonic's
/// server enforces `grpc-timeout` itself and answers CANCELLED on expiry,
/// which would replace the engine's own DEADLINE_EXCEEDED on passed-through
/// calls. Deadlines are the engine's (and the client's) to enforce.
pub async fn serve(
    listener: TcpListener,
    parts: ServerParts,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (routes, health) = routes(&parts)?;
    let names = std::iter::once("").chain(SUBSCRIBE_SERVICES);
    for name in names.clone() {
        health
            .set_service_status(name, ServingStatus::NotServing)
            .await;
    }
    let mut source_ready = parts.source_ready;
    tokio::spawn(async move {
        if source_ready.wait_for(|ready| *ready).await.is_ok() {
            for name in names {
                health
                    .set_service_status(name, ServingStatus::Serving)
                    .await;
            }
        }
    });
    if let Some(acceptor) = parts.tls {
        let listener = tls_listener::TlsListener::new(listener, acceptor)?;
        axum::serve(listener, routes)
            .with_graceful_shutdown(shutdown)
            .await?;
        return Ok(());
    }
    // Small batches must not wait for Nagle's algorithm.
    let listener = listener.tap_io(|stream| {
        let _ = stream.set_nodelay(true);
    });
    axum::serve(listener, routes)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}
