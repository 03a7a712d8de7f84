//! `kvgate index` following kvgate sidecars as `grpc://` workers, exact
//! through faults: real `kvgate serve` sidecars on real ZMQ publishers with
//! replay rings (one engine of several ranks), a real `kvgate index`, and a
//! TCP proxy between them that the test can cut. Each engine rank's cache is
//! simulated by the test, which is the truth: once events flow again after a
//! fault, the index's `/dump` holds, per worker and rank, exactly the blocks
//! each rank's cache holds, nothing stale and nothing missing.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::{
    DEADLINE, Gateway, IndexProcess, Polling, http_exchange, poll_until, removed_payload,
};
use kvgate_sim::{EnginePublisher, PublisherOptions, SimConfig, SimEngine, SimEvent, encode_batch};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const BLOCK_SIZE: u32 = 4;

/// Steps an engine publishes while the index is paused, to leave a sidecar
/// that keeps 64 batches behind it.
const PAST_THE_HISTORY: usize = 12000;

/// One rank of an engine: its cache (the truth) and its publisher.
struct Rank {
    rank: u32,
    cache: SimEngine,
    publisher: EnginePublisher,
}

/// A cache that evicts as it goes, its hashes drawn from `seed`.
fn cache(seed: u64) -> SimEngine {
    SimEngine::new(SimConfig {
        seed,
        block_size: BLOCK_SIZE,
        capacity_blocks: 120,
        ..SimConfig::default()
    })
    .unwrap()
}

impl Rank {
    async fn publish(&mut self, events: &[SimEvent]) {
        let mut payload = Vec::new();
        encode_batch(1.0, events, Some(self.rank), &mut payload);
        self.publisher.publish(payload.into()).await.unwrap();
    }
}

/// An engine of `ranks` data-parallel ranks.
struct Engine {
    ranks: Vec<Rank>,
}

impl Engine {
    async fn new(ranks: u32, seed: u64) -> Self {
        let options = PublisherOptions {
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            ..PublisherOptions::default()
        };
        let mut all = Vec::new();
        for rank in 0..ranks {
            all.push(Rank {
                rank,
                cache: cache(seed * 100 + u64::from(rank)),
                publisher: EnginePublisher::bind("tcp://127.0.0.1:0", &options)
                    .await
                    .unwrap(),
            });
        }
        Engine { ranks: all }
    }

    /// `steps` scheduler steps on every rank.
    async fn steps(&mut self, steps: usize) {
        for _ in 0..steps {
            for rank in &mut self.ranks {
                let events = rank.cache.step();
                rank.publish(&events).await;
            }
        }
    }

    /// A removal of a block nobody stored on every rank: changes nothing,
    /// and shows a subscriber that joined late what it missed.
    async fn nudge(&mut self) {
        for rank in &mut self.ranks {
            let payload = removed_payload(&[-12345], rank.rank);
            rank.publisher.publish(payload).await.unwrap();
        }
    }

    /// Each rank's live blocks.
    fn truth(&self) -> BTreeMap<u32, BTreeSet<u64>> {
        self.ranks
            .iter()
            .map(|rank| (rank.rank, rank.cache.live_blocks().collect()))
            .filter(|(_, blocks): &(u32, BTreeSet<u64>)| !blocks.is_empty())
            .collect()
    }

    /// A sidecar's flags for this engine, on `state_dir` if given.
    fn sidecar_args(&self, state_dir: Option<&PathBuf>) -> Vec<String> {
        let mut args = vec!["--dp-size".to_owned(), self.ranks.len().to_string()];
        for rank in &self.ranks {
            args.extend(["--zmq-endpoint".into(), rank.publisher.endpoint().into()]);
        }
        for rank in &self.ranks {
            let replay = rank.publisher.replay_endpoint().unwrap();
            args.extend(["--zmq-replay-endpoint".into(), replay.into()]);
        }
        args.extend(["--zmq-replay-timeout-ms".into(), "10000".into()]);
        if let Some(dir) = state_dir {
            args.extend(["--state-dir".into(), dir.display().to_string()]);
        }
        args
    }

    /// A sidecar on this engine, serving once its source is up.
    async fn sidecar(&self, state_dir: Option<&PathBuf>) -> Gateway {
        let args = self.sidecar_args(state_dir);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let sidecar = Gateway::start(&args);
        sidecar.await_serving("").await;
        sidecar
    }

