//! Limits at the gRPC port (contract section 7): bounded connections,
//! HTTP/2 only, idle and unresponsive connections closed, bounded streams
//! per connection, and a pass-through metric with a closed label set.

mod common;

use std::sync::{Arc, Mutex};

use common::{DEADLINE, Gateway, await_metric, http_get, metric_sample};
use kvgate_sim::{EnginePublisher, PublisherOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Request;
use tonic::transport::Channel;

const SUBSCRIBE: &str = "/kvgate.v1.KvGate/SubscribeKvEvents";

async fn gateway_with(args: &[&str]) -> (Gateway, EnginePublisher, std::net::SocketAddr) {
    let publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let mut all = vec![
        "--zmq-endpoint",
        publisher.endpoint(),
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    all.extend_from_slice(args);
    let gateway = Gateway::start(&all);
    let admin = gateway.admin.expect("admin port reported");
    (gateway, publisher, admin)
}

/// An HTTP/2 connection made by the `h2` crate, served by its own task
/// (aborting the task closes the connection).
async fn h2_connection(
    address: std::net::SocketAddr,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(address).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    (client, tokio::spawn(connection))
}

#[tokio::test(flavor = "multi_thread")]
async fn past_max_connections_the_next_is_closed_at_once_and_metrics_and_subscribers_still_work() {
    let (gateway, mut publisher, admin) = gateway_with(&["--max-connections", "2"]).await;
    let _first = h2_connection(gateway.address).await;
    let (_second_client, second) = h2_connection(gateway.address).await;
    await_metric(admin, "kvgate_connections", 2.0).await;

    let mut third = TcpStream::connect(gateway.address).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(DEADLINE, third.read(&mut byte))
        .await
        .expect("closed before the deadline");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "the connection past the limit is closed: {read:?}"
    );
    let (status, text) = http_get(admin, "/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(
        metric_sample(
            &text,
            "kvgate_connections_refused_total{reason=\"max_connections\"}"
        ),
        Some(1.0)
    );

    second.abort();
    await_metric(admin, "kvgate_connections", 1.0).await;
    let mut streams = vec![
        common::subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
            .await
            .expect("a subscriber gets the freed slot"),
    ];
    common::sync_streams(&mut publisher, 0, &mut streams).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_connection_with_no_open_stream_is_closed_after_the_idle_timeout_and_one_streaming_is_not()
 {
    let (gateway, mut publisher, admin) = gateway_with(&["--idle-timeout-ms", "100"]).await;
    let mut streams = vec![
        common::subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
            .await
            .unwrap(),
    ];
    let (_idle_client, idle) = h2_connection(gateway.address).await;
    let ended = tokio::time::timeout(DEADLINE, idle)
        .await
        .expect("the idle connection is closed before the deadline");
    let ended = ended.expect("the connection task ran to its end");
    assert!(ended.is_ok(), "closed cleanly (GOAWAY): {ended:?}");
    let (_, text) = http_get(admin, "/metrics").await;
    assert_eq!(
        metric_sample(&text, "kvgate_connections_closed_total{reason=\"idle\"}"),
        Some(1.0)
    );
    common::sync_streams(&mut publisher, 0, &mut streams).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_http1_request_on_the_grpc_port_is_refused_with_505_and_counted() {
    let (gateway, _publisher, admin) = gateway_with(&[]).await;
    let mut tcp = TcpStream::connect(gateway.address).await.unwrap();
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nhost: kvgate\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(DEADLINE, tcp.read_to_string(&mut answer))
        .await
        .expect("answered and closed before the deadline")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 505 "), "{answer}");
    assert!(answer.contains("HTTP/2 only"), "{answer}");
    // Counted once the connection task is done, which may be just after the
    // client read the answer.
    await_metric(
        admin,
        "kvgate_connections_refused_total{reason=\"not_http2\"}",
        1.0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn request_headers_over_the_header_list_limit_are_refused_and_the_connection_keeps_serving() {
    let (gateway, mut publisher, _admin) =
        gateway_with(&["--http2-max-header-list-bytes", "4096"]).await;
    let channel = gateway.channel().await;
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let mut request = Request::new(kvgate::proto::common::SubscribeKvEventsRequest::default());
    let big = "x".repeat(8000);
    request.metadata_mut().insert("x-big", big.parse().unwrap());
    let called = grpc
        .server_streaming(
            request,
            SUBSCRIBE.parse().unwrap(),
            tonic_prost::ProstCodec::<_, kvgate::proto::common::KvEventBatch>::default(),
        )
        .await;
    // HTTP/2 answers 431 Request Header Fields Too Large, which tonic
    // reports on the call or on its first message.
    let refused = match called {
        Err(status) => status,
        Ok(response) => {
            let first = tokio::time::timeout(DEADLINE, response.into_inner().message())
                .await
                .expect("an answer before the deadline");
            first.expect_err("8000 bytes of metadata over a 4096-byte limit")
        }
    };
    assert!(refused.message().contains("431"), "{refused:?}");
    let mut streams = vec![
        common::subscribe(channel, "kvgate.v1.KvGate", 0)
            .await
            .expect("the same connection still serves"),
    ];
    common::sync_streams(&mut publisher, 0, &mut streams).await;
}

/// Hand-made HTTP/2 frames, for a client that ignores the server's settings
/// or never reads.
mod raw {
    use super::*;

    pub const HEADERS: u8 = 0x1;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    const DATA: u8 = 0x0;
    const END_HEADERS: u8 = 0x4;
    const ACK: u8 = 0x1;

    pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let length = (payload.len() as u32).to_be_bytes();
        let mut out = length[1..].to_vec();
        out.extend_from_slice(&[kind, flags]);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// The preface and empty client settings.
    pub fn opening() -> Vec<u8> {
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        out.extend(frame(SETTINGS, 0, 0, &[]));
        out
    }

    pub fn settings_ack() -> Vec<u8> {
        frame(SETTINGS, ACK, 0, &[])
    }

    /// A gRPC request's HEADERS on `stream` (HPACK literals, never indexed),
    /// its request stream left open.
    pub fn grpc_headers(stream: u32, path: &str) -> Vec<u8> {
        let mut block = Vec::new();
        for (name, value) in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "kvgate"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ] {
            block.push(0);
            block.push(name.len() as u8);
            block.extend_from_slice(name.as_bytes());
            block.push(value.len() as u8);
            block.extend_from_slice(value.as_bytes());
        }
        frame(HEADERS, END_HEADERS, stream, &block)
    }

    /// One empty gRPC message (a default request) on `stream`.
    pub fn empty_message(stream: u32) -> Vec<u8> {
        frame(DATA, 0, stream, &[0, 0, 0, 0, 0])
    }

    /// The next frame: (type, flags, stream, payload).
    pub async fn read_frame(tcp: &mut TcpStream) -> std::io::Result<(u8, u8, u32, Vec<u8>)> {
        let mut head = [0u8; 9];
        tcp.read_exact(&mut head).await?;
        let length = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0; length];
        tcp.read_exact(&mut payload).await?;
        Ok((head[3], head[4], stream, payload))
    }

    /// Reads frames until the server's own settings, then acknowledges them.
    pub async fn settle(tcp: &mut TcpStream) {
        loop {
            let (kind, flags, _, _) = tokio::time::timeout(DEADLINE, read_frame(tcp))
                .await
                .expect("server settings before the deadline")
                .unwrap();
            if kind == SETTINGS && flags & ACK == 0 {
                tcp.write_all(&settings_ack()).await.unwrap();
                return;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_past_the_concurrent_stream_limit_is_refused_with_refused_stream() {
    let (gateway, _publisher, _admin) =
        gateway_with(&["--http2-max-concurrent-streams", "2"]).await;
    let mut tcp = TcpStream::connect(gateway.address).await.unwrap();
    tcp.write_all(&raw::opening()).await.unwrap();
    raw::settle(&mut tcp).await;
    // Three subscriptions that wait for their request message: all open.
    for stream in [1, 3, 5] {
        tcp.write_all(&raw::grpc_headers(stream, SUBSCRIBE))
            .await
            .unwrap();
    }
    let reset = loop {
        let (kind, _, stream, payload) = tokio::time::timeout(DEADLINE, raw::read_frame(&mut tcp))
            .await
            .expect("a reset before the deadline")
            .unwrap();
        if kind == raw::RST_STREAM {
            break (stream, u32::from_be_bytes(payload[..4].try_into().unwrap()));
        }
    };
    const REFUSED_STREAM: u32 = 0x7;
    assert_eq!(reset, (5, REFUSED_STREAM));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_never_reads_or_answers_pings_is_disconnected_after_the_keepalive_timeout() {
    let (gateway, _publisher, admin) = gateway_with(&[
        "--http2-keepalive-interval-ms",
        "100",
        "--http2-keepalive-timeout-ms",
        "200",
    ])
    .await;
    let mut tcp = TcpStream::connect(gateway.address).await.unwrap();
    // A subscriber that says everything a client must and then never reads
    // its socket again.
    let mut hello = raw::opening();
    hello.extend(raw::grpc_headers(1, SUBSCRIBE));
    hello.extend(raw::empty_message(1));
    tcp.write_all(&hello).await.unwrap();
    await_metric(
        admin,
        "kvgate_connections_closed_total{reason=\"keepalive_timeout\"}",
        1.0,
    )
    .await;
    await_metric(admin, "kvgate_connections", 0.0).await;
    drop(tcp);
}

/// What the test engine saw: the path of every call that reached it.
type Paths = Arc<Mutex<Vec<String>>>;

/// A real gRPC server (tonic) that records each call's path and answers
/// UNIMPLEMENTED, as an engine does for a method it does not have.
async fn start_engine(paths: Paths) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let router = axum::Router::new().fallback(move |request: http::Request<axum::body::Body>| {
        paths.lock().unwrap().push(request.uri().path().to_owned());
        std::future::ready(
            tonic::Status::unimplemented("no such method").into_http::<tonic::body::Body>(),
        )
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_routes(tonic::service::Routes::from(router))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    format!("http://{address}")
}

async fn call(channel: Channel, path: &str) -> tonic::Status {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = path.parse().expect("a valid path");
    grpc.unary::<(), (), _>(
        Request::new(()),
        path,
        tonic_prost::ProstCodec::<(), ()>::default(),
    )
    .await
    .expect_err("the engine has no such method")
}

fn pass_through_series(metrics: &str) -> usize {
    metrics
        .lines()
        .filter(|line| line.starts_with("kvgate_pass_through_calls_total{"))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_made_up_method_names_through_the_pass_through_make_no_new_series() {
    let paths = Paths::default();
    let engine = start_engine(Arc::clone(&paths)).await;
    // Load records off: the engine here counts only passed-through calls.
    let (gateway, _publisher, admin) =
        gateway_with(&["--engine-grpc", &engine, "--load-poll-ms", "0"]).await;
    let channel = gateway.channel().await;
    let known = "/vllm.grpc.engine.VllmEngine/GetLoads";
    call(channel.clone(), known).await;
    call(channel.clone(), "/made.up.Service/First").await;
    let (_, before) = http_get(admin, "/metrics").await;
    for n in 0..1000 {
        let status = call(channel.clone(), &format!("/made.up.Service{n}/Method{n}")).await;
        assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
    }
    let (_, after) = http_get(admin, "/metrics").await;
    assert_eq!(pass_through_series(&after), pass_through_series(&before));
    assert_eq!(
        metric_sample(
            &after,
            "kvgate_pass_through_calls_total{method=\"other\",code=\"12\"}"
        ),
        Some(1001.0)
    );
    assert_eq!(
        metric_sample(
            &after,
            &format!("kvgate_pass_through_calls_total{{method=\"{known}\",code=\"12\"}}")
        ),
        Some(1.0)
    );
    assert_eq!(
        paths.lock().unwrap().len(),
        1002,
        "every call reached the engine"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_method_path_over_the_bound_is_refused_with_resource_exhausted_and_never_reaches_the_engine()
 {
    let paths = Paths::default();
    let engine = start_engine(Arc::clone(&paths)).await;
    // Load records off: the engine here counts only passed-through calls.
    let (gateway, _publisher, _admin) =
        gateway_with(&["--engine-grpc", &engine, "--load-poll-ms", "0"]).await;
    let channel = gateway.channel().await;
    let long = format!("/made.up.Service/{}", "x".repeat(4000));
    let status = call(channel.clone(), &long).await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("--pass-through-max-path-bytes"),
        "{status:?}"
    );
    call(channel, "/made.up.Service/Short").await;
    assert_eq!(
        *paths.lock().unwrap(),
        ["/made.up.Service/Short"],
        "only the short call reached the engine"
    );
}

#[test]
fn an_open_file_limit_without_room_for_each_ranks_load_socket_fails_at_start_naming_the_limit() {
    const RANKS: u16 = 64;
    const CONNECTIONS: u64 = 64;
    // Room for every connection, the 128 descriptors kvgate keeps for
    // itself and each rank's event and replay sockets, but not for the
    // load socket each rank adds.
    const FILE_LIMIT: u64 = CONNECTIONS + 128 + 2 * RANKS as u64;
    let base = common::free_ports(2 * RANKS);
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--dp-size"])
        .arg(RANKS.to_string())
        .arg("--max-connections")
        .arg(CONNECTIONS.to_string())
        .arg("--zmq-endpoint")
        .arg(format!("tcp://127.0.0.1:{base}"))
        .arg("--zmq-load-endpoint")
        .arg(format!("tcp://127.0.0.1:{}", base + RANKS))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    common::limit_open_files(&mut command, FILE_LIMIT);
    let output = common::output_within_deadline(command.spawn().expect("kvgate runs"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("--max-connections 64"), "{stderr}");
    assert!(stderr.contains("3 per rank"), "{stderr}");
    assert!(
        stderr.contains(&format!("the limit is {FILE_LIMIT}")),
        "{stderr}"
    );
}
