//! The gRPC front: `SubscribeKvEvents` under every service name, health,
//! reflection, and every other RPC passed through to the engine (or
//! answered UNIMPLEMENTED when there is no engine server to pass it to).

pub(crate) mod accept;
mod activity;
pub(crate) mod admin;
pub(crate) mod admin_connection;
pub(crate) mod auth;
pub(crate) mod connection;
pub(crate) mod fd_limit;
mod health;
pub(crate) mod index_grpc;
pub(crate) mod index_http;
mod index_query_body;
mod methods;
pub(crate) mod passthrough;
mod preface;
mod progress;
pub(crate) mod reload;
pub(crate) mod request_limit;
pub(crate) mod stream_body;
pub(crate) mod subscribe;
pub(crate) mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tonic::server::NamedService;
use tonic::service::Routes;

use crate::health::HealthWatch;
use crate::hub::HubReader;
use crate::index::registry::Registry;
use crate::metrics::Metrics;
use subscribe::{SubscribeLimits, SubscribeService};

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
    /// Where subscribers read batches from.
    pub hub: HubReader,
    /// Where the services count what they serve.
    pub metrics: Metrics,
    /// What the health service reports.
    pub health: HealthWatch,
    /// Where RPCs other than `SubscribeKvEvents` go, if anywhere.
    pub pass_through: Option<passthrough::PassThrough>,
    /// The bounds of every connection.
    pub limits: connection::ConnectionLimits,
    /// The bounds of subscriber streams.
    pub subscribe_limits: SubscribeLimits,
    /// TLS on the gRPC port, when configured.
    pub tls: Option<tls::TlsAcceptor>,
    /// The bearer tokens every call but health needs, when configured.
    pub tokens: Option<auth::Tokens>,
    /// The engine's own prefix index, with `--index`: `KvIndex/Match`.
    pub index: Option<Arc<Registry>>,
}

/// The reflection services' names, listed beside the services they describe.
const REFLECTION_SERVICES: [&str; 2] = [
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

/// Server reflection, v1 and v1alpha, listing `services` (and itself);
/// every file of kvgate's protos and of health can be described.
pub(crate) fn reflection_routes(services: &[&str]) -> anyhow::Result<axum::Router> {
    let reflection = || {
        services.iter().chain(&REFLECTION_SERVICES).fold(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET),
            |builder, service| builder.with_service_name(*service),
        )
    };
    let router = grpc_route(axum::Router::new(), reflection().build_v1()?);
    Ok(grpc_route(router, reflection().build_v1alpha()?))
}

/// `router` with `service` at its gRPC path, as tonic's `Routes` mounts one,
/// but with no fallback of its own (so it merges beside HTTP routes).
fn grpc_route<S>(router: axum::Router, service: S) -> axum::Router
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    router.route_service(
        &format!("/{}/{{*rest}}", S::NAME),
        tower::ServiceExt::map_request(service, |request: http::Request<axum::body::Body>| {
            request.map(tonic::body::Body::new)
        }),
    )
}

/// Builds every route of the server.
pub fn routes(
    parts: &ServerParts,
) -> anyhow::Result<(axum::Router, tonic_health::server::HealthReporter)> {
    let (health, health_service) = tonic_health::server::health_reporter();
    let mut advertised: Vec<&str> = SUBSCRIBE_SERVICES.to_vec();
    advertised.push("grpc.health.v1.Health");
    if parts.index.is_some() {
        advertised.push(index_grpc::SERVICE);
    }
    let mut router = Routes::default()
        .add_service(health_service)
        .into_axum_router()
        .merge(reflection_routes(&advertised)?);
    if let Some(registry) = &parts.index {
        router = router.merge(index_grpc::routes(Arc::clone(registry)));
    }
    let subscribe = SubscribeService::new(
        parts.hub.clone(),
        parts.metrics.clone(),
        parts.subscribe_limits,
    );
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

/// Serves plaintext HTTP/2 until `shutdown` resolves, then waits for open
/// streams to end (closing the hub ends them).
pub async fn serve(
    listener: TcpListener,
    mut parts: ServerParts,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    match parts.tls.take() {
        Some(tls) => serve_with(listener, tls, parts, shutdown).await,
        None => serve_with(listener, accept::Plaintext, parts, shutdown).await,
    }
}

/// [`serve`] over whatever `acceptor` makes of each accepted TCP stream.
///
/// Served by hyper's HTTP/2 server (`connection`) rather than tonic's
/// `Server`: tonic's server enforces `grpc-timeout` itself and answers
/// CANCELLED on expiry, which would replace the engine's own
/// DEADLINE_EXCEEDED on passed-through calls. Deadlines are the engine's
/// (and the client's) to enforce.
pub async fn serve_with<A: accept::Acceptor>(
    listener: TcpListener,
    acceptor: A,
    parts: ServerParts,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (routes, health) = routes(&parts)?;
    let health = health::follow(health, parts.health).await;
    let serving = connection::serve(
        listener,
        acceptor,
        parts.limits,
        routes,
        parts.metrics,
        shutdown,
    );
    tokio::select! {
        () = serving => Ok(()),
        never = health => match never {},
    }
}
