//! A router always ends with exactly the engine's blocks: resume, lag refill,
//! data loss, snapshots, DP > 1 pacing and engine restarts, driven through
//! the real drain and hub in-process (no sockets, no binary), every batch
//! admitted by `RouterView`, the contract's mirror of the router.
//!
//! What every test here asserts, batch by batch and at the end:
//! - no gap: each rank's numbers reach a router as `cursor + 1` (or `cursor`,
//!   stale and harmless), never skipping one (`RouterView::gaps` stays empty);
//! - never below a cursor: outside a snapshot no batch carries a number below
//!   its rank's cursor. This is the DP > 1 promise (resuming from rank 0's
//!   cursor never hands another rank a batch below its own cursor), and it
//!   means the restart rule never even comes into play, so
//!   `RouterView::restarts` stays 0. That is the exact invariant: kvgate
//!   never needs the router's restart rule, because an engine restart or
//!   clear reaches the router as an ownerless clear *at the next number*
//!   (applied in order; it empties that rank only) and a snapshot bypasses
//!   admission;
//! - each connection delivers consecutive stream positions, starting right
//!   after the resumed cursor's batch or the snapshot's cut;
//! - OUT_OF_RANGE only when kvgate could not have honoured the cursor: some
//!   batch after the cursor's rank-0 batch has left the history (contract:
//!   "holds c+1 onwards"); a cursor a router got from kvgate is never
//!   refused as ahead or unknown;
//! - DATA_LOSS only for a position the history no longer holds;
//! - once every subscriber has read to the newest position, its block set
//!   per rank, copies counted, equals the engine's.

mod common;

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use futures::FutureExt;
use proptest::prelude::*;
use proptest::sample::Index;
use prost::Message;

use common::router::{Admission, BlockSet, RouterView};
use kvgate::drain::Drain;
use kvgate::drain::batcher::BatchLimits;
use kvgate::hub::snapshot::encode_snapshot;
use kvgate::hub::state::MAX_COPIES;
use kvgate::hub::subscription::{CursorError, Step, Subscription};
use kvgate::hub::{HistoryLimits, HubReader, hub};
use kvgate::metrics::Metrics;
use kvgate::proto::common::{KvCacheCleared, KvEventBatch, kv_cache_event::Data};
use kvgate::sim::{SimEvent, encode_batch};
use kvgate::source::{EngineMessage, SourceEvent};

/// Far above 1024, so neither `seq <= 1` nor `seq + 1024 <= last` can make
/// a router take a batch for a restart by accident.
const FIRST_SEQUENCE: u64 = 7_000_000;
const BLOCK_SIZE: u32 = 2;
/// A history that never evicts in these tests.
const UNBOUNDED_HISTORY: usize = 4096;

