//! The drain: the one task that turns engine messages into published batches.
//!
//! Invariants: it is the only writer of sequence numbers, history and state;
//! it never waits on a subscriber. Each drain cycle takes the message that
//! woke it plus whatever is already queued (bounded), converts it, packs the
//! events into batches per rank, and publishes them before waiting again, so
//! an idle engine adds no delay.
//!
//! With several ranks, emission is paced: between two consecutive rank-0
//! batches every other rank gets at most one batch (an empty rank-0 batch is
//! inserted when needed). A router resuming from rank 0's cursor alone then
//! never receives another rank's batch below that rank's own cursor.
//!
//! With a state directory, each cycle's batches are written to the store's
//! log before any of them is announced, with the engine publishers' resume
//! points as of the cycle's end: the drain hands the cycle to the log
//! writer thread and goes on with the next payloads, and announces the
//! cycle when the writer hands it back, or once `--state-io-timeout-ms`
//! has passed without it (persistence then pauses; see `crate::store`). What must not
//! name a position or a sequence number subscribers have not been given (a
//! snapshot cut, a checkpoint's cut, a `load_only` batch) waits for a quiet
//! point, when every cycle handed over is announced; while one waits, the
//! drain takes no engine message, so the wait ends under any load.
//!
//! In an engine of several ranks, one rank's restart or own clear goes out
//! as removals of every block the rank held, never as a clear (a router
//! clears the whole worker on any clear): the rank's blocks leave the state
//! at once and their removals go out a cycle's budget at a time, while
//! whatever comes meanwhile waits behind them, so no removal can overtake
//! a store of the rank's new incarnation. A resync of every rank, or a
//! clear a router-side source sends, is the worker's whole cache: one clear.
//!
//! With load records on, every batch carries its rank's latest record,
//! stamped as it is encoded, and `load_only` batches go out between cycles
//! (see `crate::load::records`); they take no sequence number and no place
//! in the history.

pub mod batcher;
mod rank_counters;
pub(crate) mod sequence;
#[cfg(test)]
mod several_ranks_tests;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::clock::unix_now;
use crate::convert::{Converter, Forwarded, StoredBlocks, Tally, TranscodedPayload};
use crate::hub::{CutRequest, FramedBatch, HubWriter, RankReport};
use crate::load::LoadSource;
use crate::load::records::LoadRecords;
use crate::metrics::{Metrics, RankGauges};
use crate::proto::common::{KvCacheEvent, kv_cache_event::Data};
use crate::source::continuity::ResumePoint;
use crate::source::{EngineMessage, SourceEvent};
use crate::state::LiveState;
use crate::state::retraction::Retraction;
use crate::state::snapshot::SnapshotCut;
use crate::store::{LogCycle, LogThread, RankMark};
use crate::wire::OpenBatch;
use crate::wire::batch::ROUTER_MAX_MESSAGE_BYTES;
use batcher::{BatchLimits, Batcher, Output};
use prost::Message;
pub use rank_counters::DROPPED_EVENTS;
use rank_counters::RankCounters;

/// The `events_dropped` reason of an event (or piece of one: a single block)
/// larger than any message the router accepts.
pub const OVERSIZED_EVENT: &str = "oversized_event";
use sequence::Sequencer;

/// Upper bound on engine messages folded into one drain cycle, so a flood
/// cannot hold finished batches back.
const MAX_MESSAGES_PER_CYCLE: usize = 256;

/// Copies of a retracted rank's blocks named per drain cycle: about what a
/// cycle of engine messages stores (256 payloads of 256 blocks), so a
/// rank of millions of blocks holds the drain no longer than a cycle.
const RETRACTED_COPIES_PER_CYCLE: usize = 65_536;

/// How long a stopping drain waits for the state directory's last sync: a
/// share of the gateway's shutdown grace, so a hung disk cannot hold it.
const STORE_CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Bytes the store body buffer keeps between stores: a store of about
/// 1,000 blocks of 16 tokens; an outsized store's room is not kept for good.
const STORE_BODY_KEPT_BYTES: usize = 64 << 10;

/// The one task that numbers, batches and publishes every engine event.
pub struct Drain {
    converter: Converter,
    /// The payload being ingested (its buffers reused from one to the next).
    transcoded: TranscodedPayload,
    /// The encoded body of the transcoded store being batched.
    store_body: Vec<u8>,
    sequencer: Sequencer,
    limits: BatchLimits,
    batchers: BTreeMap<u32, Batcher>,
    /// Full batches of this cycle in the order they filled: (rank, batch).
    ready: Vec<(u32, OpenBatch)>,
    /// Ranks other than 0 that got a batch since rank 0's last one.
    since_rank0: BTreeSet<u32>,
    /// Ranks whose publisher restarted and that still owe subscribers a clear.
    owe_clear: BTreeSet<u32>,
    /// Every rank started over (a resync of an engine of several ranks):
    /// one clear is owed, before the next events of any rank.
    owe_worker_clear: bool,
    /// The engine's data-parallel ranks: with several (or once a rank other
    /// than 0 holds blocks), a rank's restart or own clear is sent as
    /// removals of its blocks (`retracting`).
    engine_ranks: u32,
    /// The rank whose blocks are going out as removals, a cycle's budget at
    /// a time. One at most: whatever could start another waits behind it.
    retracting: Option<(u32, Retraction)>,
    /// What came while removals were still going out, in order: it follows
    /// them. Engine messages are not taken meanwhile, so this holds at most
    /// one cycle's messages and the rest of one payload.
    deferred: VecDeque<Deferred>,
    /// The publisher marks of ranks still catching up, logged only once
    /// they are: a kvgate stopped midway then resumes the publisher from
    /// before the restart or clear, sees it again and sends the removals
    /// it had not.
    held_marks: BTreeMap<u32, HeldMark>,
    state: LiveState,
    /// The first engine sequence number seen per rank since its publisher
    /// (re)started: that many engine messages came before kvgate's record.
    first_engine_sequence: BTreeMap<u32, u64>,
    hub: HubWriter,
    metrics: Metrics,
    /// Each rank's counters, resolved at its first message.
    rank_counters: BTreeMap<u32, RankCounters>,
    /// Each rank's report gauges, resolved at its first report.
    rank_gauges: BTreeMap<u32, RankGauges>,
    /// The reports `/status` showed before the current ones: refilled in
    /// place when no reader still holds them, so a cycle's report
    /// allocates nothing.
    spare_reports: Option<Arc<Vec<RankReport>>>,
    /// The ranks of a report (reused from cycle to cycle).
    report_ranks: Vec<u32>,
    /// The engine's load, when kvgate polls it or the engine pushes it.
    records: Option<LoadRecords>,
    /// This cycle's batches, numbered and encoded, announced at its end.
    outgoing: Vec<(u32, u64, FramedBatch)>,
    /// The state directory's log writer, when kvgate keeps one.
    store: Option<LogThread>,
    /// A snapshot request that came while cycles were out to the log.
    waiting_cut: Option<CutRequest>,
    /// `load_only` batches came due while cycles were out to the log.
    load_waiting: bool,
    /// Where each publisher's record ends (kept only with a store).
    resume_points: BTreeMap<u32, ResumePoint>,
    /// The last message of each rank this cycle (only with a store): its
    /// resume point is taken once, at the cycle's end.
    cycle_last: BTreeMap<u32, (u64, bytes::Bytes)>,
    /// A resume point changed this cycle.
    marks_changed: bool,
}

