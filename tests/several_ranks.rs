//! An engine of several data-parallel ranks through the router's rules
//! (contract sections 2, 3 and 4), end to end: the real binary on two real
//! ZMQ publishers with replay rings, a simulated engine per rank as the
//! truth, and every batch admitted by the router-rules mirror, which, like
//! the SMG router, clears the whole worker on any `KvCacheCleared`. A
//! re-snapshot, one rank's restart and one rank's own clear each leave the
//! router holding exactly what every rank's engine holds.

mod common;

use common::router::{Admission, RouterView};
use common::{Gateway, fence_payload, follow_to_fence, next_batch, subscribe, true_blocks};
use kvgate::proto::common::KvEventBatch;
use kvgate_sim::{EnginePublisher, PublisherOptions, SimConfig, SimEngine, SimEvent, encode_batch};
use tonic::codec::Streaming;

const SERVICE: &str = "kvgate.v1.KvGate";

/// One rank of the engine: its cache and its publisher.
struct Rank {
    rank: u32,
    cache: SimEngine,
    publisher: EnginePublisher,
}

impl Rank {
    async fn new(rank: u32) -> Self {
        let options = PublisherOptions {
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            ..PublisherOptions::default()
        };
        Self {
            rank,
            cache: cache(u64::from(rank) + 1),
            publisher: EnginePublisher::bind("tcp://127.0.0.1:0", &options)
                .await
                .unwrap(),
        }
    }

    async fn publish(&mut self, events: &[SimEvent]) {
        let mut payload = Vec::new();
        encode_batch(1.0, events, Some(self.rank), &mut payload);
        self.publisher.publish(payload.into()).await.unwrap();
    }

    /// `steps` scheduler steps, then fence `fence`.
    async fn steps_then_fence(&mut self, steps: usize, fence: u64) {
        for _ in 0..steps {
            let events = self.cache.step();
            self.publish(&events).await;
        }
        let fence = fence_payload(fence, self.rank);
        self.publisher.publish(fence).await.unwrap();
    }

    /// The engine's cache starts over empty (a restart or its own clear).
    fn start_over(&mut self, seed: u64) {
        self.cache = cache(seed);
    }
}

/// A cache that evicts as it goes, its hashes drawn from `seed`.
fn cache(seed: u64) -> SimEngine {
    SimEngine::new(SimConfig {
        seed,
        block_size: 4,
        capacity_blocks: 300,
        ..SimConfig::default()
    })
    .unwrap()
}

