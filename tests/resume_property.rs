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
//!   clear reaches the router *at the next number* (applied in order): with
//!   one rank as an ownerless clear, with several as removals of every block
//!   the rank held (the router clears the whole worker on any clear, so a
//!   clear would take the other ranks' blocks too), and a snapshot bypasses
//!   admission;
//! - each connection delivers consecutive stream positions, starting right
//!   after the resumed cursor's batch or the snapshot's cut;
//! - OUT_OF_RANGE only when kvgate could not have honoured the cursor: some
//!   batch after the cursor's rank-0 batch has left the history (contract:
//!   "holds c+1 onwards"); a cursor a router got from kvgate is never
//!   refused as ahead or unknown;
//! - DATA_LOSS only for a position the history no longer holds;
//! - once every subscriber has read to the newest position, its block set
//!   per rank, copies counted, equals the engine's. The truth is kept from
//!   the events published: a store adds a copy of each block (the simulated
//!   engines keep within kvgate's cap of 8), a removal takes one away, a
//!   clear or an engine restart empties the rank.
//!
//! With load records on (`..._with_load_records_on`), `load_only` batches
//! come between the batches: each must reach a stream only where it was
//! published (right after the last batch the stream got), repeat its rank's
//! cursor, carry a sample above any the stream showed before, and change
//! nothing in the router.

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
use kvgate::hub::subscription::{CursorError, Step, Subscription};
use kvgate::hub::{HistoryLimits, HubReader, hub};
use kvgate::load::BoardWriter;
use kvgate::load::records::LoadRecords;
use kvgate::metrics::Metrics;
use kvgate::proto::common::{KvCacheCleared, KvEventBatch, kv_cache_event::Data};
use kvgate::source::{EngineMessage, SourceEvent};
use kvgate::state::MAX_COPIES;
use kvgate::state::snapshot::SnapshotEncoder;
use kvgate_sim::{SimConfig, SimEngine, SimEvent, encode_batch};

/// Far above 1024, so neither `seq <= 1` nor `seq + 1024 <= last` can make
/// a router take a batch for a restart by accident.
const FIRST_SEQUENCE: u64 = 7_000_000;
const BLOCK_SIZE: u32 = 2;
/// A history that never evicts in these tests.
const UNBOUNDED_HISTORY: HistoryLimits = HistoryLimits {
    batches: 4096,
    bytes: usize::MAX,
};

fn history_of(batches: usize) -> HistoryLimits {
    HistoryLimits {
        batches,
        bytes: usize::MAX,
    }
}

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
                // kvgate drops a store that repeats a hash or names one of
                // its own blocks as parent, so the plan leaves those out.
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
    /// The poller's side of the load records, when they are on.
    load: Option<BoardWriter>,
}

impl Gateway {
    /// A gateway for an engine of `ranks` ranks (1 unless told).
    fn with_engine_ranks(mut self, ranks: u32) -> Self {
        self.drain = self.drain.with_engine_ranks(ranks);
        self
    }

    /// A gateway whose drain stamps load records for `ranks` ranks.
    fn with_load_records(mut self, ranks: u32) -> Self {
        let (board, feed) = BoardWriter::new(ranks, None);
        self.drain = self
            .drain
            .with_load_records(LoadRecords::new(feed, LoadRecords::DEFAULT_HEARTBEAT));
        self.load = Some(board);
        self
    }

    /// The engine reports `running` requests on `rank`; a cycle follows (in
    /// which the drain sends what is due), as the drain wakes for a poll.
    fn load_changes(&mut self, rank: u32, running: u32) {
        let Some(board) = &self.load else { return };
        let load = kvgate::proto::common::EngineLoad {
            running_requests: running,
            ..Default::default()
        };
        board.pushed(rank, load, tokio::time::Instant::now());
        self.cycle();
    }

