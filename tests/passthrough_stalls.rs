//! Clients that never read their pass-through streams, end to end: a real
//! tonic engine streaming 1 MB messages on `Generate` behind the real
//! `kvgate` binary, raw `h2` clients that open streams with a zero window
//! and never read them (their connections still answer PINGs), and a
//! well-behaved tonic client on its own connection. Unread responses must
//! hold back no other call and no `GetLoads` poll (docs/guarantees.md,
//! "Connections and HTTP/2").

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use common::{
    DEADLINE, Gateway, await_metric_where, gateway_on_a_publisher, http_get, metric_sample,
};
use kvgate::proto::vllm::grpc::engine as vllm;
use kvgate_sim::EnginePublisher;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

/// The test engine's only message.
#[derive(Clone, PartialEq, prost::Message)]
struct Chunk {
    #[prost(bytes = "bytes", tag = "1")]
    data: Bytes,
}

type Codec = tonic_prost::ProstCodec<Chunk, Chunk>;

const GENERATE: &str = "/test.Engine/Generate";
const MODEL_INFO: &str = "/test.Engine/GetModelInfo";
const POLLS_OK: &str = "kvgate_load_polls_total{outcome=\"ok\"}";

/// What `Generate` streams, message after message, until the client goes.
const MESSAGE_BYTES: usize = 1 << 20;

/// A tonic engine on loopback: `Generate` streams 1 MB messages forever
/// (counting them as it hands them to tonic), `GetModelInfo` answers at
/// once, and vLLM's `GetLoads` reports rank 0.
struct TestEngine {
    url: String,
    generated: Arc<AtomicU64>,
}

impl TestEngine {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let generated = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&generated);
        let generate = tower::service_fn(move |request: http::Request<axum::body::Body>| {
            let counter = Arc::clone(&counter);
            async move {
                let request = request.map(tonic::body::Body::new);
                let handler = tower::service_fn(move |_: Request<Chunk>| {
                    let counter = Arc::clone(&counter);
                    async move {
                        let chunk = Chunk {
                            data: Bytes::from(vec![0x42; MESSAGE_BYTES]),
                        };
                        let stream = futures::stream::repeat_with(move || {
                            counter.fetch_add(1, Ordering::Relaxed);
                            Ok(chunk.clone())
                        });
                        Ok::<_, Status>(Response::new(stream))
                    }
                });
                let mut grpc = tonic::server::Grpc::new(Codec::default());
                Ok::<_, std::convert::Infallible>(grpc.server_streaming(handler, request).await)
            }
        });
        let model_info = tower::service_fn(|request: http::Request<axum::body::Body>| async {
            let request = request.map(tonic::body::Body::new);
            let handler = tower::service_fn(|_: Request<Chunk>| async {
                Ok::<_, Status>(Response::new(Chunk {
                    data: Bytes::from_static(b"model"),
                }))
            });
            let mut grpc = tonic::server::Grpc::new(Codec::default());
            Ok::<_, std::convert::Infallible>(grpc.unary(handler, request).await)
        });
        let loads = tower::service_fn(|request: http::Request<axum::body::Body>| async {
            let request = request.map(tonic::body::Body::new);
            let handler = tower::service_fn(|_: Request<vllm::GetLoadsRequest>| async {
                Ok::<_, Status>(Response::new(vllm::GetLoadsResponse {
                    loads: vec![vllm::SchedulerLoad {
                        dp_rank: 0,
                        num_running_reqs: 3,
                        ..Default::default()
                    }],
                    ..Default::default()
                }))
            });
            let codec =
                tonic_prost::ProstCodec::<vllm::GetLoadsResponse, vllm::GetLoadsRequest>::default();
            Ok::<_, std::convert::Infallible>(
                tonic::server::Grpc::new(codec)
                    .unary(handler, request)
                    .await,
            )
        });
        let router = axum::Router::new()
            .route_service(GENERATE, generate)
            .route_service(MODEL_INFO, model_info)
            .route_service("/vllm.grpc.engine.VllmEngine/GetLoads", loads);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_routes(tonic::service::Routes::from(router))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        Self { url, generated }
    }

    fn generated(&self) -> u64 {
        self.generated.load(Ordering::Relaxed)
    }
}

async fn gateway_in_front_of(engine: &TestEngine, extra: &[&str]) -> (Gateway, EnginePublisher) {
    let mut args = vec![
        "--engine-grpc",
        &engine.url,
        "--engine-kind",
        "vllm",
        "--load-poll-ms",
        "50",
    ];
    args.extend_from_slice(extra);
    gateway_on_a_publisher(&args).await
}

