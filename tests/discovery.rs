//! kvgate next to an engine it asks where it publishes, instead of port
//! flags: small HTTP and gRPC servers here answer as vLLM
//! (`GET /kv_event_sources`), OpenEngine (`Control.GetKvEventSources`) and
//! SGLang (`GetServerInfo`'s `kv_events`) do, in front of real ZMQ
//! publishers, with the real binary and real subscribers.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use common::{Gateway, http_get, skip_past_fence, subscribe, sync_streams};
use kvgate::proto::openengine::v1 as openengine;
use kvgate::proto::sglang_runtime::v1 as sglang;
use kvgate_sim::{EnginePublisher, PublisherOptions};
use serde_json::{Value, json};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

async fn publisher() -> EnginePublisher {
    let options = PublisherOptions {
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        ..PublisherOptions::default()
    };
    EnginePublisher::bind("tcp://127.0.0.1:0", &options)
        .await
        .expect("publisher binds")
}

fn port_of(endpoint: &str) -> u16 {
    endpoint.rsplit(':').next().unwrap().parse().unwrap()
}

/// vLLM's answer for `publishers` (rank r at index r), wildcard hosts as an
/// engine bound on every interface reports them.
fn vllm_answer(publishers: &[&EnginePublisher]) -> String {
    let sources: Vec<Value> = publishers
        .iter()
        .enumerate()
        .map(|(rank, publisher)| {
            json!({
                "data_parallel_rank": rank,
                "endpoint": format!("tcp://*:{}", port_of(publisher.endpoint())),
                "replay_endpoint": publisher.replay_endpoint().map(|replay| format!("tcp://0.0.0.0:{}", port_of(replay))),
                "topic": "",
                "buffer_steps": 10000,
            })
        })
        .collect();
    Value::Array(sources).to_string()
}

/// An HTTP server answering `GET /kv_event_sources` with whatever `answer`
/// holds at the time (status 200).
async fn vllm_server(answer: Arc<Mutex<String>>) -> SocketAddr {
    let route = axum::routing::get(move || {
        let body = answer.lock().unwrap().clone();
        async move { body }
    });
    let router = axum::Router::new().route("/kv_event_sources", route);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    address
}

/// kvgate started with `args` and an admin port, and one subscriber on
/// `service`.
async fn gateway_subscribed(
    args: &[&str],
    service: &str,
) -> (
    Gateway,
    Vec<tonic::codec::Streaming<kvgate::proto::common::KvEventBatch>>,
) {
    let mut args = args.to_vec();
    args.extend(["--metrics-listen", "127.0.0.1:0"]);
    let gateway = Gateway::start(&args);
    let streams = vec![
        subscribe(gateway.channel().await, service, 0)
            .await
            .unwrap(),
    ];
    (gateway, streams)
}