    fn new(live_capacity: usize, history: HistoryLimits, max_batch_events: usize) -> Self {
        let (writer, reader) = hub(live_capacity, history);
        let limits = BatchLimits {
            max_events: max_batch_events,
            max_bytes: 1 << 20,
        };
        Self {
            drain: Drain::new(limits, FIRST_SEQUENCE, writer, Metrics::default()),
            hub: reader,
            engines: Engines::default(),
            rank0_positions: BTreeMap::new(),
            logged_through: 0,
            load: None,
        }
    }

    /// Rank `rank`'s engine publishes one message made of `plans`.
    fn publish(&mut self, rank: u32, plans: &[EventPlan]) {
        let events: Vec<SimEvent> = plans
            .iter()
            .filter_map(|plan| self.engines.event(rank, plan))
            .collect();
        self.send(rank, &events);
    }

    /// Rank `rank`'s publisher sends `events` as its next message.
    fn send(&mut self, rank: u32, events: &[SimEvent]) {
        let mut payload = Vec::new();
        encode_batch(1.0, events, Some(rank), &mut payload);
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
                        last_sample: 0,
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
        let position = cut.position;
        let stream = Subscription::after_cut(&self.hub, live, position);
        Connection {
            chunks: SnapshotEncoder::plan(std::sync::Arc::new(cut), 1.0).collect(),
            stream,
            last_position: Some(position),
            last_sample: 0,
        }
    }

