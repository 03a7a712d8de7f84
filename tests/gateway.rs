//! The core path end to end: a real ZMQ publisher, the real `kvgate` binary,
//! real tonic subscribers (contract sections 1–3).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Gateway, fixture, next_batch, skip_past_fence, subscribe, sync_streams};
use kvgate::proto::common::KvEventBatch;
use kvgate::server::SUBSCRIBE_SERVICES;
use kvgate_sim::{EnginePublisher, PublisherOptions};
use serde_json::Value;

async fn bound_publisher() -> EnginePublisher {
    EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .expect("publisher binds")
}

/// Every fixture of the corpus, malformed ones included, in index order.
fn corpus() -> Vec<String> {
    let index: Value =
        serde_json::from_slice(&std::fs::read(common::fixtures_dir().join("index.json")).unwrap())
            .unwrap();
    index["fixtures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["fixture"].as_str().unwrap().to_owned())
        .collect()
}

/// An event in the fixtures' JSON form, without its kvgate-wide id.
fn event_json_without_id(event: &kvgate::proto::common::KvCacheEvent) -> Value {
    let mut json = kvgate::json::to_json(event, "smg.grpc.common.KvCacheEvent");
    json.as_object_mut().unwrap().remove("event_id");
    json
}

fn events_of(batches: &[KvEventBatch]) -> Vec<&kvgate::proto::common::KvCacheEvent> {
    batches
        .iter()
        .flat_map(|batch| batch.events.iter())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_subscriber_on_every_service_name_receives_identical_correctly_converted_batches() {
    let mut publisher = bound_publisher().await;
    let gateway = Gateway::start(&["--zmq-endpoint", publisher.endpoint()]);
    let channel = gateway.channel().await;
    let mut streams = Vec::new();
    for i in 0..8 {
        let service = SUBSCRIBE_SERVICES[i % SUBSCRIBE_SERVICES.len()];
        streams.push(
            subscribe(channel.clone(), service, 0)
                .await
                .expect("subscribed"),
        );
    }
    sync_streams(&mut publisher, 0, &mut streams).await;

    let mut expected = Vec::new();
    for (i, name) in corpus().iter().enumerate() {
        let (payload, description) = fixture(name);
        publisher.publish(payload.clone().into()).await.unwrap();
        if description["expected"]["decodes"] == Value::Bool(true) {
            let events = description["expected"]["events"].as_array().unwrap();
            expected.extend(events.iter().map(|event| {
                let mut event = event.clone();
                event.as_object_mut().unwrap().remove("event_id");
                event
            }));
        }
        // Malformed framing between good messages: kvgate counts and skips it.
        match i % 3 {
            0 => publisher
                .send_frames(vec![
                    Bytes::new(),
                    Bytes::from_static(&[0, 0, 0, 1]),
                    payload.into(),
                ])
                .await
                .unwrap(),
            1 => publisher
                .send_frames(vec![Bytes::new(), Bytes::from_static(&[0; 8])])
                .await
                .unwrap(),
            _ => publisher
                .send_frames(vec![
                    Bytes::from_static(b"other-topic"),
                    Bytes::from_static(&[0; 8]),
                    Bytes::new(),
                ])
                .await
                .unwrap(),
        }
    }
    let last_fence = common::fence_payload(u64::MAX, 0);
    publisher.publish(last_fence).await.unwrap();

    let mut received = Vec::new();
    for stream in &mut streams {
        received.push(skip_past_fence(stream, u64::MAX).await);
    }
    for other in &received[1..] {
        assert_eq!(
            other, &received[0],
            "every subscriber gets the same batches"
        );
    }
    let batches = &received[0];
    for pair in batches.windows(2) {
        assert_eq!(pair[1].sequence_number, pair[0].sequence_number + 1);
    }
    assert!(batches.iter().all(|batch| batch.dp_rank == Some(0)));
    assert!(batches.iter().all(|batch| batch.events.len() <= 1024));
    // The fence may share its batch with the last fixture's events.
    let mut events = events_of(batches);
    assert!(common::fence_in(batches.last().unwrap()).is_some());
    events.pop();
    let ids: Vec<u64> = events.iter().map(|event| event.event_id).collect();
    assert!(
        ids.windows(2).all(|pair| pair[0] < pair[1]),
        "event ids increase"
    );
    let actual: Vec<Value> = events
        .iter()
        .map(|event| event_json_without_id(event))
        .collect();
    for (n, (actual, expected)) in actual.iter().zip(&expected).enumerate() {
        assert_eq!(actual, expected, "event {n} differs");
    }
    assert_eq!(actual.len(), expected.len());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_engine_batch_of_3000_events_goes_out_as_batches_of_at_most_1024() {
    let mut publisher = bound_publisher().await;
    let gateway = Gateway::start(&["--zmq-endpoint", publisher.endpoint()]);
    let mut streams = vec![
        subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
            .await
            .unwrap(),
    ];
    sync_streams(&mut publisher, 0, &mut streams).await;
    let (payload, _) = fixture("vllm-0.33.0/batch-3000-events");
    publisher.publish(payload.into()).await.unwrap();
    let mut sizes = Vec::new();
    let mut sequences = Vec::new();
    while sizes.iter().sum::<usize>() < 3000 {
        let batch = next_batch(&mut streams[0]).await;
        sizes.push(batch.events.len());
        sequences.push(batch.sequence_number);
    }
    assert_eq!(sizes, vec![1024, 1024, 952]);
    assert_eq!(sequences[1], sequences[0] + 1);
    assert_eq!(sequences[2], sequences[0] + 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lower_max_batch_events_is_honoured() {
    let mut publisher = bound_publisher().await;
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--max-batch-events",
        "100",
    ]);
    let mut streams = vec![
        subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
            .await
            .unwrap(),
    ];
    sync_streams(&mut publisher, 0, &mut streams).await;
    let (payload, _) = fixture("sglang-0.5.23/batch-3000-events");
    publisher.publish(payload.into()).await.unwrap();
    let mut total = 0;
    while total < 3000 {
        let batch = next_batch(&mut streams[0]).await;
        assert!(batch.events.len() <= 100);
        total += batch.events.len();
    }
    assert_eq!(total, 3000);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_two_ranks_each_rank_keeps_its_own_numbering_and_events() {
    let (gateway, base) = Gateway::start_on_free_ports(2, |base| {
        vec![
            "--zmq-endpoint".into(),
            format!("tcp://127.0.0.1:{base}"),
            "--zmq-bind".into(),
            "--dp-size".into(),
            "2".into(),
        ]
    });
    let endpoint = format!("tcp://127.0.0.1:{base}");
    let options = PublisherOptions::default();
    let mut rank0 = EnginePublisher::connect(&endpoint, &options).await.unwrap();
    let mut rank1 = EnginePublisher::connect(&format!("tcp://127.0.0.1:{}", base + 1), &options)
        .await
        .unwrap();
    let mut streams = vec![
        subscribe(gateway.channel().await, "vllm.grpc.engine.VllmEngine", 0)
            .await
            .unwrap(),
    ];
    sync_streams(&mut rank0, 0, &mut streams).await;
    sync_streams(&mut rank1, 1, &mut streams).await;

    let (stored, _) = fixture("vllm-0.33.0/stored-int-root");
    let (removed, _) = fixture("vllm-0.33.0/removed");
    for _ in 0..5 {
        rank0.publish(stored.clone().into()).await.unwrap();
        rank1.publish(removed.clone().into()).await.unwrap();
    }
    rank0
        .publish(common::fence_payload(1 << 40, 0))
        .await
        .unwrap();
    rank1
        .publish(common::fence_payload(1 << 41, 1))
        .await
        .unwrap();
    let mut last: [Option<u64>; 2] = [None, None];
    let mut seen = [false, false];
    let mut per_rank_events = [0usize, 0usize];
    while !(seen[0] && seen[1]) {
        let batch = next_batch(&mut streams[0]).await;
        let rank = batch.dp_rank.expect("dp_rank is always set") as usize;
        if let Some(previous) = last[rank] {
            assert_eq!(
                batch.sequence_number,
                previous + 1,
                "rank {rank} counts by one"
            );
        }
        last[rank] = Some(batch.sequence_number);
        for event in &batch.events {
            use kvgate::proto::common::kv_cache_event::Data;
            match (&event.data, rank) {
                _ if common::fence_number(event).is_some() => {}
                (Some(Data::Stored(_)), 0) | (Some(Data::Removed(_)), 1) => {
                    per_rank_events[rank] += 1
                }
                other => panic!("event on the wrong rank: {other:?}"),
            }
        }
        seen[0] |= common::carries_fence(&batch, 1 << 40);
        seen[1] |= common::carries_fence(&batch, 1 << 41);
    }
    assert_eq!(per_rank_events, [5, 15]);
}

#[tokio::test(flavor = "multi_thread")]
async fn response_headers_arrive_at_once_even_when_no_event_flows() {
    let publisher = bound_publisher().await;
    let gateway = Gateway::start(&["--zmq-endpoint", publisher.endpoint()]);
    let channel = gateway.channel().await;
    let call = tokio::time::timeout(
        Duration::from_secs(2),
        subscribe(channel, "trtllm.TrtllmService", 0),
    );
    call.await
        .expect("headers within 2 s")
        .expect("call accepted");
}

#[test]
fn a_port_taken_between_its_choice_and_kvgate_s_bind_costs_a_retry_on_others_not_the_test() {
    // The first port chosen is taken before kvgate binds it, as a
    // connection from another test may take it.
    let squatter = std::sync::Mutex::new(None);
    let (gateway, port) = Gateway::start_on_free_ports(1, |port| {
        let mut squatter = squatter.lock().unwrap();
        if squatter.is_none() {
            *squatter = Some(std::net::TcpListener::bind(("127.0.0.1", port)).unwrap());
        }
        vec![
            "--zmq-endpoint".into(),
            format!("tcp://127.0.0.1:{port}"),
            "--zmq-bind".into(),
        ]
    });
    let taken = squatter
        .lock()
        .unwrap()
        .as_ref()
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    assert_ne!(port, taken);
    assert!(gateway.address.port() > 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tensorrt_llm_native_stream_reaches_a_router_with_every_store_and_its_multimodal_keys() {
    use kvgate::proto::common::{KvBlock, kv_block_extra_key::Key, kv_cache_event::Data};
    let mut publisher = bound_publisher().await;
    let gateway = Gateway::start(&["--zmq-endpoint", publisher.endpoint()]);
    let mut streams = vec![
        subscribe(gateway.channel().await, "trtllm.TrtllmService", 0)
            .await
            .unwrap(),
    ];
    sync_streams(&mut publisher, 0, &mut streams).await;
    for name in [
        "trtllm-native/stored-mm-keys",
        "trtllm-native/stored-mm-keys-other-image",
        "trtllm-native/stored-digest-token-then-chained",
    ] {
        publisher.publish(fixture(name).0.into()).await.unwrap();
    }
    publisher
        .publish(common::fence_payload(50, 0))
        .await
        .unwrap();
    let batches = skip_past_fence(&mut streams[0], 50).await;
    let stores: Vec<_> = events_of(&batches)
        .into_iter()
        .filter_map(|event| match &event.data {
            Some(Data::Stored(stored)) => Some(stored.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(stores.len(), 4, "every store arrives, none dropped whole");
    let images = |block: &KvBlock| -> Vec<(String, i64)> {
        block
            .extra_keys
            .iter()
            .filter_map(|key| match &key.key {
                Some(Key::Multimodal(mm)) => Some((mm.identifier.clone(), mm.offset)),
                _ => None,
            })
            .collect()
    };
    let (cat, dog) = (&stores[0].blocks[0], &stores[1].blocks[0]);
    assert_eq!(
        cat.token_ids, dog.token_ids,
        "the same text and placeholder tokens"
    );
    assert_ne!(images(cat), images(dog), "told apart by their images");
    assert_eq!(images(cat)[0].1, 5);
    assert_eq!(
        images(&stores[0].blocks[1])[0],
        (images(cat)[0].0.clone(), -11)
    );
    let (with_digest, chained) = (&stores[2], &stores[3]);
    assert_eq!(images(&with_digest.blocks[0]).len(), 1);
    assert_eq!(
        chained.parent_block_hash,
        Some(with_digest.blocks.last().unwrap().block_hash),
        "the chained store's parent is a block the router was sent"
    );
}