/// One `Generate` stream on a connection of its own whose window is zero:
/// kvgate may send it headers but never a byte of data, and its
/// connection task answers PINGs. Held until dropped.
struct Unread {
    _response: http::Response<h2::RecvStream>,
    _client: h2::client::SendRequest<Bytes>,
    connection: JoinHandle<()>,
}

impl Drop for Unread {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

fn grpc_frame(message: &Chunk) -> Bytes {
    let body = prost::Message::encode_to_vec(message);
    let mut frame = vec![0];
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame.into()
}

async fn unread_stream(address: SocketAddr) -> Unread {
    let tcp = TcpStream::connect(address).await.unwrap();
    let (client, connection) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    let connection = tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await.unwrap();
    let request = http::Request::post(format!("http://{address}{GENERATE}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut body) = client.send_request(request, false).unwrap();
    body.send_data(grpc_frame(&Chunk::default()), true).unwrap();
    let response = timeout(DEADLINE, response)
        .await
        .expect("response headers before the deadline")
        .expect("the engine answers");
    assert_eq!(response.status(), 200);
    Unread {
        _response: response,
        _client: client,
        connection,
    }
}

async fn model_info(channel: Channel) -> Result<Chunk, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let call = grpc.unary(
        Request::new(Chunk::default()),
        MODEL_INFO.parse().unwrap(),
        Codec::default(),
    );
    timeout(DEADLINE, call)
        .await
        .expect("GetModelInfo answered before the deadline")
        .map(Response::into_inner)
}

/// Reads `count` messages of a `Generate` stream, each before the deadline.
async fn generate(channel: Channel, count: usize) {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let call = grpc.server_streaming(
        Request::new(Chunk::default()),
        GENERATE.parse().unwrap(),
        Codec::default(),
    );
    let mut stream = timeout(DEADLINE, call)
        .await
        .expect("Generate answered before the deadline")
        .expect("Generate succeeds")
        .into_inner();
    for n in 0..count {
        let message = timeout(DEADLINE, stream.message())
            .await
            .unwrap_or_else(|_| panic!("message {n} of Generate before the deadline"))
            .expect("a healthy stream")
            .expect("an open stream");
        assert_eq!(message.data.len(), MESSAGE_BYTES);
    }
}

async fn metric(gateway: &Gateway, series: &str) -> f64 {
    let (_, text) = http_get(gateway.admin.expect("admin port"), "/metrics").await;
    metric_sample(&text, series).unwrap_or_else(|| panic!("{series} exported"))
}

/// Waits (bounded) until the engine has handed tonic `count` messages.
async fn until_generated(engine: &TestEngine, count: u64) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while engine.generated() < count {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the engine generated {} messages, never {count}",
            engine.generated()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn clients_that_never_read_their_streams_hold_back_no_other_call_and_no_load_poll() {
    let engine = TestEngine::start().await;
    let (gateway, _publisher) = gateway_in_front_of(&engine, &[]).await;
    let mut unread = Vec::new();
    for _ in 0..3 {
        unread.push(unread_stream(gateway.address).await);
    }
    // Each stream is past its first message: kvgate holds what its windows
    // let the engine send.
    until_generated(&engine, 6).await;

    let channel = gateway.channel().await;
    generate(channel.clone(), 8).await;
    let info = model_info(channel).await.expect("GetModelInfo succeeds");
    assert_eq!(info.data, Bytes::from_static(b"model"));

    // The poller's answers keep coming: records do not go stale.
    let polled = metric(&gateway, POLLS_OK).await;
    let admin = gateway.admin.expect("admin port");
    await_metric_where(admin, POLLS_OK, "5 more ok polls", |now| {
        now >= polled + 5.0
    })
    .await;
    assert_eq!(unread.len(), 3, "the unread streams stayed open throughout");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_over_the_pass_through_stream_cap_is_refused_naming_the_flag_until_one_ends() {
    let engine = TestEngine::start().await;
    let (gateway, _publisher) =
        gateway_in_front_of(&engine, &["--pass-through-max-streams", "2"]).await;
    let first = unread_stream(gateway.address).await;
    let _second = unread_stream(gateway.address).await;
    let channel = gateway.channel().await;
    let refused = model_info(channel.clone())
        .await
        .expect_err("a third call is over the cap");
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(
        refused.message().contains("--pass-through-max-streams"),
        "{}",
        refused.message()
    );

    // The cap is on calls in flight: once one ends, the next goes through.
    drop(first);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        match model_info(channel.clone()).await {
            Ok(info) => break assert_eq!(info.data, Bytes::from_static(b"model")),
            Err(status) => assert_eq!(status.code(), Code::ResourceExhausted),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slot never came free"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
