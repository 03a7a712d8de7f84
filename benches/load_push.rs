//! Pushed load, measured: how long a stat SGLang's load publisher pushes
//! takes to reach a subscriber's stream through kvgate, and how many
//! `GetLoads` calls the engine is spared against polling every 100 ms.
//!
//! Everything real and on loopback, kvgate in this process: a ZMQ load PUB
//! sending SGLang 0.5.23's `LoadStat` frames, a tonic subscriber, and a gRPC
//! engine answering (and counting) `GetLoads`. Prints a table; `make bench`
//! runs it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvgate::proto::common::{KvEventBatch, SubscribeKvEventsRequest};
use kvgate::proto::sglang::grpc::scheduler as sglang;
use kvgate_sim::{EnginePublisher, LOAD_TOPIC, LoadStat, PublisherOptions};
use tokio::net::TcpListener;
use tonic::codec::Streaming;
use tonic::{Request, Response, Status};

const SAMPLES: usize = 2000;
const WARMUP: usize = 200;
/// How long each engine-RPC run is counted.
const WINDOW: Duration = Duration::from_secs(10);
const SERVICE: &str = "sglang.grpc.scheduler.SglangScheduler";

/// A gRPC engine that answers every `GetLoads` (one rank, 4 running) and
/// counts the calls.
async fn start_engine(calls: Arc<AtomicU64>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let get_loads = tower::service_fn(move |request: http::Request<axum::body::Body>| {
        calls.fetch_add(1, Ordering::Relaxed);
        async move {
            let codec =
                tonic_prost::ProstCodec::<sglang::GetLoadsResponse, sglang::GetLoadsRequest>::default();
            let handler = tower::service_fn(|_: Request<sglang::GetLoadsRequest>| async {
                Ok::<_, Status>(Response::new(sglang::GetLoadsResponse {
                    loads: vec![sglang::SchedulerLoad {
                        num_running_reqs: 4,
                        ..Default::default()
                    }],
                    ..Default::default()
                }))
            });
            Ok::<_, std::convert::Infallible>(
                tonic::server::Grpc::new(codec)
                    .unary(handler, request.map(tonic::body::Body::new))
                    .await,
            )
        }
    });
    let router = axum::Router::new().route_service(&format!("/{SERVICE}/GetLoads"), get_loads);
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{address}")
}

/// kvgate in this process with `flags`, and one subscriber asking for
/// records before the first batch.
async fn gateway(flags: &[&str]) -> Streaming<KvEventBatch> {
    let mut argv = vec!["kvgate", "serve", "--listen", "127.0.0.1:0"];
    argv.extend_from_slice(flags);
    let cli = <kvgate::cli::Cli as clap::Parser>::parse_from(argv);
    let kvgate::cli::Command::Serve(args) = cli.command else {
        unreachable!()
    };
    let kvgate = kvgate::app::Gateway::start(*args).await.unwrap();
    let uri = format!("http://{}", kvgate.address());
    tokio::spawn(kvgate.run(std::future::pending()));
    let channel = tonic::transport::Channel::from_shared(uri)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let request = SubscribeKvEventsRequest {
        start_sequence_number: 0,
        load_records_before_first_batch: true,
    };
    let codec = tonic_prost::ProstCodec::<SubscribeKvEventsRequest, KvEventBatch>::default();
    kvgate::client::subscribe_requesting(channel, SERVICE, request, codec)
        .await
        .unwrap()
}

fn stat(running: i64) -> bytes::Bytes {
    let mut payload = Vec::new();
    LoadStat {
        num_running_reqs: running,
        num_tokens: 1000,
        max_total_num_tokens: 4000,
        attn_dp_rank: Some(0),
        max_running_requests: 64,
        ..LoadStat::default()
    }
    .encode(&mut payload);
    payload.into()
}

/// Reads `stream` until a record of `running` requests arrives.
async fn until_running(stream: &mut Streaming<KvEventBatch>, running: u32) {
    loop {
        let batch = stream.message().await.unwrap().unwrap();
        if batch
            .load
            .is_some_and(|load| load.running_requests == running)
        {
            return;
        }
    }
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    samples[((samples.len() - 1) as f64 * p) as usize]
}

