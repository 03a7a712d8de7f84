//! Packing converted events into outgoing batches.
//!
//! Invariants: a batch holds events of one rank only, at most `max_events`
//! of them, and either its encoded events take at most `max_bytes`, or it is
//! one event alone, larger than that but still a message the router accepts
//! (4 MiB). An event over `max_bytes` is cut, in one pass over its blocks,
//! into events of the same kind (a store into a parent-linked chain of
//! stores, a removal into several removals); a piece that is still too large
//! for a batch goes alone, and one too large for the router is reported and
//! dropped. Nothing is ever cut twice, so a push ends after work linear in
//! the event's size whatever the event. Events are encoded once as they
//! arrive (the pieces of a cut event once more); closing a batch only
//! prepends its header.

use prost::Message;
use prost::encoding;

use crate::proto::common::{KvBlocksRemoved, KvBlocksStored, KvCacheEvent, kv_cache_event::Data};
use crate::wire::batch::{EventLen, MAX_EVENTS_BYTES, OpenBatch};
use crate::wire::event::{BLOCKS_FIELD, BlockFields, encode_event};

/// Limits of one outgoing batch.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    /// Most events a batch holds.
    pub max_events: usize,
    /// Most encoded bytes a batch holds (an event alone may exceed it, up to the router's limit).
    pub max_bytes: usize,
}

/// What the batcher did with an event, or with one piece of a cut event.
#[derive(Debug)]
pub enum Output<'a> {
    /// A batch is complete: full, or an oversized event alone.
    Batch(OpenBatch),
    /// This event (or piece) is in a batch; the batcher is done with it.
    Sent(&'a mut KvCacheEvent),
    /// This event (or piece, a single block) encodes to `bytes`, more than
    /// any message the router accepts: it is not sent.
    Oversized {
        /// The event, as it goes out.
        event: &'a KvCacheEvent,
        /// Its encoded size.
        bytes: usize,
    },
}

/// Fills batches for one rank, handing over each full one.
#[derive(Debug)]
pub struct Batcher {
    max_events: usize,
    /// `BatchLimits::max_bytes`, never above what the router accepts.
    max_bytes: usize,
    open: OpenBatch,
    /// A published batch's buffer, the next one to fill once the open
    /// batch is handed over: in the steady state (one batch per rank and
    /// cycle) two buffers take turns and no batch allocates. Kept only up
    /// to `SPARE_BUFFER_MAX_BYTES`.
    spare: Option<Vec<u8>>,
    /// The event being added, encoded (reused from event to event).
    encoded: Vec<u8>,
}

/// The largest buffer kept as a spare: a batch this large (at full speed,
/// a thousand events) costs far more than a fresh buffer, and a rank's
/// spare stays small beside its open batch.
const SPARE_BUFFER_MAX_BYTES: usize = 256 << 10;

impl Batcher {
    /// A batcher with nothing open.
    pub fn new(limits: BatchLimits) -> Self {
        Self {
            max_events: limits.max_events.max(1),
            max_bytes: limits.max_bytes.min(MAX_EVENTS_BYTES),
            open: OpenBatch::default(),
            spare: None,
            encoded: Vec::new(),
        }
    }