    /// A sidecar on this engine with `extra` flags, once it listens.
    fn sidecar_with(&self, extra: &[&str]) -> Gateway {
        let mut args = self.sidecar_args(None);
        args.extend(extra.iter().map(|arg| (*arg).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Gateway::start(&args)
    }
}

/// A TCP proxy between the index and a sidecar: its target can change (a
/// sidecar restarted elsewhere) and its connections can be cut.
struct Proxy {
    address: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    open: Arc<AtomicBool>,
    cut: watch::Sender<u64>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let target = Arc::new(Mutex::new(target));
        let open = Arc::new(AtomicBool::new(true));
        let (cut, _) = watch::channel(0);
        let accept = tokio::spawn({
            let target = Arc::clone(&target);
            let open = Arc::clone(&open);
            let cut = cut.clone();
            async move {
                loop {
                    let Ok((mut inbound, _)) = listener.accept().await else {
                        return;
                    };
                    if !open.load(Ordering::SeqCst) {
                        continue;
                    }
                    let to = *target.lock().unwrap();
                    let mut cut = cut.subscribe();
                    tokio::spawn(async move {
                        let Ok(mut outbound) = TcpStream::connect(to).await else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = cut.changed() => {}
                        }
                    });
                }
            }
        });
        Proxy {
            address,
            target,
            open,
            cut,
            accept,
        }
    }

    fn endpoint(&self) -> String {
        format!("grpc://{}", self.address)
    }

    /// Cuts every connection and refuses new ones until [`Self::restore`].
    fn sever(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.cut.send_modify(|generation| *generation += 1);
    }

    fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }

    /// New connections go to `target`; the old ones are cut.
    fn retarget(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = target;
        self.cut.send_modify(|generation| *generation += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut.send_modify(|generation| *generation += 1);
    }
}

async fn get(address: SocketAddr, path: &str) -> (u16, String) {
    http_exchange(address, "GET", path, None, None).await
}

async fn get_json(address: SocketAddr, path: &str) -> Value {
    let (status, body) = get(address, path).await;
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

async fn post(address: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let body = body.to_string();
    let (status, answer) = http_exchange(
        address,
        "POST",
        path,
        Some(body.as_bytes()),
        Some("application/json"),
    )
    .await;
    (
        status,
        serde_json::from_str(&answer).unwrap_or(Value::String(answer)),
    )
}

/// The index's blocks of `worker`, per rank, from `/dump`.
async fn indexed(index: SocketAddr, worker: u64) -> BTreeMap<u32, BTreeSet<u64>> {
    let dump = get_json(index, "/dump").await;
    let mut ranks: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    for partition in dump.as_object().unwrap().values() {
        for event in partition["events"].as_array().unwrap() {
            if event["worker_id"].as_u64() != Some(worker) {
                continue;
            }
            let rank = event["event"]["dp_rank"].as_u64().unwrap() as u32;
            for block in event["event"]["data"]["stored"]["blocks"]
                .as_array()
                .unwrap()
            {
                ranks
                    .entry(rank)
                    .or_default()
                    .insert(block["block_hash"].as_u64().unwrap());
            }
        }
    }
    ranks
}

/// Waits, keeping events flowing, until the index holds exactly what each
/// of `engine`'s ranks holds for `worker`; fails at the deadline showing how
/// far apart they are.
async fn await_exact(index: SocketAddr, worker: u64, engine: &mut Engine, context: &str) {
    let truth = engine.truth();
    assert!(!truth.is_empty(), "{context}: the engine holds blocks");
    let mut polling = Polling::within(DEADLINE * 2);
    loop {
        let held = indexed(index, worker).await;
        if held == truth {
            return;
        }
        if polling.expired() {
            let differences: Vec<String> = truth
                .keys()
                .chain(held.keys())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .map(|rank| {
                    let empty = BTreeSet::new();
                    let want = truth.get(rank).unwrap_or(&empty);
                    let have = held.get(rank).unwrap_or(&empty);
                    format!(
                        "rank {rank}: {} live, {} indexed, {} stale, {} missing",
                        want.len(),
                        have.len(),
                        have.difference(want).count(),
                        want.difference(have).count()
                    )
                })
                .collect();
            let workers = get_json(index, "/workers").await;
            panic!("{context}: the index is not exact: {differences:?}; /workers: {workers}");
        }
        engine.nudge().await;
        polling.again(context).await;
    }
}

/// `/workers`' entry for `worker`.
async fn worker_report(index: SocketAddr, worker: u64) -> Value {
    let workers = get_json(index, "/workers").await;
    workers
        .as_array()
        .unwrap()
        .iter()
        .find(|entry| entry["instance_id"].as_u64() == Some(worker))
        .cloned()
        .unwrap_or_else(|| panic!("worker {worker} is listed: {workers}"))
}

/// One of a grpc worker's counters in `/workers`.
async fn counter(index: SocketAddr, worker: u64, name: &str) -> u64 {
    worker_report(index, worker).await["kvgate"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("{name} is a count"))
}

fn index_following(worker: u64, endpoint: &str) -> IndexProcess {
    let workers = format!("{worker}={endpoint}");
    IndexProcess::start(&[
        "--workers",
        &workers,
        "--model-name",
        "m",
        "--block-size",
        &BLOCK_SIZE.to_string(),
    ])
}

fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {signal} {pid}");
}

