//! The operator's HTTP port: Prometheus `/metrics`, `/healthz` for probes
//! and a human-readable `/status`, and with `--index` the engine's own
//! `/query` and `/query_by_hash` (its connections' bounds are in
//! `admin_connection`).

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json};
use axum::routing::get;
use serde::Serialize;
use tokio::net::TcpListener;

use super::admin_connection::{self, AdminLimits, Protocols};
use crate::health::HealthWatch;
use crate::hub::HubReader;
use crate::metrics::Metrics;

/// What `/status` and `/healthz` read.
#[derive(Clone)]
pub struct AdminState {
    pub metrics: Metrics,
    pub hub: HubReader,
    pub health: HealthWatch,
    /// Where events come from, as configured (for `/status`).
    pub source: Arc<str>,
    pub started: Instant,
    /// The state directory, with `--state-dir`.
    pub store: Option<crate::store::StoreStatus>,
    /// What the engine said of its publishers, when kvgate asked it.
    pub engine_sources: Option<tokio::sync::watch::Receiver<crate::source::discovery::Discovered>>,
    /// The engine's own prefix index, with `--index`: `/query` and
    /// `/query_by_hash`.
    pub index: Option<Arc<crate::index::registry::Registry>>,
}

#[derive(Serialize)]
struct Status {
    version: &'static str,
    uptime_seconds: u64,
    /// The runtime's workers (`--worker-threads`), as tokio has them.
    worker_threads: usize,
    source: String,
    source_ready: bool,
    /// What `/healthz` says.
    health: String,
    subscribers: i64,
    history: HistoryStatus,
    engine: EngineStatus,
    ranks: Vec<crate::hub::RankReport>,
    /// With `--state-dir`: what was restored, persistence, checkpoints.
    #[serde(skip_serializing_if = "Option::is_none")]
    state_dir: Option<crate::store::StoreStatusView>,
    /// Where each rank's events come from and how kvgate learned it.
    sources: Vec<RankSourceStatus>,
    /// With `--index`: the engine's own tree.
    #[serde(skip_serializing_if = "Option::is_none")]
    index: Option<Vec<crate::index::partition::PartitionStatus>>,
}

#[derive(Serialize)]
struct RankSourceStatus {
    rank: u32,
    endpoint: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    replay_endpoint: Option<String>,
    topic: String,
    learned_from: String,
}

#[derive(Serialize)]
struct EngineStatus {
    restarts: u64,
    /// Messages missing from the publishers' counters that replay filled.
    messages_recovered: u64,
    /// Messages that stayed missing.
    messages_lost: u64,
}

#[derive(Serialize)]
struct HistoryStatus {
    oldest_position: u64,
    newest_position: u64,
    batches: u64,
    bytes: u64,
}

pub fn router(state: AdminState) -> Router {
    let index = state.index.clone();
    let router = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/status", get(status))
        .with_state(state);
    match index {
        Some(registry) => router.merge(super::index_http::query_router(registry)),
        None => router,
    }
}

/// Serves the admin port until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: AdminState,
    limits: AdminLimits,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let metrics = state.metrics.clone();
    let routes = router(state);
    admin_connection::serve(
        listener,
        routes,
        Protocols::Http1,
        limits,
        metrics,
        shutdown,
    )
    .await;
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    state
        .metrics
        .set_subscriber_lags(&state.hub.subscriber_lags());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn healthz(State(state): State<AdminState>) -> impl IntoResponse {
    let health = state.health.now();
    let code = if health.is_serving() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, format!("{health}\n"))
}

async fn status(State(state): State<AdminState>) -> Json<Status> {
    let history = state.hub.history();
    let (oldest, newest) = history.span();
    Json(Status {
        version: env!("CARGO_PKG_VERSION"),
        uptime_seconds: state.started.elapsed().as_secs(),
        worker_threads: tokio::runtime::Handle::current().metrics().num_workers(),
        source: state.source.to_string(),
        source_ready: state.health.source_ready(),
        health: state.health.now().to_string(),
        subscribers: state.metrics.subscribers.get(),
        history: HistoryStatus {
            oldest_position: oldest,
            newest_position: newest,
            batches: (newest + 1).saturating_sub(oldest),
            bytes: state.metrics.history_bytes.get() as u64,
        },
        engine: EngineStatus {
            restarts: state.metrics.engine_restarts.get(),
            messages_recovered: state.metrics.engine_messages_recovered.get(),
            messages_lost: state.metrics.engine_messages_lost.get(),
        },
        ranks: state.hub.rank_reports(),
        state_dir: state.store.as_ref().map(crate::store::StoreStatus::view),
        sources: state
            .engine_sources
            .as_ref()
            .map_or_else(Vec::new, |learned| {
                let learned = learned.borrow();
                (0u32..)
                    .zip(&learned.ranks)
                    .map(|(rank, source)| RankSourceStatus {
                        rank,
                        endpoint: source.endpoint.to_string(),
                        replay_endpoint: source.replay_endpoint.as_ref().map(ToString::to_string),
                        topic: source.topic.clone(),
                        learned_from: learned.learned_from.clone(),
                    })
                    .collect()
            }),
        index: state.index.as_ref().map(|registry| {
            registry
                .partitions()
                .iter()
                .map(|partition| crate::index::partition::PartitionStatus::of(partition))
                .collect()
        }),
    })
}
