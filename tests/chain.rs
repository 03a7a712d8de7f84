//! A gRPC event source (contract section 5 and the sidecar issue): kvgate
//! re-serving another `SubscribeKvEvents` server, chained kvgate → kvgate →
//! router, through a restart of the upstream kvgate.

mod common;

use common::router::RouterView;
use common::{Gateway, next_batch, subscribe};
use kvgate::proto::common::KvEventBatch;
use kvgate_sim::{EnginePublisher, PublisherOptions, SimConfig, SimEngine};

#[tokio::test(flavor = "multi_thread")]
async fn a_chained_gateway_keeps_its_subscribers_through_a_restart_of_the_upstream_one() {
    let options = PublisherOptions {
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        ..PublisherOptions::default()
    };
    let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &options)
        .await
        .unwrap();
    let replay = publisher.replay_endpoint().unwrap().to_owned();
    let endpoint = publisher.endpoint().to_owned();
    let upstream_args = [
        "--zmq-endpoint",
        &endpoint,
        "--zmq-replay-endpoint",
        &replay,
    ];
    let (mut upstream, _) = Gateway::start_listening_on_free_ports(1, |port| {
        let args = upstream_args.iter().map(|&arg| arg.to_owned()).collect();
        (format!("127.0.0.1:{port}"), args)
    });
    // Restarted on the same port, which its downstream keeps dialling (a
    // restart cannot move to another port if this one was taken meanwhile).
    let upstream_listen = upstream.address.to_string();
    let upstream_uri = format!("http://{upstream_listen}");
    let downstream = Gateway::start(&["--upstream-grpc", &upstream_uri]);

    let mut streams = vec![
        subscribe(
            downstream.channel().await,
            "sglang.grpc.scheduler.SglangScheduler",
            0,
        )
        .await
        .unwrap(),
    ];
    common::sync_streams(&mut publisher, 0, &mut streams).await;
    let mut stream = streams.pop().unwrap();
    let mut view = RouterView::new();

    let mut engine = SimEngine::new(SimConfig {
        seed: 11,
        capacity_blocks: 256,
        ..SimConfig::default()
    })
    .unwrap();
    common::publish_steps_then_fence(&mut engine, &mut publisher, 40, 1).await;
    common::follow_to_fence(&mut stream, &mut view, 1).await;
    assert_eq!(view.blocks(0), common::true_blocks(&engine));

    // The upstream restarts; the new one primes itself from the engine's
    // replay ring. The downstream's cursor means nothing to it any more.
    assert!(upstream.terminate().success());
    drop(upstream);
    let _upstream = Gateway::start_listening(&upstream_listen, &upstream_args);
    // Fences published before the new upstream joined are history, not
    // state: no snapshot carries them. Wait for a live one.
    common::sync_streams_observing(
        &mut publisher,
        0,
        std::slice::from_mut(&mut stream),
        |_, batch| {
            view.admit(batch);
        },
    )
    .await;
    common::publish_steps_then_fence(&mut engine, &mut publisher, 40, 2).await;
    common::follow_to_fence(&mut stream, &mut view, 2).await;
    assert_eq!(
        view.blocks(0),
        common::true_blocks(&engine),
        "the resync rebuilt the engine's blocks"
    );
    assert!(view.gaps.is_empty(), "no gap: {:?}", view.gaps);
    assert_eq!(view.restarts, 0, "the router never had to guess a restart");
}

/// Serves `SubscribeKvEvents` like a broken upstream: each call gets the
/// next batch after its cursor (one stored block), then bytes that are not
/// protobuf.
async fn start_garbage_upstream() -> String {
    use common::raw_codec::RawCodec;
    use kvgate::proto::common::{
        KvBlock, KvBlocksStored, KvCacheEvent, SubscribeKvEventsRequest, kv_cache_event::Data,
    };
    use prost::Message;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let route = tower::service_fn(|request: http::Request<axum::body::Body>| async move {
        let request = request.map(tonic::body::Body::new);
        let mut grpc = tonic::server::Grpc::new(RawCodec::<SubscribeKvEventsRequest>::default());
        let handler = tower::service_fn(
            |request: tonic::Request<SubscribeKvEventsRequest>| async move {
                let next = request.get_ref().start_sequence_number.max(1000) + 1;
                let batch = KvEventBatch {
                    sequence_number: next,
                    dp_rank: Some(0),
                    events: vec![KvCacheEvent {
                        event_id: next,
                        data: Some(Data::Stored(KvBlocksStored {
                            blocks: vec![KvBlock {
                                block_hash: next as i64,
                                token_ids: vec![1, 2],
                                block_size: 2,
                                ..Default::default()
                            }],
                            ..Default::default()
                        })),
                    }],
                    ..Default::default()
                };
                let messages = vec![
                    Ok(bytes::Bytes::from(batch.encode_to_vec())),
                    Ok(bytes::Bytes::from_static(&[0xff, 0xff, 0xff])),
                ];
                Ok::<_, tonic::Status>(tonic::Response::new(tokio_stream::iter(messages)))
            },
        );
        Ok::<_, std::convert::Infallible>(grpc.server_streaming(handler, request).await)
    });
    let router = axum::Router::new().route_service("/kvgate.v1.KvGate/SubscribeKvEvents", route);
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{address}")
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_sending_garbage_is_counted_and_resumed_while_subscribers_keep_their_streams() {
    let upstream = start_garbage_upstream().await;
    let gateway = Gateway::start(&[
        "--upstream-grpc",
        &upstream,
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let mut stream = subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
        .await
        .unwrap();
    let mut view = RouterView::new();
    let mut stored = Vec::new();
    while stored.len() < 3 {
        let batch = next_batch(&mut stream).await;
        view.admit(&batch);
        for event in &batch.events {
            if let Some(kvgate::proto::common::kv_cache_event::Data::Stored(store)) = &event.data {
                stored.extend(store.blocks.iter().map(|block| block.block_hash));
            }
        }
    }
    assert_eq!(
        stored[..3],
        [1001, 1002, 1003],
        "each resume continued after the cursor"
    );
    assert!(view.gaps.is_empty());
    let (_, metrics) = common::http_get(gateway.admin.unwrap(), "/metrics").await;
    let count = |series: &str| {
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(
        count("kvgate_bad_messages_total{reason=\"upstream_undecodable\"}") >= 2.0,
        "{metrics}"
    );
    assert!(
        count("kvgate_upstream_reconnects_total") >= 2.0,
        "{metrics}"
    );
}