/// A kvgate on both ranks.
fn gateway(ranks: &[Rank]) -> Gateway {
    let mut args = vec!["--dp-size".to_owned(), ranks.len().to_string()];
    for rank in ranks {
        args.extend(["--zmq-endpoint".into(), rank.publisher.endpoint().into()]);
    }
    for rank in ranks {
        let replay = rank.publisher.replay_endpoint().unwrap();
        args.extend(["--zmq-replay-endpoint".into(), replay.into()]);
    }
    args.extend(["--zmq-replay-timeout-ms".into(), "10000".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Gateway::start(&args)
}

async fn subscribe_from(gateway: &Gateway, cursor: u64) -> Streaming<KvEventBatch> {
    subscribe(gateway.channel().await, SERVICE, cursor)
        .await
        .unwrap_or_else(|status| panic!("cursor {cursor} refused: {status:?}"))
}

/// Follows `stream` into `router` up to fence `fence`; the router never
/// takes a batch as a restart, sees a gap or ignores one.
async fn follow(stream: &mut Streaming<KvEventBatch>, router: &mut RouterView, fence: u64) {
    for (batch, admission) in follow_to_fence(stream, router, fence).await {
        assert!(
            matches!(admission, Admission::Applied | Admission::SnapshotChunk),
            "rank {:?} batch {} admitted as {admission:?}",
            batch.dp_rank,
            batch.sequence_number
        );
    }
}

/// The router holds exactly each rank's live blocks.
fn assert_holds_every_rank(router: &RouterView, ranks: &[Rank], context: &str) {
    for rank in ranks {
        let held = router.blocks(rank.rank as i32);
        let truth = true_blocks(&rank.cache);
        assert!(!truth.is_empty(), "rank {} holds blocks", rank.rank);
        assert_eq!(
            held.len(),
            truth.len(),
            "{context}: rank {}'s block count in the router",
            rank.rank
        );
        assert_eq!(held, truth, "{context}: rank {}'s blocks", rank.rank);
    }
}

/// Two ranks, each a few hundred live blocks, followed by a router from 0.
async fn two_ranks_followed() -> (Vec<Rank>, Gateway, Streaming<KvEventBatch>, RouterView) {
    let mut ranks = vec![Rank::new(0).await, Rank::new(1).await];
    let gateway = gateway(&ranks);
    let mut router = RouterView::new();
    let mut stream = subscribe_from(&gateway, 0).await;
    ranks[0].steps_then_fence(40, 1).await;
    follow(&mut stream, &mut router, 1).await;
    ranks[1].steps_then_fence(40, 2).await;
    follow(&mut stream, &mut router, 2).await;
    assert_holds_every_rank(&router, &ranks, "steady state");
    (ranks, gateway, stream, router)
}

#[tokio::test]
async fn a_new_routers_snapshot_of_two_ranks_holds_every_ranks_blocks() {
    let (ranks, gateway, _stream, _router) = two_ranks_followed().await;
    let mut router = RouterView::new();
    let mut stream = subscribe_from(&gateway, 0).await;
    let first = next_batch(&mut stream).await;
    let count = first.snapshot.as_ref().expect("a snapshot chunk").count;
    assert!(count >= 2, "one chunk per rank at least");
    let mut chunks = vec![first];
    for _ in 1..count {
        chunks.push(next_batch(&mut stream).await);
    }
    let clears = |batch: &KvEventBatch| {
        batch
            .events
            .iter()
            .filter(|event| {
                matches!(
                    event.data,
                    Some(kvgate::proto::common::kv_cache_event::Data::Cleared(_))
                )
            })
            .count()
    };
    assert_eq!(clears(&chunks[0]), 1, "chunk 0 starts with the clear");
    assert!(
        chunks[1..].iter().all(|chunk| clears(chunk) == 0),
        "the only clear of the snapshot"
    );
    for chunk in &chunks {
        assert_eq!(router.admit(chunk), Admission::SnapshotChunk);
    }
    assert_holds_every_rank(&router, &ranks, "after a snapshot");
}

#[tokio::test]
async fn one_ranks_publisher_restarting_leaves_the_other_ranks_blocks_in_the_router() {
    let (mut ranks, _gateway, mut stream, mut router) = two_ranks_followed().await;
    ranks[1].publisher.restart();
    ranks[1].start_over(101);
    ranks[1].steps_then_fence(10, 3).await;
    follow(&mut stream, &mut router, 3).await;
    assert_holds_every_rank(&router, &ranks, "after rank 1 restarted");
    assert_eq!(router.restarts, 0);
}

#[tokio::test]
async fn one_ranks_own_clear_leaves_the_other_ranks_blocks_in_the_router() {
    let (mut ranks, _gateway, mut stream, mut router) = two_ranks_followed().await;
    ranks[1].publish(&[SimEvent::Cleared]).await;
    ranks[1].start_over(202);
    ranks[1].steps_then_fence(10, 3).await;
    follow(&mut stream, &mut router, 3).await;
    assert_holds_every_rank(&router, &ranks, "after rank 1 cleared its cache");
    // Rank 0 goes on as before.
    ranks[0].steps_then_fence(5, 4).await;
    follow(&mut stream, &mut router, 4).await;
    assert_holds_every_rank(&router, &ranks, "after rank 0 went on");
}
