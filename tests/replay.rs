//! Lost engine messages and priming, end to end: a real publisher with a
//! vLLM-style replay ROUTER, the real `kvgate` binary, tonic subscribers
//! checked against the router's admission rules (contract sections 2 and 4).

mod common;

use std::collections::HashSet;

use bytes::Bytes;
use common::router::{Admission, RouterView};
use common::{Gateway, free_ports, http_get, next_batch, subscribe, sync_streams};
use kvgate::proto::common::{KvEventBatch, kv_cache_event::Data};
use kvgate_sim::{EnginePublisher, PublisherOptions, SimEvent, encode_batch};
use tonic::codec::Streaming;

const SERVICE: &str = "kvgate.v1.KvGate";

async fn replaying_publisher(buffer_steps: usize) -> EnginePublisher {
    let options = PublisherOptions {
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        buffer_steps,
        ..PublisherOptions::default()
    };
    EnginePublisher::bind("tcp://127.0.0.1:0", &options)
        .await
        .expect("publisher binds")
}

/// A gateway on `publisher` (one rank) with its replay endpoint and the
/// admin port, for the counters.
/// A gateway with a replay timeout that a loaded test machine cannot miss
/// for a reachable endpoint (`gateway_timing_out_after` for a dead one).
fn gateway(publisher: &EnginePublisher, replay_endpoint: &str) -> Gateway {
    gateway_timing_out_after(publisher, replay_endpoint, "10000")
}

fn gateway_timing_out_after(
    publisher: &EnginePublisher,
    replay_endpoint: &str,
    millis: &str,
) -> Gateway {
    Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--zmq-replay-endpoint",
        replay_endpoint,
        "--zmq-replay-timeout-ms",
        millis,
        "--metrics-listen",
        "127.0.0.1:0",
    ])
}

/// A vLLM 0.33 batch storing the one root block `hash` on rank 0.
fn stored(hash: u64) -> Bytes {
    stored_on(hash, 0)
}

fn stored_on(hash: u64, rank: u32) -> Bytes {
    let mut out = Vec::new();
    let event = SimEvent::Stored {
        hashes: vec![hash],
        parent: None,
        tokens: vec![1, 2, 3, 4],
        block_size: 4,
    };
    encode_batch(1.0, &[event], Some(rank), &mut out);
    out.into()
}

fn stored_hashes(batches: &[KvEventBatch]) -> Vec<i64> {
    batches
        .iter()
        .flat_map(|batch| &batch.events)
        .filter_map(|event| match &event.data {
            Some(Data::Stored(stored)) => Some(stored.blocks.iter().map(|block| block.block_hash)),
            _ => None,
        })
        .flatten()
        .collect()
}

fn block_set(hashes: impl IntoIterator<Item = u64>) -> HashSet<i64> {
    hashes.into_iter().map(|hash| hash as i64).collect()
}

fn router_blocks(router: &RouterView) -> HashSet<i64> {
    rank_blocks(router, 0)
}

fn rank_blocks(router: &RouterView, rank: i32) -> HashSet<i64> {
    router.blocks(rank).into_keys().collect()
}

/// Reads and admits batches until one stores `hash`; fails on any gap.
async fn read_until_stored(
    stream: &mut Streaming<KvEventBatch>,
    router: &mut RouterView,
    hash: u64,
) -> Vec<KvEventBatch> {
    let mut batches = Vec::new();
    loop {
        let batch = next_batch(stream).await;
        let admission = router.admit(&batch);
        assert!(!matches!(admission, Admission::Gap { .. }), "{admission:?}");
        let done = stored_hashes(std::slice::from_ref(&batch)).contains(&(hash as i64));
        batches.push(batch);
        if done {
            return batches;
        }
    }
}

