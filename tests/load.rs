//! The engine's load on the stream (contract section 6), end to end: the real
//! binary in front of a real tonic test engine serving `GetLoads` and real
//! ZMQ load publishers sending SGLang's `LoadStat`, real ZMQ KV publishers
//! and real tonic subscribers; and data-parallel ranks on several hosts
//! (contract section 2).

mod common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::router::{Admission, RouterView};
use common::socket_dir::SocketDir;
use common::{DEADLINE, Gateway, is_load_only, next_batch};
use kvgate::proto::common::{KvEventBatch, SubscribeKvEventsRequest};
use kvgate::proto::sglang::grpc::scheduler as sglang;
use kvgate::proto::vllm::grpc::engine as vllm;
use kvgate_sim::{EnginePublisher, LOAD_TOPIC, LoadStat, PublisherOptions, SimConfig, SimEngine};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::codec::Streaming;
use tonic::{Request, Response, Status};

const SERVICE: &str = "sglang.grpc.scheduler.SglangScheduler";

/// What the test engine answers to `GetLoads`.
#[derive(Clone)]
enum Answer {
    Loads(Vec<sglang::SchedulerLoad>),
    Fails,
}

/// Which engine service the test engine serves `GetLoads` on.
#[derive(Clone, Copy, PartialEq)]
enum Serves {
    Sglang,
    Vllm,
    Nothing,
}

/// A real gRPC engine on loopback that answers `GetLoads` from `answer` and
/// counts the calls; any other call gets UNIMPLEMENTED.
struct TestEngine {
    url: String,
    calls: Arc<AtomicU64>,
    answer: Arc<Mutex<Answer>>,
}

fn load(rank: i32, running: i32) -> sglang::SchedulerLoad {
    sglang::SchedulerLoad {
        dp_rank: rank,
        num_running_reqs: running,
        num_waiting_reqs: 1,
        num_waiting_uncached_tokens: 256,
        token_usage: 0.5,
        gen_throughput: 42.0,
        max_running_requests: 64,
        cache_hit_rate: 0.25,
        num_used_tokens: 100,
        max_total_num_tokens: 200,
        queues: Some(sglang::QueueMetrics {
            waiting: 1,
            grammar: 2,
            paused: 0,
            retracted: 0,
        }),
        ..Default::default()
    }
}

