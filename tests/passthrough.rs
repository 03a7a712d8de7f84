//! Pass-through (contract section 5): every RPC other than
//! `SubscribeKvEvents` reaches the engine's own gRPC server unchanged —
//! messages, metadata, deadlines, cancellation, status and trailers.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{DEADLINE, Gateway};
use futures::StreamExt;
use kvgate_sim::{EnginePublisher, PublisherOptions};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

/// The test engine's only message.
#[derive(Clone, PartialEq, prost::Message)]
struct Echo {
    #[prost(string, tag = "1")]
    text: String,
}

type Codec = tonic_prost::ProstCodec<Echo, Echo>;

/// What the test engine saw.
#[derive(Default)]
struct Seen {
    /// `grpc-timeout` headers of incoming calls.
    timeouts: Mutex<Vec<String>>,
    /// Signals when a handler's work is dropped (cancelled).
    cancelled: Mutex<Option<mpsc::UnboundedSender<&'static str>>>,
}

/// Fires when dropped: the engine's handler was cancelled or finished.
struct DropSignal(Arc<Seen>, &'static str);

impl Drop for DropSignal {
    fn drop(&mut self) {
        if let Some(tx) = self.0.cancelled.lock().unwrap().as_ref() {
            let _ = tx.send(self.1);
        }
    }
}

async fn unary(request: Request<Echo>) -> Result<Response<Echo>, Status> {
    let tenant = request.metadata().get("x-tenant").cloned();
    let text = request.into_inner().text;
    if text == "fail" {
        let mut status = Status::failed_precondition("engine says no");
        status
            .metadata_mut()
            .insert("x-reason", MetadataValue::from_static("quota"));
        return Err(status);
    }
    let mut response = Response::new(Echo {
        text: format!("echo {text}"),
    });
    if let Some(tenant) = tenant {
        response.metadata_mut().insert("x-echo-tenant", tenant);
    }
    Ok(response)
}

/// Starts the test engine on loopback; returns its address.
async fn start_engine(seen: Arc<Seen>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let unary_route =
        tower::service_fn(move |request: http::Request<axum::body::Body>| async move {
            let request = request.map(tonic::body::Body::new);
            let mut grpc = tonic::server::Grpc::new(Codec::default());
            Ok::<_, std::convert::Infallible>(grpc.unary(tower::service_fn(unary), request).await)
        });
    let slow_seen = Arc::clone(&seen);
    let slow_route = tower::service_fn(move |request: http::Request<axum::body::Body>| {
        let seen = Arc::clone(&slow_seen);
        async move {
            if let Some(timeout) = request.headers().get("grpc-timeout") {
                seen.timeouts
                    .lock()
                    .unwrap()
                    .push(timeout.to_str().unwrap().to_owned());
            }
            let request = request.map(tonic::body::Body::new);
            let mut grpc = tonic::server::Grpc::new(Codec::default());
            let handler = tower::service_fn(move |_: Request<Echo>| {
                let guard = DropSignal(Arc::clone(&seen), "slow");
                async move {
                    let _guard = guard;
                    std::future::pending::<()>().await;
                    Ok::<Response<Echo>, Status>(Response::new(Echo::default()))
                }
            });
            Ok::<_, std::convert::Infallible>(grpc.unary(handler, request).await)
        }
    });
    let chat_seen = Arc::clone(&seen);
    let chat_route = tower::service_fn(move |request: http::Request<axum::body::Body>| {
        let seen = Arc::clone(&chat_seen);
        async move {
            let request = request.map(tonic::body::Body::new);
            let mut grpc = tonic::server::Grpc::new(Codec::default());
            let handler = tower::service_fn(move |request: Request<Streaming<Echo>>| {
                let seen = Arc::clone(&seen);
                async move {
                    let mut incoming = request.into_inner();
                    let (tx, rx) = mpsc::channel(4);
                    tokio::spawn(async move {
                        let _guard = DropSignal(seen, "chat");
                        while let Some(Ok(message)) = incoming.next().await {
                            let reply = Echo {
                                text: format!("chat {}", message.text),
                            };
                            if tx.send(Ok(reply)).await.is_err() {
                                break;
                            }
                        }
                    });
                    Ok::<_, Status>(Response::new(ReceiverStream::new(rx)))
                }
            });
            Ok::<_, std::convert::Infallible>(grpc.streaming(handler, request).await)
        }
    });
    let router = axum::Router::new()
        .route_service("/test.Engine/Unary", unary_route)
        .route_service("/test.Engine/Slow", slow_route)
        .route_service("/test.Engine/Chat", chat_route);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_routes(tonic::service::Routes::from(router))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    format!("http://{address}")
}

async fn gateway_in_front_of(engine: &str) -> (Gateway, EnginePublisher) {
    let publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--engine-grpc",
        engine,
    ]);
    (gateway, publisher)
}