    /// Adds `event`, reporting to `out` every batch that completes and what
    /// became of the event (or of each of its pieces).
    pub fn push(
        &mut self,
        mut event: KvCacheEvent,
        timestamp: f64,
        out: &mut impl FnMut(Output<'_>),
    ) {
        let entry = self.encode(&mut event);
        if entry <= self.max_bytes {
            self.append(entry, timestamp, out);
            out(Output::Sent(&mut event));
            return;
        }
        match split(event, self.max_bytes) {
            Split::Whole(mut event) => self.place_oversized(&mut event, entry, timestamp, out),
            Split::Pieces(pieces) => {
                for mut piece in pieces {
                    let entry = self.encode(&mut piece);
                    if entry <= self.max_bytes {
                        self.append(entry, timestamp, out);
                        out(Output::Sent(&mut piece));
                    } else {
                        self.place_oversized(&mut piece, entry, timestamp, out);
                    }
                }
            }
        }
        // An outsized event must not keep its buffer's size for good.
        self.encoded.clear();
        self.encoded.shrink_to(self.max_bytes);
    }

    /// Adds an event given as its encoded body (a removal the converter
    /// wrote), handing `out` the batch it completes. Returns `false`, having
    /// done nothing, when the event is over `max_bytes`: it must go through
    /// [`Batcher::push`] to be cut.
    pub fn push_encoded(
        &mut self,
        body: &[u8],
        timestamp: f64,
        out: &mut impl FnMut(Output<'_>),
    ) -> bool {
        let entry = EventLen::of_body(body.len()).entry;
        if entry > self.max_bytes {
            return false;
        }
        self.make_room(entry, out);
        self.open.push_encoded(body, timestamp);
        true
    }

    /// Hands over the batch being filled, if it has any event.
    pub fn close(&mut self) -> Option<OpenBatch> {
        (!self.open.is_empty()).then(|| self.take_open())
    }

    /// Takes back a handed-over batch's buffer, once its bytes are copied
    /// (the larger of it and the spare, up to the bound).
    pub fn recycle(&mut self, batch: OpenBatch) {
        let buffer = batch.into_buffer();
        let larger = self
            .spare
            .as_ref()
            .is_none_or(|spare| spare.capacity() < buffer.capacity());
        if larger && buffer.capacity() <= SPARE_BUFFER_MAX_BYTES {
            self.spare = Some(buffer);
        }
    }

    /// The open batch, the spare buffer (or a new one that holds as much
    /// as the batch, so it does not grow step by step) open in its place.
    fn take_open(&mut self) -> OpenBatch {
        let buffer = self
            .spare
            .take()
            .unwrap_or_else(|| Vec::with_capacity(self.open.buffer_len()));
        self.open.take(buffer)
    }

    /// Encodes `event` into `self.encoded`; returns its length as an entry.
    fn encode(&mut self, event: &mut KvCacheEvent) -> usize {
        encode_event(event, &mut self.encoded);
        EventLen::of_body(self.encoded.len()).entry
    }

    /// Appends the encoded event to the open batch, first handing the open
    /// batch over if the event would not fit in it.
    fn append(&mut self, entry: usize, timestamp: f64, out: &mut impl FnMut(Output<'_>)) {
        self.make_room(entry, out);
        self.open.push_encoded(&self.encoded, timestamp);
    }

    /// Hands the open batch over if an event of `entry` bytes would not fit.
    fn make_room(&mut self, entry: usize, out: &mut impl FnMut(Output<'_>)) {
        if !self.open.fits(self.max_events, self.max_bytes, entry) {
            out(Output::Batch(self.take_open()));
        }
    }

    /// An encoded event over `max_bytes` goes alone, after the batch being
    /// filled (order is kept), if the router accepts it; otherwise it is
    /// reported as oversized.
    fn place_oversized(
        &mut self,
        event: &mut KvCacheEvent,
        entry: usize,
        timestamp: f64,
        out: &mut impl FnMut(Output<'_>),
    ) {
        if entry > MAX_EVENTS_BYTES {
            out(Output::Oversized {
                event,
                bytes: entry,
            });
            return;
        }
        if let Some(open) = self.close() {
            out(Output::Batch(open));
        }
        out(Output::Batch(OpenBatch::alone(&self.encoded, timestamp)));
        out(Output::Sent(event));
    }
}

/// An event cut for batching, or left whole (its encoding is then still the
/// batcher's `encoded`).
enum Split {
    Whole(KvCacheEvent),
    Pieces(Vec<KvCacheEvent>),
}

/// Bytes a piece may take beyond its fields without blocks or hashes: the
/// length prefixes of the entry, of the store or removal and of the packed
/// hashes grow with the piece (3 varints of at most 10 bytes), plus the
/// packed field's tag.
const PIECE_SLACK: usize = 32;

/// Cuts an event over `max_bytes` into pieces in one pass. Every piece of
/// several blocks (or hashes) fits the budget; a piece of one may not, and
/// is never cut again.
///
/// The budget is `max_bytes` when the fields every piece repeats (salt,
/// LoRA name, ...) take at most half of it, else the router's limit when
/// they take at most half of that, else the event stays whole. Two
/// consecutive pieces then always carry more than half a budget of blocks,
/// so the pieces together take at most about 3 times the event: a cut can
/// never multiply a large salt by the number of blocks.
fn split(event: KvCacheEvent, max_bytes: usize) -> Split {
    let KvCacheEvent { event_id, data } = event;
    let wrap = |data: Data| KvCacheEvent {
        event_id,
        data: Some(data),
    };
    match data {
        Some(Data::Stored(mut stored)) if stored.blocks.len() > 1 => {
            let blocks = std::mem::take(&mut stored.blocks);
            let fixed = wrap(Data::Stored(stored.clone())).encoded_len() + PIECE_SLACK;
            let entry_len = |block: &crate::proto::common::KvBlock| {
                let body = BlockFields::from(block).encoded_len();
                encoding::key_len(BLOCKS_FIELD) + encoding::encoded_len_varint(body as u64) + body
            };
            let Some(runs) = runs(blocks.iter().map(entry_len), fixed, max_bytes) else {
                stored.blocks = blocks;
                return Split::Whole(wrap(Data::Stored(stored)));
            };
            let mut blocks = blocks.into_iter();
            let mut parent = stored.parent_block_hash;
            let pieces = runs
                .into_iter()
                .map(|count| {
                    let piece = KvBlocksStored {
                        blocks: blocks.by_ref().take(count).collect(),
                        parent_block_hash: parent,
                        ..stored.clone()
                    };
                    // The chain stays intact: each piece hangs off the last
                    // block of the one before.
                    parent = piece.blocks.last().map(|block| block.block_hash);
                    wrap(Data::Stored(piece))
                })
                .collect();
            Split::Pieces(pieces)
        }
        Some(Data::Removed(mut removed)) if removed.block_hashes.len() > 1 => {
            let hashes = std::mem::take(&mut removed.block_hashes);
            let fixed = wrap(Data::Removed(removed.clone())).encoded_len() + PIECE_SLACK;
            let hash_len = |hash: &i64| encoding::encoded_len_varint(*hash as u64);
            let Some(runs) = runs(hashes.iter().map(hash_len), fixed, max_bytes) else {
                removed.block_hashes = hashes;
                return Split::Whole(wrap(Data::Removed(removed)));
            };
            let mut rest = hashes.as_slice();
            let pieces = runs
                .into_iter()
                .map(|count| {
                    let (run, after) = rest.split_at(count);
                    rest = after;
                    wrap(Data::Removed(KvBlocksRemoved {
                        block_hashes: run.to_vec(),
                        ..removed.clone()
                    }))
                })
                .collect();
            Split::Pieces(pieces)
        }
        data => Split::Whole(KvCacheEvent { event_id, data }),
    }
}

/// How many consecutive units (of the given encoded lengths) go in each
/// piece, when pieces that repeat `fixed` bytes are worth cutting (see
/// `split`); `None` when the event is better left whole.
fn runs(
    lengths: impl Iterator<Item = usize>,
    fixed: usize,
    max_bytes: usize,
) -> Option<Vec<usize>> {
    let budget = [max_bytes, MAX_EVENTS_BYTES]
        .into_iter()
        .find(|&budget| fixed <= budget / 2)?;
    let room = budget - fixed;
    let mut runs = Vec::new();
    let (mut count, mut bytes) = (0, 0);
    for len in lengths {
        if count > 0 && bytes + len > room {
            runs.push(count);
            (count, bytes) = (0, 0);
        }
        count += 1;
        bytes += len;
    }
    runs.push(count);
    (runs.len() > 1).then_some(runs)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::proto::common::{KvBlock, KvBlocksRemoved, KvBlocksStored, KvEventBatch};

    fn stored(hashes: std::ops::Range<i64>, tokens_per_block: usize) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 1,
            data: Some(Data::Stored(KvBlocksStored {
                blocks: hashes
                    .map(|hash| KvBlock {
                        block_hash: hash,
                        token_ids: vec![7; tokens_per_block],
                        block_size: tokens_per_block as i32,
                        ..Default::default()
                    })
                    .collect(),
                parent_block_hash: Some(-1),
                ..Default::default()
            })),
        }
    }

    /// Everything a batcher made of `events`: batches, pieces sent and
    /// pieces too large for the router.
    #[derive(Default)]
    struct Made {
        batches: Vec<OpenBatch>,
        sent: Vec<KvCacheEvent>,
        oversized: Vec<usize>,
    }

    fn batch_all(limits: BatchLimits, events: Vec<KvCacheEvent>) -> Made {
        let mut batcher = Batcher::new(limits);
        let mut made = Made::default();
        for event in events {
            batcher.push(event, 1.5, &mut |output| match output {
                Output::Batch(batch) => made.batches.push(batch),
                Output::Sent(event) => made.sent.push(event.clone()),
                Output::Oversized { bytes, .. } => made.oversized.push(bytes),
            });
        }
        made.batches.extend(batcher.close());
        made
    }

    fn decoded(batches: Vec<OpenBatch>) -> Vec<KvEventBatch> {
        batches
            .into_iter()
            .enumerate()
            .map(|(i, batch)| KvEventBatch::decode(batch.encode(2, 100 + i as u64, None)).unwrap())
            .collect()
    }

    fn collect(limits: BatchLimits, events: Vec<KvCacheEvent>) -> Vec<KvEventBatch> {
        decoded(batch_all(limits, events).batches)
    }

    #[test]
    fn a_batch_holds_at_most_max_events_and_splits_exactly_at_the_limit() {
        let limits = BatchLimits {
            max_events: 1024,
            max_bytes: usize::MAX,
        };
        let events: Vec<_> = (0..2049).map(|i| stored(i..i + 1, 1)).collect();
        let batches = collect(limits, events);
        let sizes: Vec<_> = batches.iter().map(|b| b.events.len()).collect();
        assert_eq!(sizes, vec![1024, 1024, 1]);
        assert!(batches.iter().all(|b| b.dp_rank == Some(2)));
        assert_eq!(batches[2].sequence_number, 102);
        assert_eq!(batches[0].timestamp, 1.5);
    }

    #[test]
    fn a_rank_keeps_the_larger_handed_back_buffer_up_to_the_bound_and_fills_it_next() {
        let mut batcher = Batcher::new(BatchLimits {
            max_events: 1024,
            max_bytes: usize::MAX,
        });
        let handed_back = |capacity: usize| {
            let mut batch = OpenBatch::default();
            batch.take(Vec::with_capacity(capacity));
            batch
        };
        batcher.recycle(handed_back(SPARE_BUFFER_MAX_BYTES + 1));
        assert!(batcher.spare.is_none(), "over the bound: not kept");
        batcher.recycle(handed_back(4096));
        batcher.recycle(handed_back(64));
        let spare = batcher.spare.as_ref().expect("kept");
        assert_eq!(spare.capacity(), 4096, "the larger one");
        let spare_at = spare.as_ptr();
        let mut out = |_: Output<'_>| {};
        assert!(batcher.push_encoded(&[8, 1], 1.0, &mut out));
        let closed = batcher.close().expect("one event");
        assert!(batcher.spare.is_none(), "the spare is open now");
        assert!(batcher.push_encoded(&[8, 2], 1.0, &mut out));
        let open = batcher.close().expect("one event").into_buffer();
        assert_eq!(open.as_ptr(), spare_at, "the next batch filled the spare");
        assert!(closed.into_buffer().capacity() >= 8);
    }

    #[test]
    fn a_batch_stays_under_the_byte_limit() {
        let limits = BatchLimits {
            max_events: 1024,
            max_bytes: 4096,
        };
        let events: Vec<_> = (0..100).map(|i| stored(i..i + 1, 64)).collect();
        let batches = batch_all(limits, events).batches;
        assert!(batches.len() > 1);
        assert!(batches.iter().all(|b| b.events_len() <= 4096));
        let total: u32 = batches.iter().map(|b| b.event_count()).sum();
        assert_eq!(total, 100);
    }

    #[test]
    fn an_oversized_store_becomes_a_parent_linked_chain_of_stores() {
        let limits = BatchLimits {
            max_events: 1024,
            max_bytes: 512,
        };
        let batches = collect(limits, vec![stored(10..60, 16)]);
        let events: Vec<_> = batches.iter().flat_map(|b| b.events.clone()).collect();
        assert!(events.len() > 1);
        let mut expected_parent = Some(-1);
        let mut hashes = Vec::new();
        for event in &events {
            let Some(Data::Stored(stored)) = &event.data else {
                panic!("not a store")
            };
            assert_eq!(stored.parent_block_hash, expected_parent);
            expected_parent = stored.blocks.last().map(|b| b.block_hash);
            hashes.extend(stored.blocks.iter().map(|b| b.block_hash));
        }
        assert_eq!(hashes, (10..60).collect::<Vec<_>>());
        assert!(batches.iter().all(|b| b.encoded_len() <= 512 + 32));
    }

    #[test]
    fn an_oversized_removal_becomes_several_removals() {
        let limits = BatchLimits {
            max_events: 1024,
            max_bytes: 1024,
        };
        let removal = KvCacheEvent {
            event_id: 9,
            data: Some(Data::Removed(KvBlocksRemoved {
                block_hashes: (0..1000).map(|h| -h * 1_000_000_007).collect(),
                ..Default::default()
            })),
        };
        let batches = collect(limits, vec![removal]);
        let mut hashes = Vec::new();
        for event in batches.iter().flat_map(|b| b.events.iter()) {
            assert_eq!(event.event_id, 9);
            let Some(Data::Removed(removed)) = &event.data else {
                panic!("not a removal")
            };
            hashes.extend(removed.block_hashes.iter().copied());
        }
        assert_eq!(
            hashes,
            (0..1000).map(|h| -h * 1_000_000_007).collect::<Vec<_>>()
        );
    }

    pub(crate) fn block(hash: i64, tokens: usize, token: u32) -> KvBlock {
        KvBlock {
            block_hash: hash,
            token_ids: vec![token; tokens],
            block_size: tokens as i32,
            ..Default::default()
        }
    }

    fn store_of(blocks: Vec<KvBlock>, cache_salt: Option<String>) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 5,
            data: Some(Data::Stored(KvBlocksStored {
                blocks,
                parent_block_hash: Some(-1),
                cache_salt,
                ..Default::default()
            })),
        }
    }

    fn stored_hashes(events: &[KvCacheEvent]) -> Vec<i64> {
        events
            .iter()
            .flat_map(|event| match &event.data {
                Some(Data::Stored(stored)) => stored.blocks.iter().map(|b| b.block_hash).collect(),
                _ => Vec::new(),
            })
            .collect()
    }

    const DEFAULT_LIMITS: BatchLimits = BatchLimits {
        max_events: 1024,
        max_bytes: 1 << 20,
    };

    #[test]
    fn a_block_larger_than_a_batch_goes_alone_and_keeps_its_place_in_the_stream() {
        let limits = BatchLimits {
            max_events: 1024,
            max_bytes: 4096,
        };
        // 1024 tokens of 4 varint bytes each: one block over 4096 bytes.
        let events = vec![
            stored(1..2, 4),
            store_of(vec![block(2, 1024, 3_000_000)], None),
            stored(3..4, 4),
        ];
        let made = batch_all(limits, events);
        assert!(made.oversized.is_empty());
        let batches = decoded(made.batches);
        let per_batch: Vec<Vec<i64>> = batches
            .iter()
            .map(|batch| stored_hashes(&batch.events))
            .collect();
        assert_eq!(per_batch, vec![vec![1], vec![2], vec![3]]);
        assert!(batches[1].encoded_len() > 4096);
    }

    #[test]
    fn a_block_larger_than_any_router_message_is_reported_and_the_rest_of_its_store_is_sent() {
        let limits = BatchLimits {
            max_events: 1024,
            max_bytes: 4096,
        };
        // 1.2M tokens of 4 varint bytes: 4.8 MB, over the router's 4 MiB.
        let huge = block(11, 1_200_000, 3_000_000);
        let event = store_of(vec![block(10, 16, 1), huge, block(12, 16, 1)], None);
        let made = batch_all(limits, vec![event, stored(20..21, 4)]);
        assert_eq!(made.oversized.len(), 1);
        assert!(made.oversized[0] > MAX_EVENTS_BYTES);
        assert_eq!(stored_hashes(&made.sent), vec![10, 12, 20]);
        let batches = decoded(made.batches);
        assert_eq!(
            stored_hashes(
                &batches
                    .iter()
                    .flat_map(|b| b.events.clone())
                    .collect::<Vec<_>>()
            ),
            vec![10, 12, 20]
        );
        let Some(Data::Stored(after)) = &made.sent[1].data else {
            panic!("not a store")
        };
        assert_eq!(
            after.parent_block_hash,
            Some(11),
            "the chain names the dropped block, as the engine did"
        );
    }

    #[test]
    fn an_outsized_event_leaves_no_outsized_buffer_behind() {
        let mut batcher = Batcher::new(BatchLimits {
            max_events: 1024,
            max_bytes: 4096,
        });
        let huge = store_of(vec![block(1, 1_200_000, 3_000_000)], Some("salt".into()));
        batcher.push(huge, 1.0, &mut |_| {});
        assert!(batcher.encoded.capacity() <= 4096);
    }

    #[test]
    fn a_salt_larger_than_a_batch_sends_its_store_whole_and_alone() {
        let salt = "s".repeat(1_100_000);
        let blocks = (0..1000).map(|hash| block(hash, 16, 1)).collect();
        let made = batch_all(DEFAULT_LIMITS, vec![store_of(blocks, Some(salt))]);
        assert!(made.oversized.is_empty());
        assert_eq!(made.batches.len(), 1, "one event, not a salt per block");
        assert_eq!(made.sent.len(), 1);
        let batch = &decoded(made.batches)[0];
        assert!(batch.encoded_len() <= crate::wire::batch::ROUTER_MAX_MESSAGE_BYTES);
    }

    #[test]
    fn a_salt_too_large_for_the_router_drops_its_store_whole_instead_of_copying_the_salt_per_block()
    {
        let salt = "s".repeat(3_000_000);
        let blocks = (0..100_000).map(|hash| block(hash, 16, 1)).collect();
        let made = batch_all(DEFAULT_LIMITS, vec![store_of(blocks, Some(salt))]);
        assert_eq!(made.oversized.len(), 1);
        assert!(made.sent.is_empty());
        assert!(made.batches.is_empty());
    }

    #[test]
    fn a_large_salt_cut_into_router_sized_pieces_takes_at_most_three_times_the_event() {
        let salt = "s".repeat(1_500_000);
        let blocks: Vec<_> = (0..200_000).map(|hash| block(hash, 16, 1)).collect();
        let event = store_of(blocks, Some(salt));
        let input = event.encoded_len();
        let made = batch_all(DEFAULT_LIMITS, vec![event]);
        assert!(made.oversized.is_empty());
        assert_eq!(stored_hashes(&made.sent), (0..200_000).collect::<Vec<_>>());
        let output: usize = made.batches.iter().map(OpenBatch::events_len).sum();
        assert!(output <= 3 * input, "{output} bytes out of {input}");
        assert!(
            made.batches
                .iter()
                .all(|b| b.events_len() <= MAX_EVENTS_BYTES)
        );
    }

    #[test]
    fn cutting_ends_and_conserves_every_block_and_hash_for_any_limit() {
        for max_bytes in [1, 7, 64, 300, 4096, 1 << 20] {
            for tokens in [0, 1, 16, 1024, 20_000] {
                let limits = BatchLimits {
                    max_events: 3,
                    max_bytes,
                };
                let blocks = (0..50).map(|hash| block(hash, tokens, 200_000)).collect();
                let removal = KvCacheEvent {
                    event_id: 6,
                    data: Some(Data::Removed(KvBlocksRemoved {
                        block_hashes: (0..500).map(|h| h * -1_000_000_007).collect(),
                        ..Default::default()
                    })),
                };
                let made = batch_all(limits, vec![store_of(blocks, Some("salt".into())), removal]);
                assert!(made.oversized.is_empty());
                assert_eq!(stored_hashes(&made.sent), (0..50).collect::<Vec<_>>());
                let batches = decoded(made.batches);
                let events: Vec<_> = batches.iter().flat_map(|b| b.events.clone()).collect();
                assert_eq!(events, made.sent);
                let removed: Vec<i64> = events
                    .iter()
                    .filter_map(|event| match &event.data {
                        Some(Data::Removed(removed)) => Some(removed.block_hashes.clone()),
                        _ => None,
                    })
                    .flatten()
                    .collect();
                assert_eq!(
                    removed,
                    (0..500).map(|h| h * -1_000_000_007).collect::<Vec<_>>()
                );
                for batch in &batches {
                    assert!(batch.events.len() <= 3);
                    let events_len = batch.encoded_len()
                        - KvEventBatch {
                            events: Vec::new(),
                            ..batch.clone()
                        }
                        .encoded_len();
                    assert!(events_len <= max_bytes || batch.events.len() == 1);
                }
            }
        }
    }
}