impl TestEngine {
    async fn start(serves: Serves, answer: Answer) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let calls = Arc::new(AtomicU64::new(0));
        let answer = Arc::new(Mutex::new(answer));
        let (route_calls, route_answer) = (Arc::clone(&calls), Arc::clone(&answer));
        let route = tower::service_fn(move |request: http::Request<axum::body::Body>| {
            let (calls, answer) = (Arc::clone(&route_calls), Arc::clone(&route_answer));
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let request = request.map(tonic::body::Body::new);
                let answer = answer.lock().unwrap().clone();
                let response = match serves {
                    Serves::Vllm => {
                        let codec = tonic_prost::ProstCodec::<
                            vllm::GetLoadsResponse,
                            vllm::GetLoadsRequest,
                        >::default();
                        let handler =
                            tower::service_fn(move |_: Request<vllm::GetLoadsRequest>| {
                                let answer = answer.clone();
                                async move {
                                    match answer {
                                        Answer::Fails => Err(Status::internal("engine trouble")),
                                        Answer::Loads(loads) => {
                                            Ok(Response::new(vllm::GetLoadsResponse {
                                                loads: loads.iter().map(as_vllm).collect(),
                                                ..Default::default()
                                            }))
                                        }
                                    }
                                }
                            });
                        tonic::server::Grpc::new(codec)
                            .unary(handler, request)
                            .await
                    }
                    _ => {
                        let codec = tonic_prost::ProstCodec::<
                            sglang::GetLoadsResponse,
                            sglang::GetLoadsRequest,
                        >::default();
                        let handler =
                            tower::service_fn(move |_: Request<sglang::GetLoadsRequest>| {
                                let answer = answer.clone();
                                async move {
                                    match answer {
                                        Answer::Fails => Err(Status::internal("engine trouble")),
                                        Answer::Loads(loads) => {
                                            Ok(Response::new(sglang::GetLoadsResponse {
                                                loads,
                                                ..Default::default()
                                            }))
                                        }
                                    }
                                }
                            });
                        tonic::server::Grpc::new(codec)
                            .unary(handler, request)
                            .await
                    }
                };
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let fallback_calls = Arc::clone(&calls);
        let fallback = tower::service_fn(move |_: http::Request<axum::body::Body>| {
            fallback_calls.fetch_add(1, Ordering::SeqCst);
            async {
                Ok::<_, std::convert::Infallible>(
                    Status::unimplemented("").into_http::<tonic::body::Body>(),
                )
            }
        });
        let path = match serves {
            Serves::Sglang => Some("/sglang.grpc.scheduler.SglangScheduler/GetLoads"),
            Serves::Vllm => Some("/vllm.grpc.engine.VllmEngine/GetLoads"),
            Serves::Nothing => None,
        };
        let mut router = axum::Router::new().fallback_service(fallback);
        if let Some(path) = path {
            router = router.route_service(path, route);
        }
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_routes(tonic::service::Routes::from(router))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        Self { url, calls, answer }
    }

    fn answer(&self, answer: Answer) {
        *self.answer.lock().unwrap() = answer;
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

fn as_vllm(load: &sglang::SchedulerLoad) -> vllm::SchedulerLoad {
    vllm::SchedulerLoad {
        dp_rank: load.dp_rank,
        num_running_reqs: load.num_running_reqs,
        num_waiting_reqs: load.num_waiting_reqs,
        token_usage: load.token_usage,
        max_running_requests: load.max_running_requests,
        ..Default::default()
    }
}

async fn publisher(host: &str) -> EnginePublisher {
    EnginePublisher::bind(&format!("tcp://{host}:0"), &PublisherOptions::default())
        .await
        .unwrap()
}

/// kvgate in front of `engine`, polling every `poll_ms`, metrics on.
fn gateway(publisher: &EnginePublisher, engine: &TestEngine, extra: &[&str]) -> Gateway {
    let poll_ms = if extra.contains(&"--load-poll-ms") {
        &[][..]
    } else {
        &["--load-poll-ms", "20"][..]
    };
    let mut args = vec![
        "--zmq-endpoint",
        publisher.endpoint(),
        "--engine-grpc",
        &engine.url,
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(poll_ms);
    args.extend_from_slice(extra);
    Gateway::start(&args)
}

async fn subscribe(gateway: &Gateway, cursor: u64, early: bool) -> Streaming<KvEventBatch> {
    let request = SubscribeKvEventsRequest {
        start_sequence_number: cursor,
        load_records_before_first_batch: early,
    };
    let codec = tonic_prost::ProstCodec::<SubscribeKvEventsRequest, KvEventBatch>::default();
    kvgate::client::subscribe_requesting(gateway.channel().await, SERVICE, request, codec)
        .await
        .expect("subscribed")
}

/// Reads `stream` until a batch satisfies `wanted`; checks on the way that
/// samples only go up. Fails the test at the deadline.
async fn read_until(
    stream: &mut Streaming<KvEventBatch>,
    last_sample: &mut u64,
    wanted: impl Fn(&KvEventBatch) -> bool,
) -> KvEventBatch {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no such batch before the deadline"
        );
        let batch = next_batch(stream).await;
        if let Some(load) = &batch.load {
            assert!(
                load.sample > *last_sample,
                "sample {} after {}",
                load.sample,
                *last_sample
            );
            *last_sample = load.sample;
        }
        if wanted(&batch) {
            return batch;
        }
    }
}

fn running(batch: &KvEventBatch) -> Option<u32> {
    batch.load.as_ref().map(|load| load.running_requests)
}

/// A counter or gauge from `/metrics` (0 when absent).
async fn metric(gateway: &Gateway, series: &str) -> f64 {
    let (_, body) = common::http_get(gateway.admin.expect("admin port"), "/metrics").await;
    body.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits (bounded) until `series` reaches at least `at_least`.
async fn wait_for_metric(gateway: &Gateway, series: &str, at_least: f64) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while metric(gateway, series).await < at_least {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} never reached {at_least}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_stream_gets_the_engines_load_and_a_change_reaches_each_without_any_kv_event() {
    let engine = TestEngine::start(Serves::Sglang, Answer::Loads(vec![load(0, 3)])).await;
    let publisher = publisher("127.0.0.1").await;
    let gateway = gateway(&publisher, &engine, &[]);
    let mut streams = Vec::new();
    for _ in 0..3 {
        streams.push((subscribe(&gateway, 0, true).await, 0));
    }
    for (stream, sample) in &mut streams {
        let first = read_until(stream, sample, |batch| running(batch) == Some(3)).await;
        assert!(is_load_only(&first) && first.events.is_empty());
        assert_eq!(
            first.sequence_number, 0,
            "no KV batch yet: numbered 0, for a subscriber that asked"
        );
        assert_eq!(first.dp_rank, Some(0));
        let record = first.load.unwrap();
        assert_eq!(
            (record.waiting_requests, record.max_running_requests),
            (1, 64)
        );
        assert_eq!(record.waiting_uncached_tokens, Some(256));
        assert_eq!((record.token_usage, record.gen_throughput), (0.5, 42.0));
        assert_eq!(record.cache_hit_rate, Some(0.25));
        assert_eq!(record.num_used_tokens, Some(100));
        assert_eq!(record.queues.unwrap().grammar, 2);
        assert_eq!(record.memory, None, "the engine did not report it");
    }
    engine.answer(Answer::Loads(vec![load(0, 7)]));
    for (stream, sample) in &mut streams {
        let changed = read_until(stream, sample, |batch| running(batch) == Some(7)).await;
        assert!(is_load_only(&changed));
    }
    assert!(metric(&gateway, "kvgate_load_only_batches_total").await >= 2.0);
    assert!(metric(&gateway, "kvgate_load_records_sent_total{source=\"poll\"}").await >= 2.0);
    assert!(metric(&gateway, "kvgate_load_polls_total{outcome=\"ok\"}").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn heartbeats_repeat_an_unchanged_record_with_the_age_of_its_poll() {
    let engine = TestEngine::start(Serves::Sglang, Answer::Loads(vec![load(0, 2)])).await;
    let publisher = publisher("127.0.0.1").await;
    let gateway = gateway(&publisher, &engine, &[]);
    let mut stream = subscribe(&gateway, 0, true).await;
    let mut sample = 0;
    let first = read_until(&mut stream, &mut sample, is_load_only).await;
    for _ in 0..2 {
        let heartbeat = read_until(&mut stream, &mut sample, is_load_only).await;
        assert_eq!(running(&heartbeat), running(&first), "nothing changed");
        assert!(
            heartbeat.load.unwrap().age_ms < 1000,
            "the engine answers every poll"
        );
    }
    // The engine stops answering: heartbeats go on with the record's true age.
    engine.answer(Answer::Fails);
    let aged = read_until(&mut stream, &mut sample, |batch| {
        is_load_only(batch) && batch.load.as_ref().unwrap().age_ms >= 1000
    })
    .await;
    assert_eq!(running(&aged), Some(2));
    assert!(metric(&gateway, "kvgate_load_polls_total{outcome=\"error\"}").await >= 1.0);
    wait_for_metric(&gateway, "kvgate_load_poll_age_seconds", 1.0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn one_engine_poll_serves_every_subscriber_the_engine_sees_as_many_calls_with_16_as_with_1() {
    let engine = TestEngine::start(Serves::Sglang, Answer::Loads(vec![load(0, 1)])).await;
    let publisher = publisher("127.0.0.1").await;
    let gateway = gateway(&publisher, &engine, &["--load-poll-ms", "50"]);
    let window = std::time::Duration::from_secs(1);
    let mut streams = vec![(subscribe(&gateway, 0, true).await, 0)];
    let (stream, sample) = &mut streams[0];
    read_until(stream, sample, is_load_only).await;
    let before = engine.calls();
    tokio::time::sleep(window).await;
    let with_one = engine.calls() - before;
    for _ in 1..16 {
        streams.push((subscribe(&gateway, 0, true).await, 0));
    }
    for (stream, sample) in &mut streams[1..] {
        read_until(stream, sample, is_load_only).await;
    }
    let before = engine.calls();
    tokio::time::sleep(window).await;
    let with_sixteen = engine.calls() - before;
    assert!(with_one > 0 && with_sixteen > 0);
    assert!(
        with_sixteen <= with_one * 2 + 4,
        "{with_sixteen} calls with 16 subscribers against {with_one} with 1"
    );
    // kvgate counts a poll once its answer is in, the engine when the call
    // arrives, and one call at most is in flight: read around the metric.
    let calls_before = engine.calls();
    let counted = metric(&gateway, "kvgate_load_polls_total{outcome=\"ok\"}").await as u64;
    let calls_after = engine.calls();
    assert!(
        calls_before <= counted + 1 && counted <= calls_after,
        "every call is kvgate's one poller's: {counted} counted, the engine saw {calls_before}..{calls_after}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kv_batches_carry_the_latest_record_and_a_load_only_batch_repeats_the_ranks_last_sequence()
{
    let engine = TestEngine::start(Serves::Sglang, Answer::Loads(vec![load(0, 5)])).await;
    let mut publisher = publisher("127.0.0.1").await;
    let gateway = gateway(&publisher, &engine, &[]);
    // Once a record reached a subscriber, the drain holds the engine's load.
    read_until(
        &mut subscribe(&gateway, 0, true).await,
        &mut 0,
        is_load_only,
    )
    .await;
    let mut streams = vec![subscribe(&gateway, 0, false).await];
    let mut sample = 0;
    let fence = common::sync_streams(&mut publisher, 0, &mut streams).await;
    let stream = &mut streams[0];
    publisher
        .publish(common::fence_payload(fence + 1000, 0))
        .await
        .unwrap();
    let carried = read_until(stream, &mut sample, |batch| {
        common::carries_fence(batch, fence + 1000)
    })
    .await;
    let record = carried
        .load
        .clone()
        .expect("the batch carries its rank's record");
    assert!(!record.load_only);
    assert_eq!(record.running_requests, 5);
    assert_eq!(
        record.cache_hit_rate, None,
        "event batches carry the routing core only"
    );
    engine.answer(Answer::Loads(vec![load(0, 6)]));
    let load_only = read_until(stream, &mut sample, |batch| running(batch) == Some(6)).await;
    assert!(is_load_only(&load_only));
    assert_eq!(load_only.sequence_number, carried.sequence_number);
    let mut router = RouterView::new();
    router.admit(&carried);
    assert_eq!(router.admit(&load_only), Admission::LoadOnly);
    assert_eq!(router.cursor(0), Some(carried.sequence_number));
}

#[tokio::test(flavor = "multi_thread")]
async fn records_numbered_0_come_before_the_first_batch_only_to_subscribers_that_ask() {
    let engine = TestEngine::start(Serves::Sglang, Answer::Loads(vec![load(0, 1)])).await;
    let mut publisher = publisher("127.0.0.1").await;
    let gateway = gateway(&publisher, &engine, &[]);
    let mut asking = subscribe(&gateway, 0, true).await;
    let mut sample = 0;
    let early = read_until(&mut asking, &mut sample, is_load_only).await;
    assert_eq!(early.sequence_number, 0);
    // A subscriber that did not ask: its first message is a real batch,
    // however many records went out before it.
    let mut streams = vec![subscribe(&gateway, 0, false).await];
    read_until(&mut asking, &mut sample, is_load_only).await;
    let mut first = None;
    common::sync_streams_observing(&mut publisher, 0, &mut streams, |_, batch| {
        first.get_or_insert_with(|| batch.clone());
    })
    .await;
    let first = first.expect("a batch");
    assert!(
        !is_load_only(&first),
        "a subscriber that did not ask got {first:?}"
    );
    assert_ne!(first.sequence_number, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_getloads_answers_are_clamped_or_dropped_and_counted_never_forwarded() {
    let mut bad = load(0, -4);
    bad.token_usage = f64::NAN;
    let answer = vec![bad, load(3, 9), load(0, 8)];
    let engine = TestEngine::start(Serves::Sglang, Answer::Loads(answer)).await;
    let publisher = publisher("127.0.0.1").await;
    let gateway = gateway(&publisher, &engine, &["--dp-size", "2"]);
    let mut stream = subscribe(&gateway, 0, true).await;
    let mut sample = 0;
    let mut records = Vec::new();
    while records.len() < 3 {
        records.push(read_until(&mut stream, &mut sample, is_load_only).await);
    }
    for record in &records {
        assert_eq!(
            record.dp_rank,
            Some(0),
            "rank 3 is not served, rank 1 was not answered"
        );
        let load = record.load.as_ref().unwrap();
        assert_eq!(
            load.running_requests, 0,
            "clamped, and the repeat of rank 0 dropped"
        );
        assert_eq!(load.token_usage, 0.0);
    }
    for reason in [
        "negative",
        "not_finite",
        "unknown_rank",
        "duplicate_rank",
        "missing_rank",
    ] {
        let series = format!("kvgate_load_answer_faults_total{{reason=\"{reason}\"}}");
        assert!(metric(&gateway, &series).await >= 1.0, "{series}");
    }
    assert_eq!(
        metric(
            &gateway,
            "kvgate_load_answer_faults_total{reason=\"above_one\"}"
        )
        .await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_engine_without_getloads_turns_records_off_after_one_round_of_detection() {
    let engine = TestEngine::start(Serves::Nothing, Answer::Fails).await;
    let mut publisher = publisher("127.0.0.1").await;
    let gateway = gateway(&publisher, &engine, &[]);
    wait_for_metric(
        &gateway,
        "kvgate_load_polls_total{outcome=\"unimplemented\"}",
        1.0,
    )
    .await;
    assert_eq!(engine.calls(), 3, "each engine service tried once");
    let mut streams = vec![subscribe(&gateway, 0, true).await];
    let mut seen = Vec::new();
    common::sync_streams_observing(&mut publisher, 0, &mut streams, |_, batch| {
        seen.push(batch.clone());
    })
    .await;
    assert!(seen.iter().all(|batch| batch.load.is_none()));
    assert_eq!(engine.calls(), 3, "never polled again");
    assert_eq!(
        metric(&gateway, "kvgate_load_polls_total{outcome=\"ok\"}").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_vllm_engine_is_detected_by_trying_and_its_getloads_messages_are_read() {
    let engine = TestEngine::start(Serves::Vllm, Answer::Loads(vec![load(0, 4)])).await;
    let publisher = publisher("127.0.0.1").await;
    let gateway = gateway(&publisher, &engine, &[]);
    let mut stream = subscribe(&gateway, 0, true).await;
    let record = read_until(&mut stream, &mut 0, is_load_only).await;
    let load = record.load.unwrap();
    assert_eq!((load.running_requests, load.max_running_requests), (4, 64));
    assert_eq!(load.queues, None, "vLLM reports no sections");
}

#[tokio::test(flavor = "multi_thread")]
async fn resuming_with_load_records_on_delivers_every_batch_after_the_cursor_exactly_once() {
    let engine = TestEngine::start(Serves::Sglang, Answer::Loads(vec![load(0, 1)])).await;
    let mut publisher = publisher("127.0.0.1").await;
    let gateway = gateway(&publisher, &engine, &["--max-batch-events", "4"]);
    let mut view = RouterView::new();
    let mut streams = vec![subscribe(&gateway, 0, true).await];
    common::sync_streams_observing(&mut publisher, 0, &mut streams, |_, batch| {
        view.admit(batch);
    })
    .await;
    let mut stream = streams.pop().unwrap();
    let mut sim = SimEngine::new(SimConfig {
        seed: 7,
        capacity_blocks: 128,
        ..SimConfig::default()
    })
    .unwrap();
    common::publish_steps_then_fence(&mut sim, &mut publisher, 20, 1).await;
    engine.answer(Answer::Loads(vec![load(0, 2)]));
    common::follow_to_fence(&mut stream, &mut view, 1).await;
    drop(stream);

    common::publish_steps_then_fence(&mut sim, &mut publisher, 20, 2).await;
    engine.answer(Answer::Loads(vec![load(0, 3)]));
    view.reconnecting();
    let cursor = view.resume_cursor();
    let mut stream = subscribe(&gateway, cursor, true).await;
    let resumed: Vec<_> = common::follow_to_fence(&mut stream, &mut view, 2)
        .await
        .into_iter()
        .filter(|(_, admission)| *admission != Admission::LoadOnly)
        .collect();
    assert_eq!(resumed[0].0.sequence_number, cursor + 1);
    assert!(
        resumed
            .iter()
            .all(|(_, admission)| *admission == Admission::Applied)
    );
    // Records keep coming after the resume, and change nothing.
    engine.answer(Answer::Loads(vec![load(0, 4)]));
    read_until(&mut stream, &mut 0, |batch| running(batch) == Some(4)).await;
    assert_eq!(view.blocks(0), common::true_blocks(&sim));
    assert!(view.gaps.is_empty() && view.restarts == 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn ranks_on_two_hosts_with_unrelated_ports_each_reach_the_stream_with_their_rank() {
    let mut rank0 = publisher("127.0.0.1").await;
    let mut rank1 = publisher("127.0.0.2").await;
    let gateway = Gateway::start(&[
        "--dp-size",
        "2",
        "--zmq-endpoint",
        rank0.endpoint(),
        "--zmq-endpoint",
        rank1.endpoint(),
    ]);
    let mut streams = vec![
        kvgate::client::subscribe(gateway.channel().await, SERVICE, 0)
            .await
            .unwrap(),
    ];
    let mut ranks_seen = Vec::new();
    for (rank, publisher) in [(0, &mut rank0), (1, &mut rank1)] {
        common::sync_streams_observing(publisher, rank, &mut streams, |_, batch| {
            if common::fence_in(batch).is_some() {
                ranks_seen.push(batch.dp_rank);
            }
        })
        .await;
    }
    assert!(ranks_seen.contains(&Some(0)) && ranks_seen.contains(&Some(1)));
}

/// Runs `kvgate serve` with `args` and `env`, expecting it to refuse to
/// start; returns its stderr.
fn refused_start(args: &[&str], env: &[(&str, &str)]) -> String {
    let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate starts");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let output = match rx.recv_timeout(DEADLINE) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("kvgate started despite {args:?} {env:?}");
        }
    };
    assert!(!output.status.success());
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn a_dp_size_that_disagrees_with_the_endpoints_given_fails_at_start_naming_both() {
    let stderr = refused_start(
        &[
            "--dp-size",
            "3",
            "--zmq-endpoint",
            "tcp://127.0.0.1:5001",
            "--zmq-endpoint",
            "tcp://127.0.0.2:6001",
        ],
        &[],
    );
    assert!(
        stderr.contains("--zmq-endpoint is given 2 times") && stderr.contains("--dp-size is 3"),
        "{stderr}"
    );
    let stderr = refused_start(
        &["--zmq-endpoint", "tcp://127.0.0.1:5001"],
        &[
            ("KVGATE_DP_SIZE", "2"),
            (
                "KVGATE_ZMQ_REPLAY_ENDPOINT",
                "tcp://127.0.0.1:5101,tcp://127.0.0.2:6101,tcp://127.0.0.3:7101",
            ),
        ],
    );
    assert!(
        stderr.contains("--zmq-replay-endpoint is given 3 times")
            && stderr.contains("--dp-size is 2"),
        "{stderr}"
    );
}

/// An engine's load PUB, as SGLang binds it (`--load-publish-endpoint`).
async fn load_publisher(endpoint: &str) -> EnginePublisher {
    let options = PublisherOptions {
        topic: LOAD_TOPIC.to_owned(),
        ..PublisherOptions::default()
    };
    EnginePublisher::bind(endpoint, &options).await.unwrap()
}

/// kvgate on an engine's KV and load publishers, metrics on; the KV
/// publisher is returned to keep it up.
async fn pushing_gateway(extra: &[&str]) -> (Gateway, EnginePublisher, EnginePublisher) {
    pushing_gateway_at("tcp://127.0.0.1:0", extra).await
}

/// [`pushing_gateway`] with the load publisher bound at `load_endpoint`.
async fn pushing_gateway_at(
    load_endpoint: &str,
    extra: &[&str],
) -> (Gateway, EnginePublisher, EnginePublisher) {
    let kv = publisher("127.0.0.1").await;
    let load = load_publisher(load_endpoint).await;
    let mut args = vec![
        "--zmq-endpoint",
        kv.endpoint(),
        "--zmq-load-endpoint",
        load.endpoint(),
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    (Gateway::start(&args), kv, load)
}

/// A stat of `running` requests on `rank`, 1024 of 4096 tokens in use.
fn stat(rank: u32, running: i64) -> LoadStat {
    LoadStat {
        num_running_reqs: running,
        num_waiting_reqs: 2,
        num_tokens: 1024,
        max_total_num_tokens: 4096,
        attn_dp_rank: Some(i64::from(rank)),
        num_waiting_uncached_tokens: 300,
        num_total_tokens: 2000,
        max_running_requests: 48,
        total_prefill_uncached_tokens: 10,
        total_prefill_busy_us: 20,
    }
}

async fn push(publisher: &mut EnginePublisher, stat: LoadStat) {
    let mut payload = Vec::new();
    stat.encode(&mut payload);
    publisher.publish(payload.into()).await.unwrap();
}

/// Gets past the load socket's slow joiner: pushes stats of a new running
/// count each until `stream` shows the last one pushed on `rank`; returns
/// that count. Every later push reaches kvgate.
async fn sync_load(
    publisher: &mut EnginePublisher,
    rank: u32,
    stream: &mut Streaming<KvEventBatch>,
    sample: &mut u64,
) -> u32 {
    static NEXT: AtomicU64 = AtomicU64::new(1000);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "kvgate never forwarded a pushed stat"
        );
        let count = NEXT.fetch_add(1, Ordering::Relaxed) as u32;
        push(publisher, stat(rank, i64::from(count))).await;
        let wanted = |batch: &KvEventBatch| {
            batch.dp_rank == Some(rank as i32) && running(batch) == Some(count)
        };
        let probe = tokio::time::timeout(std::time::Duration::from_millis(100), async {
            loop {
                let batch = next_batch(stream).await;
                if let Some(load) = &batch.load {
                    assert!(load.sample > *sample);
                    *sample = load.sample;
                }
                if wanted(&batch) {
                    return;
                }
            }
        })
        .await;
        if probe.is_ok() {
            return count;
        }
    }
}

/// `/status` as JSON.
async fn status(gateway: &Gateway) -> serde_json::Value {
    let (_, body) = common::http_get(gateway.admin.expect("admin port"), "/status").await;
    serde_json::from_str(&body).expect("/status is JSON")
}

fn load_sources(status: &serde_json::Value) -> Vec<Option<String>> {
    status["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|rank| rank["load_source"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stat_pushed_on_an_ipc_load_endpoint_reaches_the_stream() {
    let dir = SocketDir::new("load-ipc");
    let (gateway, _kv, mut load) = pushing_gateway_at(&dir.endpoint("load.sock"), &[]).await;
    let (mut stream, mut sample) = (subscribe(&gateway, 0, true).await, 0);
    sync_load(&mut load, 0, &mut stream, &mut sample).await;
    assert_eq!(load_sources(&status(&gateway).await), [Some("push".into())]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pushed_stat_reaches_every_subscribers_stream_in_the_next_drain_cycle_with_every_field_mapped()
 {
    // With heartbeats a minute apart, every record read here went out
    // because the stat changed.
    let (gateway, _kv, mut load) = pushing_gateway(&["--load-heartbeat-ms", "60000"]).await;
    let mut streams = Vec::new();
    for _ in 0..3 {
        streams.push((subscribe(&gateway, 0, true).await, 0));
    }
    let (first, sample) = &mut streams[0];
    sync_load(&mut load, 0, first, sample).await;
    // The stat exactly as SGLang 0.5.23's publisher sent it.
    let golden = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/load/sglang-0.5.23/load-stat.msgpack"
    ))
    .unwrap();
    load.publish(golden.into()).await.unwrap();
    for (stream, sample) in &mut streams {
        let pushed = read_until(stream, sample, |batch| running(batch) == Some(3)).await;
        assert!(is_load_only(&pushed));
        assert_eq!(pushed.dp_rank, Some(0));
        let record = pushed.load.unwrap();
        assert_eq!((record.running_requests, record.waiting_requests), (3, 2));
        assert_eq!(record.num_used_tokens, Some(1200));
        assert_eq!(record.max_total_num_tokens, Some(4096));
        assert_eq!(record.token_usage, 1200.0 / 4096.0);
        assert_eq!(record.waiting_uncached_tokens, Some(800));
        assert_eq!(record.max_running_requests, 48);
        assert_eq!(record.cache_hit_rate, None, "a stat does not carry it");
        assert!(
            record.age_ms < 60_000,
            "sent when the push arrived, not by a heartbeat"
        );
    }
    assert!(metric(&gateway, "kvgate_load_pushes_total").await >= 2.0);
    assert!(metric(&gateway, "kvgate_load_records_sent_total{source=\"push\"}").await >= 2.0);
    assert_eq!(
        metric(&gateway, "kvgate_load_records_sent_total{source=\"poll\"}").await,
        0.0
    );
    assert_eq!(load_sources(&status(&gateway).await), [Some("push".into())]);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unchanged_pushed_stat_is_repeated_every_heartbeat_flat_with_the_age_of_its_push() {
    let (gateway, _kv, mut load) = pushing_gateway(&["--load-heartbeat-ms", "200"]).await;
    let mut stream = subscribe(&gateway, 0, true).await;
    let mut sample = 0;
    let running_now = sync_load(&mut load, 0, &mut stream, &mut sample).await;
    // Nothing is pushed any more: each heartbeat repeats the last stat,
    // every 200 ms on one cadence (never backing off), older each time.
    let mut ages = Vec::new();
    while ages.len() < 6 {
        let beat = read_until(&mut stream, &mut sample, is_load_only).await;
        assert_eq!(running(&beat), Some(running_now));
        ages.push(beat.load.unwrap().age_ms);
    }
    // The k-th is due (k + 1) intervals after the stat went out.
    for (beats, age) in (1..).zip(&ages) {
        assert!(
            (200 * beats..200 * beats + 1000).contains(age),
            "heartbeats aged {ages:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn dp_ranks_push_each_on_its_own_port_and_from_other_hosts_with_their_rank() {
    // Rank r at base + r.
    let base = common::free_ports(2);
    let mut rank0 = load_publisher(&format!("tcp://127.0.0.1:{base}")).await;
    let mut rank1 = load_publisher(&format!("tcp://127.0.0.1:{}", base + 1)).await;
    let kv_base = common::free_ports(2);
    let kv0 = publisher_at(kv_base).await;
    let kv1 = publisher_at(kv_base + 1).await;
    let gateway = Gateway::start(&[
        "--dp-size",
        "2",
        "--zmq-endpoint",
        kv0.endpoint(),
        "--zmq-load-endpoint",
        rank0.endpoint(),
    ]);
    let mut stream = subscribe(&gateway, 0, true).await;
    let mut sample = 0;
    sync_load(&mut rank0, 0, &mut stream, &mut sample).await;
    sync_load(&mut rank1, 1, &mut stream, &mut sample).await;
    drop((kv0, kv1));

    // Multi-host: one endpoint per rank, on unrelated hosts and ports.
    let mut host0 = load_publisher("tcp://127.0.0.1:0").await;
    let mut host1 = load_publisher("tcp://127.0.0.2:0").await;
    let kv = publisher("127.0.0.1").await;
    let kv_other = publisher("127.0.0.2").await;
    let gateway = Gateway::start(&[
        "--dp-size",
        "2",
        "--zmq-endpoint",
        kv.endpoint(),
        "--zmq-endpoint",
        kv_other.endpoint(),
        "--zmq-load-endpoint",
        &format!("{},{}", host0.endpoint(), host1.endpoint()),
    ]);
    let mut stream = subscribe(&gateway, 0, true).await;
    let mut sample = 0;
    sync_load(&mut host1, 1, &mut stream, &mut sample).await;
    sync_load(&mut host0, 0, &mut stream, &mut sample).await;
}

async fn publisher_at(port: u16) -> EnginePublisher {
    EnginePublisher::bind(
        &format!("tcp://127.0.0.1:{port}"),
        &PublisherOptions::default(),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn while_pushes_flow_getloads_is_never_called_a_silent_rank_is_polled_until_pushes_return() {
    let engine = TestEngine::start(Serves::Sglang, Answer::Loads(vec![load(0, 9)])).await;
    let kv = publisher("127.0.0.1").await;
    let mut load = load_publisher("tcp://127.0.0.1:0").await;
    let gateway = gateway(
        &kv,
        &engine,
        &[
            "--zmq-load-endpoint",
            load.endpoint(),
            "--load-push-stale-ms",
            "1500",
            "--load-heartbeat-ms",
            "100",
        ],
    );
    let mut stream = subscribe(&gateway, 0, true).await;
    let mut sample = 0;
    let pushed = sync_load(&mut load, 0, &mut stream, &mut sample).await;
    // The engine re-sends its unchanged stat every 100 ms (every second in
    // SGLang) for three stale intervals: kvgate never polls.
    for _ in 0..45 {
        push(&mut load, stat(0, i64::from(pushed))).await;
        let beat = read_until(&mut stream, &mut sample, is_load_only).await;
        assert_eq!(running(&beat), Some(pushed), "only pushed records");
    }
    assert_eq!(engine.calls(), 0, "GetLoads called while pushes flowed");
    assert_eq!(load_sources(&status(&gateway).await), [Some("push".into())]);

    // The pushes stop: past the stale interval, the poller takes over.
    let polled = read_until(&mut stream, &mut sample, |batch| running(batch) == Some(9)).await;
    assert!(is_load_only(&polled));
    assert!(engine.calls() >= 1);
    assert!(metric(&gateway, "kvgate_load_records_sent_total{source=\"poll\"}").await >= 1.0);
    assert_eq!(load_sources(&status(&gateway).await), [Some("poll".into())]);

    // Pushes return: the next one replaces the polled reading at once, and
    // polling stops (one call may have been in flight).
    let back = sync_load(&mut load, 0, &mut stream, &mut sample).await;
    let calls = engine.calls();
    for _ in 0..20 {
        push(&mut load, stat(0, i64::from(back))).await;
        let beat = read_until(&mut stream, &mut sample, is_load_only).await;
        assert_eq!(running(&beat), Some(back));
    }
    assert!(
        engine.calls() <= calls + 1,
        "{} GetLoads calls after pushes returned",
        engine.calls() - calls
    );
    assert_eq!(load_sources(&status(&gateway).await), [Some("push".into())]);
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_load_messages_are_counted_by_reason_and_every_stream_goes_on() {
    let (gateway, _kv, mut load) = pushing_gateway(&["--zmq-max-message-bytes", "64KiB"]).await;
    let mut streams = vec![
        (subscribe(&gateway, 0, true).await, 0),
        (subscribe(&gateway, 0, true).await, 0),
    ];
    let (first, sample) = &mut streams[0];
    sync_load(&mut load, 0, first, sample).await;

    let seq = bytes::Bytes::from_static(&[0; 8]);
    let topic = bytes::Bytes::from_static(LOAD_TOPIC.as_bytes());
    let mut good = Vec::new();
    stat(0, 1).encode(&mut good);
    let good = bytes::Bytes::from(good);
    let bad_frames = [
        vec![topic.clone(), seq.clone()],
        vec![
            topic.clone(),
            bytes::Bytes::from_static(b"seq"),
            good.clone(),
        ],
        vec![
            bytes::Bytes::from_static(b"loadavg"),
            seq.clone(),
            good.clone(),
        ],
    ];
    for frames in bad_frames {
        load.send_frames(frames).await.unwrap();
    }
    let payload = |stat: LoadStat| {
        let mut out = Vec::new();
        stat.encode(&mut out);
        bytes::Bytes::from(out)
    };
    load.publish(bytes::Bytes::from_static(b"\x93garbage"))
        .await
        .unwrap();
    load.publish(payload(LoadStat {
        num_running_reqs: -3,
        num_waiting_reqs: i64::MAX,
        num_tokens: 9000,
        ..stat(0, 0)
    }))
    .await
    .unwrap();
    for (stream, sample) in &mut streams {
        let repaired = read_until(stream, sample, |batch| running(batch) == Some(0)).await;
        let record = repaired.load.unwrap();
        assert_eq!(record.waiting_requests, u32::MAX);
        assert_eq!(record.token_usage, 1.0);
    }
    load.publish(payload(stat(5, 77))).await.unwrap();
    load.skip(3);
    load.publish(payload(stat(0, 4))).await.unwrap();
    load.restart();
    load.publish(payload(stat(0, 5))).await.unwrap();
    // Larger than --zmq-max-message-bytes: the connection goes, kvgate
    // reconnects.
    load.publish(vec![0u8; 128 << 10].into()).await.unwrap();
    for reason in [
        "wrong_frame_count",
        "bad_sequence_frame",
        "topic_mismatch",
        "not_load_stat",
        "negative",
        "too_large",
        "above_one",
        "unknown_rank",
        "sequence_gap",
        "sequence_back",
    ] {
        let series = format!("kvgate_load_push_faults_total{{reason=\"{reason}\"}}");
        wait_for_metric(&gateway, &series, 1.0).await;
    }
    wait_for_metric(
        &gateway,
        "kvgate_zmq_peers_dropped_total{socket=\"sub\",reason=\"message_too_large\"}",
        1.0,
    )
    .await;
    // Every stream is intact and gets the latest stat (a gauge: one that a
    // later one superseded within a drain cycle may be skipped); rank 5's
    // never came.
    for (stream, sample) in &mut streams {
        read_until(stream, sample, |batch| {
            assert_ne!(running(batch), Some(77), "a rank kvgate does not serve");
            running(batch) == Some(5)
        })
        .await;
    }
    // And after the oversized message cost the connection, pushes go on.
    let (first, sample) = &mut streams[0];
    sync_load(&mut load, 0, first, sample).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_demo_engine_pushes_its_load_in_sglangs_format_and_kvgate_streams_it() {
    let gateway = Gateway::start(&["--demo", "--metrics-listen", "127.0.0.1:0"]);
    let mut stream = subscribe(&gateway, 0, true).await;
    let record = read_until(&mut stream, &mut 0, is_load_only).await;
    let load = record.load.unwrap();
    assert_eq!(load.max_running_requests, 64);
    assert!(load.max_total_num_tokens.is_some());
    wait_for_metric(&gateway, "kvgate_load_pushes_total", 1.0).await;
    assert_eq!(load_sources(&status(&gateway).await), [Some("push".into())]);
}

#[test]
fn load_push_and_heartbeat_flags_out_of_range_fail_at_start_naming_the_flag() {
    let stderr = refused_start(
        &[
            "--zmq-endpoint",
            "tcp://127.0.0.1:5001",
            "--load-heartbeat-ms",
            "50",
        ],
        &[],
    );
    assert!(stderr.contains("--load-heartbeat-ms"), "{stderr}");
    let stderr = refused_start(
        &["--zmq-endpoint", "tcp://127.0.0.1:5001"],
        &[("KVGATE_LOAD_PUSH_STALE_MS", "10")],
    );
    assert!(stderr.contains("--load-push-stale-ms"), "{stderr}");
    let stderr = refused_start(
        &["--zmq-endpoint", "tcp://127.0.0.1:5001", "--dp-size", "2"],
        &[(
            "KVGATE_ZMQ_LOAD_ENDPOINT",
            "tcp://127.0.0.1:5101,tcp://127.0.0.2:6101,tcp://127.0.0.3:7101",
        )],
    );
    assert!(
        stderr.contains("--zmq-load-endpoint is given 3 times"),
        "{stderr}"
    );
}

/// Admits `batch` into `view`, checking that a `load_only` batch names no
/// sequence of rank 0 the stream has not delivered (`last`: the last KV
/// batch's; 0 before the first, as `load_only` batches before it are).
fn admit_checking_load_only(view: &mut RouterView, last: &mut Option<u64>, batch: &KvEventBatch) {
    if is_load_only(batch) {
        let named = batch.sequence_number;
        assert!(
            named <= last.unwrap_or(0),
            "a load_only batch names sequence {named}, the stream's last is {last:?}"
        );
    } else if batch.dp_rank.unwrap_or(0) == 0 {
        *last = Some(batch.sequence_number);
    }
    let admission = view.admit(batch);
    assert!(!matches!(admission, Admission::Gap { .. }), "{admission:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_state_dir_no_load_only_batch_names_a_sequence_still_being_written_to_the_log() {
    let dir = std::env::temp_dir().join(format!("load-held-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A write held longer than this would pause persistence instead.
    let (gateway, mut kv, mut load) = pushing_gateway(&[
        "--state-dir",
        dir.to_str().unwrap(),
        "--state-io-timeout-ms",
        "10000",
        "--load-heartbeat-ms",
        "100",
    ])
    .await;
    let mut stream = subscribe(&gateway, 0, true).await;
    let mut sample = 0;
    sync_load(&mut load, 0, &mut stream, &mut sample).await;
    // The log writer's first open waits for a reader, as a write waits for
    // a slow disk (the first segment of a new directory starts at 1).
    let segment = dir.join("segment-00000000000000000001.log");
    common::replace_with_fifo(&segment);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut fence = 1u64 << 40;
    while metric(&gateway, "kvgate_engine_messages_total{rank=\"0\"}").await == 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "no message taken");
        kv.publish(common::fence_payload(fence, 0)).await.unwrap();
        fence += 1;
    }
    let mut sim = SimEngine::new(SimConfig {
        seed: 3,
        capacity_blocks: 128,
        ..SimConfig::default()
    })
    .unwrap();
    common::publish_steps_then_fence(&mut sim, &mut kv, 5, fence).await;
    // Heartbeats and a changed record come due while the batches are
    // numbered and not yet written: none may name their sequences.
    push(&mut load, stat(0, 7)).await;
    let mut view = RouterView::new();
    let mut last = None;
    let window = tokio::time::Instant::now() + std::time::Duration::from_millis(600);
    while let Ok(message) = tokio::time::timeout_at(window, stream.message()).await {
        let batch = message.expect("healthy").expect("open");
        admit_checking_load_only(&mut view, &mut last, &batch);
    }

    let reader = std::thread::spawn(move || std::fs::read(segment).unwrap());
    common::sync_streams_observing(&mut kv, 0, std::slice::from_mut(&mut stream), |_, batch| {
        admit_checking_load_only(&mut view, &mut last, batch);
    })
    .await;
    // Once written and announced, the heartbeat names the last batch.
    let heartbeat = loop {
        let batch = next_batch(&mut stream).await;
        admit_checking_load_only(&mut view, &mut last, &batch);
        if is_load_only(&batch) {
            break batch;
        }
    };
    assert_eq!(Some(heartbeat.sequence_number), last);
    assert_eq!(view.blocks(0), common::true_blocks(&sim));
    drop(gateway);
    assert!(reader.join().unwrap().starts_with(b"KVGLOG\0\0"));
    common::remove_state_dir(&dir);
}
