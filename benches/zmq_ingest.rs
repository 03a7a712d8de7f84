//! The ZMQ receive path alone: a real PUB and a real SUB on loopback, each
//! message shaped like an engine's `[topic, sequence, payload]`, timed from
//! the first send to the last receive. Run once with the SUB's
//! `max_message_size` set (kvgate's case) and once without, to show what
//! the size check costs, and once more with the limit over a Unix-domain
//! socket (`ipc://`, an engine on the same host) beside TCP loopback;
//! BENCHMARKS.md has the numbers and the method.

use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group};
use zeromq::{PubSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

#[path = "../tests/common/socket_dir.rs"]
mod socket_dir;

/// kvgate's default `--zmq-max-message-bytes`.
const LIMIT: usize = 64 << 20;

const WAIT: Duration = Duration::from_secs(20);

fn sub_options(limit: Option<usize>) -> SocketOptions {
    let mut options = SocketOptions::default();
    if let Some(limit) = limit {
        options.max_message_size(limit);
    }
    options
}

fn message(sequence: u64, payload: &Bytes) -> ZmqMessage {
    let mut message = ZmqMessage::from(Bytes::new());
    message.push_back(Bytes::copy_from_slice(&sequence.to_be_bytes()));
    message.push_back(payload.clone());
    message
}

/// A connected PUB/SUB pair at `endpoint`, past the slow joiner.
async fn pair(endpoint: &str, limit: Option<usize>) -> (PubSocket, SubSocket) {
    let mut publisher = PubSocket::new();
    let endpoint = publisher.bind(endpoint).await.unwrap();
    let mut sub = SubSocket::with_options(sub_options(limit));
    sub.subscribe("").await.unwrap();
    sub.connect(&endpoint.to_string()).await.unwrap();
    let warm_up = Bytes::from_static(b"warm-up");
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(Instant::now() < deadline, "the subscription never arrived");
        publisher.send(message(0, &warm_up)).await.unwrap();
        if tokio::time::timeout(Duration::from_millis(20), sub.recv())
            .await
            .is_ok()
        {
            break;
        }
    }
    // Drain what the warm-up left in flight.
    while tokio::time::timeout(Duration::from_millis(50), sub.recv())
        .await
        .is_ok()
    {}
    (publisher, sub)
}

/// Sends `count` messages on one task and receives them on this one.
async fn burst(publisher: &mut PubSocket, sub: &mut SubSocket, payload: &Bytes, count: u64) {
    let send = async {
        for sequence in 0..count {
            publisher.send(message(sequence, payload)).await.unwrap();
        }
    };
    let receive = async {
        for _ in 0..count {
            tokio::time::timeout(WAIT, sub.recv())
                .await
                .expect("the PUB dropped a message: lower the burst")
                .unwrap();
        }
    };
    tokio::join!(send, receive);
}

fn receive(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sockets = socket_dir::SocketDir::new("zmq-ingest");
    let mut group = c.benchmark_group("zmq-receive");
    group.sample_size(20);
    // Small engine messages, and large batches.
    for (name, size, count) in [("1KiB", 1 << 10, 2_000u64), ("1MiB", 1 << 20, 32)] {
        let payload = Bytes::from(vec![0x5a; size]);
        group.throughput(Throughput::Elements(count));
        let ipc = sockets.endpoint(&format!("{name}.sock"));
        for (variant, endpoint, limit) in [
            ("no-limit", "tcp://127.0.0.1:0", None),
            ("limit-64MiB", "tcp://127.0.0.1:0", Some(LIMIT)),
            ("ipc/limit-64MiB", ipc.as_str(), Some(LIMIT)),
        ] {
            let (mut publisher, mut sub) = runtime.block_on(pair(endpoint, limit));
            group.bench_function(format!("{name}/{variant}"), |b| {
                b.iter_custom(|iters| {
                    runtime.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            burst(&mut publisher, &mut sub, &payload, count).await;
                        }
                        start.elapsed()
                    })
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, receive);
fn main() {
    kvgate::allocator::bench_on_the_gateways_heap(); // `criterion_main!`
    benches();
    Criterion::default().configure_from_args().final_summary();
}