/// An engine of two ranks with blocks, its sidecar behind a proxy, and an
/// index following the proxy as worker 7, exact once.
async fn fleet(state_dir: Option<&PathBuf>) -> (Engine, Gateway, Proxy, IndexProcess) {
    let mut engine = Engine::new(2, 1).await;
    let sidecar = engine.sidecar(state_dir).await;
    engine.steps(20).await;
    let proxy = Proxy::start(sidecar.address).await;
    let index = index_following(7, &proxy.endpoint());
    await_exact(index.address, 7, &mut engine, "first contact").await;
    (engine, sidecar, proxy, index)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sidecar_killed_and_restarted_without_a_state_dir_is_taken_again_by_snapshot_and_the_answers_are_exact()
 {
    let (mut engine, sidecar, proxy, index) = fleet(None).await;
    let snapshots = counter(index.address, 7, "snapshots").await;
    // SIGKILL; the engine keeps storing and evicting meanwhile.
    drop(sidecar);
    engine.steps(40).await;
    let sidecar = engine.sidecar(None).await;
    proxy.retarget(sidecar.address);
    engine.steps(5).await;
    await_exact(index.address, 7, &mut engine, "after the restart").await;
    assert!(
        counter(index.address, 7, "refused_cursors").await >= 1,
        "the new numbering refused the cursor"
    );
    assert!(
        counter(index.address, 7, "snapshots").await > snapshots,
        "a snapshot was taken again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_cursor_clears_the_worker_even_when_the_new_sidecar_has_no_snapshot_to_send() {
    let (mut engine, sidecar, proxy, index) = fleet(None).await;
    let snapshots = counter(index.address, 7, "snapshots").await;
    // The sidecar and its engine restart together: the engine's cache and
    // replay rings are empty, so the new sidecar has nothing to snapshot.
    drop(sidecar);
    for (rank, seed) in engine.ranks.iter_mut().zip(50..) {
        rank.publisher.restart();
        rank.cache = cache(seed);
    }
    let sidecar = engine.sidecar(None).await;
    proxy.retarget(sidecar.address);
    let address = index.address;
    let mut polling = Polling::within(DEADLINE);
    while !indexed(address, 7).await.is_empty() {
        let report = worker_report(address, 7).await;
        polling
            .again(format_args!(
                "the refused cursor left blocks behind: {report}"
            ))
            .await;
    }
    assert!(counter(address, 7, "refused_cursors").await >= 1);
    assert_eq!(
        counter(address, 7, "snapshots").await,
        snapshots,
        "no snapshot came: the clear was the refusal's"
    );
    engine.steps(10).await;
    await_exact(address, 7, &mut engine, "after the restart").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sidecar_killed_and_restarted_on_its_state_dir_is_resumed_by_cursor_without_a_snapshot() {
    let scratch = common::recording::Scratch::new("index-sidecar-state");
    let dir = scratch.path("state");
    let (mut engine, sidecar, proxy, index) = fleet(Some(&dir)).await;
    let snapshots = counter(index.address, 7, "snapshots").await;
    let resumes = counter(index.address, 7, "resumes").await;
    drop(sidecar);
    engine.steps(30).await;
    let sidecar = engine.sidecar(Some(&dir)).await;
    proxy.retarget(sidecar.address);
    engine.steps(5).await;
    await_exact(index.address, 7, &mut engine, "after the restart").await;
    assert_eq!(
        counter(index.address, 7, "refused_cursors").await,
        0,
        "the numbering continued"
    );
    assert_eq!(
        counter(index.address, 7, "snapshots").await,
        snapshots,
        "no snapshot was needed"
    );
    assert!(
        counter(index.address, 7, "resumes").await > resumes,
        "the index resumed by its cursor"
    );
    drop(sidecar);
    common::remove_state_dir(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_engine_rank_restarted_loses_its_blocks_in_the_index_and_its_new_ones_are_indexed() {
    let (mut engine, _sidecar, _proxy, index) = fleet(None).await;
    let before = indexed(index.address, 7).await;
    let rank = &mut engine.ranks[1];
    rank.publisher.restart();
    rank.cache = cache(999);
    engine.steps(10).await;
    await_exact(index.address, 7, &mut engine, "after rank 1's restart").await;
    let after = indexed(index.address, 7).await;
    assert!(
        before[&1].difference(&after[&1]).next().is_some(),
        "rank 1 held blocks before its restart that its new cache does not"
    );
    assert!(
        before[&0].intersection(&after[&0]).next().is_some(),
        "rank 0 kept its blocks"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_index_paused_and_then_restarted_answers_exactly_once_events_flow_again() {
    let (mut engine, _sidecar, proxy, index) = fleet(None).await;
    signal(index.pid(), "-STOP");
    engine.steps(60).await;
    signal(index.pid(), "-CONT");
    engine.steps(2).await;
    await_exact(index.address, 7, &mut engine, "after the pause").await;
    // Restarted: the workers come from --workers again.
    drop(index);
    engine.steps(20).await;
    let index = index_following(7, &proxy.endpoint());
    await_exact(index.address, 7, &mut engine, "after the index's restart").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_index_paused_past_the_sidecars_history_is_cleared_and_takes_a_snapshot_again() {
    let mut engine = Engine::new(2, 4).await;
    let sidecar = engine.sidecar_with(&["--history-batches", "64", "--max-batch-bytes", "4096"]);
    sidecar.await_serving("").await;
    engine.steps(20).await;
    let index = index_following(7, &format!("grpc://{}", sidecar.address));
    await_exact(index.address, 7, &mut engine, "first contact").await;
    let refused = counter(index.address, 7, "refused_cursors").await;
    let snapshots = counter(index.address, 7, "snapshots").await;
    // More than the connection's buffers and flow-control windows hold,
    // and far more than the sidecar's history.
    signal(index.pid(), "-STOP");
    engine.steps(PAST_THE_HISTORY).await;
    signal(index.pid(), "-CONT");
    engine.steps(2).await;
    await_exact(index.address, 7, &mut engine, "after the pause").await;
    assert!(
        counter(index.address, 7, "refused_cursors").await > refused,
        "the sidecar ended the stream with DATA_LOSS: {}",
        worker_report(index.address, 7).await
    );
    assert!(counter(index.address, 7, "snapshots").await > snapshots);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_connection_cut_and_restored_is_resumed_by_cursor_and_the_answers_are_exact() {
    let (mut engine, _sidecar, proxy, index) = fleet(None).await;
    let snapshots = counter(index.address, 7, "snapshots").await;
    let resumes = counter(index.address, 7, "resumes").await;
    proxy.sever();
    engine.steps(30).await;
    let address = index.address;
    let mut polling = Polling::within(DEADLINE);
    let mut reported = worker_report(address, 7).await;
    while reported["kvgate"]["state"] != "disconnected" {
        polling
            .again(format_args!("/workers says the cut: {reported}"))
            .await;
        reported = worker_report(address, 7).await;
    }
    assert_eq!(reported["status"], "pending", "Dynamo's status of it");
    assert!(
        reported["kvgate"]["reason"]
            .as_str()
            .is_some_and(|why| !why.is_empty()),
        "and why: {reported}"
    );
    proxy.restore();
    engine.steps(5).await;
    await_exact(index.address, 7, &mut engine, "after the cut").await;
    assert!(counter(index.address, 7, "resumes").await > resumes);
    assert_eq!(
        counter(index.address, 7, "snapshots").await,
        snapshots,
        "resumed, not taken again"
    );
    let reported = worker_report(address, 7).await;
    assert_eq!(reported["kvgate"]["state"], "connected", "{reported}");
    assert_eq!(reported["status"], "active");
}

#[tokio::test(flavor = "multi_thread")]
async fn one_registration_of_an_engine_of_several_ranks_indexes_every_rank() {
    let mut engine = Engine::new(3, 2).await;
    let sidecar = engine.sidecar(None).await;
    engine.steps(15).await;
    let index = IndexProcess::start(&[]);
    let endpoint = format!("grpc://{}", sidecar.address);
    let registration = |extra: Value| {
        let mut body = json!({
            "instance_id": 21,
            "endpoint": endpoint,
            "model_name": "m",
            "block_size": BLOCK_SIZE,
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let (status, answer) = post(
        index.address,
        "/register",
        registration(json!({"dp_rank": 1})),
    )
    .await;
    assert_eq!(status, 422, "a rank with a grpc:// endpoint: {answer}");
    assert!(answer["error"].as_str().unwrap().contains("dp_rank"));
    let (status, answer) = post(index.address, "/register", registration(json!({}))).await;
    assert_eq!(status, 201, "{answer}");
    let (status, answer) = post(index.address, "/register", registration(json!({}))).await;
    assert_eq!(status, 409, "registered once: {answer}");
    await_exact(index.address, 21, &mut engine, "every rank").await;
    assert_eq!(indexed(index.address, 21).await.len(), 3);
    let report = worker_report(index.address, 21).await;
    assert_eq!(report["source"], "grpc");
    for rank in ["0", "1", "2"] {
        assert!(
            report["kvgate"]["cursors"][rank].as_u64().is_some(),
            "rank {rank}'s cursor: {report}"
        );
        assert_eq!(report["listeners"][rank]["status"], "active", "{report}");
        assert_eq!(report["endpoints"][rank], endpoint.as_str());
    }
    let (status, answer) = post(
        index.address,
        "/unregister",
        json!({"instance_id": 21, "model_name": "m", "routing_group": "default", "dp_rank": 1}),
    )
    .await;
    assert_eq!(status, 422, "a grpc:// worker leaves whole: {answer}");
    let (status, answer) = post(
        index.address,
        "/unregister",
        json!({"instance_id": 21, "model_name": "m"}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert!(
        indexed(index.address, 21).await.is_empty(),
        "unregistered, forgotten"
    );
}

/// A `SubscribeKvEvents` server that answers each call with a batch for a
/// rank past every limit, then, by turns, a message larger than a client
/// takes or bytes that are not protobuf.
async fn start_hostile_worker() -> SocketAddr {
    use common::raw_codec::RawCodec;
    use kvgate::proto::common::{KvEventBatch, SubscribeKvEventsRequest};
    use prost::Message;

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let route = tower::service_fn(|request: http::Request<axum::body::Body>| async move {
        let request = request.map(tonic::body::Body::new);
        let mut grpc = tonic::server::Grpc::new(RawCodec::<SubscribeKvEventsRequest>::default());
        let handler = tower::service_fn(|_: tonic::Request<SubscribeKvEventsRequest>| async move {
            static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let call = CALLS.fetch_add(1, Ordering::SeqCst);
            let far_rank = KvEventBatch {
                sequence_number: 5,
                dp_rank: Some(5000),
                ..Default::default()
            };
            let bad = if call.is_multiple_of(2) {
                bytes::Bytes::from(vec![0x0a; 5 << 20])
            } else {
                bytes::Bytes::from_static(&[0xff, 0xff, 0xff])
            };
            let messages = vec![Ok(bytes::Bytes::from(far_rank.encode_to_vec())), Ok(bad)];
            Ok::<_, tonic::Status>(tonic::Response::new(tokio_stream::iter(messages)))
        });
        Ok::<_, std::convert::Infallible>(grpc.server_streaming(handler, request).await)
    });
    let router = axum::Router::new().route_service("/kvgate.v1.KvGate/SubscribeKvEvents", route);
    tokio::spawn(async move { axum::serve(listener, router).await });
    address
}

/// An HTTP/2 server that serves no gRPC method at all.
async fn start_methodless_worker() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, axum::Router::new()).await });
    address
}

/// A server that accepts connections and never answers.
async fn start_silent_worker() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((connection, _)) = listener.accept().await {
            held.push(connection);
        }
    });
    address
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_grpc_worker_is_counted_and_said_why_while_other_workers_stay_exact() {
    let hostile = start_hostile_worker().await;
    let silent = start_silent_worker().await;
    let methodless = start_methodless_worker().await;
    let (mut engine, _sidecar, _proxy, index) = fleet(None).await;
    for (worker, address) in [(66, hostile), (67, silent), (68, methodless)] {
        let (status, answer) = post(
            index.address,
            "/register",
            json!({
                "instance_id": worker,
                "endpoint": format!("grpc://{address}"),
                "model_name": "m",
                "block_size": BLOCK_SIZE,
            }),
        )
        .await;
        assert_eq!(status, 201, "{answer}");
    }
    let address = index.address;
    let bad = |metrics: &str| {
        common::metric_sample(
            metrics,
            "kvgate_index_bad_payloads_total{instance_id=\"66\"}",
        )
        .unwrap_or(0.0)
    };
    let mut polling = Polling::within(DEADLINE);
    loop {
        let (_, metrics) = get(address, "/metrics").await;
        let report = worker_report(address, 66).await;
        if bad(&metrics) >= 4.0 && report["kvgate"]["unknown_ranks"].as_u64() >= Some(2) {
            break;
        }
        polling
            .again(format_args!(
                "the hostile worker's batches are counted: {report}"
            ))
            .await;
    }
    let report = worker_report(address, 66).await;
    assert!(
        report["kvgate"]["reason"].as_str().is_some(),
        "/workers says why: {report}"
    );
    poll_until(
        "the silent worker is reported as not answering",
        DEADLINE,
        || {
            let report = tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(worker_report(address, 67))
            });
            report["kvgate"]["reason"]
                .as_str()
                .is_some_and(|why| why.contains("did not answer"))
        },
    )
    .await;
    poll_until(
        "a server without SubscribeKvEvents is reported failed",
        DEADLINE,
        || {
            let report = tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(worker_report(address, 68))
            });
            report["status"] == "failed"
                && report["kvgate"]["reason"]
                    .as_str()
                    .is_some_and(|why| why.contains("UNIMPLEMENTED"))
        },
    )
    .await;
    assert!(
        indexed(address, 66).await.is_empty(),
        "nothing indexed of 66"
    );
    assert!(
        indexed(address, 67).await.is_empty(),
        "nothing indexed of 67"
    );
    engine.steps(10).await;
    await_exact(address, 7, &mut engine, "the good worker beside them").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_grpcs_worker_is_followed_over_mutual_tls_with_the_token_and_each_missing_credential_is_named()
 {
    use common::pki::{Authority, Files};
    let authority = Authority::new("sidecar CA");
    let server = authority.server();
    let client = authority.client("index");
    let files = Files::new();
    let cert = files.write("cert.pem", &server.cert);
    let key = files.write("key.pem", &server.key);
    let ca = files.write("ca.pem", &authority.pem());
    let client_cert = files.write("client.pem", &client.cert);
    let client_key = files.write("client-key.pem", &client.key);
    let tokens = files.write("tokens", "index-secret\n");
    let mut engine = Engine::new(1, 3).await;
    let sidecar = engine.sidecar_with(&[
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
        "--tls-client-ca",
        ca.to_str().unwrap(),
        "--auth-token-file",
        tokens.to_str().unwrap(),
    ]);
    engine.steps(10).await;
    let workers = format!("9=grpcs://localhost:{}", sidecar.address.port());
    let trusted = [
        "--workers",
        &workers,
        "--model-name",
        "m",
        "--block-size",
        "4",
        "--worker-ca-file",
        ca.to_str().unwrap(),
        "--worker-tls-cert",
        client_cert.to_str().unwrap(),
        "--worker-tls-key",
        client_key.to_str().unwrap(),
    ];
    let token_flags = ["--worker-token-file", tokens.to_str().unwrap()];
    let index = IndexProcess::start(&[&trusted[..], &token_flags[..]].concat());
    await_exact(index.address, 9, &mut engine, "over TLS with the token").await;

    // Without the token the sidecar refuses every call, and /workers says so.
    let tokenless = IndexProcess::start(&trusted);
    poll_until("the refusal is reported", DEADLINE, || {
        let report = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(worker_report(tokenless.address, 9))
        });
        report["kvgate"]["reason"]
            .as_str()
            .is_some_and(|why| why.contains("UNAUTHENTICATED"))
    })
    .await;
    assert!(indexed(tokenless.address, 9).await.is_empty());

    // Without a CA a grpcs:// registration is refused naming the flag.
    let untrusting = IndexProcess::start(&[]);
    let (status, answer) = post(
        untrusting.address,
        "/register",
        json!({
            "instance_id": 9,
            "endpoint": format!("grpcs://localhost:{}", sidecar.address.port()),
            "model_name": "m",
            "block_size": BLOCK_SIZE,
        }),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("--worker-ca-file"),
        "{answer}"
    );

    // A credential that cannot be read fails the start, naming its flag.
    let missing = files.path("missing.pem");
    let output = common::output_within_deadline(
        std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .args(["index", "--listen", "127.0.0.1:0", "--worker-ca-file"])
            .arg(&missing)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("--worker-ca-file"), "{stderr}");
}