impl Drain {
    /// A drain numbering every rank from `sequence_seed`, publishing into `hub`.
    pub fn new(limits: BatchLimits, sequence_seed: u64, hub: HubWriter, metrics: Metrics) -> Self {
        Self {
            converter: Converter::new(),
            transcoded: TranscodedPayload::default(),
            store_body: Vec::new(),
            sequencer: Sequencer::new(sequence_seed),
            limits,
            batchers: BTreeMap::new(),
            ready: Vec::new(),
            since_rank0: BTreeSet::new(),
            owe_clear: BTreeSet::new(),
            owe_worker_clear: false,
            engine_ranks: 1,
            retracting: None,
            deferred: VecDeque::new(),
            held_marks: BTreeMap::new(),
            state: LiveState::default(),
            first_engine_sequence: BTreeMap::new(),
            hub,
            metrics,
            rank_counters: BTreeMap::new(),
            rank_gauges: BTreeMap::new(),
            spare_reports: None,
            report_ranks: Vec::new(),
            records: None,
            outgoing: Vec::new(),
            store: None,
            waiting_cut: None,
            load_waiting: false,
            resume_points: BTreeMap::new(),
            cycle_last: BTreeMap::new(),
            marks_changed: false,
        }
    }

    /// Continues what a state directory kept (history, live state, each
    /// rank's last number under the same numbering, each publisher's mark)
    /// and logs every cycle into it. The drain must have been made with
    /// `opened.seed()` and have published nothing yet.
    pub fn with_state_dir(mut self, opened: crate::store::Opened) -> Self {
        let restored = opened.restored;
        self.hub.restore(restored.next_position, restored.history);
        if let Some((_, last_sequences)) = &restored.numbering {
            self.sequencer.resume(last_sequences);
        }
        self.state = restored.state;
        for (rank, mark) in restored.marks {
            self.first_engine_sequence.insert(rank, mark.first);
            self.resume_points.insert(rank, mark.resume);
        }
        // Whatever the old process paced, the next other rank's batch
        // follows a rank-0 batch of this one.
        self.since_rank0 = self
            .sequencer
            .ranks()
            .chain(self.state.ranks())
            .filter(|&rank| rank != 0)
            .collect();
        self.store = Some(opened.log);
        self
    }

    /// Follows an engine of `ranks` data-parallel ranks (1 unless told).
    pub fn with_engine_ranks(mut self, ranks: u32) -> Self {
        self.engine_ranks = ranks;
        self
    }

    /// Stamps load records on the batches and sends `load_only` batches.
    pub fn with_load_records(mut self, records: LoadRecords) -> Self {
        self.records = Some(records);
        self
    }

