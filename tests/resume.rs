//! Sequence numbers a router can trust, end to end with the real binary
//! (contract sections 3 and 4): every stream here is admitted by
//! `RouterView`, the mirror of the router's rules.

mod common;

use common::router::{Admission, RouterView};
use common::{Gateway, subscribe, sync_streams_observing};
use kvgate::proto::common::{KvEventBatch, kv_cache_event::Data};
use kvgate_sim::{EnginePublisher, PublisherOptions, SimConfig, SimEngine};
use tonic::codec::Streaming;

const SERVICE: &str = "vllm.grpc.engine.VllmEngine";

async fn publisher() -> EnginePublisher {
    EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap()
}

fn engine(seed: u64) -> SimEngine {
    SimEngine::new(SimConfig {
        seed,
        capacity_blocks: 128,
        ..SimConfig::default()
    })
    .unwrap()
}

async fn joined(
    gateway: &Gateway,
    publisher: &mut EnginePublisher,
    view: &mut RouterView,
) -> Streaming<KvEventBatch> {
    let mut streams = vec![
        subscribe(gateway.channel().await, SERVICE, 0)
            .await
            .unwrap(),
    ];
    sync_streams_observing(publisher, 0, &mut streams, |_, batch| {
        view.admit(batch);
    })
    .await;
    streams.pop().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn resuming_after_a_disconnect_delivers_every_batch_after_the_cursor_exactly_once() {
    let mut publisher = publisher().await;
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--max-batch-events",
        "4",
    ]);
    let mut view = RouterView::new();
    let mut stream = joined(&gateway, &mut publisher, &mut view).await;
    let mut engine = engine(1);
    common::publish_steps_then_fence(&mut engine, &mut publisher, 20, 1).await;
    common::follow_to_fence(&mut stream, &mut view, 1).await;

    drop(stream);
    common::publish_steps_then_fence(&mut engine, &mut publisher, 20, 2).await;
    view.reconnecting();
    let cursor = view.resume_cursor();
    let mut stream = subscribe(gateway.channel().await, SERVICE, cursor)
        .await
        .expect("resumed");
    let resumed = common::follow_to_fence(&mut stream, &mut view, 2).await;

    assert_eq!(
        resumed[0].0.sequence_number,
        cursor + 1,
        "strictly after the cursor"
    );
    assert!(
        resumed
            .iter()
            .all(|(_, admission)| *admission == Admission::Applied),
        "no duplicate, no gap"
    );
    assert_eq!(view.blocks(0), common::true_blocks(&engine));
    assert!(view.gaps.is_empty() && view.restarts == 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_cursor_is_refused_with_out_of_range_and_a_fresh_join_rebuilds_the_whole_state()
{
    let mut publisher = publisher().await;
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--max-batch-events",
        "1",
        "--history-batches",
        "8",
    ]);
    let mut view = RouterView::new();
    let mut stream = joined(&gateway, &mut publisher, &mut view).await;
    let mut engine = engine(2);
    common::publish_steps_then_fence(&mut engine, &mut publisher, 5, 1).await;
    common::follow_to_fence(&mut stream, &mut view, 1).await;
    drop(stream);

    // Another subscriber sees when kvgate has the fence: by then the
    // history has moved past the first one's cursor.
    let mut probe = RouterView::new();
    let mut watcher = subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .unwrap();
    common::publish_steps_then_fence(&mut engine, &mut publisher, 30, 2).await;
    common::follow_to_fence(&mut watcher, &mut probe, 2).await;

    view.reconnecting();
    let refused = subscribe(gateway.channel().await, SERVICE, view.resume_cursor())
        .await
        .expect_err("the cursor left the history");
    assert_eq!(refused.code(), tonic::Code::OutOfRange);
    assert!(
        refused
            .message()
            .contains("the oldest cursor it can resume is"),
        "the refusal names the oldest cursor that works: {}",
        refused.message()
    );

    view.clear_worker();
    let mut stream = subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .unwrap();
    publisher
        .publish(common::fence_payload(3, 0))
        .await
        .unwrap();
    let rejoined = common::follow_to_fence(&mut stream, &mut view, 3).await;
    assert_eq!(rejoined[0].1, Admission::SnapshotChunk);
    assert_eq!(
        view.blocks(0),
        common::true_blocks(&engine),
        "the snapshot rebuilt the engine's blocks"
    );
    assert!(view.gaps.is_empty() && view.restarts == 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_engine_reaches_subscribers_as_a_clear_on_the_same_stream_and_numbering_goes_on()
 {
    let mut publisher = publisher().await;
    let gateway = Gateway::start(&["--zmq-endpoint", publisher.endpoint()]);
    let mut view = RouterView::new();
    let mut stream = joined(&gateway, &mut publisher, &mut view).await;
    let mut old_engine = engine(3);
    common::publish_steps_then_fence(&mut old_engine, &mut publisher, 10, 1).await;
    common::follow_to_fence(&mut stream, &mut view, 1).await;
    assert!(!view.blocks(0).is_empty());

    // The engine restarts: its counter starts over and its cache is empty.
    publisher.restart();
    let mut new_engine = engine(4);
    common::publish_steps_then_fence(&mut new_engine, &mut publisher, 10, 2).await;
    let after = common::follow_to_fence(&mut stream, &mut view, 2).await;

    let cleared = after.iter().any(|(batch, _)| {
        batch.events.iter().any(|event| {
            event.event_id == 0 && matches!(&event.data, Some(Data::Cleared(cleared)) if cleared.ownership.is_none())
        })
    });
    assert!(cleared, "an ownerless clear announced the restart");
    assert!(
        after
            .iter()
            .all(|(_, admission)| *admission == Admission::Applied)
    );
    assert_eq!(view.blocks(0), common::true_blocks(&new_engine));
    assert!(view.gaps.is_empty() && view.restarts == 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn after_kvgate_restarts_an_old_cursor_is_refused_never_silently_aliased() {
    let mut publisher = publisher().await;
    let endpoint = publisher.endpoint().to_owned();
    let (mut gateway, _) = Gateway::start_listening_on_free_ports(1, |port| {
        let args = vec!["--zmq-endpoint".to_owned(), endpoint.clone()];
        (format!("127.0.0.1:{port}"), args)
    });
    // Restarted on the same port, as a router's configured address (a
    // restart cannot move to another port if this one was taken meanwhile).
    let listen = gateway.address.to_string();
    let mut view = RouterView::new();
    let mut stream = joined(&gateway, &mut publisher, &mut view).await;
    let mut engine = engine(5);
    common::publish_steps_then_fence(&mut engine, &mut publisher, 5, 1).await;
    common::follow_to_fence(&mut stream, &mut view, 1).await;
    let old_cursor = view.resume_cursor();
    drop(stream);
    assert!(gateway.terminate().success());
    drop(gateway);

    let gateway = Gateway::start_listening(&listen, &["--zmq-endpoint", &endpoint]);
    let mut fresh = RouterView::new();
    let _stream = joined(&gateway, &mut publisher, &mut fresh).await;
    assert!(
        fresh.resume_cursor() > old_cursor,
        "the new process numbers above the old one"
    );
    let refused = subscribe(gateway.channel().await, SERVICE, old_cursor)
        .await
        .expect_err("an old cursor means nothing here");
    assert_eq!(refused.code(), tonic::Code::OutOfRange);
    assert!(
        refused.message().contains("earlier kvgate process"),
        "the refusal says the cursor is from before the restart: {}",
        refused.message()
    );
}
