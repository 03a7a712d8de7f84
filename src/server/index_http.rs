//! `kvgate index`'s HTTP port: Dynamo's standalone indexer API, drop-in
//! (`/health`, `/metrics`, `/register`, `/unregister`, `/workers`, `/query`,
//! `/query_by_hash`, `/dump`), held to the admin port's connection bounds;
//! the same port answers gRPC's `kvgate.v1.KvIndex/Match` (`index_grpc`).
//!
//! Invariants: request and answer bodies carry Dynamo's field names, types
//! and status codes (201 on register, 409 for a conflicting registration,
//! 404 for an unknown partition or instance, axum's 400/415/422 for a body
//! that is not the expected JSON, 413 above the body limit); kvgate's own
//! additions are only ever new keys (`kvgate` in a listener), new status
//! codes for what Dynamo has no limit for (503 naming the limit), or a path
//! Dynamo does not have (`/status`, kvgate's own summary). A query
//! reads its partition's tree for the walk only; its answer is built and
//! written after the lock is let go.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::net::TcpListener;

use super::admin_connection::{self, AdminLimits, Protocols};
use super::index_grpc;
use super::index_query_body::{self, QueryBody};
use crate::index::block_hash::HashSeed;
use crate::index::feed::FeedPhase;
use crate::index::overlap::{Answer, QueryBlocks, RankTokens, WorkerOverlap};
use crate::index::partition::{PartitionKey, PartitionStatus};
use crate::index::registry::{
    DEFAULT_ROUTING_GROUP, RankReport, RegisterError, Registration, Registry, UnregisterError,
    Unregistration, WorkerReport,
};
use crate::index::tier::Tier;
use crate::index::tree::WorkerId;
use crate::metrics::Metrics;

/// Dynamo's limit on a `/query` body: a million tokens as JSON text.
pub const QUERY_BODY_LIMIT_BYTES: usize = 8 * 1024 * 1024;

/// Why a query by hashes cannot take a salt (Dynamo's words).
pub(crate) const HASHES_TAKE_NO_SALT: &str = "cache_salt is not accepted by /query_by_hash; block_hashes must already include the intended cache salt";

/// Serves the index's API on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    limits: AdminLimits,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let routes = router(Arc::clone(&registry))
        .merge(index_grpc::routes(registry))
        .merge(
            super::reflection_routes(&[index_grpc::SERVICE])
                .expect("kvgate's own descriptor sets are well-formed"),
        );
    admin_connection::serve(
        listener,
        routes,
        Protocols::Http1AndGrpc,
        limits,
        Metrics::default(),
        shutdown,
    )
    .await;
}

/// The routes.
pub fn router(registry: Arc<Registry>) -> Router {
    query_router(Arc::clone(&registry)).merge(
        Router::new()
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .route("/register", post(register))
            .route("/unregister", post(unregister))
            .route("/workers", get(workers))
            .route("/status", get(status))
            .route("/dump", get(dump))
            .with_state(registry),
    )
}

/// `/query` and `/query_by_hash` alone (`kvgate serve --index`'s admin port).
pub fn query_router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route(
            "/query",
            post(query).layer(DefaultBodyLimit::max(QUERY_BODY_LIMIT_BYTES)),
        )
        .route("/query_by_hash", post(query_by_hash))
        .with_state(registry)
}

fn default_routing_group() -> String {
    DEFAULT_ROUTING_GROUP.to_owned()
}

#[derive(Deserialize)]
struct RegisterRequest {
    instance_id: WorkerId,
    endpoint: String,
    model_name: String,
    #[serde(default = "default_routing_group")]
    routing_group: String,
    /// Dynamo's old name, read (a `null` is refused) and ignored.
    #[serde(default = "default_routing_group", rename = "tenant_id")]
    _tenant_id: String,
    block_size: u32,
    #[serde(default)]
    dp_rank: Option<u32>,
    #[serde(default)]
    replay_endpoint: Option<String>,
}