    fn assert_refusal_justified(&self, cursor: u64, refusal: CursorError) {
        assert!(
            matches!(refusal, CursorError::Behind { oldest } if oldest.is_none_or(|oldest| oldest > cursor)),
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
    /// The newest load record's sample this stream delivered.
    last_sample: u64,
}

/// A router subscribed to kvgate.
struct Subscriber {
    router: RouterView,
    connection: Connection,
    /// Streams that ended with DATA_LOSS.
    losses: usize,
    /// `load_only` batches received.
    load_only: usize,
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
            load_only: 0,
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
        // Far more than any test publishes: a stream that never runs dry
        // fails here instead of hanging.
        const READ_LIMIT: usize = 100_000;
        let read = self.read(gateway, READ_LIMIT);
        assert!(read.len() < READ_LIMIT, "the stream never ran dry");
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
                    self.check_sample(&decoded);
                    return Some(decoded);
                }
                Step::LoadOnly(record) => {
                    let decoded =
                        KvEventBatch::decode(record.encoded.clone()).expect("a load-only decodes");
                    assert!(decoded.load.as_ref().is_some_and(|load| load.load_only));
                    assert!(decoded.events.is_empty() && decoded.snapshot.is_none());
                    assert_eq!(
                        Some(record.after_position),
                        self.connection.last_position,
                        "a load-only reached a stream away from where it was published"
                    );
                    let rank = decoded.dp_rank.expect("kvgate always sets dp_rank");
                    assert_eq!(
                        Some(decoded.sequence_number),
                        self.router.cursor(rank),
                        "a load-only repeats its rank's last sequence"
                    );
                    self.check_sample(&decoded);
                    self.load_only += 1;
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

    /// Samples only go up on a stream.
    fn check_sample(&mut self, batch: &KvEventBatch) {
        if let Some(load) = &batch.load {
            assert!(
                load.sample > self.connection.last_sample,
                "sample {} after {}",
                load.sample,
                self.connection.last_sample
            );
            self.connection.last_sample = load.sample;
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

    /// The router holds exactly `truth`, rank by rank from 0, and never saw
    /// a gap nor took a batch for a restart.
    fn assert_holds(&self, truth: impl IntoIterator<Item = BlockSet>) {
        assert!(self.router.gaps.is_empty());
        assert_eq!(self.router.restarts, 0);
        for (rank, blocks) in (0..).zip(truth) {
            assert_eq!(
                self.router.blocks(rank),
                blocks,
                "rank {rank}'s blocks differ from the engine's"
            );
        }
    }

    fn assert_holds_the_engines_blocks(&self, gateway: &Gateway, ranks: u32) {
        self.assert_holds((0..ranks).map(|rank| gateway.engines.truth(rank)));
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
// One mechanism at a time.

#[test]
fn resuming_from_a_cursor_replays_everything_after_it_exactly_once_while_the_engine_keeps_publishing()
 {
    let mut gateway = Gateway::new(4, UNBOUNDED_HISTORY, 1);
    let mut subscriber = Subscriber::join(&gateway);
    for block in 0..3 {
        gateway.publish_cycle(0, &[store(&[block], None)]);
    }
    subscriber.read_to_end(&gateway);
    let cursor = subscriber.router.resume_cursor();
    assert_eq!(cursor, FIRST_SEQUENCE + 2);
    // Published while the router is away.
    for block in 3..6 {
        gateway.publish_cycle(0, &[store(&[block], Some(block - 1))]);
    }
    subscriber.reconnect(&gateway);
    let mut received = subscriber.read(&gateway, 2);
    for block in 6..9 {
        gateway.publish_cycle(0, &[store(&[block], None), remove(&[0])]);
        received.extend(subscriber.read(&gateway, 1));
    }
    received.extend(subscriber.read_to_end(&gateway));
    assert_eq!(
        sequences(&received, 0),
        (cursor + 1..=FIRST_SEQUENCE + 11).collect::<Vec<_>>()
    );
    assert!(received.iter().all(|batch| batch.snapshot.is_none()));
    subscriber.assert_holds_the_engines_blocks(&gateway, 1);
}

#[test]
fn a_resumed_subscriber_gets_what_it_missed_even_while_the_engine_is_idle() {
    let mut gateway = Gateway::new(4, UNBOUNDED_HISTORY, 1);
    let mut subscriber = Subscriber::join(&gateway);
    for block in 0..5 {
        gateway.publish_cycle(0, &[store(&[block], None)]);
    }
    subscriber.read(&gateway, 2);
    subscriber.reconnect(&gateway);
    // Nothing is published from here on: no live batch will come to reveal
    // what the router missed.
    let received = subscriber.read_to_end(&gateway);
    assert_eq!(
        sequences(&received, 0),
        (FIRST_SEQUENCE + 2..FIRST_SEQUENCE + 5).collect::<Vec<_>>()
    );
    subscriber.assert_holds_the_engines_blocks(&gateway, 1);
}

#[test]
fn a_lagging_subscriber_is_refilled_from_the_history_without_noticing() {
    let live_capacity = 2;
    let mut gateway = Gateway::new(live_capacity, UNBOUNDED_HISTORY, 1);
    let mut subscriber = Subscriber::join(&gateway);
    gateway.publish_cycle(0, &[store(&[0], None)]);
    gateway.publish_cycle(1, &[store(&[0], None)]);
    subscriber.read_to_end(&gateway);
    for block in 1..=6 {
        gateway.publish_cycle(0, &[store(&[block], Some(block - 1))]);
        gateway.publish_cycle(1, &[store(&[block], Some(block - 1))]);
    }
    let lag = gateway.hub.subscriber_lags()[0].1;
    assert!(
        lag > live_capacity as u64,
        "{lag} batches behind: more than the live channel holds, so it overflowed"
    );
    let received = subscriber.read_to_end(&gateway);
    for rank in 0..2 {
        assert_eq!(
            sequences(&received, rank),
            (FIRST_SEQUENCE + 1..=FIRST_SEQUENCE + 6).collect::<Vec<_>>()
        );
    }
    assert_eq!(subscriber.losses, 0);
    subscriber.assert_holds_the_engines_blocks(&gateway, 2);
}

#[test]
fn a_subscriber_behind_the_history_ends_with_data_loss() {
    let mut gateway = Gateway::new(2, history_of(4), 1);
    let mut subscriber = Subscriber::join(&gateway);
    gateway.publish_cycle(0, &[store(&[0], None)]);
    subscriber.read_to_end(&gateway);
    for block in 1..=6 {
        gateway.publish_cycle(0, &[store(&[block], Some(block - 1))]);
    }
    assert!(matches!(
        subscriber.connection.stream.next().now_or_never(),
        Some(Step::Lost { position: 2 })
    ));
    // The router clears the worker and subscribes again with 0.
    let received = subscriber.read_to_end(&gateway);
    assert_eq!(subscriber.losses, 1);
    assert!(received[0].snapshot.is_some());
    subscriber.assert_holds_the_engines_blocks(&gateway, 1);
}

#[test]
fn a_cursor_older_than_the_history_or_newer_than_anything_sent_is_refused() {
    let mut gateway = Gateway::new(4, history_of(3), 1);
    let refusal = |gateway: &Gateway, cursor| Subscription::resume(&gateway.hub, cursor).err();
    assert_eq!(refusal(&gateway, FIRST_SEQUENCE), Some(CursorError::Empty));
    gateway.publish_cycle(1, &[store(&[0], None)]);
    assert_eq!(
        refusal(&gateway, FIRST_SEQUENCE),
        Some(CursorError::Empty),
        "rank 0 sent nothing yet"
    );

    let mut gateway = Gateway::new(4, history_of(3), 1);
    let mut subscriber = Subscriber::join(&gateway);
    gateway.publish_cycle(0, &[store(&[0], None)]);
    subscriber.read_to_end(&gateway);
    for block in 1..6 {
        gateway.publish_cycle(0, &[store(&[block], None)]);
    }
    // Held: FIRST_SEQUENCE + 3 ..= + 5; + 2 was evicted last, so a cursor
    // naming it resumes with everything after it.
    let behind = CursorError::Behind {
        oldest: Some(FIRST_SEQUENCE + 2),
    };
    for (cursor, expected) in [
        (
            FIRST_SEQUENCE - 5,
            Some(CursorError::OtherIncarnation {
                first: FIRST_SEQUENCE,
            }),
        ),
        (FIRST_SEQUENCE, Some(behind)),
        (FIRST_SEQUENCE + 1, Some(behind)),
        (FIRST_SEQUENCE + 2, None),
        (FIRST_SEQUENCE + 5, None),
        (
            FIRST_SEQUENCE + 6,
            Some(CursorError::Ahead {
                newest: FIRST_SEQUENCE + 5,
            }),
        ),
    ] {
        assert_eq!(refusal(&gateway, cursor), expected, "cursor {cursor}");
    }
    // The router's answer to OUT_OF_RANGE: clear, then a snapshot.
    assert_eq!(subscriber.router.resume_cursor(), FIRST_SEQUENCE);
    subscriber.reconnect(&gateway);
    assert!(!subscriber.connection.chunks.is_empty());
    subscriber.read_to_end(&gateway);
    subscriber.assert_holds_the_engines_blocks(&gateway, 1);
}

#[test]
fn a_cursor_whose_own_batch_was_just_evicted_is_resumed_while_everything_after_it_is_held() {
    let mut gateway = Gateway::new(4, history_of(3), 1);
    let mut subscriber = Subscriber::join(&gateway);
    gateway.publish_cycle(0, &[store(&[0], None)]);
    subscriber.read_to_end(&gateway);
    gateway.publish_cycle(1, &[store(&[1], None)]);
    gateway.publish_cycle(0, &[store(&[2], None)]);
    gateway.publish_cycle(1, &[store(&[3], None)]);
    assert_eq!(
        gateway.hub.history().oldest(),
        2,
        "only the cursor's batch is gone"
    );
    let cursor = subscriber.router.resume_cursor();
    subscriber.reconnect(&gateway);
    assert!(
        subscriber.connection.chunks.is_empty(),
        "resumed, no snapshot"
    );
    let received = subscriber.read_to_end(&gateway);
    assert_eq!(received.len(), 3);
    subscriber.assert_holds_the_engines_blocks(&gateway, 2);

    gateway.publish_cycle(0, &[store(&[4], None)]);
    assert_eq!(
        Subscription::resume(&gateway.hub, cursor).err(),
        Some(CursorError::Behind {
            oldest: Some(cursor + 1)
        }),
        "rank 1's batch after the cursor is gone too; rank 0's next batch is the oldest cursor"
    );
}

#[test]
fn load_only_batches_reach_only_caught_up_streams_and_change_nothing_in_the_router() {
    let mut gateway = Gateway::new(2, UNBOUNDED_HISTORY, 1).with_load_records(2);
    let mut keeping_up = Subscriber::join(&gateway);
    let mut lagging = Subscriber::join(&gateway);
    gateway.publish_cycle(0, &[store(&[0], None)]);
    gateway.load_changes(1, 3);
    keeping_up.read_to_end(&gateway);
    assert_eq!(
        keeping_up.load_only, 0,
        "rank 1 has had no batch: its record is numbered 0, for subscribers that ask"
    );
    gateway.publish_cycle(1, &[store(&[0], None)]);
    keeping_up.read_to_end(&gateway);
    gateway.load_changes(1, 4);
    gateway.load_changes(0, 1);
    let read = keeping_up.read_to_end(&gateway);
    assert_eq!(keeping_up.load_only, 2);
    assert!(
        read.iter()
            .all(|batch| batch.load.as_ref().is_some_and(|load| load.load_only))
    );
    for block in 1..=4 {
        gateway.publish_cycle(0, &[store(&[block], Some(block - 1))]);
        gateway.load_changes(0, u32::from(block) + 10);
    }
    let refilled = lagging.read_to_end(&gateway);
    assert!(
        lagging.load_only <= 1,
        "a stream catching up skips the records published while it was behind ({} taken)",
        lagging.load_only
    );
    assert!(
        refilled
            .iter()
            .any(|batch| batch.load.as_ref().is_some_and(|load| !load.load_only)),
        "the batches it catches up on carry records"
    );
    let mut joining = Subscriber::join(&gateway);
    joining.read_to_end(&gateway);
    gateway.load_changes(1, 9);
    joining.read_to_end(&gateway);
    assert_eq!(joining.load_only, 1, "after the snapshot, records flow");
    for subscriber in [&mut keeping_up, &mut lagging, &mut joining] {
        subscriber.read_to_end(&gateway);
        subscriber.assert_holds_the_engines_blocks(&gateway, 2);
    }
}

#[test]
fn a_snapshot_then_live_has_no_gap_and_no_duplicate() {
    let mut gateway = Gateway::new(4, UNBOUNDED_HISTORY, 2);
    gateway.publish_cycle(
        0,
        &[
            store(&[1, 2, 3], None),
            store(&[4], Some(3)),
            store(&[2], None),
        ],
    );
    gateway.publish_cycle(1, &[store(&[5, 6], Some(1)), remove(&[0])]);
    gateway.publish_cycle(0, &[remove(&[1])]);
    let last_sequences = gateway.drain.cut().last_sequences;
    let mut subscriber = Subscriber::join(&gateway);
    let snapshot = subscriber.read_to_end(&gateway);
    assert!(snapshot.iter().all(|chunk| chunk.snapshot.is_some()));
    assert_eq!(
        snapshot
            .iter()
            .map(|chunk| (chunk.dp_rank, chunk.sequence_number))
            .collect::<Vec<_>>(),
        vec![(Some(1), last_sequences[&1]), (Some(0), last_sequences[&0])],
        "rank 0 last, each rank stamped with its last number"
    );
    assert!(matches!(
        snapshot[0].events[0].data,
        Some(Data::Cleared(KvCacheCleared { ownership: None }))
    ));
    let copies: u32 = (0..2)
        .flat_map(|rank| gateway.engines.truth(rank).into_values())
        .sum();
    assert_eq!(copies, 5, "block 2 twice, two removals");
    assert_eq!(snapshot[1].snapshot.unwrap().blocks, u64::from(copies));
    assert!(
        snapshot
            .iter()
            .flat_map(|chunk| &chunk.events)
            .all(|event| event.event_id == 0)
    );
    subscriber.assert_holds_the_engines_blocks(&gateway, 2);

    let mut live = Vec::new();
    for block in 7..10 {
        gateway.publish_cycle(0, &[store(&[block], None), remove(&[0])]);
        gateway.publish_cycle(1, &[store(&[block], Some(block - 1))]);
        live.extend(subscriber.read(&gateway, 2));
    }
    live.extend(subscriber.read_to_end(&gateway));
    for rank in 0..2 {
        let first = last_sequences[&(rank as u32)] + 1;
        let sent = sequences(&live, rank);
        assert_eq!(sent, (first..first + sent.len() as u64).collect::<Vec<_>>());
    }
    subscriber.assert_holds_the_engines_blocks(&gateway, 2);
}

#[test]
fn a_subscriber_cut_off_inside_a_snapshot_takes_a_new_one_and_loses_no_rank() {
    let mut gateway = Gateway::new(4, UNBOUNDED_HISTORY, 1024);
    gateway.publish_cycle(0, &[store(&[1], None)]);
    gateway.publish_cycle(1, &[store(&[2, 3], None)]);
    gateway.publish_cycle(2, &[store(&[4], None)]);
    let mut subscriber = Subscriber::join(&gateway);
    let ranks = |chunks: &VecDeque<Bytes>| -> Vec<Option<i32>> {
        chunks
            .iter()
            .map(|chunk| KvEventBatch::decode(chunk.clone()).unwrap().dp_rank)
            .collect()
    };
    assert_eq!(
        ranks(&subscriber.connection.chunks),
        vec![Some(1), Some(2), Some(0)]
    );
    for applied in 1..=2 {
        subscriber.read(&gateway, applied);
        // No rank-0 cursor yet: the router asks for a whole new snapshot.
        subscriber.reconnect(&gateway);
        assert_eq!(subscriber.connection.chunks.len(), 3);
    }
    subscriber.read_to_end(&gateway);
    gateway.publish_cycle(1, &[store(&[5], Some(3))]);
    gateway.publish_cycle(2, &[remove(&[0])]);
    subscriber.read_to_end(&gateway);
    subscriber.assert_holds_the_engines_blocks(&gateway, 3);
}

#[test]
fn with_three_ranks_resuming_never_trips_the_restart_rule() {
    let mut gateway = Gateway::new(4, UNBOUNDED_HISTORY, 1);
    let mut subscriber = Subscriber::join(&gateway);
    let mut empty_rank0_batches = 0;
    for round in 0..12u8 {
        gateway.publish(
            1,
            &[
                store(&[round], None),
                store(&[round + 1], Some(round)),
                remove(&[round]),
            ],
        );
        gateway.publish(2, &[store(&[round], None), store(&[round + 2], None)]);
        if round % 3 == 0 {
            gateway.publish(0, &[store(&[round], None)]);
        }
        gateway.cycle();
        // Cut off after 1, 2 or 3 live batches in turn (a snapshot is read
        // whole): each resume goes by rank 0's cursor alone, and `admit`
        // checks no rank ever gets a batch below its own. Pacing puts at
        // most 2 other batches between rank-0 ones, so 3 always gets the
        // router past the next rank-0 batch.
        let mut at_the_end = false;
        for cut_after in (1..=3).cycle().take(200) {
            let read = subscriber.read(&gateway, cut_after);
            empty_rank0_batches += read
                .iter()
                .filter(|batch| batch.dp_rank == Some(0) && batch.events.is_empty())
                .count();
            let connection = &subscriber.connection;
            if !connection.chunks.is_empty() {
                continue;
            }
            at_the_end = connection.last_position == Some(gateway.hub.history().newest());
            if at_the_end {
                break;
            }
            subscriber.reconnect(&gateway);
        }
        assert!(at_the_end, "the router stopped making progress");
    }
    assert!(
        empty_rank0_batches > 0,
        "ranks 1 and 2 outpace rank 0, so empty rank-0 batches pace them"
    );
    subscriber.assert_holds_the_engines_blocks(&gateway, 3);
}

#[test]
fn an_engine_restart_reaches_subscribers_as_an_ownerless_clear_and_numbering_goes_on() {
    let mut gateway = Gateway::new(4, UNBOUNDED_HISTORY, 1024);
    let mut subscriber = Subscriber::join(&gateway);
    gateway.publish_cycle(0, &[store(&[1, 2], None)]);
    subscriber.read_to_end(&gateway);
    let last = subscriber.router.cursor(0).unwrap();

    // Restarted and quiet: the clear goes out alone at the next number.
    gateway.restart_engine(0);
    gateway.cycle();
    let batches = subscriber.read_to_end(&gateway);
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].sequence_number, last + 1);
    assert!(is_ownerless_clear(&batches[0]));
    assert!(subscriber.router.blocks(0).is_empty());

    // The new engine counts from 0 again; kvgate's numbers go on.
    gateway.publish_cycle(0, &[store(&[3], None)]);
    assert_eq!(gateway.engines.counters[&0], 1);
    // Restarted and publishing in the same cycle: its events follow the
    // clear in one batch.
    gateway.restart_engine(0);
    gateway.publish_cycle(0, &[store(&[4], None)]);
    // Restarted and clearing by itself: no second clear.
    gateway.restart_engine(0);
    gateway.publish_cycle(0, &[EventPlan::Clear, store(&[5], None)]);
    let batches = subscriber.read_to_end(&gateway);
    assert_eq!(sequences(&batches, 0), vec![last + 2, last + 3, last + 4]);
    assert_eq!(
        batches.iter().map(clears).collect::<Vec<_>>(),
        vec![0, 1, 1]
    );
    assert_eq!(batches[1].events[0].event_id, 0, "kvgate's own clear");
    assert_ne!(batches[2].events[0].event_id, 0, "the engine's clear");
    subscriber.assert_holds_the_engines_blocks(&gateway, 1);
}

/// The clears `batch` carries.
fn clears(batch: &KvEventBatch) -> usize {
    batch
        .events
        .iter()
        .filter(|event| matches!(event.data, Some(Data::Cleared(_))))
        .count()
}

#[test]
fn one_ranks_engine_restart_or_clear_reaches_subscribers_as_removals_of_its_blocks_and_numbering_goes_on()
 {
    let mut gateway = Gateway::new(4, UNBOUNDED_HISTORY, 1024).with_engine_ranks(2);
    let mut subscriber = Subscriber::join(&gateway);
    gateway.publish_cycle(0, &[store(&[1], None)]);
    gateway.publish_cycle(1, &[store(&[1, 2], None)]);
    subscriber.read_to_end(&gateway);
    let last = subscriber.router.cursor(1).unwrap();
    let rank1_batches = |subscriber: &mut Subscriber, gateway: &Gateway| {
        let read = subscriber.read_to_end(gateway);
        read.into_iter()
            .filter(|batch| batch.dp_rank == Some(1))
            .collect::<Vec<_>>()
    };

    // Restarted and quiet: its blocks' removals go out at the next number.
    gateway.restart_engine(1);
    gateway.cycle();
    let batches = rank1_batches(&mut subscriber, &gateway);
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].sequence_number, last + 1);
    assert_eq!(clears(&batches[0]), 0);
    assert!(subscriber.router.blocks(1).is_empty());
    assert!(!subscriber.router.blocks(0).is_empty(), "only that rank");

    // Restarted and publishing in the same cycle, then clearing by itself:
    // never a clear, and kvgate's numbers go on.
    gateway.publish_cycle(1, &[store(&[3], None)]);
    gateway.restart_engine(1);
    gateway.publish_cycle(1, &[store(&[4], None)]);
    gateway.publish_cycle(
        1,
        &[store(&[6], Some(4)), EventPlan::Clear, store(&[5], None)],
    );
    let batches = rank1_batches(&mut subscriber, &gateway);
    let sent = sequences(&batches, 1);
    assert_eq!(
        sent,
        (last + 2..last + 2 + sent.len() as u64).collect::<Vec<_>>()
    );
    assert_eq!(batches.iter().map(clears).sum::<usize>(), 0);
    assert_eq!(
        subscriber.router.blocks(1).len(),
        1,
        "what followed the clear"
    );
    subscriber.assert_holds_the_engines_blocks(&gateway, 2);
}

#[test]
fn routers_following_simulated_engines_end_with_the_engines_own_blocks() {
    // A small cache, so that it evicts, and a periodic reset.
    let engine = |seed| {
        SimEngine::new(SimConfig {
            seed,
            capacity_blocks: 24,
            prompt_families: 3,
            family_prompt_blocks: 2,
            max_suffix_blocks: 3,
            max_requests_per_step: 3,
            clear_every: Some(17),
            ..SimConfig::default()
        })
        .unwrap()
    };
    let mut engines: Vec<SimEngine> = (11..14).map(engine).collect();
    let mut gateway = Gateway::new(3, history_of(24), 4).with_engine_ranks(3);
    let mut subscribers: Vec<Subscriber> = (0..3).map(|_| Subscriber::join(&gateway)).collect();
    for step in 0..60usize {
        for (rank, engine) in (0..).zip(&mut engines) {
            gateway.send(rank, &engine.step());
        }
        if step % 23 == 22 {
            gateway.restart_engine(1);
            engines[1] = engine(step as u64);
        }
        gateway.cycle();
        // Three paces: keeping up, reconnecting now and then, falling behind.
        subscribers[0].read(&gateway, 12);
        subscribers[1].read(&gateway, step % 9);
        if step % 5 == 4 {
            subscribers[1].reconnect(&gateway);
        }
        if step % 13 == 12 {
            subscribers[2].read(&gateway, 8);
        }
    }
    assert!(
        subscribers[2].losses > 0,
        "the slow router fell behind the history"
    );
    for subscriber in &mut subscribers {
        subscriber.read_to_end(&gateway);
        // The simulated cache never stores a live block again: one copy each.
        subscriber.assert_holds(
            engines
                .iter()
                .map(|engine| engine.live_blocks().map(|hash| (hash as i64, 1)).collect()),
        );
    }
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
    /// The engine's load on a rank changes (with load records on).
    Load {
        rank: u32,
        running: u32,
    },
}

#[derive(Clone, Debug)]
struct Setup {
    ranks: u32,
    live_capacity: usize,
    history: HistoryLimits,
    max_batch_events: usize,
    subscribers: usize,
}

/// Subscribers never exceed this many, joins included.
const MAX_SUBSCRIBERS: usize = 5;

fn setup() -> impl Strategy<Value = Setup> {
    // Small histories (a batch here takes about 20 to 200 bytes) are what
    // idle routers fall out of: DATA_LOSS, OUT_OF_RANGE, the eviction edge.
    let history = prop_oneof![
        (2..=12usize).prop_map(history_of),
        (100..=1500usize).prop_map(|bytes| HistoryLimits {
            batches: UNBOUNDED_HISTORY.batches,
            bytes,
        }),
        Just(UNBOUNDED_HISTORY),
    ];
    (
        1..=3u32,
        1..=4usize,
        history,
        prop_oneof![Just(1usize), Just(2), Just(1024)],
        1..=3usize,
    )
        .prop_map(
            |(ranks, live_capacity, history, max_batch_events, subscribers)| Setup {
                ranks,
                live_capacity,
                history,
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
        3 => (0..3u32, 0..4u32).prop_map(|(rank, running)| Op::Load { rank, running }),
    ]
}

fn run(setup: &Setup, ops: &[Op], load_records: bool) {
    let mut gateway = Gateway::new(setup.live_capacity, setup.history, setup.max_batch_events)
        .with_engine_ranks(setup.ranks);
    if load_records {
        gateway = gateway.with_load_records(setup.ranks);
    }
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
            Op::Load { rank, running } => gateway.load_changes(rank % setup.ranks, *running),
        }
    }
    for subscriber in &mut subscribers {
        subscriber.read_to_end(&gateway);
        subscriber.assert_holds_the_engines_blocks(&gateway, setup.ranks);
    }
}

// 400 cases take about 3 s in a debug build. A failure shrinks to a short op
// list worth keeping as a focused test above, hence no regressions file.
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
        run(&setup, &ops, false);
    }

    #[test]
    fn a_router_always_ends_with_exactly_the_engines_blocks_with_load_records_on(
        setup in setup(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(&setup, &ops, true);
    }
}
