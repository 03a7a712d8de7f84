//! The gRPC front: `SubscribeKvEvents` under every service name, health,
//! reflection, and everything else answered UNIMPLEMENTED.

pub mod codec;
pub mod subscribe;

use std::future::Future;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;
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
}

/// Builds every route of the server.
pub fn routes(
    parts: &ServerParts,
) -> anyhow::Result<(Routes, tonic_health::server::HealthReporter)> {
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
    Ok((Routes::from(router), health))
}

/// Serves until `shutdown` resolves, then waits for open streams to end
/// (closing the hub ends them).
pub async fn serve(
    listener: TcpListener,
    parts: ServerParts,
    shutdown: impl Future<Output = ()> + Send,
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
    tonic::transport::Server::builder()
        .add_routes(routes)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await?;
    Ok(())
}