    /// Runs until every source sender is gone, then closes the hub so each
    /// subscriber's stream ends cleanly.
    ///
    /// Once `stop` is cancelled it ends at once, leaving what is still
    /// queued: after a restart every subscriber starts over from a snapshot
    /// of the new incarnation anyway, so publishing a backlog would only
    /// delay the clean end of every stream (a flooded queue takes seconds).
    /// Dropping the input also ends the sources, whose next send fails.
    pub async fn run(mut self, mut events: mpsc::Receiver<SourceEvent>, stop: CancellationToken) {
        // One wait for the whole run: a fresh one each cycle would register
        // a waiter with the token and remove it again, two locks a cycle.
        let mut stopped = std::pin::pin!(stop.cancelled());
        loop {
            // Cuts are taken between cycles, when everything applied to the
            // state has been published (with a store: announced).
            self.collect_written();
            let out = self.store.as_ref().map_or(0, LogThread::out);
            let written = self.store.as_ref().map(LogThread::written_signal);
            let deadline = self.store.as_ref().and_then(LogThread::deadline);
            let takes_events = self.takes_events();
            let takes_cuts = self.waiting_cut.is_none();
            let takes_load = !self.load_waiting;
            let catching_up = self.catching_up();
            tokio::select! {
                biased;
                () = &mut stopped => break,
                () = written_signal(written), if out > 0 => {}
                () = log_deadline(deadline), if deadline.is_some() => {}
                request = self.hub.next_cut_request(), if takes_cuts => self.answer(request),
                () = load_wake(&mut self.records), if takes_load => self.load_woke(),
                // A cut or `load_only` batch waiting for a quiet point waits
                // for the removals too, so they go on: a bounded number.
                () = std::future::ready(()), if catching_up && self.log_has_room() => {
                    self.catch_up_step();
                    self.end_cycle();
                    self.answer_waiting_cut();
                }
                first = events.recv(), if takes_events => {
                    let Some(first) = first else { break };
                    self.ingest(first);
                    for _ in 1..MAX_MESSAGES_PER_CYCLE {
                        if self.catching_up() {
                            break;
                        }
                        match events.try_recv() {
                            Ok(event) => self.ingest(event),
                            Err(_) => break,
                        }
                    }
                    self.end_cycle();
                }
            }
        }
        self.hub.close();
        // The writer finishes what it has, then the last fsync: both wait
        // for the disk, never on an async worker, and the drain waits for
        // them no longer than `STORE_CLOSE_GRACE` (a hung disk's threads are
        // left behind: the process exits without them).
        if let Some(store) = self.store.take() {
            let closing = tokio::task::spawn_blocking(move || store.close());
            match tokio::time::timeout(STORE_CLOSE_GRACE, closing).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => warn!(%error, "state directory: the last sync did not finish"),
                Err(_) => warn!(
                    "state directory: the last sync did not finish within {STORE_CLOSE_GRACE:?}; left behind"
                ),
            }
        }
    }

    /// No cycle is out to the log: every position and sequence number
    /// assigned has been announced.
    fn quiet(&self) -> bool {
        self.store.as_ref().is_none_or(|store| store.out() == 0)
    }

    /// Whether `run` takes engine messages now: not while a rank's
    /// removals are still going out, nor while something waits for a quiet
    /// point, nor while the log writer is `LOG_QUEUE` behind.
    fn takes_events(&self) -> bool {
        !self.catching_up()
            && self.store_takes_cycles()
            && self
                .store
                .as_ref()
                .is_none_or(|store| !store.wants_checkpoint())
    }

    /// Whether the store takes another cycle now: not while the log writer
    /// is `LOG_QUEUE` behind, nor while something waits for a quiet point.
    fn store_takes_cycles(&self) -> bool {
        self.log_has_room() && self.waiting_cut.is_none() && !self.load_waiting
    }

    /// The log writer (if any) is less than `LOG_QUEUE` cycles behind.
    fn log_has_room(&self) -> bool {
        self.store.as_ref().is_none_or(|store| !store.is_full())
    }

    /// A rank's removals are still going out, or what came meanwhile still
    /// waits behind them.
    fn catching_up(&self) -> bool {
        self.retracting.is_some() || !self.deferred.is_empty()
    }

    /// Sends the next removals of the rank being retracted, a cycle's
    /// budget of them; once none is left, takes what waited, and then logs
    /// the marks held meanwhile.
    fn catch_up_step(&mut self) {
        if let Some((rank, retraction)) = &mut self.retracting {
            let rank = *rank;
            let mut removals = Vec::new();
            let done =
                retraction.step(RETRACTED_COPIES_PER_CYCLE, |removal| removals.push(removal));
            if done && let Some((_, retraction)) = self.retracting.take() {
                crate::state::free(retraction.into_blocks());
            }
            let timestamp = unix_now();
            for removal in removals {
                self.push_unrecorded(rank, removal, timestamp);
            }
            return;
        }
        while self.retracting.is_none()
            && let Some(deferred) = self.deferred.pop_front()
        {
            match deferred {
                Deferred::Source(event) => self.ingest_now(event),
                Deferred::EngineEvents {
                    rank,
                    timestamp,
                    events,
                } => self.push_engine_events(rank, events, timestamp),
            }
        }
        if !self.catching_up() {
            for (rank, held) in std::mem::take(&mut self.held_marks) {
                match held {
                    HeldMark::Forget => self.forget_marks(rank),
                    HeldMark::Last(last) => {
                        self.cycle_last.insert(rank, last);
                    }
                }
            }
        }
    }

    /// The engine has several ranks: it was configured so, or a rank other
    /// than 0 holds blocks (a state directory written under a larger
    /// `--dp-size`).
    fn several_ranks(&self) -> bool {
        self.engine_ranks > 1 || self.state.ranks().any(|rank| rank != 0)
    }

    /// Answers a snapshot request at once when every position assigned is
    /// announced and no rank is mid-removal (a cut then would hold neither
    /// the blocks the stream still has nor their removals); else later.
    fn answer(&mut self, request: CutRequest) {
        self.waiting_cut = Some(request);
        self.answer_waiting_cut();
    }

    fn answer_waiting_cut(&mut self) {
        if self.quiet()
            && !self.catching_up()
            && let Some(request) = self.waiting_cut.take()
        {
            request.answer(self.cut());
        }
    }

    /// The load records need the drain: `load_only` batches are numbered
    /// from the last sequence assigned, so they go out at a quiet point.
    fn load_woke(&mut self) {
        if self.quiet() {
            self.send_load_records();
            self.report();
        } else {
            self.load_waiting = true;
        }
    }

    /// The state now, with each known rank's last sequence number. With a
    /// state directory, only at a quiet point (after `settle`).
    pub fn cut(&self) -> SnapshotCut {
        debug_assert!(self.quiet(), "a cut names only announced positions");
        let mut last_sequences = BTreeMap::new();
        for rank in self.sequencer.ranks().chain(self.state.ranks()) {
            last_sequences.insert(rank, self.sequencer.last(rank));
        }
        SnapshotCut {
            state: self.state.cut(),
            last_sequences,
            position: self.hub.next_position() - 1,
            // A publisher's first number is whatever it sent: never let a
            // wild one wrap the total.
            unknown_before: self
                .first_engine_sequence
                .values()
                .fold(0, |total: u64, &first| total.saturating_add(first)),
        }
    }

    /// Handles one source event; batches that fill up wait in `ready`.
    /// While a rank's removals are still going out, it waits behind them.
    pub fn ingest(&mut self, event: SourceEvent) {
        if self.catching_up() {
            self.deferred.push_back(Deferred::Source(event));
        } else {
            self.ingest_now(event);
        }
    }

    fn ingest_now(&mut self, event: SourceEvent) {
        match event {
            SourceEvent::Message(message) => self.ingest_message(message),
            SourceEvent::PublisherRestarted { rank } => self.restart_rank(rank),
            SourceEvent::Events {
                rank,
                timestamp,
                events,
            } => self.push_events(rank, events, timestamp),
            SourceEvent::Resync => {
                let ranks: BTreeSet<u32> =
                    self.sequencer.ranks().chain(self.state.ranks()).collect();
                if self.several_ranks() {
                    for &rank in &ranks {
                        self.close_batch(rank);
                        self.state.reset_rank(rank);
                        self.forget_publisher(rank);
                    }
                    self.owe_worker_clear = true;
                } else {
                    for rank in ranks {
                        self.restart_rank(rank);
                    }
                }
            }
        }
    }

    /// Everything known about `rank`'s cache is void. With one rank,
    /// subscribers get an ownerless clear before its next events; with
    /// several, removals of every block it held.
    fn restart_rank(&mut self, rank: u32) {
        // What the old engine sent still goes out, then the clear.
        self.close_batch(rank);
        if !self.several_ranks() {
            self.owe_clear.insert(rank);
            self.state.reset_rank(rank);
            self.forget_publisher(rank);
        } else if self.retract(rank) {
            self.converter.forget_rank(rank);
            self.held_marks.insert(rank, HeldMark::Forget);
        } else {
            self.forget_publisher(rank);
        }
    }

    /// Takes `rank`'s blocks out of the state, their removals to go out
    /// after what the rank sent before; `false` when it held none, so
    /// nothing need wait.
    fn retract(&mut self, rank: u32) -> bool {
        self.close_batch(rank);
        let Some(blocks) = self.state.take_rank(rank) else {
            return false;
        };
        self.retracting = Some((rank, Retraction::of(blocks)));
        true
    }

    /// Forgets what was known of `rank`'s publisher: its cache groups and
    /// where kvgate's record of it begins and ends.
    fn forget_publisher(&mut self, rank: u32) {
        self.converter.forget_rank(rank);
        self.forget_marks(rank);
    }

    /// Forgets where kvgate's record of `rank`'s publisher begins and ends.
    fn forget_marks(&mut self, rank: u32) {
        self.first_engine_sequence.remove(&rank);
        if self.store.is_some() {
            self.resume_points.remove(&rank);
            self.cycle_last.remove(&rank);
            self.marks_changed = true;
        }
    }

    fn ingest_message(&mut self, message: EngineMessage) {
        let rank = message.rank;
        self.first_engine_sequence
            .entry(rank)
            .or_insert(message.engine_sequence);
        let before = if self.store.is_some() {
            self.cycle_last
                .insert(rank, (message.engine_sequence, message.payload.clone()))
        } else {
            None
        };
        let mut tally = Tally::default();
        let mut transcoded = std::mem::take(&mut self.transcoded);
        let converted =
            self.converter
                .transcode(rank, &message.payload, &mut tally, &mut transcoded);
        let metrics = &self.metrics;
        self.rank_counters
            .entry(rank)
            .or_insert_with(|| RankCounters::new(metrics, rank))
            .record(&tally, metrics);
        if let Err(error) = converted {
            self.transcoded = transcoded;
            self.metrics.count_bad_message(error.reason());
            crate::logging::rate_limited(error.reason(), || {
                warn!(rank, engine_sequence = message.engine_sequence, %error, "engine payload skipped");
            });
            return;
        }
        if let Some(claimed) = transcoded.dp_rank.filter(|claimed| *claimed != rank) {
            crate::logging::rate_limited("rank_mismatch", || {
                warn!(
                    rank,
                    claimed,
                    "payload names another dp_rank than its socket; numbering by the socket's rank"
                );
            });
        }
        self.push_transcoded(rank, &mut transcoded);
        self.transcoded = transcoded;
        if self.catching_up() && self.store.is_some() && !self.held_marks.contains_key(&rank) {
            // The payload cleared the rank: its mark waits until the
            // removals and the payload's rest are out.
            if let Some(last) = self.cycle_last.remove(&rank) {
                self.held_marks.insert(rank, HeldMark::Last(last));
            }
            if let Some(before) = before {
                self.cycle_last.insert(rank, before);
            }
        }
    }

    /// Batches one payload's events as `push_events` does; its removals,
    /// already encoded, go into the batch as they are, and its stores with
    /// their blocks' entries as they are.
    fn push_transcoded(&mut self, rank: u32, payload: &mut TranscodedPayload) {
        let timestamp = payload.timestamp;
        // An engine's own clear stands for the one owed only where it goes
        // out as a clear: in an engine of one rank.
        let starts_with_clear = payload.starts_with_ownerless_clear() && !self.several_ranks();
        if self.pay_owed_clear(rank, starts_with_clear, timestamp) && self.several_ranks() {
            // The whole worker's clear: nothing any rank sends next may
            // reach a router before it.
            self.close_batch(rank);
        }
        self.state.prefetch_lookups(rank, payload.lookups());
        // After a rank's own clear in an engine of several ranks, the rest
        // of the payload waits behind the clear's removals.
        let mut after_clear: Option<Vec<KvCacheEvent>> = None;
        payload.drain(|event| {
            if let Some(rest) = &mut after_clear {
                rest.push(owned(event));
                return;
            }
            match event {
                Forwarded::Event(event) if self.several_ranks() && is_clear(&event) => {
                    if self.retract(rank) {
                        after_clear = Some(Vec::new());
                    }
                }
                Forwarded::Event(event) => self.push_event(rank, event, timestamp),
                Forwarded::Store { event, blocks } => {
                    self.push_store(rank, event, blocks, timestamp);
                }
                Forwarded::Removal { body, tier, hashes } => {
                    if self.push_encoded(rank, body, timestamp) {
                        self.state.remove_blocks(rank, tier, hashes);
                    } else {
                        self.push_decoded(rank, body, timestamp);
                    }
                }
            }
        });
        if let Some(rest) = after_clear {
            self.defer_rest(rank, rest, timestamp);
        }
    }

    /// Puts the rest of `rank`'s payload after a clear first in line behind
    /// the clear's removals.
    fn defer_rest(&mut self, rank: u32, events: Vec<KvCacheEvent>, timestamp: f64) {
        if !events.is_empty() {
            self.deferred.push_front(Deferred::EngineEvents {
                rank,
                timestamp,
                events,
            });
        }
    }

    /// Events of an engine's payload, as `push_transcoded` batches them:
    /// a rank's own clear in an engine of several ranks becomes its
    /// removals, and what follows it waits behind them.
    fn push_engine_events(&mut self, rank: u32, events: Vec<KvCacheEvent>, timestamp: f64) {
        let mut events = events.into_iter();
        while let Some(event) = events.next() {
            if self.several_ranks() && is_clear(&event) {
                if !self.retract(rank) {
                    continue;
                }
                self.defer_rest(rank, events.collect(), timestamp);
                return;
            }
            self.push_event(rank, event, timestamp);
        }
    }

    /// Completes a transcoded store from the state, as `push_event` does,
    /// and batches it with its blocks' entries as the converter wrote them.
    fn push_store(
        &mut self,
        rank: u32,
        mut event: KvCacheEvent,
        blocks: StoredBlocks<'_>,
        timestamp: f64,
    ) {
        self.state.complete(rank, &mut event);
        let Some(Data::Stored(stored)) = &event.data else {
            unreachable!("a transcoded store is built as a store");
        };
        let mut body = std::mem::take(&mut self.store_body);
        blocks.encode_event(event.event_id, stored, &mut body);
        if self.push_encoded(rank, &body, timestamp) {
            let shared = (blocks.lora_id, blocks.cache_level);
            self.state.store_blocks(rank, stored, shared, blocks.iter());
            self.converter.recycle(&mut event);
        } else {
            self.push_decoded(rank, &body, timestamp);
        }
        body.clear();
        body.shrink_to(STORE_BODY_KEPT_BYTES);
        self.store_body = body;
    }

    /// Adds an event given as its encoded body to `rank`'s batch; `false`,
    /// having done nothing, when it is over `--max-batch-bytes`.
    fn push_encoded(&mut self, rank: u32, body: &[u8], timestamp: f64) -> bool {
        let ready = &mut self.ready;
        batcher_of(&mut self.batchers, rank, self.limits).push_encoded(
            body,
            timestamp,
            &mut |output| {
                if let Output::Batch(batch) = output {
                    ready.push((rank, batch));
                }
            },
        )
    }

    /// An encoded event over `--max-batch-bytes`, built again to be cut.
    fn push_decoded(&mut self, rank: u32, body: &[u8], timestamp: f64) {
        let event = KvCacheEvent::decode(body).expect("an event the drain wrote decodes");
        self.push_event(rank, event, timestamp);
    }

    /// Sends the clear a restarted rank (or, after a resync, the worker)
    /// owes before its first events, unless they start with one.
    /// `true` when it sent one.
    fn pay_owed_clear(&mut self, rank: u32, starts_with_clear: bool, timestamp: f64) -> bool {
        let owed = self.owe_clear.remove(&rank) | std::mem::take(&mut self.owe_worker_clear);
        let pays = owed && !starts_with_clear;
        if pays {
            self.push_event(rank, KvCacheEvent::ownerless_clear(), timestamp);
        }
        pays
    }

    /// Batches one message's events from a source that speaks the router's
    /// stream (an upstream gateway, a recording, a trace), after the clear
    /// owed, with the state's lookups for all of them fetched first. There
    /// a clear is the whole worker's, as a router takes it: in an engine of
    /// several ranks every other rank's batch closes before it, so what they
    /// sent before goes out first, and its own batch closes after the
    /// message, so what any rank sends next goes out after it.
    fn push_events(&mut self, rank: u32, events: Vec<KvCacheEvent>, timestamp: f64) {
        let several = self.several_ranks();
        let starts_with_clear = events.first().is_some_and(KvCacheEvent::is_ownerless_clear);
        let mut worker_cleared = self.pay_owed_clear(rank, starts_with_clear, timestamp) && several;
        self.state.prefetch(rank, &events);
        for event in events {
            if several && is_clear(&event) {
                self.close_other_batches(rank);
                worker_cleared = true;
            }
            self.push_event(rank, event, timestamp);
        }
        if worker_cleared {
            self.close_batch(rank);
        }
    }

    /// Closes every rank's batch but `rank`'s.
    fn close_other_batches(&mut self, rank: u32) {
        let others: Vec<u32> = self
            .batchers
            .keys()
            .copied()
            .filter(|&other| other != rank)
            .collect();
        for other in others {
            self.close_batch(other);
        }
    }

    /// Batches a removal of blocks already taken out of the state.
    fn push_unrecorded(&mut self, rank: u32, event: KvCacheEvent, timestamp: f64) {
        let ready = &mut self.ready;
        let metrics = &self.metrics;
        batcher_of(&mut self.batchers, rank, self.limits).push(event, timestamp, &mut |output| {
            match output {
                Output::Batch(batch) => ready.push((rank, batch)),
                Output::Sent(_) => {}
                Output::Oversized { .. } => metrics.count_dropped_events(OVERSIZED_EVENT, 1),
            }
        });
    }

    /// Completes `event` from the state, batches it, and records in the
    /// state what was sent: a piece too large for any batch is counted and
    /// left out of both, so a snapshot never carries what the stream did not.
    fn push_event(&mut self, rank: u32, mut event: KvCacheEvent, timestamp: f64) {
        self.state.complete(rank, &mut event);
        let limits = self.limits;
        let (ready, state, converter, metrics) = (
            &mut self.ready,
            &mut self.state,
            &mut self.converter,
            &self.metrics,
        );
        batcher_of(&mut self.batchers, rank, limits).push(event, timestamp, &mut |output| {
            match output {
                Output::Batch(batch) => ready.push((rank, batch)),
                Output::Sent(event) => {
                    state.record(rank, event);
                    converter.recycle(event);
                }
                Output::Oversized { event, bytes } => {
                    metrics.count_dropped_events(OVERSIZED_EVENT, 1);
                    crate::logging::rate_limited(OVERSIZED_EVENT, || {
                        warn!(
                            rank,
                            event_id = event.event_id,
                            bytes,
                            limit = ROUTER_MAX_MESSAGE_BYTES,
                            "event dropped: larger than any message the router accepts"
                        );
                    });
                }
            }
        });
    }

    fn close_batch(&mut self, rank: u32) {
        if let Some(batch) = self.batchers.get_mut(&rank).and_then(Batcher::close) {
            self.ready.push((rank, batch));
        }
    }

    /// Publishes every batch of this cycle, including partly filled ones.
    ///
    /// With a state directory the batches are handed to the log writer and
    /// announced once written: by a later `flush`, or by `settle`, which
    /// waits for them. It waits for the writer itself only when the writer
    /// is `LOG_QUEUE` cycles behind or asks for a checkpoint's cut (with no
    /// `run` loop, nothing else would reach a quiet point).
    pub fn flush(&mut self) {
        self.end_cycle();
        while self.catching_up() {
            self.catch_up_step();
            self.end_cycle();
        }
        if self
            .store
            .as_ref()
            .is_some_and(|store| store.is_full() || store.wants_checkpoint())
        {
            self.settle();
        }
    }

    /// Waits until every cycle handed to the log writer is written and
    /// announced, then does what waited for that quiet point. Blocks the
    /// calling thread: for tests and benches (`run` waits asynchronously).
    pub fn settle(&mut self) {
        while let Some(cycle) = self.store.as_mut().and_then(LogThread::wait_written) {
            self.announce(cycle);
        }
        self.at_quiet_point();
    }

    /// Closes this cycle's batches and numbers them; without a store
    /// announces them, with one hands them to the log writer.
    fn end_cycle(&mut self) {
        // A restarted rank that sent nothing since still gets its clear now.
        for rank in std::mem::take(&mut self.owe_clear) {
            self.push_event(rank, KvCacheEvent::ownerless_clear(), unix_now());
        }
        if std::mem::take(&mut self.owe_worker_clear) {
            self.push_event(0, KvCacheEvent::ownerless_clear(), unix_now());
        }
        for (&rank, batcher) in &mut self.batchers {
            if let Some(batch) = batcher.close() {
                self.ready.push((rank, batch));
            }
        }
        for (rank, batch) in std::mem::take(&mut self.ready) {
            self.publish(rank, batch);
        }
        if self.store.is_some() {
            self.log_cycle();
            self.collect_written();
            // Counted only when the drain does stop: what was written
            // meanwhile has just been collected.
            if self.store.as_ref().is_some_and(LogThread::is_full) {
                self.metrics.state_log_queue_full.inc();
            }
        } else {
            for (rank, sequence, framed) in self.outgoing.drain(..) {
                self.hub.publish(rank, sequence, framed);
            }
            self.send_load_records();
        }
        self.report();
    }

    /// Hands this cycle to the log writer (if it published a batch or took
    /// an engine message), with each publisher's mark as of its end.
    fn log_cycle(&mut self) {
        let Some(store) = &mut self.store else {
            return;
        };
        for (rank, (sequence, payload)) in std::mem::take(&mut self.cycle_last) {
            self.resume_points
                .insert(rank, ResumePoint::of(sequence, &payload));
            self.marks_changed = true;
        }
        if self.outgoing.is_empty() && !self.marks_changed {
            return;
        }
        let (first_engine_sequence, resume_points) =
            (&self.first_engine_sequence, &self.resume_points);
        store.hand_over(&mut self.outgoing, |out| {
            out.extend(marks(first_engine_sequence, resume_points));
        });
        self.marks_changed = false;
    }

    /// Announces every cycle the log writer has handed back (never waits),
    /// and, once none is out, does what waited for a quiet point.
    fn collect_written(&mut self) {
        while let Some(cycle) = self.store.as_mut().and_then(LogThread::try_written) {
            self.announce(cycle);
        }
        if self.store.is_some() && self.quiet() {
            self.at_quiet_point();
        }
    }

    /// Announces a written cycle's batches.
    fn announce(&mut self, mut cycle: LogCycle) {
        debug_assert!(
            cycle.batches.is_empty() || cycle.first_position == self.hub.next_position(),
            "a cycle is announced at the positions it was logged under"
        );
        for (rank, sequence, framed) in cycle.batches.drain(..) {
            self.hub.publish(rank, sequence, framed);
        }
        if let Some(store) = &mut self.store {
            store.history_oldest(self.hub.history_oldest());
            store.recycle(cycle);
        }
    }

    /// With a store and no cycle out: answers a waiting snapshot request,
    /// sends waiting `load_only` batches, hands a cut to the checkpoint
    /// thread if the writer asks for one.
    fn at_quiet_point(&mut self) {
        self.answer_waiting_cut();
        if std::mem::take(&mut self.load_waiting) {
            self.send_load_records();
            self.report();
        }
        // A checkpoint must not leave out blocks whose removals are not out.
        if !self.catching_up() && self.store.as_ref().is_some_and(LogThread::wants_checkpoint) {
            let cut = self.cut();
            let marks = marks(&self.first_engine_sequence, &self.resume_points).collect();
            if let Some(store) = &mut self.store {
                store.checkpoint(cut, marks);
            }
        }
    }

    /// Sends the `load_only` batches due: record changes no batch carried,
    /// and heartbeats.
    fn send_load_records(&mut self) {
        let Some(records) = &mut self.records else {
            return;
        };
        let now = tokio::time::Instant::now();
        records.refresh(now);
        for (rank, record) in records.due(now) {
            let sent = self.sequencer.sent(rank);
            let encoded = OpenBatch::with_timestamp(unix_now())
                .carrying_load(&record.load)
                .encode(rank, sent.unwrap_or(0), None);
            self.metrics.count_load_record(record.source.as_str());
            self.metrics.load_only_batches.inc();
            self.hub.publish_load_only(sent.is_none(), encoded);
        }
    }

    /// Updates the per-rank figures of `/status` and the metrics.
    fn report(&mut self) {
        let ranks = &mut self.report_ranks;
        ranks.clear();
        ranks.extend(self.sequencer.ranks().chain(self.state.ranks()));
        if let Some(records) = &self.records {
            let loaded = (0u32..).zip(records.sources());
            ranks.extend(loaded.filter_map(|(rank, source)| source.map(|_| rank)));
        }
        ranks.sort_unstable();
        ranks.dedup();
        let mut reports = self.spare_reports.take().unwrap_or_default();
        if Arc::get_mut(&mut reports).is_none() {
            // A `/status` reader still holds them.
            reports = Arc::default();
        }
        let filled = Arc::get_mut(&mut reports).expect("held by nobody else");
        filled.clear();
        filled.extend(ranks.iter().map(|&rank| {
            RankReport {
                rank,
                last_sequence: self.sequencer.last(rank),
                blocks: self
                    .state
                    .rank(rank)
                    .map(|blocks| *blocks.counts())
                    .unwrap_or_default(),
                load_source: self
                    .records
                    .as_ref()
                    .and_then(|records| records.source(rank))
                    .map(LoadSource::as_str),
            }
        }));
        for report in filled.iter() {
            self.rank_gauges
                .entry(report.rank)
                .or_insert_with(|| {
                    let tiers = report.blocks.reported().map(|(tier, _)| tier);
                    self.metrics.rank_gauges(report.rank, tiers)
                })
                .set(report.last_sequence, report.blocks.reported());
        }
        self.metrics
            .history_bytes
            .set(self.hub.history_bytes() as i64);
        self.spare_reports = Some(self.hub.report(reports));
    }

    fn publish(&mut self, rank: u32, batch: OpenBatch) {
        if rank == 0 {
            self.since_rank0.clear();
        } else if !self.since_rank0.insert(rank) {
            // This rank already had its one batch since rank 0's last:
            // a rank-0 batch (empty) must come first.
            self.publish(0, OpenBatch::with_timestamp(unix_now()));
            self.since_rank0.insert(rank);
        }
        let sequence = self.sequencer.assign(rank);
        let event_count = batch.event_count();
        let load = self
            .records
            .as_mut()
            .and_then(|records| records.for_batch(rank, tokio::time::Instant::now()));
        let mut batch = match &load {
            Some(record) => {
                self.metrics.count_load_record(record.source.as_str());
                batch.carrying_load(&record.load)
            }
            None => batch,
        };
        let framed = FramedBatch::new(batch.finish(rank, sequence));
        if let Some(batcher) = self.batchers.get_mut(&rank) {
            batcher.recycle(batch);
        }
        self.metrics.batches_out.inc();
        self.metrics.events_out.inc_by(u64::from(event_count));
        self.metrics.bytes_out.inc_by(framed.message().len() as u64);
        self.outgoing.push((rank, sequence, framed));
    }
}

