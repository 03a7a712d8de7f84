//! What kvgate guarantees under bad input, at its edges: an
//! upstream that names ranks kvgate does not serve, a publisher whose
//! counter jumps wildly, and a flood of half-sent requests on the admin
//! port under a low open-file limit. Each attack runs against the real
//! binary on loopback, with a well-behaved subscriber checked throughout.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Gateway, subscribe};
use kvgate::proto::common::{
    KvBlock, KvBlocksStored, KvCacheEvent, KvEventBatch, SubscribeKvEventsRequest,
    kv_cache_event::Data,
};
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

/// A batch of one event for `rank`.
fn batch(rank: i32, sequence_number: u64, event: KvCacheEvent) -> KvEventBatch {
    KvEventBatch {
        sequence_number,
        timestamp: 1.0,
        events: vec![event],
        dp_rank: Some(rank),
        ..Default::default()
    }
}

/// One stored block.
fn stored(hash: i64) -> KvCacheEvent {
    KvCacheEvent {
        event_id: 0,
        data: Some(Data::Stored(KvBlocksStored {
            blocks: vec![KvBlock {
                block_hash: hash,
                token_ids: (0..16).collect(),
                block_size: 16,
                ..Default::default()
            }],
            ..Default::default()
        })),
    }
}

/// A real tonic `SubscribeKvEvents` server that, once `go` turns true,
/// sends `batches` to every subscriber and then keeps the stream open.
async fn start_upstream(batches: Vec<KvEventBatch>, go: watch::Receiver<bool>) -> String {
    let route = tower::service_fn(move |request: http::Request<axum::body::Body>| {
        let (batches, go) = (batches.clone(), go.clone());
        async move {
            let codec =
                tonic_prost::ProstCodec::<KvEventBatch, SubscribeKvEventsRequest>::default();
            let mut grpc = tonic::server::Grpc::new(codec);
            let serve = tower::service_fn(move |_: Request<SubscribeKvEventsRequest>| {
                let (batches, mut go) = (batches.clone(), go.clone());
                async move {
                    let _ = go.wait_for(|go| *go).await;
                    let stream = futures::StreamExt::chain(
                        futures::stream::iter(batches.into_iter().map(Ok::<_, Status>)),
                        futures::stream::pending(),
                    );
                    Ok::<_, Status>(Response::new(stream))
                }
            });
            let request = request.map(tonic::body::Body::new);
            Ok::<_, std::convert::Infallible>(grpc.server_streaming(serve, request).await)
        }
    });
    let router = axum::Router::new().route_service("/kvgate.v1.KvGate/SubscribeKvEvents", route);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_routes(tonic::service::Routes::from(router))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    format!("http://{address}")
}

/// A subscriber that has received what `publisher` sent after ZMQ's slow
/// joiner.
async fn synced_subscriber(
    gateway: &Gateway,
    publisher: &mut kvgate_sim::EnginePublisher,
) -> tonic::codec::Streaming<KvEventBatch> {
    let mut streams = vec![
        subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
            .await
            .unwrap(),
    ];
    common::sync_streams(publisher, 0, &mut streams).await;
    streams.pop().unwrap()
}

