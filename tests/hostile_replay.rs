//! A replay ROUTER that never ends its answer, end to end: it answers every
//! request with another run of consecutive messages and never sends END, so
//! a client that followed it would ask forever. The real binary must cut
//! each fetch at its bounds (counted by bound), stay small (peak RSS from
//! /proc), and keep live events reaching a subscriber: at start-up priming,
//! and on a gap after priming.

mod common;

use bytes::Bytes;
use common::router::RouterView;
use common::{
    Gateway, await_metric, await_metric_where, fence_payload, follow_to_fence,
    gateway_on_a_publisher, http_get, metric_sample, peak_rss_kib, subscribe,
    sync_streams_observing,
};
use kvgate_sim::{EndlessReplay, EnginePublisher, PublisherOptions};

const SERVICE: &str = "kvgate.v1.KvGate";

/// Generous: the default byte bound (64 MiB) plus the process itself. An
/// endless fetch kept whole reached 3 GB in about 4 s.
const RSS_BOUND_KIB: u64 = 384 << 10;

const RECOVERED: &str = "kvgate_engine_messages_recovered_total";

/// Messages the endless ROUTER sends per request, as an attacker would.
const PER_REQUEST: u64 = 1000;

/// A payload no engine sends (0xc1 is never used in msgpack): each is
/// counted as a bad message, so only the fetch itself costs memory.
fn junk(bytes: usize) -> Bytes {
    Bytes::from(vec![0xc1; bytes])
}

fn bounded(bound: &str) -> String {
    format!("kvgate_replay_fetches_bounded_total{{bound=\"{bound}\"}}")
}

async fn fetches_bounded(gateway: &Gateway) -> f64 {
    let (_, text) = http_get(gateway.admin.expect("admin port"), "/metrics").await;
    kvgate::app::metric_labels::closed_labels()
        .replay_bounds
        .iter()
        .map(|bound| metric_sample(&text, &bounded(bound)).expect("exported at 0"))
        .sum()
}

fn assert_small(gateway: &Gateway) {
    let peak = peak_rss_kib(gateway.pid());
    assert!(peak < RSS_BOUND_KIB, "kvgate peaked at {peak} KiB");
}

#[tokio::test(flavor = "multi_thread")]
async fn priming_from_a_replay_endpoint_that_never_ends_stops_at_its_byte_bound_and_live_events_flow()
 {
    let endless = EndlessReplay::bind("tcp://127.0.0.1:0", Bytes::new(), PER_REQUEST, junk(90_000))
        .await
        .unwrap();
    let (gateway, mut publisher) =
        gateway_on_a_publisher(&["--zmq-replay-endpoint", endless.endpoint()]).await;
    let admin = gateway.admin.expect("admin port");
    // Nothing is published yet: only the fetch's byte bound (64 MiB by
    // default, ~745 of these messages) can end priming.
    await_metric(admin, &bounded("bytes"), 1.0).await;
    assert_small(&gateway);
    let recovered = await_metric_where(admin, RECOVERED, "> 0", |now| now > 0.0).await;
    assert!(
        recovered < PER_REQUEST as f64,
        "{recovered} messages primed"
    );

    let mut streams = vec![
        subscribe(gateway.channel().await, SERVICE, 0)
            .await
            .unwrap(),
    ];
    let mut view = RouterView::new();
    let fence = sync_streams_observing(&mut publisher, 0, &mut streams, |_, batch| {
        view.admit(batch);
    })
    .await;
    for n in 1..=3 {
        publisher
            .publish(fence_payload(fence + n, 0))
            .await
            .unwrap();
    }
    follow_to_fence(&mut streams[0], &mut view, fence + 3).await;
    assert!(view.gaps.is_empty(), "{:?}", view.gaps);
    assert_small(&gateway);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gap_filled_from_a_replay_endpoint_that_never_ends_is_cut_at_a_bound_while_other_ranks_flow()
 {
    let endless = EndlessReplay::bind("tcp://127.0.0.1:0", Bytes::new(), PER_REQUEST, junk(16_000))
        .await
        .unwrap();
    let replaying = PublisherOptions {
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        ..PublisherOptions::default()
    };
    let mut rank0 = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let mut rank1 = EnginePublisher::bind("tcp://127.0.0.1:0", &replaying)
        .await
        .unwrap();
    let publishers = format!("{},{}", rank0.endpoint(), rank1.endpoint());
    let replays = format!(
        "{},{}",
        endless.endpoint(),
        rank1.replay_endpoint().unwrap()
    );
    let gateway = Gateway::start(&[
        "--dp-size",
        "2",
        "--zmq-endpoint",
        &publishers,
        "--zmq-replay-endpoint",
        &replays,
        // Only the clock ends the fetch (junk fills no history, so a big
        // one costs nothing): it runs for 3 s whatever the machine's pace,
        // and what it streams must not pile up meanwhile.
        "--history-bytes",
        "64GiB",
        "--zmq-replay-max-bytes",
        "64GiB",
        "--zmq-replay-max-messages",
        "100000000",
        "--zmq-replay-fetch-timeout-ms",
        "3000",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let admin = gateway.admin.expect("admin port");
    let mut streams = vec![
        subscribe(gateway.channel().await, SERVICE, 0)
            .await
            .unwrap(),
    ];
    let mut view = RouterView::new();
    // Priming ends at each rank's first live message.
    sync_streams_observing(&mut rank0, 0, &mut streams, |_, batch| {
        view.admit(batch);
    })
    .await;
    let fence = sync_streams_observing(&mut rank1, 1, &mut streams, |_, batch| {
        view.admit(batch);
    })
    .await;
    let bounded_before = fetches_bounded(&gateway).await;
    assert_eq!(
        bounded_before, 0.0,
        "priming ended at the first live message"
    );
    let recovered_before =
        metric_sample(&http_get(admin, "/metrics").await.1, RECOVERED).expect("exported");

    // A billion numbers rank 0's publisher never sent: the endless endpoint
    // would fill them forever.
    rank0.skip(1_000_000_000);
    rank0.publish(fence_payload(fence + 1, 0)).await.unwrap();
    await_metric_where(admin, RECOVERED, "growing", |now| {
        now > recovered_before + PER_REQUEST as f64
    })
    .await;
    rank1.publish(fence_payload(fence + 2, 1)).await.unwrap();
    follow_to_fence(&mut streams[0], &mut view, fence + 2).await;
    assert_eq!(
        fetches_bounded(&gateway).await,
        bounded_before,
        "rank 1's event came while rank 0's fetch ran"
    );
    assert_small(&gateway);

    // Rank 0's own event waits for its fetch, which its time bound ends.
    await_metric(admin, &bounded("time"), 1.0).await;
    follow_to_fence(&mut streams[0], &mut view, fence + 1).await;
    assert_small(&gateway);
    assert!(view.gaps.is_empty(), "{:?}", view.gaps);
}