async fn status_json(gateway: &Gateway) -> Value {
    let (code, body) = http_get(gateway.admin.expect("admin port"), "/status").await;
    assert_eq!(code, 200);
    serde_json::from_str(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn next_to_vllm_kvgate_needs_no_port_flag_and_status_says_where_each_rank_comes_from() {
    let (mut rank0, mut rank1) = (publisher().await, publisher().await);
    let answer = Arc::new(Mutex::new(vllm_answer(&[&rank0, &rank1])));
    let engine = vllm_server(Arc::clone(&answer)).await;
    let url = format!("http://{engine}");
    let (gateway, mut streams) =
        gateway_subscribed(&["--engine-http", &url], "vllm.grpc.engine.VllmEngine").await;
    sync_streams(&mut rank0, 0, &mut streams).await;
    sync_streams(&mut rank1, 1, &mut streams).await;

    let status = status_json(&gateway).await;
    let sources = status["sources"].as_array().unwrap();
    assert_eq!(sources.len(), 2, "{status}");
    for (rank, publisher) in [&rank0, &rank1].into_iter().enumerate() {
        let source = &sources[rank];
        assert_eq!(
            source["endpoint"],
            format!("tcp://127.0.0.1:{}", port_of(publisher.endpoint())),
            "the wildcard host became the engine's"
        );
        assert_eq!(
            source["replay_endpoint"],
            format!(
                "tcp://127.0.0.1:{}",
                port_of(publisher.replay_endpoint().unwrap())
            )
        );
        assert_eq!(
            source["learned_from"],
            format!("GET {url}/kv_event_sources")
        );
    }
    assert!(
        status["source"]
            .as_str()
            .unwrap()
            .contains("learned from GET")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_engine_restarted_on_other_ports_is_followed_without_restarting_kvgate() {
    let mut before = publisher().await;
    let answer = Arc::new(Mutex::new(vllm_answer(&[&before])));
    let engine = vllm_server(Arc::clone(&answer)).await;
    let url = format!("http://{engine}");
    let (gateway, mut streams) = gateway_subscribed(
        &["--engine-http", &url, "--engine-discovery-ms", "100"],
        "kvgate.v1.KvGate",
    )
    .await;
    sync_streams(&mut before, 0, &mut streams).await;

    drop(before);
    let mut after = publisher().await;
    *answer.lock().unwrap() = vllm_answer(&[&after]);
    let moved = format!("tcp://127.0.0.1:{}", port_of(after.endpoint()));
    // Fences until the subscriber sees one from the moved publisher: kvgate
    // asked again, connected to the new port and forwarded from it.
    sync_streams(&mut after, 0, &mut streams).await;
    let status = status_json(&gateway).await;
    assert_eq!(status["sources"][0]["endpoint"], moved, "{status}");
    assert!(
        status["engine"]["restarts"].as_u64().unwrap() >= 1,
        "{status}"
    );
    let (payload, _) = common::fixture("vllm-0.33.0/stored-int-root");
    after.publish(payload.into()).await.unwrap();
    after.publish(common::fence_payload(77, 0)).await.unwrap();
    let batches = skip_past_fence(&mut streams[0], 77).await;
    assert!(
        batches
            .iter()
            .flat_map(|batch| &batch.events)
            .any(|event| matches!(
                event.data,
                Some(kvgate::proto::common::kv_cache_event::Data::Stored(_))
            )),
        "the moved publisher's store arrives"
    );
}

/// Runs `kvgate serve ARGS`, which must fail at start: its stderr.
fn failed_start(args: &[&str]) -> String {
    let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = common::output_within_deadline(child);
    assert!(!output.status.success(), "kvgate started with {args:?}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_engine_that_answers_garbage_or_nothing_is_a_clear_error_at_start_naming_what_was_asked()
{
    let answer = Arc::new(Mutex::new("<html>busy</html>".to_owned()));
    let engine = vllm_server(Arc::clone(&answer)).await;
    let url = format!("http://{engine}");
    let stderr = failed_start(&["--engine-http", &url]);
    assert!(stderr.contains(&format!("--engine-http {url}")), "{stderr}");
    assert!(
        stderr.contains(&format!("GET {url}/kv_event_sources")),
        "{stderr}"
    );
    assert!(
        stderr.contains("not a list of KV-event sources"),
        "{stderr}"
    );

    *answer.lock().unwrap() = "[]".into();
    let stderr = failed_start(&["--engine-http", &url]);
    assert!(
        stderr.contains("no KV-event publisher is enabled"),
        "{stderr}"
    );

    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = silent.local_addr().unwrap();
    drop(silent);
    let stderr = failed_start(&["--engine-http", &format!("http://{closed}")]);
    assert!(stderr.contains("cannot connect"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn explicit_flags_win_over_the_engine_and_a_disagreement_is_logged_once() {
    let (mut flagged, elsewhere) = (publisher().await, publisher().await);
    let answer = Arc::new(Mutex::new(vllm_answer(&[&elsewhere])));
    let engine = vllm_server(Arc::clone(&answer)).await;
    let url = format!("http://{engine}");
    let log = std::env::temp_dir().join(format!("kvgate-discovery-{}.log", std::process::id()));
    let stderr = std::fs::File::create(&log).unwrap();
    let gateway = Gateway::start_configured(
        &["--zmq-endpoint", flagged.endpoint(), "--engine-http", &url],
        |command| {
            command.stderr(stderr);
        },
    );
    let mut streams = vec![
        subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
            .await
            .unwrap(),
    ];
    // Events flow from the flag's publisher.
    sync_streams(&mut flagged, 0, &mut streams).await;
    let mut polling = common::Polling::within(std::time::Duration::from_secs(10));
    let logged = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if text.contains("the flags and the engine disagree") {
            break text;
        }
        polling
            .again(format_args!("the disagreement is never logged: {text}"))
            .await;
    };
    assert_eq!(
        logged.matches("the flags and the engine disagree").count(),
        1,
        "{logged}"
    );
    assert!(
        logged.contains(&format!(
            "rank 0: --zmq-endpoint gives {}",
            flagged.endpoint()
        )),
        "{logged}"
    );
}

// ---- gRPC: OpenEngine and SGLang ----

#[derive(Clone)]
struct OpenEngine(Arc<Mutex<Vec<openengine::KvEventSource>>>);

#[tonic::async_trait]
impl openengine::control_server::Control for OpenEngine {
    async fn get_kv_event_sources(
        &self,
        _: Request<openengine::GetKvEventSourcesRequest>,
    ) -> Result<Response<openengine::GetKvEventSourcesResponse>, Status> {
        Ok(Response::new(openengine::GetKvEventSourcesResponse {
            sources: self.0.lock().unwrap().clone(),
        }))
    }
}

#[derive(Clone)]
struct Sglang(Arc<Mutex<String>>);

#[tonic::async_trait]
impl sglang::sglang_service_server::SglangService for Sglang {
    async fn get_server_info(
        &self,
        _: Request<sglang::GetServerInfoRequest>,
    ) -> Result<Response<sglang::GetServerInfoResponse>, Status> {
        Ok(Response::new(sglang::GetServerInfoResponse {
            json_info: self.0.lock().unwrap().clone(),
        }))
    }
}

/// A gRPC server on an ephemeral port with `router`'s services.
async fn grpc_engine(router: tonic::transport::server::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(router.serve_with_incoming(TcpListenerStream::new(listener)));
    format!("http://{address}")
}

fn open_engine_source(
    publisher: &EnginePublisher,
    rank: u32,
    transport: &str,
) -> openengine::KvEventSource {
    openengine::KvEventSource {
        transport: transport.into(),
        endpoint_addr: Some(openengine::KvEndpoint {
            host: "127.0.0.1".into(),
            port: port_of(publisher.endpoint()).into(),
            protocol: "tcp".into(),
        }),
        topic: String::new(),
        replay_endpoint: publisher.replay_endpoint().unwrap().to_owned(),
        data_parallel_rank: Some(rank),
        encoding: "msgpack".into(),
        buffer_steps: Some(10_000),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn next_to_an_openengine_server_kvgate_learns_every_rank_from_get_kv_event_sources() {
    let (mut rank0, mut rank1) = (publisher().await, publisher().await);
    let sources = vec![
        open_engine_source(&rank1, 1, "zmq"),
        open_engine_source(&rank0, 0, "zmq"),
        open_engine_source(&rank0, 0, "grpc"),
    ];
    let service =
        openengine::control_server::ControlServer::new(OpenEngine(Arc::new(Mutex::new(sources))));
    let uri = grpc_engine(tonic::transport::Server::builder().add_service(service)).await;
    let (gateway, mut streams) = gateway_subscribed(
        &["--engine-grpc", &uri, "--load-poll-ms", "0"],
        "trtllm.TrtllmService",
    )
    .await;
    sync_streams(&mut rank0, 0, &mut streams).await;
    sync_streams(&mut rank1, 1, &mut streams).await;
    let status = status_json(&gateway).await;
    assert_eq!(
        status["sources"][1]["learned_from"],
        format!("openengine.v1.Control/GetKvEventSources at {uri}/"),
        "{status}"
    );
}

fn sglang_info(publisher: &EnginePublisher, load: &EnginePublisher) -> String {
    json!({
        "model_path": "Qwen/Qwen3-8B",
        "kv_events": {
            "publisher": "zmq",
            "endpoint_host": "*",
            "endpoint_port_base": port_of(publisher.endpoint()),
            "topic": "",
            "block_size": 16,
            "dp_size": 1,
            "replay_endpoint_port_base": port_of(publisher.replay_endpoint().unwrap()),
            "load_endpoint_port_base": port_of(load.endpoint()),
            "load_topic": "load",
        }
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn next_to_sglang_kvgate_reads_the_kv_events_descriptor_after_openengine_is_unimplemented() {
    let mut rank0 = publisher().await;
    let load_options = PublisherOptions {
        topic: kvgate_sim::LOAD_TOPIC.to_owned(),
        ..PublisherOptions::default()
    };
    let mut load = EnginePublisher::bind("tcp://127.0.0.1:0", &load_options)
        .await
        .unwrap();
    let service = sglang::sglang_service_server::SglangServiceServer::new(Sglang(Arc::new(
        Mutex::new(sglang_info(&rank0, &load)),
    )));
    let uri = grpc_engine(tonic::transport::Server::builder().add_service(service)).await;
    let gateway = Gateway::start(&[
        "--engine-grpc",
        &uri,
        "--load-poll-ms",
        "0",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let mut streams = vec![
        subscribe(
            gateway.channel().await,
            "sglang.grpc.scheduler.SglangScheduler",
            0,
        )
        .await
        .unwrap(),
    ];
    sync_streams(&mut rank0, 0, &mut streams).await;
    let status = status_json(&gateway).await;
    let source = &status["sources"][0];
    assert_eq!(
        source["endpoint"],
        format!("tcp://127.0.0.1:{}", port_of(rank0.endpoint()))
    );
    assert!(
        source["learned_from"]
            .as_str()
            .unwrap()
            .starts_with("sglang.runtime.v1.SglangService/GetServerInfo"),
        "{status}"
    );
    // The load publisher came from the descriptor too: no port arithmetic.
    let stat = kvgate_sim::LoadStat {
        num_running_reqs: 7,
        num_waiting_reqs: 0,
        num_tokens: 10,
        max_total_num_tokens: 100,
        attn_dp_rank: Some(0),
        num_waiting_uncached_tokens: 0,
        num_total_tokens: 10,
        max_running_requests: 8,
        total_prefill_uncached_tokens: 0,
        total_prefill_busy_us: 0,
    };
    let mut running = None;
    while running != Some(7) {
        let mut payload = Vec::new();
        stat.encode(&mut payload);
        load.publish(payload.into()).await.unwrap();
        let batch = common::next_batch(&mut streams[0]).await;
        running = batch.load.map(|load| load.running_requests);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_grpc_engine_that_answers_garbage_fails_the_start_naming_every_question() {
    let garbage = sglang::sglang_service_server::SglangServiceServer::new(Sglang(Arc::new(
        Mutex::new("{\"kv_events\": {\"publisher\": 5}}".into()),
    )));
    let grpc_only_sources =
        openengine::control_server::ControlServer::new(OpenEngine(Arc::new(Mutex::new(vec![
            openengine::KvEventSource {
                transport: "grpc".into(),
                encoding: "protobuf".into(),
                ..Default::default()
            },
        ]))));
    let uri = grpc_engine(
        tonic::transport::Server::builder()
            .add_service(garbage)
            .add_service(grpc_only_sources),
    )
    .await;
    let stderr = failed_start(&["--engine-grpc", &uri, "--load-poll-ms", "0"]);
    assert!(stderr.contains(&format!("--engine-grpc {uri}")), "{stderr}");
    assert!(
        stderr.contains("no ZMQ msgpack source (sources: grpc/protobuf)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("json_info is not a server-info object"),
        "{stderr}"
    );
}