async fn kv_publisher() -> EnginePublisher {
    EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap()
}

async fn load_publisher() -> EnginePublisher {
    let options = PublisherOptions {
        topic: LOAD_TOPIC.to_owned(),
        ..PublisherOptions::default()
    };
    EnginePublisher::bind("tcp://127.0.0.1:0", &options)
        .await
        .unwrap()
}

/// Push to subscriber: each stat a change, the next pushed once the last
/// arrived.
async fn push_latencies() -> Vec<Duration> {
    let kv = kv_publisher().await;
    let mut load = load_publisher().await;
    let mut stream = gateway(&[
        "--zmq-endpoint",
        kv.endpoint(),
        "--zmq-load-endpoint",
        load.endpoint(),
    ])
    .await;
    // ZMQ's slow joiner: push until the first stat comes through.
    let mut running = 1;
    loop {
        load.publish(stat(running)).await.unwrap();
        let arrived = tokio::time::timeout(
            Duration::from_millis(100),
            until_running(&mut stream, running as u32),
        );
        if arrived.await.is_ok() {
            break;
        }
        running += 1;
    }
    let mut samples = Vec::with_capacity(SAMPLES);
    for n in 0..SAMPLES + WARMUP {
        running += 1;
        let started = Instant::now();
        load.publish(stat(running)).await.unwrap();
        until_running(&mut stream, running as u32).await;
        if n >= WARMUP {
            samples.push(started.elapsed());
        }
    }
    samples
}

/// `GetLoads` calls the engine gets in [`WINDOW`] with `flags`, while a
/// load publisher (if `push`) re-sends an unchanged stat every second, as
/// SGLang does.
async fn engine_calls(push: bool) -> u64 {
    let calls = Arc::new(AtomicU64::new(0));
    let engine = start_engine(Arc::clone(&calls)).await;
    let kv = kv_publisher().await;
    let mut load = load_publisher().await;
    let mut flags = vec![
        "--zmq-endpoint",
        kv.endpoint(),
        "--engine-grpc",
        &engine,
        "--load-poll-ms",
        "100",
    ];
    if push {
        flags.extend(["--zmq-load-endpoint", load.endpoint()]);
    }
    let mut stream = gateway(&flags).await;
    let mut second = tokio::time::interval(Duration::from_secs(1));
    if push {
        // Until the push is through: from then on, no poll is due.
        loop {
            second.tick().await;
            load.publish(stat(7)).await.unwrap();
            let arrived =
                tokio::time::timeout(Duration::from_millis(900), until_running(&mut stream, 7));
            if arrived.await.is_ok() {
                break;
            }
        }
    } else {
        until_running(&mut stream, 4).await;
    }
    let before = calls.load(Ordering::Relaxed);
    let started = Instant::now();
    while started.elapsed() < WINDOW {
        second.tick().await;
        if push {
            load.publish(stat(7)).await.unwrap();
        }
    }
    calls.load(Ordering::Relaxed) - before
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|arg| arg == "--test" || arg == "--list") {
        return;
    }
    let load_average = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "loopback, kvgate in this process; load average {}",
        load_average
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut samples = push_latencies().await;
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let (p50, p99, max) = (
        percentile(&mut samples, 0.5),
        percentile(&mut samples, 0.99),
        percentile(&mut samples, 1.0),
    );
    println!(
        "push to subscriber ({SAMPLES} stats, each a change, after {WARMUP} of warm-up): \
         p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs",
        micros(p50),
        micros(p99),
        micros(max)
    );
    let polled = engine_calls(false).await;
    let pushed = engine_calls(true).await;
    let per_minute = |calls: u64| calls as f64 * 60.0 / WINDOW.as_secs_f64();
    println!(
        "GetLoads calls per minute, polling every 100 ms: {:.0}; with pushes (one a second) and polling as fallback: {:.0}; saved: {:.0}",
        per_minute(polled),
        per_minute(pushed),
        per_minute(polled) - per_minute(pushed)
    );
}