/// Hash of pool block `index`, spread over 64 bits so that half of them
/// read as negative int64 on the wire.
fn pool_hash(index: u8) -> u64 {
    (u64::from(index) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// An engine event before it meets the engine's state: which pool blocks to
/// store, which live blocks to evict (by index into the sorted live set).
#[derive(Clone, Debug)]
enum EventPlan {
    Store { blocks: Vec<u8>, parent: Option<u8> },
    Remove { picks: Vec<u8> },
    Clear,
}

/// The engines' truth: every rank's live blocks and publisher counter.
#[derive(Default)]
struct Engines {
    blocks: BTreeMap<u32, BlockSet>,
    counters: BTreeMap<u32, u64>,
}

impl Engines {
    /// Turns `plan` into the event rank `rank`'s engine reports, applying it
    /// to the truth; `None` when nothing is left to store.
    fn event(&mut self, rank: u32, plan: &EventPlan) -> Option<SimEvent> {
        let blocks = self.blocks.entry(rank).or_default();
        match plan {
            EventPlan::Store {
                blocks: pool,
                parent,
            } => {
                let mut hashes: Vec<u64> = Vec::new();
                for hash in pool.iter().map(|&index| pool_hash(index)) {
                    // Past the contract's cap a router fed live would count
                    // more copies than a snapshot can carry, so the simulated
                    // engines stay within it.
                    let copies = blocks.get(&(hash as i64)).copied().unwrap_or(0);
                    if !hashes.contains(&hash) && copies < u32::from(MAX_COPIES) {
                        hashes.push(hash);
                    }
                }
                if hashes.is_empty() {
                    return None;
                }
                let parent = parent.map(pool_hash).filter(|hash| !hashes.contains(hash));
                for &hash in &hashes {
                    *blocks.entry(hash as i64).or_default() += 1;
                }
                let tokens = hashes
                    .iter()
                    .flat_map(|&hash| [hash as u32, (hash >> 32) as u32])
                    .collect();
                Some(SimEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    block_size: BLOCK_SIZE,
                })
            }
            EventPlan::Remove { picks } => {
                let mut live: Vec<i64> = blocks.keys().copied().collect();
                live.sort_unstable();
                let hashes: Vec<u64> = picks
                    .iter()
                    .map(|&pick| match live.len() {
                        // Evicting what is not live changes nothing anywhere.
                        0 => pool_hash(pick),
                        len => live[usize::from(pick) % len] as u64,
                    })
                    .collect();
                for &hash in &hashes {
                    remove_copy(blocks, hash as i64);
                }
                Some(SimEvent::Removed { hashes })
            }
            EventPlan::Clear => {
                blocks.clear();
                Some(SimEvent::Cleared)
            }
        }
    }

    fn truth(&self, rank: u32) -> BlockSet {
        self.blocks.get(&rank).cloned().unwrap_or_default()
    }
}

fn remove_copy(blocks: &mut BlockSet, hash: i64) {
    if let Some(copies) = blocks.get_mut(&hash) {
        *copies -= 1;
        if *copies == 0 {
            blocks.remove(&hash);
        }
    }
}

/// The library pieces kvgate's serve path wires together, plus the engines.
struct Gateway {
    drain: Drain,
    hub: HubReader,
    engines: Engines,
    /// Rank 0's sequence → stream position, read from the history after
    /// every drain cycle (a batch evicted within its own cycle is missing).
    rank0_positions: BTreeMap<u64, u64>,
    logged_through: u64,
}

impl Gateway {
    fn new(live_capacity: usize, history_batches: usize, max_batch_events: usize) -> Self {
        let (writer, reader) = hub(
            live_capacity,
            HistoryLimits {
                batches: history_batches,
                bytes: usize::MAX,
            },
        );
        let limits = BatchLimits {
            max_events: max_batch_events,
            max_bytes: 1 << 20,
        };
        Self {
            drain: Drain::new(limits, FIRST_SEQUENCE, writer, Metrics::new()),
            hub: reader,
            engines: Engines::default(),
            rank0_positions: BTreeMap::new(),
            logged_through: 0,
        }
    }

    /// Rank `rank`'s engine publishes one message made of `plans`.
    fn publish(&mut self, rank: u32, plans: &[EventPlan]) {
        let events: Vec<SimEvent> = plans
            .iter()
            .filter_map(|plan| self.engines.event(rank, plan))
            .collect();
        let mut payload = Vec::new();
        encode_batch(1.0, &events, Some(rank), &mut payload);
        let counter = self.engines.counters.entry(rank).or_default();
        self.drain.ingest(SourceEvent::Message(EngineMessage {
            rank,
            engine_sequence: *counter,
            payload: Bytes::from(payload),
        }));
        *counter += 1;
    }

    /// Rank `rank`'s engine restarts: empty cache, counter back to 0.
    fn restart_engine(&mut self, rank: u32) {
        self.engines.blocks.remove(&rank);
        self.engines.counters.insert(rank, 0);
        self.drain.ingest(SourceEvent::PublisherRestarted { rank });
    }

    /// Ends a drain cycle: everything ingested is published.
    fn cycle(&mut self) {
        self.drain.flush();
        let history = self.hub.history();
        for position in self.logged_through + 1..=history.newest() {
            if let Some(batch) = history.get(position).filter(|batch| batch.rank == 0) {
                self.rank0_positions.insert(batch.sequence, position);
            }
        }
        self.logged_through = history.newest();
    }

    /// One cycle in which rank `rank` publishes `plans`.
    fn publish_cycle(&mut self, rank: u32, plans: &[EventPlan]) {
        self.publish(rank, plans);
        self.cycle();
    }

    /// A `SubscribeKvEvents` call from `router`, as `src/server/subscribe.rs`
    /// serves it and the router reacts to a refusal: its rank-0 cursor,
    /// else (or after OUT_OF_RANGE, which clears the worker) 0 for a
    /// snapshot cut right after subscribing to live.
    fn connect(&self, router: &mut RouterView) -> Connection {
        router.reconnecting();
        let cursor = router.resume_cursor();
        if cursor != 0 {
            match Subscription::resume(&self.hub, cursor) {
                Ok(stream) => {
                    return Connection {
                        chunks: VecDeque::new(),
                        stream,
                        last_position: self.rank0_positions.get(&cursor).copied(),
                    };
                }
                Err(refusal) => {
                    self.assert_refusal_justified(cursor, refusal);
                    router.clear_worker();
                }
            }
        }
        let live = self.hub.subscribe_live();
        let cut = self.drain.cut();
        let stream = Subscription::after_cut(&self.hub, live, cut.position);
        Connection {
            chunks: encode_snapshot(&cut, 1.0)
                .into_iter()
                .map(|chunk| chunk.encoded)
                .collect(),
            stream,
            last_position: Some(cut.position),
        }
    }

    fn assert_refusal_justified(&self, cursor: u64, refusal: CursorError) {
        assert_eq!(
            refusal,
            CursorError::Behind,
            "cursor {cursor} came from kvgate, yet it was refused as {refusal:?}"
        );
        if let Some(&position) = self.rank0_positions.get(&cursor) {
            let oldest = self.hub.history().oldest();
            assert!(
                oldest > position + 1,
                "cursor {cursor} (position {position}) refused while the history still holds everything after it (oldest {oldest})"
            );
        }
    }
}

/// One open `SubscribeKvEvents` stream.
struct Connection {
    /// Snapshot chunks not read yet; they come before the live stream.
    chunks: VecDeque<Bytes>,
    stream: Subscription,
    /// Position of the last batch this stream delivered, or of the batch
    /// (or cut) it started after; unknown only after resuming at a batch
    /// that was evicted before the test could log it.
    last_position: Option<u64>,
}

/// A router subscribed to kvgate.
struct Subscriber {
    router: RouterView,
    connection: Connection,
    /// Streams that ended with DATA_LOSS.
    losses: usize,
}

impl Subscriber {
    /// A router that knows nothing yet joins with 0.
    fn join(gateway: &Gateway) -> Self {
        let mut router = RouterView::new();
        let connection = gateway.connect(&mut router);
        Self {
            router,
            connection,
            losses: 0,
        }
    }

    /// The stream breaks; the router subscribes again with its cursor.
    fn reconnect(&mut self, gateway: &Gateway) {
        self.connection = gateway.connect(&mut self.router);
    }

    /// Admits up to `max` batches that are ready now; returns them.
    fn read(&mut self, gateway: &Gateway, max: usize) -> Vec<KvEventBatch> {
        let mut read = Vec::new();
        while read.len() < max {
            let Some(batch) = self.next_batch(gateway) else {
                break;
            };
            self.admit(&batch);
            read.push(batch);
        }
        read
    }

    /// Reads everything there is and checks the stream stands at the newest
    /// position.
    fn read_to_end(&mut self, gateway: &Gateway) -> Vec<KvEventBatch> {
        let read = self.read(gateway, usize::MAX);
        assert!(self.connection.chunks.is_empty());
        let newest = gateway.hub.history().newest();
        if let Some(last) = self.connection.last_position {
            assert_eq!(last, newest, "a stream stopped short of the newest batch");
        }
        read
    }

    fn next_batch(&mut self, gateway: &Gateway) -> Option<KvEventBatch> {
        loop {
            if let Some(chunk) = self.connection.chunks.pop_front() {
                let chunk = KvEventBatch::decode(chunk).expect("a snapshot chunk decodes");
                assert!(chunk.snapshot.is_some());
                return Some(chunk);
            }
            match self.connection.stream.next().now_or_never()? {
                Step::Batch(batch) => {
                    if let Some(last) = self.connection.last_position {
                        assert_eq!(
                            batch.position,
                            last + 1,
                            "a stream skipped or repeated a position"
                        );
                    }
                    self.connection.last_position = Some(batch.position);
                    let decoded =
                        KvEventBatch::decode(batch.encoded.clone()).expect("a batch decodes");
                    assert_eq!(decoded.dp_rank, Some(batch.rank as i32));
                    assert_eq!(decoded.sequence_number, batch.sequence);
                    assert!(decoded.snapshot.is_none());
                    return Some(decoded);
                }
                Step::Lost { position } => {
                    let history = gateway.hub.history();
                    assert!(
                        position < history.oldest(),
                        "DATA_LOSS at position {position}, which the history holds"
                    );
                    if let Some(last) = self.connection.last_position {
                        assert_eq!(position, last + 1);
                    }
                    // The router clears the worker and resubscribes with 0.
                    self.losses += 1;
                    self.router.clear_worker();
                    self.connection = gateway.connect(&mut self.router);
                }
                Step::Closed => panic!("the hub closed while its drain is alive"),
            }
        }
    }

    fn admit(&mut self, batch: &KvEventBatch) {
        let rank = batch.dp_rank.expect("kvgate always sets dp_rank");
        if batch.snapshot.is_none()
            && let Some(cursor) = self.router.cursor(rank)
        {
            assert!(
                batch.sequence_number >= cursor,
                "rank {rank} got {} below its cursor {cursor}",
                batch.sequence_number
            );
        }
        let admission = self.router.admit(batch);
        assert!(
            !matches!(admission, Admission::Restart | Admission::Gap { .. }),
            "{admission:?} on rank {rank} at {} (restarts {}, gaps {:?})",
            batch.sequence_number,
            self.router.restarts,
            self.router.gaps
        );
    }

    /// The router's blocks equal the engines', rank by rank.
    fn assert_holds_the_engines_blocks(&self, gateway: &Gateway, ranks: u32) {
        assert!(self.router.gaps.is_empty());
        assert_eq!(self.router.restarts, 0);
        for rank in 0..ranks {
            assert_eq!(
                self.router.blocks(rank as i32),
                gateway.engines.truth(rank),
                "rank {rank}'s blocks differ from the engine's"
            );
        }
    }
}

fn store(blocks: &[u8], parent: Option<u8>) -> EventPlan {
    EventPlan::Store {
        blocks: blocks.to_vec(),
        parent,
    }
}

fn remove(picks: &[u8]) -> EventPlan {
    EventPlan::Remove {
        picks: picks.to_vec(),
    }
}

fn sequences(batches: &[KvEventBatch], rank: i32) -> Vec<u64> {
    batches
        .iter()
        .filter(|batch| batch.dp_rank == Some(rank))
        .map(|batch| batch.sequence_number)
        .collect()
}

fn is_ownerless_clear(batch: &KvEventBatch) -> bool {
    matches!(
        batch.events.as_slice(),
        [event] if event.event_id == 0
            && matches!(event.data, Some(Data::Cleared(KvCacheCleared { ownership: None })))
    )
}

// ---------------------------------------------------------------------------
// The property.

#[derive(Clone, Debug)]
enum Ingest {
    Message { rank: u32, events: Vec<EventPlan> },
    Restart { rank: u32 },
}

#[derive(Clone, Debug)]
enum Op {
    /// One drain cycle over the engine messages and restarts queued since
    /// the last one.
    Cycle(Vec<Ingest>),
    Read {
        subscriber: Index,
        batches: usize,
    },
    Reconnect {
        subscriber: Index,
    },
    Join,
}

#[derive(Clone, Debug)]
struct Setup {
    ranks: u32,
    live_capacity: usize,
    history_batches: usize,
    max_batch_events: usize,
    subscribers: usize,
}

/// Subscribers never exceed this many, joins included.
const MAX_SUBSCRIBERS: usize = 5;

fn setup() -> impl Strategy<Value = Setup> {
    (
        1..=3u32,
        1..=4usize,
        prop_oneof![2..=12usize, Just(UNBOUNDED_HISTORY)],
        prop_oneof![Just(1usize), Just(2), Just(1024)],
        1..=3usize,
    )
        .prop_map(
            |(ranks, live_capacity, history_batches, max_batch_events, subscribers)| Setup {
                ranks,
                live_capacity,
                history_batches,
                max_batch_events,
                subscribers,
            },
        )
}

fn event_plan() -> impl Strategy<Value = EventPlan> {
    prop_oneof![
        6 => (prop::collection::vec(0..12u8, 1..=4), prop::option::of(0..12u8))
            .prop_map(|(blocks, parent)| EventPlan::Store { blocks, parent }),
        3 => prop::collection::vec(any::<u8>(), 1..=3).prop_map(|picks| EventPlan::Remove { picks }),
        1 => Just(EventPlan::Clear),
    ]
}

fn ingest() -> impl Strategy<Value = Ingest> {
    prop_oneof![
        9 => (0..3u32, prop::collection::vec(event_plan(), 0..=4))
            .prop_map(|(rank, events)| Ingest::Message { rank, events }),
        1 => (0..3u32).prop_map(|rank| Ingest::Restart { rank }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => prop::collection::vec(ingest(), 1..=3).prop_map(Op::Cycle),
        6 => (any::<Index>(), 1..=6usize)
            .prop_map(|(subscriber, batches)| Op::Read { subscriber, batches }),
        2 => any::<Index>().prop_map(|subscriber| Op::Reconnect { subscriber }),
        1 => Just(Op::Join),
    ]
}

fn run(setup: &Setup, ops: &[Op]) {
    let mut gateway = Gateway::new(
        setup.live_capacity,
        setup.history_batches,
        setup.max_batch_events,
    );
    let mut subscribers: Vec<Subscriber> = (0..setup.subscribers)
        .map(|_| Subscriber::join(&gateway))
        .collect();
    for op in ops {
        match op {
            Op::Cycle(ingests) => {
                for ingest in ingests {
                    match ingest {
                        Ingest::Message { rank, events } => {
                            gateway.publish(rank % setup.ranks, events);
                        }
                        Ingest::Restart { rank } => gateway.restart_engine(rank % setup.ranks),
                    }
                }
                gateway.cycle();
            }
            Op::Read {
                subscriber,
                batches,
            } => {
                let subscriber = subscriber.index(subscribers.len());
                subscribers[subscriber].read(&gateway, *batches);
            }
            Op::Reconnect { subscriber } => {
                let subscriber = subscriber.index(subscribers.len());
                subscribers[subscriber].reconnect(&gateway);
            }
            Op::Join => {
                if subscribers.len() < MAX_SUBSCRIBERS {
                    subscribers.push(Subscriber::join(&gateway));
                }
            }
        }
    }
    for subscriber in &mut subscribers {
        subscriber.read_to_end(&gateway);
        subscriber.assert_holds_the_engines_blocks(&gateway, setup.ranks);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn a_router_always_ends_with_exactly_the_engines_blocks(
        setup in setup(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(&setup, &ops);
    }
}
