//! The engine's load on the stream (contract section 6), end to end: the real
//! binary in front of a real tonic test engine serving `GetLoads`, real ZMQ
//! publishers and real tonic subscribers; and data-parallel ranks on several
//! hosts (contract section 2).

mod common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::router::{Admission, RouterView};
use common::{DEADLINE, Gateway, is_load_only, next_batch};
use kvgate::proto::common::{KvEventBatch, SubscribeKvEventsRequest};
use kvgate::proto::sglang::grpc::scheduler as sglang;
use kvgate::proto::vllm::grpc::engine as vllm;
use kvgate_sim::{EnginePublisher, PublisherOptions, SimConfig, SimEngine};
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
    assert!(metric(&gateway, "kvgate_load_records_sent_total").await >= 2.0);
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
    assert!(metric(&gateway, "kvgate_load_poll_age_seconds").await >= 1.0);
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