#[derive(Deserialize)]
struct UnregisterRequest {
    instance_id: WorkerId,
    model_name: String,
    #[serde(default)]
    routing_group: Option<String>,
    #[serde(default)]
    dp_rank: Option<u32>,
}

#[derive(Deserialize)]
struct WorkersFilter {
    model_name: Option<String>,
    routing_group: Option<String>,
}

/// A `/query` body.
#[derive(Deserialize)]
struct QueryRequest {
    token_ids: Vec<u32>,
    model_name: String,
    #[serde(default = "default_routing_group")]
    routing_group: String,
    #[serde(default = "default_routing_group", rename = "tenant_id")]
    _tenant_id: String,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// A `/query_by_hash` body.
#[derive(Deserialize)]
struct QueryByHashRequest {
    block_hashes: Vec<i64>,
    model_name: String,
    #[serde(default = "default_routing_group")]
    routing_group: String,
    #[serde(default = "default_routing_group", rename = "tenant_id")]
    _tenant_id: String,
    #[serde(default)]
    cache_salt: Option<String>,
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    (status, Json(json!({"error": message.to_string()}))).into_response()
}

fn ok(status: StatusCode) -> Response {
    (status, Json(json!({"status": "ok"}))).into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn register(
    State(registry): State<Arc<Registry>>,
    Json(request): Json<RegisterRequest>,
) -> Response {
    let registration = Registration {
        instance_id: request.instance_id,
        dp_rank: request.dp_rank,
        partition: PartitionKey {
            model_name: request.model_name,
            routing_group: request.routing_group,
        },
        block_size: request.block_size,
        endpoint: request.endpoint,
        replay_endpoint: request.replay_endpoint,
    };
    match registry.register(registration) {
        Ok(()) => ok(StatusCode::CREATED),
        Err(refused) => {
            let status = match refused {
                RegisterError::OtherPartition { .. }
                | RegisterError::DuplicateRank { .. }
                | RegisterError::BlockSizeMismatch { .. }
                | RegisterError::SidecarConflict { .. } => StatusCode::CONFLICT,
                RegisterError::RankOfSidecar => StatusCode::UNPROCESSABLE_ENTITY,
                RegisterError::BadEndpoint(_) => StatusCode::BAD_REQUEST,
                RegisterError::TooManyWorkerRanks(_) | RegisterError::TooManyPartitions(_) => {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            };
            error(status, refused)
        }
    }
}

async fn unregister(
    State(registry): State<Arc<Registry>>,
    Json(request): Json<UnregisterRequest>,
) -> Response {
    let which = match (request.routing_group, request.dp_rank) {
        (Some(routing_group), Some(dp_rank)) => Unregistration::Rank {
            partition: PartitionKey {
                model_name: request.model_name,
                routing_group,
            },
            dp_rank,
        },
        (Some(routing_group), None) => Unregistration::Worker {
            partition: PartitionKey {
                model_name: request.model_name,
                routing_group,
            },
        },
        (None, _) => Unregistration::Model {
            model_name: request.model_name,
        },
    };
    match registry.unregister(request.instance_id, which).await {
        Ok(()) => ok(StatusCode::OK),
        Err(refused @ UnregisterError::RankOfSidecar { .. }) => {
            error(StatusCode::UNPROCESSABLE_ENTITY, refused)
        }
        Err(not_found) => error(StatusCode::NOT_FOUND, not_found),
    }
}

#[derive(Serialize)]
struct WorkerInfo {
    instance_id: WorkerId,
    source: &'static str,
    status: &'static str,
    model_name: String,
    routing_group: String,
    block_size: u32,
    endpoints: BTreeMap<String, String>,
    listeners: BTreeMap<String, ListenerInfo>,
    /// kvgate's own account of a `grpc://` worker's one subscription.
    #[serde(skip_serializing_if = "Option::is_none")]
    kvgate: Option<SidecarDetail>,
}

#[derive(Serialize)]
struct SidecarDetail {
    endpoint: String,
    /// `connecting`, `catching_up`, `connected` or `disconnected`.
    state: &'static str,
    /// When the subscription entered its state (Unix seconds).
    since: f64,
    /// Why it disconnected.
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    /// Each rank's cursor: the last sequence number admitted.
    cursors: BTreeMap<String, u64>,
    snapshots: u64,
    resumes: u64,
    refused_cursors: u64,
    reconnects: u64,
    /// Batches admitted and applied.
    batches: u64,
    /// Batches set aside (undecodable, oversized, a rank past the limit).
    bad_batches: u64,
    unknown_ranks: u64,
    rank_restarts: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_batch: Option<f64>,
}

#[derive(Serialize)]
struct ListenerInfo {
    endpoint: String,
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_error: Option<String>,
    /// kvgate's own account of the source.
    kvgate: ListenerDetail,
}

#[derive(Serialize)]
struct ListenerDetail {
    #[serde(skip_serializing_if = "Option::is_none")]
    replay_endpoint: Option<String>,
    /// `connecting`, `catching_up`, `connected`, `disconnected` or `failed`.
    state: &'static str,
    /// A `grpc://` worker's cursor of this rank.
    #[serde(skip_serializing_if = "Option::is_none")]
    cursor: Option<u64>,
    /// When the listener entered its state (Unix seconds).
    since: f64,
    /// Why it failed or disconnected.
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    payloads: u64,
    bad_payloads: u64,
    publisher_restarts: u64,
    /// Connections dropped for breaking ZMTP or the message size limit.
    peers_dropped: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_payload: Option<f64>,
}

fn unix_seconds(time: SystemTime) -> f64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64())
}

/// Dynamo's aggregate of listener statuses: failed over pending over active.
fn aggregate_status(statuses: &[&'static str]) -> &'static str {
    ["failed", "pending", "active"]
        .into_iter()
        .find(|status| statuses.contains(status))
        .unwrap_or("paused")
}

fn listener_info(report: RankReport, cursor: Option<u64>) -> ListenerInfo {
    let feed = report.feed;
    ListenerInfo {
        endpoint: report.endpoint,
        status: feed.phase.dynamo_status(),
        last_error: feed
            .error
            .clone()
            .filter(|_| feed.phase == FeedPhase::Failed),
        kvgate: ListenerDetail {
            replay_endpoint: report.replay_endpoint,
            state: feed.phase.as_str(),
            cursor,
            since: unix_seconds(feed.since),
            reason: feed.error,
            payloads: feed.payloads,
            bad_payloads: feed.bad_payloads,
            publisher_restarts: feed.publisher_restarts,
            peers_dropped: feed.peers_dropped,
            last_payload: feed.last_payload.map(unix_seconds),
        },
    }
}

fn worker_info(worker: WorkerReport) -> WorkerInfo {
    let mut info = WorkerInfo {
        instance_id: worker.instance_id,
        source: "zmq",
        status: "paused",
        model_name: worker.partition.model_name,
        routing_group: worker.partition.routing_group,
        block_size: worker.block_size,
        endpoints: BTreeMap::new(),
        listeners: BTreeMap::new(),
        kvgate: None,
    };
    if let Some(report) = worker.sidecar {
        // One subscription; each rank it has brought is listed with it.
        let feed = &report.feed;
        let progress = feed.sidecar.clone().unwrap_or_default();
        info.source = "grpc";
        info.status = feed.phase.dynamo_status();
        info.kvgate = Some(SidecarDetail {
            endpoint: report.endpoint.clone(),
            state: feed.phase.as_str(),
            since: unix_seconds(feed.since),
            reason: feed.error.clone(),
            cursors: progress
                .cursors
                .iter()
                .map(|(rank, cursor)| (rank.to_string(), *cursor))
                .collect(),
            snapshots: progress.snapshots,
            resumes: progress.resumes,
            refused_cursors: progress.refused_cursors,
            reconnects: progress.reconnects,
            batches: feed.payloads,
            bad_batches: feed.bad_payloads,
            unknown_ranks: progress.unknown_ranks,
            rank_restarts: feed.publisher_restarts,
            last_batch: feed.last_payload.map(unix_seconds),
        });
        for (&rank, &cursor) in &progress.cursors {
            info.endpoints
                .insert(rank.to_string(), report.endpoint.clone());
            info.listeners.insert(
                rank.to_string(),
                listener_info(report.clone(), Some(cursor)),
            );
        }
        return info;
    }
    let statuses: Vec<&'static str> = worker
        .ranks
        .values()
        .map(|rank| rank.feed.phase.dynamo_status())
        .collect();
    info.status = aggregate_status(&statuses);
    for (rank, report) in worker.ranks {
        info.endpoints
            .insert(rank.to_string(), report.endpoint.clone());
        info.listeners
            .insert(rank.to_string(), listener_info(report, None));
    }
    info
}

async fn workers(
    State(registry): State<Arc<Registry>>,
    Query(filter): Query<WorkersFilter>,
) -> Json<Vec<WorkerInfo>> {
    Json(
        registry
            .workers(
                filter.model_name.as_deref(),
                filter.routing_group.as_deref(),
            )
            .into_iter()
            .map(worker_info)
            .collect(),
    )
}

/// kvgate's own summary, not Dynamo's: every partition's figures and
/// `/workers`' answer (what `kvgate status --index` prints).
async fn status(State(registry): State<Arc<Registry>>) -> Json<serde_json::Value> {
    let partitions: Vec<PartitionStatus> = registry
        .partitions()
        .iter()
        .map(|partition| PartitionStatus::of(partition))
        .collect();
    let workers: Vec<WorkerInfo> = registry
        .workers(None, None)
        .into_iter()
        .map(worker_info)
        .collect();
    Json(json!({"partitions": partitions, "workers": workers}))
}

/// The answer to a query, in Dynamo's JSON: `scores` (device tokens per
/// worker and rank, where not 0), `frequencies` (always empty, as Dynamo's)
/// and `instances` (per worker, every tier, and `dp`: each rank's device
/// tokens). Written straight from the answer: it names every matching
/// worker, and a map of strings for each took a tenth of the index's CPU
/// per query. A worker whose ranks matched as the previous one's gets a
/// copy of that one's value.
fn score_json(answer: &Answer) -> Vec<u8> {
    let workers = &answer.overlap.workers;
    let device_tokens = |worker: &WorkerOverlap| {
        answer.ranks[worker.ranks.clone()].iter().map(|found| {
            (
                found.key.rank,
                RankTokens::of(found, answer.block_size).device,
            )
        })
    };
    let mut out = JsonOut {
        json: Vec::with_capacity(64 + 128 * workers.len()),
        digits: itoa::Buffer::new(),
    };
    out.json.extend_from_slice(b"{\"scores\":{");
    // A worker with no device tokens has no score; one alike the previous
    // worker has the same device tokens, so the previous was scored too.
    let mut previous_score = 0..0;
    for (index, worker) in workers.iter().filter(|worker| worker.gpu > 0).enumerate() {
        out.key(index == 0, worker.worker);
        out.json.push(b':');
        out.worker_value(worker, &mut previous_score, |out| {
            out.rank_map(device_tokens(worker).filter(|&(_, tokens)| tokens > 0));
        });
    }
    out.json
        .extend_from_slice(b"},\"frequencies\":[],\"instances\":{");
    let mut previous_instance = 0..0;
    for (index, worker) in workers.iter().enumerate() {
        out.key(index == 0, worker.worker);
        out.json.push(b':');
        out.worker_value(worker, &mut previous_instance, |out| {
            out.number(b"{\"longest_matched\":", worker.longest_matched.into());
            out.number(b",\"gpu\":", worker.gpu.into());
            out.json.extend_from_slice(b",\"dp\":");
            out.rank_map(device_tokens(worker));
            out.number(b",\"cpu\":", worker.cpu.into());
            out.number(b",\"disk\":", worker.disk.into());
            out.json.push(b'}');
        });
    }
    out.json.extend_from_slice(b"}}");
    out.json
}

/// A JSON answer being written: the bytes, and a buffer for numbers.
struct JsonOut {
    json: Vec<u8>,
    digits: itoa::Buffer,
}

impl JsonOut {
    /// `before`, then `number`.
    fn number(&mut self, before: &[u8], number: u64) {
        self.json.extend_from_slice(before);
        self.json
            .extend_from_slice(self.digits.format(number).as_bytes());
    }

    /// An object's key that is a number, a comma before it unless `first`.
    fn key(&mut self, first: bool, number: u64) {
        self.number(if first { b"\"" } else { b",\"" }, number);
        self.json.push(b'"');
    }

    /// `{"rank":tokens,...}`.
    fn rank_map(&mut self, ranks: impl Iterator<Item = (u32, u32)>) {
        self.json.push(b'{');
        for (index, (rank, tokens)) in ranks.enumerate() {
            self.key(index == 0, rank.into());
            self.number(b":", tokens.into());
        }
        self.json.push(b'}');
    }

    /// `worker`'s value in one of the answer's maps: a copy of `previous`
    /// (where the previous worker's value in that map was written) when
    /// `worker` matched alike, else what `write` writes. Leaves `previous`
    /// at this value.
    fn worker_value(
        &mut self,
        worker: &WorkerOverlap,
        previous: &mut Range<usize>,
        write: impl FnOnce(&mut Self),
    ) {
        let start = self.json.len();
        if worker.alike_previous {
            self.json.extend_from_within(previous.clone());
        } else {
            write(self);
        }
        *previous = start..self.json.len();
    }
}

/// Answers for `blocks` in the partition `key` names.
fn answer(registry: &Registry, key: &PartitionKey, blocks: QueryBlocks<'_>) -> Response {
    match registry.answer(key, blocks) {
        Ok(answer) => (
            [(header::CONTENT_TYPE, "application/json")],
            score_json(&answer),
        )
            .into_response(),
        Err(unknown) => error(StatusCode::NOT_FOUND, unknown),
    }
}

async fn query(State(registry): State<Arc<Registry>>, QueryBody(body): QueryBody) -> Response {
    let request: QueryRequest =
        match index_query_body::read(&body, "token_ids", |request: &mut QueryRequest| {
            &mut request.token_ids
        }) {
            Ok(request) => request,
            Err(refused) => return refused.into_response(),
        };
    let key = PartitionKey {
        model_name: request.model_name,
        routing_group: request.routing_group,
    };
    let seed = HashSeed::new(request.lora_name.as_deref(), request.cache_salt.as_deref());
    let blocks = QueryBlocks::Tokens {
        token_ids: &request.token_ids,
        seed,
    };
    answer(&registry, &key, blocks)
}

async fn query_by_hash(
    State(registry): State<Arc<Registry>>,
    QueryBody(body): QueryBody,
) -> Response {
    let request: QueryByHashRequest =
        match index_query_body::read(&body, "block_hashes", |request: &mut QueryByHashRequest| {
            &mut request.block_hashes
        }) {
            Ok(request) => request,
            Err(refused) => return refused.into_response(),
        };
    if request.cache_salt.is_some() {
        return error(StatusCode::BAD_REQUEST, HASHES_TAKE_NO_SALT);
    }
    let key = PartitionKey {
        model_name: request.model_name,
        routing_group: request.routing_group,
    };
    answer(&registry, &key, QueryBlocks::Hashes(&request.block_hashes))
}

/// Every partition's live blocks as Dynamo's dump lists them: one stored
/// event per block and rank, parents first.
async fn dump(State(registry): State<Arc<Registry>>) -> Json<serde_json::Value> {
    let mut partitions = serde_json::Map::new();
    for partition in registry.partitions() {
        let blocks = partition.read().dump();
        let events: Vec<serde_json::Value> = blocks
            .into_iter()
            .flat_map(|block| {
                block
                    .tiers
                    .clone()
                    .into_iter()
                    .map(move |tier| (tier, block.clone()))
            })
            .enumerate()
            .map(|(event_id, (tier, block))| {
                json!({
                    "worker_id": block.key.worker,
                    "storage_tier": storage_tier(tier),
                    "residency_domain": "worker",
                    "event": {
                        "event_id": event_id,
                        "dp_rank": block.key.rank,
                        "data": {"stored": {
                            "parent_hash": block.parent.map(|hash| hash as u64),
                            "start_position": null,
                            "blocks": [{
                                "block_hash": block.engine_hash as u64,
                                "tokens_hash": block.local_hash,
                                "mm_extra_info": null,
                            }],
                        }},
                    },
                })
            })
            .collect();
        partitions.insert(
            partition.key().to_string(),
            json!({"block_size": partition.block_size(), "events": events}),
        );
    }
    Json(serde_json::Value::Object(partitions))
}

fn storage_tier(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "device",
        Tier::Host => "host_pinned",
        Tier::Disk => "disk",
        Tier::External => "external",
    }
}

/// The index's own series, in the Prometheus text format.
async fn metrics(State(registry): State<Arc<Registry>>) -> impl IntoResponse {
    let partitions = registry.partitions();
    let workers = registry.workers(None, None);
    let mut text = String::new();
    let mut family = |name: &str, kind: &str, help: &str| {
        let _ = writeln!(
            text,
            "# HELP kvgate_index_{name} {help}\n# TYPE kvgate_index_{name} {kind}"
        );
    };
    family("partitions", "gauge", "(model, routing group) partitions");
    family(
        "worker_ranks",
        "gauge",
        "Registered worker ranks and grpc:// workers, by listener status",
    );
    family(
        "blocks",
        "gauge",
        "Live blocks held, over every rank, per partition",
    );
    family(
        "nodes",
        "gauge",
        "Distinct prefix blocks in the tree, per partition",
    );
    family(
        "events_total",
        "counter",
        "Converted events applied, per partition",
    );
    family(
        "events_dropped_total",
        "counter",
        "Stores set aside, per partition and reason",
    );
    family(
        "bad_payloads_total",
        "counter",
        "Payloads or batches a worker sent that were set aside (undecodable, oversized, a rank past the limit), per worker",
    );
    family(
        "zmq_peers_dropped_total",
        "counter",
        "ZMQ connections to a worker's publisher or replay endpoint dropped because the peer broke ZMTP or --zmq-max-message-bytes, per worker",
    );
    family(
        "sidecar_calls_total",
        "counter",
        "A grpc:// worker's subscriptions, per worker and outcome: snapshot, resume, refused_cursor, reconnect",
    );
    let _ = writeln!(text, "kvgate_index_partitions {}", partitions.len());
    for status in ["pending", "active", "failed"] {
        let count = workers
            .iter()
            .flat_map(|worker| worker.ranks.values().chain(&worker.sidecar))
            .filter(|rank| rank.feed.phase.dynamo_status() == status)
            .count();
        let _ = writeln!(
            text,
            "kvgate_index_worker_ranks{{status=\"{status}\"}} {count}"
        );
    }
    for worker in &workers {
        let id = worker.instance_id;
        let bad: u64 = worker
            .ranks
            .values()
            .chain(&worker.sidecar)
            .map(|rank| rank.feed.bad_payloads)
            .sum();
        let _ = writeln!(
            text,
            "kvgate_index_bad_payloads_total{{instance_id=\"{id}\"}} {bad}"
        );
        let dropped: u64 = worker
            .ranks
            .values()
            .map(|rank| rank.feed.peers_dropped)
            .sum();
        let _ = writeln!(
            text,
            "kvgate_index_zmq_peers_dropped_total{{instance_id=\"{id}\"}} {dropped}"
        );
        if let Some(progress) = worker
            .sidecar
            .as_ref()
            .and_then(|sidecar| sidecar.feed.sidecar.as_ref())
        {
            for (outcome, count) in [
                ("snapshot", progress.snapshots),
                ("resume", progress.resumes),
                ("refused_cursor", progress.refused_cursors),
                ("reconnect", progress.reconnects),
            ] {
                let _ = writeln!(
                    text,
                    "kvgate_index_sidecar_calls_total{{instance_id=\"{id}\",outcome=\"{outcome}\"}} {count}"
                );
            }
        }
    }
    for partition in &partitions {
        let figures = PartitionStatus::of(partition);
        let labels = format!(
            "model_name=\"{}\",routing_group=\"{}\"",
            escape(&figures.model_name),
            escape(&figures.routing_group)
        );
        let _ = writeln!(text, "kvgate_index_blocks{{{labels}}} {}", figures.blocks);
        let _ = writeln!(text, "kvgate_index_nodes{{{labels}}} {}", figures.nodes);
        let _ = writeln!(
            text,
            "kvgate_index_events_total{{{labels}}} {}",
            figures.events
        );
        for (reason, count) in &figures.dropped {
            let _ = writeln!(
                text,
                "kvgate_index_events_dropped_total{{{labels},reason=\"{reason}\"}} {count}"
            );
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
}

/// A label value as the text format writes it.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::overlap::Overlap;
    use crate::index::tree::RankMatch;

    /// Dynamo's answer built the plain way: a map per worker, every value
    /// written out.
    fn answer_by_maps(answer: &Answer) -> serde_json::Value {
        let mut scores = serde_json::Map::new();
        let mut instances = serde_json::Map::new();
        for worker in &answer.overlap.workers {
            let dp: serde_json::Map<String, serde_json::Value> = answer.ranks[worker.ranks.clone()]
                .iter()
                .map(|found| {
                    let tokens = RankTokens::of(found, answer.block_size).device;
                    (found.key.rank.to_string(), json!(tokens))
                })
                .collect();
            let scored: serde_json::Map<String, serde_json::Value> = dp
                .iter()
                .filter(|(_, tokens)| tokens.as_u64() != Some(0))
                .map(|(rank, tokens)| (rank.clone(), tokens.clone()))
                .collect();
            if !scored.is_empty() {
                scores.insert(worker.worker.to_string(), json!(scored));
            }
            instances.insert(
                worker.worker.to_string(),
                json!({
                    "longest_matched": worker.longest_matched,
                    "gpu": worker.gpu,
                    "dp": dp,
                    "cpu": worker.cpu,
                    "disk": worker.disk,
                }),
            );
        }
        json!({"scores": scores, "frequencies": [], "instances": instances})
    }

    #[test]
    fn workers_matched_alike_are_written_as_each_is_on_its_own() {
        let rank = RankMatch::of;
        let ranks = vec![
            rank(1, 0, [0, 2, 0, 0]),
            rank(2, 0, [0, 2, 0, 0]),
            rank(3, 0, [2, 0, 0, 0]),
            rank(4, 0, [2, 0, 0, 0]),
            rank(5, 0, [2, 0, 0, 0]),
            rank(6, 0, [3, 1, 0, 0]),
            rank(7, 0, [2, 0, 1, 0]),
            rank(7, 1, [0, 0, 0, 1]),
            rank(8, 0, [2, 0, 1, 0]),
            rank(8, 1, [0, 0, 0, 1]),
            rank(9, 0, [2, 0, 0, 0]),
        ];
        let answer = Answer {
            block_size: 16,
            overlap: Overlap::new(&ranks, 16),
            ranks,
        };
        let alike = answer
            .overlap
            .workers
            .iter()
            .filter(|worker| worker.alike_previous)
            .count();
        assert_eq!(alike, 4, "the answer has runs of alike workers");
        let written: serde_json::Value =
            serde_json::from_slice(&score_json(&answer)).expect("valid JSON");
        assert_eq!(written, answer_by_maps(&answer));
    }
}