/// The admin port's `/metrics` text.
async fn metrics_text(admin: SocketAddr) -> String {
    common::http_get(admin, "/metrics").await.1
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_batch_for_a_rank_outside_dp_size_is_refused_and_counted_and_makes_no_state_or_series()
 {
    const BAD_RANKS: i32 = 3000;
    const FENCES: u64 = 30;
    // Ranks 0 and 1 are served; every other one the upstream names is not,
    // negative ones included. Good batches carry fences, alternately for
    // rank 0 and rank 1, among the bad ones.
    let mut batches = Vec::new();
    let mut next = [1u64, 1];
    for bad in 0..BAD_RANKS {
        let rank = if bad % 1000 == 999 { -bad } else { 2 + bad };
        batches.push(batch(rank, 1, stored(i64::from(bad) + 1)));
        if bad % (BAD_RANKS / FENCES as i32) == 0 {
            let fence = u64::try_from(batches.len()).unwrap();
            let good = usize::from(fence % 2 == 1);
            batches.push(batch(good as i32, next[good], common::fence_event(fence)));
            next[good] += 1;
        }
    }
    let mut fences_sent: Vec<u64> = batches.iter().filter_map(common::fence_in).collect();
    let (go, wait) = watch::channel(false);
    let upstream = start_upstream(batches, wait).await;
    let gateway = Gateway::start(&[
        "--upstream-grpc",
        &upstream,
        "--dp-size",
        "2",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let admin = gateway.admin.unwrap();
    let rss_before = common::live_rss_kib(gateway.pid());
    let mut stream = subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
        .await
        .unwrap();
    go.send_replace(true);

    // Every good batch arrives, and nothing else does, wherever rank 1's
    // batches fall among rank 0's.
    let mut fences_received = Vec::new();
    while fences_received.len() < fences_sent.len() {
        let batch = common::next_batch(&mut stream).await;
        if common::is_load_only(&batch) {
            continue;
        }
        let rank = batch.dp_rank.unwrap_or(0);
        assert!((0..2).contains(&rank), "rank {rank} reached the subscriber");
        fences_received.extend(batch.events.iter().filter_map(common::fence_number));
    }
    fences_sent.sort_unstable();
    fences_received.sort_unstable();
    assert_eq!(fences_received, fences_sent);

    let series = "kvgate_bad_messages_total{reason=\"upstream_unknown_rank\"}";
    common::await_metric(admin, series, f64::from(BAD_RANKS)).await;
    let text = metrics_text(admin).await;
    assert!(
        !text.contains("rank=\"2\"") && !text.contains("rank=\"2999\""),
        "a refused rank has a metric series"
    );
    let (_, status) = common::http_get(admin, "/status").await;
    assert!(!status.contains("\"rank\":2"), "{status}");
    let grown_kib = common::live_rss_kib(gateway.pid()).saturating_sub(rss_before);
    assert!(
        grown_kib < 64 << 10,
        "kvgate grew by {grown_kib} KiB for {BAD_RANKS} refused ranks"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn wild_publisher_sequence_numbers_never_wrap_the_lost_message_count_and_the_stream_goes_on()
{
    use bytes::Bytes;
    const WILD: u64 = 2015;
    let (gateway, mut publisher) = common::gateway_on_a_publisher(&[]).await;
    let admin = gateway.admin.unwrap();
    let mut streams = vec![synced_subscriber(&gateway, &mut publisher).await];

    // Numbers scattered over the whole 64-bit range, up and down: each
    // forward step skips far more than an engine could publish.
    for i in 1..=WILD {
        let sequence = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        publisher
            .send_frames(vec![
                Bytes::new(),
                Bytes::copy_from_slice(&sequence.to_be_bytes()),
                common::fence_payload(1 << 50, 0),
            ])
            .await
            .unwrap();
    }
    // The stream goes on, and once a message published after the wild
    // ones reaches it, kvgate has counted them all (a PUB may drop some of
    // them for a slow reader; what arrives is in order).
    common::sync_streams(&mut publisher, 0, &mut streams).await;
    let text = metrics_text(admin).await;
    let lost = common::metric_sample(&text, "kvgate_engine_messages_lost_total").unwrap();
    assert_eq!(lost, 0.0, "wild numbers counted as lost messages");
    let jumps = common::metric_sample(&text, "kvgate_engine_sequence_jumps_total").unwrap();
    assert!(jumps >= 1.0, "no jump counted:\n{text}");
}

/// A GET on loopback that may be refused: `None` when the connection is
/// closed or reset without a whole answer.
async fn try_http_get(address: SocketAddr, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = Vec::new();
    tokio::time::timeout(common::DEADLINE, stream.read_to_end(&mut response))
        .await
        .expect("an answer or a close before the deadline")
        .ok()?;
    let response = String::from_utf8_lossy(&response);
    response.split(' ').nth(1)?.parse().ok()
}

/// Whether `stream` is closed by its peer before the deadline (a reset
/// counts).
async fn closed_by_kvgate(stream: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut sink = [0u8; 256];
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut sink)).await {
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn half_sent_requests_on_the_metrics_port_under_a_low_file_limit_starve_neither_healthz_nor_a_subscriber()
 {
    use tokio::io::AsyncWriteExt;
    // Below the flood: without its own cap, the admin port would hold every
    // descriptor kvgate may open.
    const FILE_LIMIT: u64 = 256;
    const FLOOD: usize = 400;
    const ADMIN_CAP: usize = 16;
    let log = std::env::temp_dir().join(format!("kvgate-hostile-{}.log", std::process::id()));
    let log_file = std::fs::File::create(&log).unwrap();
    let mut publisher = kvgate_sim::EnginePublisher::bind(
        "tcp://127.0.0.1:0",
        &kvgate_sim::PublisherOptions::default(),
    )
    .await
    .unwrap();
    let mut gateway = Gateway::start_configured(
        &[
            "--zmq-endpoint",
            publisher.endpoint(),
            "--metrics-listen",
            "127.0.0.1:0",
            "--max-connections",
            "64",
            "--metrics-max-connections",
            &ADMIN_CAP.to_string(),
            "--metrics-header-timeout-ms",
            "1000",
        ],
        |command| {
            command.stderr(log_file);
            common::limit_open_files(command, FILE_LIMIT);
        },
    );
    let started = std::time::Instant::now();
    let admin = gateway.admin.unwrap();
    let mut streams = vec![synced_subscriber(&gateway, &mut publisher).await];

    let mut flood = Vec::with_capacity(FLOOD);
    for _ in 0..FLOOD {
        let mut stream = tokio::net::TcpStream::connect(admin).await.unwrap();
        stream.write_all(b"GET /metrics HT").await.unwrap();
        flood.push(stream);
    }
    // Every one is closed: past the cap at once, the held ones by the
    // header timeout.
    for stream in &mut flood {
        assert!(
            closed_by_kvgate(stream).await,
            "a half-sent request is held"
        );
    }
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    while try_http_get(admin, "/healthz").await != Some(200) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "/healthz never answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = metrics_text(admin).await;
    let refused = common::metric_sample(&text, "kvgate_admin_connections_refused_total").unwrap();
    let timed_out = common::metric_sample(
        &text,
        "kvgate_admin_connections_closed_total{reason=\"header_timeout\"}",
    )
    .unwrap();
    // Each flood connection was refused at the cap or held until its
    // header timeout (a slow flood lets more of them in than the cap).
    assert!(refused + timed_out >= FLOOD as f64, "{text}");
    assert!(timed_out >= 1.0, "{text}");

    // A new subscriber connects and receives, the old one still does.
    streams.push(synced_subscriber(&gateway, &mut publisher).await);
    common::sync_streams(&mut publisher, 0, &mut streams).await;
    assert!(gateway.terminate().success());
    let log_text = std::fs::read_to_string(&log).unwrap();
    std::fs::remove_file(&log).unwrap();
    let accept_failures = log_text.matches("accept failed").count() as u64;
    assert!(
        accept_failures <= started.elapsed().as_secs() + 1,
        "{accept_failures} accept failures logged:\n{log_text}"
    );
}
