//! What a subscriber can cost kvgate, end to end with the real binary:
//! a stream that stops reading pins no batches beyond the history and shows
//! its lag while it stalls, unread snapshots are encoded only as their
//! clients read, streams are limited by `--max-subscribers`, and an
//! oversized request is refused with RESOURCE_EXHAUSTED (contract section 7).
//!
//! Memory is checked as generous bounds on kvgate's VmRSS, sampled from
//! `/proc`, never as timing.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use common::{
    DEADLINE, Gateway, fence_payload, next_batch, skip_past_fence, subscribe, sync_streams,
};
use kvgate::proto::common::KvEventBatch;
use kvgate_sim::{EnginePublisher, PublisherOptions, SteadyState, WorkloadShape};
use tonic::codec::Streaming;

const SERVICE: &str = "kvgate.v1.KvGate";
const MIB: u64 = 1 << 20;

async fn publisher() -> EnginePublisher {
    EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .expect("publisher binds")
}

/// kvgate's resident memory in bytes.
fn rss(gateway: &Gateway) -> u64 {
    common::live_rss_kib(gateway.pid()) * 1024
}

/// A vLLM payload removing `hashes` blocks nobody stored: a batch of about
/// 10 bytes a hash that changes no state, in kvgate or in a router.
fn removal_payload(hashes: u64, salt: u64) -> Bytes {
    let spread: Vec<i64> = (0..hashes)
        .map(|hash| ((hash + salt * hashes + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 1) as i64)
        .collect();
    common::removed_payload(&spread, 0)
}

/// One `SubscribeKvEvents` call on its own HTTP/2 connection, over the raw
/// `h2` client: the request is `message` (framed as gRPC), and nothing read
/// afterwards is released, so the stream's window is never replenished.
struct RawCall {
    response: http::Response<h2::RecvStream>,
    /// Keeps the request side open.
    _request: h2::SendStream<Bytes>,
    connection: tokio::task::JoinHandle<()>,
}

impl RawCall {
    async fn open(gateway: &Gateway, message: &[u8]) -> Self {
        let tcp = tokio::net::TcpStream::connect(gateway.address)
            .await
            .expect("connect to kvgate");
        let (client, connection) = h2::client::handshake(tcp).await.expect("HTTP/2 handshake");
        let connection = tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut client = client.ready().await.expect("a stream slot");
        let request = http::Request::post(format!(
            "http://{}/{SERVICE}/SubscribeKvEvents",
            gateway.address
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
        let (response, mut send) = client.send_request(request, false).expect("request sent");
        let mut framed = BytesMut::with_capacity(5 + message.len());
        framed.put_u8(0);
        framed.put_u32(message.len() as u32);
        framed.put_slice(message);
        send.send_data(framed.freeze(), true)
            .expect("request body sent");
        let response = tokio::time::timeout(DEADLINE, response)
            .await
            .expect("response headers before the deadline")
            .expect("a response");
        Self {
            response,
            _request: send,
            connection,
        }
    }

    /// The call's gRPC status code, from a trailers-only response.
    fn status_in_headers(&self) -> Option<i32> {
        self.response
            .headers()
            .get("grpc-status")?
            .to_str()
            .ok()?
            .parse()
            .ok()
    }
}

impl Drop for RawCall {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

/// The largest `kvgate_subscriber_lag` on the admin port.
async fn largest_lag(gateway: &Gateway) -> u64 {
    let (code, text) = common::http_get(gateway.admin.expect("admin port"), "/metrics").await;
    assert_eq!(code, 200);
    text.lines()
        .filter(|line| line.starts_with("kvgate_subscriber_lag{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .max()
        .unwrap_or(0)
}

/// Publishes `rounds` rounds of `per_round` removal batches of `hashes`
/// hashes, each round closed by a fence that `reader` reads past, so
/// kvgate has published everything when this returns.
async fn publish_rounds(
    publisher: &mut EnginePublisher,
    reader: &mut Streaming<KvEventBatch>,
    first_fence: u64,
    rounds: u64,
    per_round: u64,
    hashes: u64,
    mut after_round: impl AsyncFnMut(),
) {
    for round in 0..rounds {
        for batch in 0..per_round {
            publisher
                .publish(removal_payload(hashes, round * per_round + batch))
                .await
                .unwrap();
        }
        let fence = first_fence + round;
        publisher.publish(fence_payload(fence, 0)).await.unwrap();
        skip_past_fence(reader, fence).await;
        after_round().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_subscriber_that_never_reads_pins_no_batches_beyond_the_history_and_its_lag_grows_while_it_stalls()
 {
    let history_bytes = 16 * MIB;
    let max_batch_bytes = 128 * 1024;
    let mut publisher = publisher().await;
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--metrics-listen",
        "127.0.0.1:0",
        "--history-bytes",
        &history_bytes.to_string(),
        "--max-batch-bytes",
        &max_batch_bytes.to_string(),
    ]);
    // Opened before kvgate has seen anything: a live-only stream, which
    // its client never reads.
    let stalled = RawCall::open(&gateway, &[]).await;
    assert_eq!(stalled.response.status(), 200);
    assert_eq!(stalled.status_in_headers(), None, "the stream was admitted");
    let mut reader = [subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .unwrap()];
    let last_fence = sync_streams(&mut publisher, 0, &mut reader).await;
    let [mut reader] = reader;
    let before = rss(&gateway);

    // About 100 KB a batch, 6x the history in all.
    let hashes = 10_000;
    let rounds = 12;
    let per_round = 80;
    let mut peak = before;
    let mut lags = Vec::new();
    publish_rounds(
        &mut publisher,
        &mut reader,
        last_fence + 1,
        rounds,
        per_round,
        hashes,
        async || {
            peak = peak.max(rss(&gateway));
            lags.push(largest_lag(&gateway).await);
        },
    )
    .await;
    let published_bytes = rounds * per_round * hashes * 10;
    assert!(published_bytes > 5 * history_bytes);

    // The history (resident up to 4x its encoded bytes while the allocator
    // keeps freed pages), one batch and a flow-control window in h2's send
    // buffer for the stalled stream, and slack for the rest.
    let bound = before + 4 * history_bytes + 2 * max_batch_bytes + 32 * MIB;
    eprintln!(
        "stalled subscriber: RSS {} MiB before, peak {} MiB after {} MiB published; lag by round {lags:?}",
        before / MIB,
        peak / MIB,
        published_bytes / MIB
    );
    assert!(
        peak <= bound,
        "RSS grew from {before} to {peak} bytes (bound {bound})"
    );
    // Every round publishes more batches, and the stalled stream takes none.
    assert!(lags[0] > 0, "lag while stalled: {lags:?}");
    assert!(
        lags.windows(2).all(|pair| pair[1] >= pair[0] + per_round),
        "lag grows while the stream stalls: {lags:?}"
    );
    drop(stalled);
}

/// Publishes `blocks` live blocks in chains of `per_store`, then a fence
/// `reader` reads past.
async fn build_state(
    publisher: &mut EnginePublisher,
    reader: &mut Streaming<KvEventBatch>,
    blocks: usize,
    per_store: usize,
    fence: u64,
) {
    let mut workload = SteadyState::new(
        WorkloadShape {
            blocks_per_store: per_store,
            block_size: 16,
            live_blocks: blocks,
        },
        7,
    );
    for _ in 0..blocks / per_store {
        let payload = workload.next_payload(1.0, 0);
        publisher.publish(payload.into()).await.unwrap();
        // Paced by kvgate, so the publisher's queue never drops a store.
        publisher.publish(fence_payload(fence, 0)).await.unwrap();
        skip_past_fence(reader, fence).await;
    }
    assert_eq!(workload.live_blocks(), blocks);
}

/// Reads a whole snapshot from `stream`: (chunks, blocks in its header).
async fn read_snapshot(stream: &mut Streaming<KvEventBatch>) -> (u32, u64) {
    let first = next_batch(stream).await;
    let header = first.snapshot.expect("a snapshot chunk");
    for index in 1..header.count {
        let chunk = next_batch(stream).await;
        assert_eq!(chunk.snapshot.expect("a snapshot chunk").index, index);
    }
    (header.count, header.blocks)
}

#[tokio::test(flavor = "multi_thread")]
async fn unread_snapshots_are_encoded_only_as_their_clients_read_and_never_hold_back_another() {
    let blocks = 200_000;
    let mut publisher = publisher().await;
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--metrics-listen",
        "127.0.0.1:0",
        "--max-snapshot-encodes",
        "1",
    ]);
    let mut reader = [subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .unwrap()];
    let fence = sync_streams(&mut publisher, 0, &mut reader).await;
    let [mut reader] = reader;
    build_state(&mut publisher, &mut reader, blocks, 2000, fence + 1).await;
    let before = rss(&gateway);

    // 50 clients, each on its own connection, read the first chunk of their
    // snapshot and then stop reading.
    let mut unread = Vec::new();
    for _ in 0..50 {
        let mut stream = subscribe(gateway.channel().await, SERVICE, 0)
            .await
            .unwrap();
        let first = next_batch(&mut stream).await;
        let header = first.snapshot.expect("a snapshot chunk");
        assert!(header.count > 50, "a snapshot of many chunks");
        assert_eq!(header.blocks, blocks as u64);
        unread.push(stream);
    }
    let with_unread = rss(&gateway);

    // A 51st client gets its whole snapshot, then live batches.
    let mut fresh = subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .unwrap();
    let (_, snapshot_blocks) = read_snapshot(&mut fresh).await;
    assert_eq!(snapshot_blocks, blocks as u64);
    let live_fence = fence + 2;
    publisher
        .publish(fence_payload(live_fence, 0))
        .await
        .unwrap();
    let live = skip_past_fence(&mut fresh, live_fence).await;
    assert!(live.iter().all(|batch| batch.snapshot.is_none()));
    let peak = with_unread.max(rss(&gateway));

    // Per unread snapshot: a chunk (at most 1 MiB) in h2's send buffer, one
    // in tonic's, the walk's store buffer (64 KiB between chunks) and
    // slack; the whole snapshot would be about 14 MB each.
    let per_snapshot = 2 * MIB + MIB;
    let bound = before + 50 * per_snapshot;
    eprintln!(
        "50 unread snapshots of {blocks} blocks: RSS {} MiB before, {} MiB with them, peak {} MiB",
        before / MIB,
        with_unread / MIB,
        peak / MIB
    );
    assert!(
        peak <= bound,
        "RSS grew from {before} to {peak} bytes (bound {bound})"
    );
    drop(unread);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_request_is_refused_with_resource_exhausted_not_out_of_range() {
    let publisher = publisher().await;
    let gateway = Gateway::start(&["--zmq-endpoint", publisher.endpoint()]);
    // Field 1 (the cursor) followed by a megabyte of an unknown field.
    let mut message = vec![0x08, 0x01, 0x12];
    let padding = 1 << 20;
    prost::encoding::encode_varint(padding as u64, &mut message);
    message.resize(message.len() + padding, b'x');
    let call = RawCall::open(&gateway, &message).await;
    assert_eq!(
        call.status_in_headers(),
        Some(tonic::Code::ResourceExhausted as i32),
        "{:?}",
        call.response.headers()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn beyond_max_subscribers_the_next_stream_is_refused_naming_the_limit_and_admitted_once_one_ends()
 {
    let publisher = publisher().await;
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--max-subscribers",
        "2",
    ]);
    let first = subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .expect("first admitted");
    let _second = subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .expect("second admitted");
    let refusal = subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .expect_err("third refused");
    assert_eq!(refusal.code(), tonic::Code::ResourceExhausted);
    assert!(
        refusal.message().contains("--max-subscribers"),
        "{refusal:?}"
    );

    drop(first);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        match subscribe(gateway.channel().await, SERVICE, 0).await {
            Ok(_third) => break,
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the ended stream's slot was never freed"
                );
                // Polled: the slot frees once kvgate sees the stream reset.
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }
}