/// A counter from the admin port's Prometheus text.
async fn counter(gateway: &Gateway, name: &str) -> u64 {
    let admin = gateway.admin.expect("admin port reported");
    let (code, text) = http_get(admin, "/metrics").await;
    assert_eq!(code, 200);
    let prefix = format!("kvgate_{name}_total ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Subscribes with cursor 0 and reads the whole snapshot into `router`;
/// returns the chunks.
async fn snapshot(gateway: &Gateway, router: &mut RouterView) -> Vec<KvEventBatch> {
    let mut stream = subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .unwrap();
    let first = next_batch(&mut stream).await;
    let count = first.snapshot.as_ref().expect("a snapshot chunk").count;
    let mut chunks = vec![first];
    while chunks.len() < count as usize {
        chunks.push(next_batch(&mut stream).await);
    }
    for chunk in &chunks {
        assert!(chunk.snapshot.is_some(), "every chunk is marked");
        assert_eq!(router.admit(chunk), Admission::SnapshotChunk);
    }
    chunks
}

/// Admits what a cursor-0 subscriber receives until rank r's blocks are
/// `expected[r]`: the gateway has then ingested everything that stored them.
async fn wait_for_blocks(gateway: &Gateway, expected: &[HashSet<i64>]) {
    let mut stream = subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .unwrap();
    let mut router = RouterView::new();
    while (0..)
        .zip(expected)
        .any(|(rank, blocks)| &rank_blocks(&router, rank) != blocks)
    {
        let batch = next_batch(&mut stream).await;
        router.admit(&batch);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn engine_messages_lost_in_transit_are_fetched_from_replay_and_reach_subscribers_in_order() {
    let mut publisher = replaying_publisher(10_000).await;
    let replay = publisher.replay_endpoint().unwrap().to_owned();
    let gateway = gateway(&publisher, &replay);
    let mut streams = vec![
        subscribe(gateway.channel().await, SERVICE, 0)
            .await
            .unwrap(),
    ];
    sync_streams(&mut publisher, 0, &mut streams).await;
    let recovered_before = counter(&gateway, "engine_messages_recovered").await;

    publisher.publish(stored(1)).await.unwrap();
    publisher.lose_in_transit(stored(2));
    publisher.lose_in_transit(stored(3));
    publisher.publish(stored(4)).await.unwrap();
    publisher.lose_in_transit(stored(5));
    publisher.publish(stored(6)).await.unwrap();

    let mut router = RouterView::new();
    let batches = read_until_stored(&mut streams[0], &mut router, 6).await;
    assert_eq!(stored_hashes(&batches), [1, 2, 3, 4, 5, 6]);
    assert_eq!(router_blocks(&router), block_set(1..=6));
    assert!(router.gaps.is_empty());
    assert_eq!(
        counter(&gateway, "engine_messages_recovered").await - recovered_before,
        3
    );
    assert_eq!(counter(&gateway, "engine_messages_lost").await, 0);
}

/// Publishes stored blocks 1..=`published` into a replay ring of `ring`
/// messages before kvgate starts, then returns kvgate's snapshot once it
/// holds `expected` (the publisher is returned to keep the engine up).
async fn primed_snapshot(
    ring: usize,
    published: u64,
    expected: &HashSet<i64>,
) -> (Gateway, EnginePublisher, Vec<KvEventBatch>) {
    let mut publisher = replaying_publisher(ring).await;
    for hash in 1..=published {
        publisher.publish(stored(hash)).await.unwrap();
    }
    let replay = publisher.replay_endpoint().unwrap().to_owned();
    let gateway = gateway(&publisher, &replay);
    wait_for_blocks(&gateway, std::slice::from_ref(expected)).await;
    let mut router = RouterView::new();
    let chunks = snapshot(&gateway, &mut router).await;
    assert_eq!(&router_blocks(&router), expected);
    (gateway, publisher, chunks)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_started_after_the_engine_primes_its_state_from_replay_and_knows_it_saw_everything()
 {
    // More than one replay piece (1000 messages), before anyone subscribes:
    // these exist only in the ring.
    let (gateway, _publisher, chunks) = primed_snapshot(10_000, 2500, &block_set(1..=2500)).await;
    for chunk in &chunks {
        let header = chunk.snapshot.as_ref().unwrap();
        assert_eq!(header.unknown_before, 0);
        assert_eq!(header.blocks, 2500);
    }
    assert_eq!(counter(&gateway, "engine_messages_recovered").await, 2500);
}

#[tokio::test(flavor = "multi_thread")]
async fn when_the_ring_no_longer_reaches_back_to_the_engines_start_unknown_before_counts_what_preceded_it()
 {
    // The ring keeps the last 100 of 300 messages: seqs 200..=299, hashes 201..=300.
    let (_gateway, _publisher, chunks) = primed_snapshot(100, 300, &block_set(201..=300)).await;
    for chunk in &chunks {
        assert_eq!(chunk.snapshot.as_ref().unwrap().unknown_before, 200);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn with_several_ranks_each_rank_primes_from_its_own_replay_endpoint_at_base_port_plus_rank() {
    let base = free_ports(4);
    let replay_base = base + 2;
    let mut publishers = Vec::new();
    for rank in 0..2u16 {
        let options = PublisherOptions {
            replay_endpoint: Some(format!("tcp://127.0.0.1:{}", replay_base + rank)),
            ..PublisherOptions::default()
        };
        let mut publisher =
            EnginePublisher::bind(&format!("tcp://127.0.0.1:{}", base + rank), &options)
                .await
                .unwrap();
        for n in 0..10 {
            let hash = 100 * u64::from(rank) + n;
            publisher
                .publish(stored_on(hash, rank.into()))
                .await
                .unwrap();
        }
        publishers.push(publisher);
    }
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        &format!("tcp://*:{base}"),
        "--zmq-replay-endpoint",
        &format!("tcp://*:{replay_base}"),
        "--zmq-replay-timeout-ms",
        "10000",
        "--dp-size",
        "2",
    ]);
    let expected = [block_set(0..10), block_set(100..110)];
    wait_for_blocks(&gateway, &expected).await;

    let mut router = RouterView::new();
    let chunks = snapshot(&gateway, &mut router).await;
    assert_eq!(rank_blocks(&router, 0), expected[0]);
    assert_eq!(rank_blocks(&router, 1), expected[1]);
    assert_eq!(chunks[0].snapshot.as_ref().unwrap().unknown_before, 0);
}

/// Publishes stored block 1, numbers `lost` messages that are never sent
/// (nor kept for replay), publishes block 2: a synced subscriber gets both
/// and kvgate counts the loss. Returns that subscriber.
async fn across_a_lost_gap(
    publisher: &mut EnginePublisher,
    gateway: &Gateway,
    lost: u64,
) -> (Streaming<KvEventBatch>, RouterView) {
    let mut streams = vec![
        subscribe(gateway.channel().await, SERVICE, 0)
            .await
            .unwrap(),
    ];
    sync_streams(publisher, 0, &mut streams).await;
    let mut stream = streams.pop().unwrap();
    let mut router = RouterView::new();
    publisher.publish(stored(1)).await.unwrap();
    publisher.skip(lost);
    publisher.publish(stored(2)).await.unwrap();
    let batches = read_until_stored(&mut stream, &mut router, 2).await;
    assert_eq!(stored_hashes(&batches), [1, 2]);
    assert_eq!(counter(gateway, "engine_messages_lost").await, lost);
    (stream, router)
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_the_engine_numbered_but_never_sent_are_counted_as_lost_and_the_stream_goes_on() {
    let mut publisher = replaying_publisher(10_000).await;
    let replay = publisher.replay_endpoint().unwrap().to_owned();
    let gateway = gateway(&publisher, &replay);
    let (mut stream, mut router) = across_a_lost_gap(&mut publisher, &gateway, 3).await;

    publisher.publish(stored(3)).await.unwrap();
    read_until_stored(&mut stream, &mut router, 3).await;
    assert_eq!(router_blocks(&router), block_set(1..=3));
    assert_eq!(router.restarts, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn after_an_engine_restart_the_new_engines_first_messages_the_socket_missed_come_from_replay()
{
    let mut publisher = replaying_publisher(10_000).await;
    let replay = publisher.replay_endpoint().unwrap().to_owned();
    let gateway = gateway(&publisher, &replay);
    let mut streams = vec![
        subscribe(gateway.channel().await, SERVICE, 0)
            .await
            .unwrap(),
    ];
    sync_streams(&mut publisher, 0, &mut streams).await;
    let mut router = RouterView::new();
    publisher.publish(stored(1)).await.unwrap();
    read_until_stored(&mut streams[0], &mut router, 1).await;

    publisher.restart();
    publisher.lose_in_transit(stored(10));
    publisher.lose_in_transit(stored(11));
    publisher.publish(stored(12)).await.unwrap();
    let batches = read_until_stored(&mut streams[0], &mut router, 12).await;
    let clear_at = batches
        .iter()
        .flat_map(|batch| &batch.events)
        .position(|event| matches!(&event.data, Some(Data::Cleared(cleared)) if cleared.ownership.is_none()))
        .expect("subscribers are told to drop the rank");
    assert_eq!(
        clear_at, 0,
        "the clear comes before the new engine's events"
    );
    assert_eq!(stored_hashes(&batches), [10, 11, 12]);
    assert_eq!(router_blocks(&router), block_set(10..=12));

    let mut fresh = RouterView::new();
    let chunks = snapshot(&gateway, &mut fresh).await;
    assert_eq!(router_blocks(&fresh), block_set(10..=12));
    assert_eq!(chunks[0].snapshot.as_ref().unwrap().unknown_before, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_replay_endpoint_never_stops_the_live_stream() {
    let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let nobody = format!("tcp://127.0.0.1:{}", free_ports(1));
    let gateway = gateway_timing_out_after(&publisher, &nobody, "300");
    across_a_lost_gap(&mut publisher, &gateway, 1).await;
    assert_eq!(counter(&gateway, "engine_messages_recovered").await, 0);
}