/// What waits behind a rank's removals.
enum Deferred {
    /// A source's event, ingested as it came.
    Source(SourceEvent),
    /// The rest of an engine payload after a rank's own clear.
    EngineEvents {
        rank: u32,
        timestamp: f64,
        events: Vec<KvCacheEvent>,
    },
}

/// A publisher mark held back while its rank catches up.
enum HeldMark {
    /// The publisher restarted: its mark is forgotten.
    Forget,
    /// The last message taken from it: its engine sequence and payload.
    Last((u64, bytes::Bytes)),
}

/// A clear, owned or not.
fn is_clear(event: &KvCacheEvent) -> bool {
    matches!(event.data, Some(Data::Cleared(_)))
}

/// A transcoded event as a `KvCacheEvent` of its own, to be batched later.
fn owned(event: Forwarded<'_>) -> KvCacheEvent {
    match event {
        Forwarded::Event(event) => event,
        Forwarded::Store { event, blocks } => {
            let Some(Data::Stored(stored)) = &event.data else {
                unreachable!("a transcoded store is built as a store");
            };
            let mut body = Vec::new();
            blocks.encode_event(event.event_id, stored, &mut body);
            KvCacheEvent::decode(body.as_slice()).expect("an event the drain wrote decodes")
        }
        Forwarded::Removal { body, .. } => {
            KvCacheEvent::decode(body).expect("an event the drain wrote decodes")
        }
    }
}

