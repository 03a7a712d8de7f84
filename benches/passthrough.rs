//! Latency kvgate adds to a passed-through call: sequential unary calls and
//! bidirectional-stream round trips to an echo engine on loopback, made
//! directly and through kvgate (`--engine-grpc`), both in this process; and
//! the throughput of a stream of 1 MB messages for several
//! `--pass-through-stream-window-bytes`. Prints tables; `make bench` runs it.

use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

#[derive(Clone, PartialEq, prost::Message)]
struct Echo {
    #[prost(string, tag = "1")]
    text: String,
}

type Codec = tonic_prost::ProstCodec<Echo, Echo>;

const CALLS: usize = 5000;

/// One message of the streamed answer, and how many a measurement reads.
const MESSAGE_BYTES: usize = 1 << 20;
const MESSAGES: usize = 300;

async fn start_engine() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let unary = tower::service_fn(|request: http::Request<axum::body::Body>| async move {
        let mut grpc = tonic::server::Grpc::new(Codec::default());
        let handler = tower::service_fn(|request: Request<Echo>| async move {
            Ok::<_, Status>(Response::new(request.into_inner()))
        });
        Ok::<_, std::convert::Infallible>(
            grpc.unary(handler, request.map(tonic::body::Body::new))
                .await,
        )
    });
    let chat = tower::service_fn(|request: http::Request<axum::body::Body>| async move {
        let mut grpc = tonic::server::Grpc::new(Codec::default());
        let handler = tower::service_fn(|request: Request<Streaming<Echo>>| async move {
            let mut incoming = request.into_inner();
            let (tx, rx) = mpsc::channel(16);
            tokio::spawn(async move {
                while let Some(Ok(message)) = incoming.next().await {
                    if tx.send(Ok(message)).await.is_err() {
                        break;
                    }
                }
            });
            Ok::<_, Status>(Response::new(ReceiverStream::new(rx)))
        });
        Ok::<_, std::convert::Infallible>(
            grpc.streaming(handler, request.map(tonic::body::Body::new))
                .await,
        )
    });
    let generate = tower::service_fn(|request: http::Request<axum::body::Body>| async move {
        let mut grpc = tonic::server::Grpc::new(Codec::default());
        let handler = tower::service_fn(|_: Request<Echo>| async move {
            let message = Echo {
                text: "x".repeat(MESSAGE_BYTES),
            };
            let stream = futures::stream::repeat_with(move || Ok(message.clone()));
            Ok::<_, Status>(Response::new(stream))
        });
        Ok::<_, std::convert::Infallible>(
            grpc.server_streaming(handler, request.map(tonic::body::Body::new))
                .await,
        )
    });
    let router = axum::Router::new()
        .route_service("/bench.Engine/Unary", unary)
        .route_service("/bench.Engine/Chat", chat)
        .route_service("/bench.Engine/Generate", generate);
    let listener = axum::serve::ListenerExt::tap_io(listener, |stream| {
        let _ = stream.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{address}")
}

async fn channel(uri: &str) -> Channel {
    Channel::from_shared(uri.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    samples[((samples.len() - 1) as f64 * p) as usize]
}

async fn unary_latencies(channel: Channel) -> Vec<Duration> {
    let mut grpc = tonic::client::Grpc::new(channel);
    let mut samples = Vec::with_capacity(CALLS);
    for n in 0..CALLS + 500 {
        grpc.ready().await.unwrap();
        let started = Instant::now();
        let request = Request::new(Echo {
            text: "ping".into(),
        });
        grpc.unary(
            request,
            "/bench.Engine/Unary".parse().unwrap(),
            Codec::default(),
        )
        .await
        .unwrap();
        if n >= 500 {
            samples.push(started.elapsed());
        }
    }
    samples
}

async fn stream_latencies(channel: Channel) -> Vec<Duration> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let (outgoing, rx) = mpsc::channel(1);
    let mut replies = grpc
        .streaming(
            Request::new(ReceiverStream::new(rx)),
            "/bench.Engine/Chat".parse().unwrap(),
            Codec::default(),
        )
        .await
        .unwrap()
        .into_inner();
    let mut samples = Vec::with_capacity(CALLS);
    for n in 0..CALLS + 500 {
        let started = Instant::now();
        outgoing
            .send(Echo {
                text: "ping".into(),
            })
            .await
            .unwrap();
        replies.message().await.unwrap().unwrap();
        if n >= 500 {
            samples.push(started.elapsed());
        }
    }
    samples
}

/// MB/s of the best of three reads of `MESSAGES` messages of one stream.
async fn stream_throughput(channel: Channel) -> f64 {
    let mut grpc = tonic::client::Grpc::new(channel);
    let mut best = f64::MAX;
    for _ in 0..3 {
        grpc.ready().await.unwrap();
        let started = Instant::now();
        let mut stream = grpc
            .server_streaming(
                Request::new(Echo::default()),
                "/bench.Engine/Generate".parse().unwrap(),
                Codec::default(),
            )
            .await
            .unwrap()
            .into_inner();
        for _ in 0..MESSAGES {
            stream.message().await.unwrap().unwrap();
        }
        best = best.min(started.elapsed().as_secs_f64());
    }
    (MESSAGES * MESSAGE_BYTES) as f64 / 1e6 / best
}

/// An in-process kvgate in front of `engine` with `extra` flags; returns
/// a channel to it.
async fn through_kvgate(engine: &str, extra: &[&str]) -> Channel {
    let mut flags = vec![
        "kvgate",
        "serve",
        "--demo",
        "--listen",
        "127.0.0.1:0",
        "--engine-grpc",
        engine,
    ];
    flags.extend_from_slice(extra);
    let kvgate::cli::Command::Serve(args) = kvgate::cli::Cli::parse_from(flags).command else {
        unreachable!()
    };
    let kvgate = kvgate::app::Gateway::start(*args).await.unwrap();
    let through = format!("http://{}", kvgate.address());
    tokio::spawn(kvgate.run(std::future::pending()));
    channel(&through).await
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|arg| arg == "--test" || arg == "--list") {
        return;
    }
    let engine = start_engine().await;
    let gateway = through_kvgate(&engine, &[]).await;
    println!("{CALLS} sequential calls each, after 500 of warm-up; loopback, this process");
    println!(
        "{:<28} {:>10} {:>10} {:>10} {:>10}",
        "", "p50 µs", "p99 µs", "added p50", "added p99"
    );
    for (name, direct, via) in [
        (
            "unary call",
            unary_latencies(channel(&engine).await).await,
            unary_latencies(gateway.clone()).await,
        ),
        (
            "streamed message round trip",
            stream_latencies(channel(&engine).await).await,
            stream_latencies(gateway).await,
        ),
    ] {
        let (mut direct, mut via) = (direct, via);
        let (d50, d99) = (percentile(&mut direct, 0.5), percentile(&mut direct, 0.99));
        let (v50, v99) = (percentile(&mut via, 0.5), percentile(&mut via, 0.99));
        let micros = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "{name:<28} {:>10.0} {:>10.0} {:>10.0} {:>10.0}   (direct, then through kvgate: {:.0} / {:.0})",
            micros(d50),
            micros(d99),
            micros(v50) - micros(d50),
            micros(v99) - micros(d99),
            micros(v50),
            micros(v99),
        );
    }
    println!();
    println!("a stream of {MESSAGES} messages of 1 MB, best of three");
    println!("{:<40} {:>8}", "", "MB/s");
    let direct = stream_throughput(channel(&engine).await).await;
    println!("{:<40} {direct:>8.0}", "direct");
    // 512 streams leave room for a 2 MiB window under HTTP/2's largest
    // connection window.
    for window in ["256KiB", "1MiB", "2MiB"] {
        let flags = [
            "--pass-through-stream-window-bytes",
            window,
            "--pass-through-max-streams",
            "512",
        ];
        let through = stream_throughput(through_kvgate(&engine, &flags).await).await;
        println!(
            "{:<40} {through:>8.0}",
            format!("through kvgate, {window} window")
        );
    }
}