async fn call_unary(channel: Channel, request: Request<Echo>) -> Result<Response<Echo>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    grpc.unary(
        request,
        "/test.Engine/Unary".parse().unwrap(),
        Codec::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_unary_call_reaches_the_engine_with_its_metadata_and_returns_the_engines_answer() {
    let engine = start_engine(Arc::default()).await;
    let (gateway, _publisher) = gateway_in_front_of(&engine).await;
    let mut request = Request::new(Echo {
        text: "hello".into(),
    });
    request
        .metadata_mut()
        .insert("x-tenant", MetadataValue::from_static("team-a"));
    let response = call_unary(gateway.channel().await, request)
        .await
        .expect("engine answers");
    assert_eq!(response.metadata().get("x-echo-tenant").unwrap(), "team-a");
    assert_eq!(response.into_inner().text, "echo hello");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_engine_error_arrives_with_its_code_message_and_trailers() {
    let engine = start_engine(Arc::default()).await;
    let (gateway, _publisher) = gateway_in_front_of(&engine).await;
    let status = call_unary(
        gateway.channel().await,
        Request::new(Echo {
            text: "fail".into(),
        }),
    )
    .await
    .expect_err("the engine refuses");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert_eq!(status.message(), "engine says no");
    assert_eq!(status.metadata().get("x-reason").unwrap(), "quota");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deadline_travels_to_the_engine_and_expiry_cancels_its_work() {
    let seen = Arc::new(Seen::default());
    let (tx, mut cancelled) = mpsc::unbounded_channel();
    *seen.cancelled.lock().unwrap() = Some(tx);
    let engine = start_engine(Arc::clone(&seen)).await;
    let (gateway, _publisher) = gateway_in_front_of(&engine).await;
    let mut grpc = tonic::client::Grpc::new(gateway.channel().await);
    grpc.ready().await.unwrap();
    let mut request = Request::new(Echo::default());
    request.set_timeout(Duration::from_millis(300));
    let status = grpc
        .unary(
            request,
            "/test.Engine/Slow".parse().unwrap(),
            Codec::default(),
        )
        .await
        .expect_err("the deadline expires");
    // The test engine is tonic, which answers an expired deadline with
    // CANCELLED "Timeout expired": the engine's own verdict, passed through.
    assert_eq!(status.code(), tonic::Code::Cancelled, "{status:?}");
    assert!(status.message().contains("Timeout expired"), "{status:?}");
    let which = tokio::time::timeout(DEADLINE, cancelled.recv())
        .await
        .expect("engine work cancelled");
    assert_eq!(which, Some("slow"));
    let timeouts = seen.timeouts.lock().unwrap().clone();
    assert_eq!(timeouts.len(), 1, "the engine saw the call's grpc-timeout");
}

/// One gRPC message on the wire: uncompressed flag, length, bytes.
fn grpc_frame(message: &Echo) -> bytes::Bytes {
    use prost::Message;
    let body = message.encode_to_vec();
    let mut frame = vec![0];
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame.into()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bidirectional_stream_flows_both_ways_through_kvgate() {
    let engine = start_engine(Arc::default()).await;
    let (gateway, _publisher) = gateway_in_front_of(&engine).await;
    let mut grpc = tonic::client::Grpc::new(gateway.channel().await);
    grpc.ready().await.unwrap();
    let (outgoing, rx) = mpsc::channel(4);
    let mut replies = grpc
        .streaming(
            Request::new(ReceiverStream::new(rx)),
            "/test.Engine/Chat".parse().unwrap(),
            Codec::default(),
        )
        .await
        .expect("stream opens")
        .into_inner();
    for word in ["one", "two", "three"] {
        outgoing.send(Echo { text: word.into() }).await.unwrap();
        let reply = tokio::time::timeout(DEADLINE, replies.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(reply.text, format!("chat {word}"));
    }
    drop(outgoing);
    let end = tokio::time::timeout(DEADLINE, replies.message())
        .await
        .unwrap();
    assert!(
        matches!(end, Ok(None)),
        "the engine's clean end comes through: {end:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_cancels_a_stream_cancels_it_at_the_engine() {
    let seen = Arc::new(Seen::default());
    let (tx, mut cancelled) = mpsc::unbounded_channel();
    *seen.cancelled.lock().unwrap() = Some(tx);
    let engine = start_engine(Arc::clone(&seen)).await;
    let (gateway, _publisher) = gateway_in_front_of(&engine).await;
    // A raw HTTP/2 client, to send RST_STREAM(CANCEL) as a gRPC client does
    // when its call is cancelled, while its request stream is still open.
    let tcp = tokio::net::TcpStream::connect(gateway.address)
        .await
        .unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{}/test.Engine/Chat", gateway.address))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(request, false).unwrap();
    send.send_data(grpc_frame(&Echo { text: "one".into() }), false)
        .unwrap();
    let response = tokio::time::timeout(DEADLINE, response)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let reply = tokio::time::timeout(DEADLINE, body.data())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        reply.slice(5..),
        grpc_frame(&Echo {
            text: "chat one".into()
        })
        .slice(5..)
    );
    send.send_reset(h2::Reason::CANCEL);
    let which = tokio::time::timeout(DEADLINE, cancelled.recv())
        .await
        .expect("engine stream cancelled");
    assert_eq!(which, Some("chat"));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_engine_fails_calls_with_unavailable_naming_the_address_while_events_flow() {
    let closed = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let engine = format!("http://{closed}");
    let (gateway, mut publisher) = gateway_in_front_of(&engine).await;
    let status = call_unary(
        gateway.channel().await,
        Request::new(Echo { text: "x".into() }),
    )
    .await
    .expect_err("nobody there");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(
        status.message().contains(&closed.to_string()),
        "{}",
        status.message()
    );
    let mut streams = vec![
        common::subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
            .await
            .unwrap(),
    ];
    common::sync_streams(&mut publisher, 0, &mut streams).await;
}