/// `rank`'s batcher, made on its first event.
fn batcher_of(
    batchers: &mut BTreeMap<u32, Batcher>,
    rank: u32,
    limits: BatchLimits,
) -> &mut Batcher {
    batchers.entry(rank).or_insert_with(|| Batcher::new(limits))
}

/// Each publisher's mark: where kvgate's record of it begins and ends.
fn marks<'a>(
    first_engine_sequence: &'a BTreeMap<u32, u64>,
    resume_points: &'a BTreeMap<u32, ResumePoint>,
) -> impl Iterator<Item = (u32, RankMark)> + 'a {
    resume_points.iter().map(|(&rank, &resume)| {
        let first = first_engine_sequence
            .get(&rank)
            .copied()
            .unwrap_or(resume.last);
        (rank, RankMark { first, resume })
    })
}

/// Returns at the log writer's deadline for its oldest cycle.
async fn log_deadline(deadline: Option<std::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}

/// Returns when the log writer hands a cycle back.
async fn written_signal(signal: Option<std::sync::Arc<tokio::sync::Notify>>) {
    match signal {
        Some(signal) => signal.notified().await,
        None => std::future::pending().await,
    }
}

/// Returns when the load records need the drain (never without them).
async fn load_wake(records: &mut Option<LoadRecords>) {
    match records {
        Some(records) => records.wake().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::{HistoryLimits, hub};
    use crate::proto::common::{KvBlock, KvBlocksStored, KvEventBatch, kv_cache_event::Data};
    use crate::state::tier::Tier;
    use batcher::tests::block;
    use prost::Message;

    /// Rank 0 stores `blocks` as event `event_id`, in a cycle of its own.
    fn store_in_one_cycle(drain: &mut Drain, event_id: u64, blocks: Vec<KvBlock>) {
        let store = KvCacheEvent {
            event_id,
            data: Some(Data::Stored(KvBlocksStored {
                blocks,
                ..Default::default()
            })),
        };
        drain.ingest(SourceEvent::Events {
            rank: 0,
            timestamp: 1.0,
            events: vec![store],
        });
        drain.flush();
    }

    #[test]
    fn a_block_too_large_for_the_router_is_counted_and_kept_out_of_the_state() {
        let (writer, reader) = hub(
            16,
            HistoryLimits {
                batches: 100,
                bytes: 64 << 20,
            },
        );
        let metrics = Metrics::default();
        let limits = BatchLimits {
            max_events: 1024,
            max_bytes: 4096,
        };
        let mut drain = Drain::new(limits, 1000, writer, metrics.clone());
        // 1.2M tokens of 4 varint bytes: 4.8 MB, between two ordinary blocks.
        store_in_one_cycle(
            &mut drain,
            1,
            vec![
                block(1, 16, 1),
                block(2, 1_200_000, 3_000_000),
                block(3, 16, 1),
            ],
        );
        let cut = drain.cut();
        let mut held: Vec<i64> = cut.state[&0]
            .tier(Tier::Device)
            .map(|(hash, _)| hash)
            .collect();
        held.sort_unstable();
        assert_eq!(held, vec![1, 3]);
        assert!(
            metrics
                .render()
                .contains("kvgate_events_dropped_total{reason=\"oversized_event\"} 1")
        );
        let (oldest, newest) = reader.history().span();
        let sent: usize = (oldest..=newest)
            .filter_map(|position| reader.history().get(position))
            .map(|batch| {
                KvEventBatch::decode(batch.encoded.clone())
                    .unwrap()
                    .events
                    .len()
            })
            .sum();
        assert_eq!(sent, 2, "the blocks around it were sent");
    }

    #[test]
    fn status_shows_every_cycle_and_a_report_a_reader_holds_is_never_refilled() {
        let (mut drain, reader) = drain_batching_up_to(4096);
        let cycle = |drain: &mut Drain, n: u64| {
            store_in_one_cycle(drain, n, vec![block(n as i64, 16, 1)]);
            let reports = reader.rank_reports();
            assert_eq!(reports.len(), 1);
            assert_eq!(reports[0].last_sequence, drain.sequencer.last(0));
            let blocks: u64 = reports[0].blocks.reported().map(|(_, n)| n).sum();
            assert_eq!(blocks, n);
        };
        cycle(&mut drain, 1);
        let first = Arc::as_ptr(&reader.shown_reports());
        cycle(&mut drain, 2);
        cycle(&mut drain, 3);
        assert_eq!(
            Arc::as_ptr(&reader.shown_reports()),
            first,
            "cycle 3 refilled the reports cycle 1 showed"
        );
        let held = reader.shown_reports();
        let shown = held.as_ref().clone();
        cycle(&mut drain, 4);
        cycle(&mut drain, 5);
        assert_eq!(*held, shown, "the held reports are untouched");
        assert_ne!(Arc::as_ptr(&reader.shown_reports()), Arc::as_ptr(&held));
    }

    /// A drain on a hub of its own, batches of at most `max_bytes`.
    fn drain_batching_up_to(max_bytes: usize) -> (Drain, crate::hub::HubReader) {
        let history = HistoryLimits {
            batches: 100,
            bytes: 64 << 20,
        };
        drain_keeping(history, max_bytes)
    }

    /// A drain on a hub of its own keeping `history`, batches of at most
    /// `max_bytes`.
    fn drain_keeping(history: HistoryLimits, max_bytes: usize) -> (Drain, crate::hub::HubReader) {
        let (writer, reader) = hub(64, history);
        let limits = BatchLimits {
            max_events: 1024,
            max_bytes,
        };
        (Drain::new(limits, 1, writer, Metrics::default()), reader)
    }

    #[test]
    fn a_removal_over_the_batch_byte_limit_is_cut_into_removals_and_removes_every_block() {
        use kvgate_sim::SimEvent;
        let (mut drain, reader) = drain_batching_up_to(4096);
        // 1,000 blocks, then one removal naming them all: about 10 kB of
        // hashes, more than a batch may hold.
        let hashes: Vec<u64> = (1..=1000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let mut events: Vec<SimEvent> = hashes
            .chunks(100)
            .map(|chunk| SimEvent::Stored {
                hashes: chunk.to_vec(),
                parent: None,
                tokens: vec![7; chunk.len()],
                block_size: 1,
            })
            .collect();
        events.push(SimEvent::Removed { hashes });
        for (engine_sequence, events) in [(0, &events[..10]), (1, &events[10..])] {
            let mut payload = Vec::new();
            kvgate_sim::encode_batch(1.0, events, Some(0), &mut payload);
            drain.ingest(SourceEvent::Message(EngineMessage {
                rank: 0,
                engine_sequence,
                payload: payload.into(),
            }));
            drain.flush();
        }
        assert!(held(&drain.cut()).is_empty(), "every block removed");
        assert!(
            replayed(&reader).is_empty(),
            "every block removed on the wire"
        );
        let (oldest, newest) = reader.history().span();
        let removals = (oldest..=newest)
            .flat_map(|position| {
                let batch = reader.history().get(position).unwrap();
                assert!(
                    batch.encoded.len() <= 4096 + 64,
                    "{} bytes",
                    batch.encoded.len()
                );
                KvEventBatch::decode(batch.encoded.clone()).unwrap().events
            })
            .filter(|event| matches!(event.data, Some(Data::Removed(_))))
            .count();
        assert!(removals > 1, "cut into {removals} removals");
    }

    /// The live blocks, with their tokens, that the batches in the history
    /// leave when replayed in order; every removal names a live block of
    /// the engine's medium.
    fn replayed(reader: &crate::hub::HubReader) -> BTreeMap<i64, Vec<u32>> {
        let (oldest, newest) = reader.history().span();
        let mut live = BTreeMap::new();
        for position in oldest..=newest {
            let batch = reader.history().get(position).unwrap();
            for event in KvEventBatch::decode(batch.encoded.clone()).unwrap().events {
                match event.data {
                    Some(Data::Stored(stored)) => {
                        assert_eq!(stored.medium.as_deref(), Some("GPU"));
                        for block in stored.blocks {
                            live.insert(block.block_hash, block.token_ids);
                        }
                    }
                    Some(Data::Removed(removed)) => {
                        assert_eq!(removed.medium.as_deref(), Some("GPU"));
                        for hash in removed.block_hashes {
                            assert!(live.remove(&hash).is_some(), "{hash} was not live");
                        }
                    }
                    other => panic!("unexpected event {other:?}"),
                }
            }
        }
        live
    }

    fn held(cut: &SnapshotCut) -> BTreeMap<i64, Vec<u32>> {
        cut.state[&0]
            .tier(Tier::Device)
            .map(|(hash, record)| (hash, record.encoded_block(hash).to_block().token_ids))
            .collect()
    }

    #[test]
    fn the_state_and_a_cut_taken_midway_hold_exactly_the_sent_blocks_while_buffers_serve_later_events()
     {
        use kvgate_sim::{SteadyState, WorkloadShape};
        let (mut drain, reader) = drain_batching_up_to(1 << 20);
        // An engine that evicts from its 5th payload on: every later one
        // stores 8 new blocks and removes 8, one removal event each.
        let shape = WorkloadShape {
            blocks_per_store: 8,
            block_size: 4,
            live_blocks: 32,
        };
        let mut workload = SteadyState::new(shape, 5);
        let mut ingest = |drain: &mut Drain, engine_sequence| {
            drain.ingest(SourceEvent::Message(EngineMessage {
                rank: 0,
                engine_sequence,
                payload: workload.next_payload(1.0, 0).into(),
            }));
            drain.flush();
        };
        for engine_sequence in 0..10 {
            ingest(&mut drain, engine_sequence);
        }
        let midway = drain.cut();
        let live_midway = replayed(&reader);
        for engine_sequence in 10..40 {
            ingest(&mut drain, engine_sequence);
        }
        let live_at_end = replayed(&reader);
        assert_eq!(live_midway.len(), 32);
        assert_eq!(live_at_end.len(), 32);
        assert!(
            live_midway
                .keys()
                .all(|hash| !live_at_end.contains_key(hash))
        );
        assert_eq!(held(&midway), live_midway, "the cut as it was");
        assert_eq!(held(&drain.cut()), live_at_end);
    }

    /// A store in vLLM's map form: `hashes` of 2 tokens each, chained under
    /// `parent`, with a LoRA name and a salt when given.
    fn store_payload(parent: Option<u64>, hashes: &[u64], named: Option<(&str, &str)>) -> Vec<u8> {
        use rmp::encode::*;
        let mut out = Vec::new();
        write_array_len(&mut out, 3).unwrap();
        write_f64(&mut out, 2.5).unwrap();
        write_array_len(&mut out, 1).unwrap();
        write_map_len(&mut out, if named.is_some() { 7 } else { 5 }).unwrap();
        write_str(&mut out, "type").unwrap();
        write_str(&mut out, "BlockStored").unwrap();
        write_str(&mut out, "block_hashes").unwrap();
        write_array_len(&mut out, hashes.len() as u32).unwrap();
        for &hash in hashes {
            write_uint(&mut out, hash).unwrap();
        }
        write_str(&mut out, "parent_block_hash").unwrap();
        match parent {
            Some(parent) => drop(write_uint(&mut out, parent).unwrap()),
            None => write_nil(&mut out).unwrap(),
        }
        write_str(&mut out, "token_ids").unwrap();
        write_array_len(&mut out, 2 * hashes.len() as u32).unwrap();
        for token in 0..2 * hashes.len() as u64 {
            write_uint(&mut out, token * 40_000).unwrap();
        }
        write_str(&mut out, "block_size").unwrap();
        write_uint(&mut out, 2).unwrap();
        if let Some((lora_name, cache_salt)) = named {
            write_str(&mut out, "lora_name").unwrap();
            write_str(&mut out, lora_name).unwrap();
            write_str(&mut out, "cache_salt").unwrap();
            write_str(&mut out, cache_salt).unwrap();
        }
        write_uint(&mut out, 0).unwrap();
        out
    }

    /// Every payload of the golden fixtures, a full engine's steady state,
    /// and chains whose later stores take their LoRA and salt from a parent.
    fn payloads_of_every_kind() -> Vec<Vec<u8>> {
        use kvgate_sim::{SteadyState, WorkloadShape};
        let mut payloads = Vec::new();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wire");
        for dir in std::fs::read_dir(root).unwrap() {
            let dir = dir.unwrap().path();
            if dir.is_dir() {
                let mut files: Vec<_> = std::fs::read_dir(dir)
                    .unwrap()
                    .map(|file| file.unwrap().path())
                    .filter(|path| path.extension().is_some_and(|e| e == "msgpack"))
                    .collect();
                files.sort();
                payloads.extend(files.into_iter().map(|path| std::fs::read(path).unwrap()));
            }
        }
        let shape = WorkloadShape {
            blocks_per_store: 8,
            block_size: 4,
            live_blocks: 32,
        };
        let mut workload = SteadyState::new(shape, 5);
        payloads.extend((0..20).map(|_| workload.next_payload(1.0, 0)));
        payloads.push(store_payload(None, &[1, 2], Some(("sql-lora", "tenant-a"))));
        payloads.push(store_payload(Some(2), &[3, 4, 5], None));
        payloads.push(store_payload(Some(5), &[6], Some(("other", "tenant-b"))));
        payloads.push(store_payload(Some(99), &[7], None));
        payloads
    }

    /// A drain fed `payloads` as engine messages, or (`as_built`) as the
    /// events `Converter::convert` builds of them: its history's batches
    /// and a snapshot's chunks at the end.
    fn ingested(
        max_bytes: usize,
        payloads: &[Vec<u8>],
        as_built: bool,
    ) -> (Vec<bytes::Bytes>, Vec<bytes::Bytes>) {
        use crate::state::snapshot::SnapshotEncoder;
        let history = HistoryLimits {
            batches: 100_000,
            bytes: 1 << 30,
        };
        let (mut drain, reader) = drain_keeping(history, max_bytes);
        let mut converter = Converter::new();
        for (engine_sequence, payload) in (0..).zip(payloads) {
            if as_built {
                if let Ok(converted) = converter.convert(0, payload, &mut Tally::default()) {
                    drain.ingest(SourceEvent::Events {
                        rank: 0,
                        timestamp: converted.timestamp,
                        events: converted.events,
                    });
                }
            } else {
                drain.ingest(SourceEvent::Message(EngineMessage {
                    rank: 0,
                    engine_sequence,
                    payload: payload.clone().into(),
                }));
            }
            drain.flush();
        }
        let (oldest, newest) = reader.history().span();
        let batches = (oldest..=newest)
            .map(|position| reader.history().get(position).unwrap().encoded.clone())
            .collect();
        let snapshot = SnapshotEncoder::plan(std::sync::Arc::new(drain.cut()), 1.0).collect();
        (batches, snapshot)
    }

    #[test]
    fn transcoded_stores_are_batched_and_recorded_byte_for_byte_as_built_ones() {
        let payloads = payloads_of_every_kind();
        for max_bytes in [64, 300, 1 << 20] {
            let (batches, snapshot) = ingested(max_bytes, &payloads, false);
            let (built_batches, built_snapshot) = ingested(max_bytes, &payloads, true);
            assert!(batches.len() > 50, "{} batches", batches.len());
            assert!(
                batches == built_batches,
                "the same batches, {max_bytes} bytes"
            );
            assert!(!snapshot.is_empty());
            assert!(
                snapshot == built_snapshot,
                "the same snapshot, {max_bytes} bytes"
            );
        }
        let (batches, _) = ingested(1 << 20, &payloads, false);
        let inherited = batches.iter().rev().find_map(|batch| {
            let events = KvEventBatch::decode(batch.clone()).unwrap().events;
            events.into_iter().find_map(|event| match event.data {
                Some(Data::Stored(stored)) if stored.blocks[0].block_hash == 3 => Some(stored),
                _ => None,
            })
        });
        let inherited = inherited.expect("the child store was sent");
        assert_eq!(inherited.lora_name.as_deref(), Some("sql-lora"));
        assert_eq!(inherited.cache_salt.as_deref(), Some("tenant-a"));
    }
}
