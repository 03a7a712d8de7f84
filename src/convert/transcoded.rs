//! A payload converted for the drain: its blocks and removals already
//! protobuf bytes.
//!
//! Invariant: each removal's bytes are the body of the `KvCacheEvent` that
//! [`Converter::convert`](super::Converter::convert) would have built for
//! it, byte for byte as prost encodes that event, and its hashes and tier
//! are that event's; a store's blocks are the `blocks` entries of the store
//! `convert` builds, written as `wire::event` writes them, and its other
//! fields are that store's, built (the drain completes them from the state
//! before the store is encoded; a block's bytes do not depend on that). A
//! full engine sends one removal per evicted block and one store per new
//! chain, most of its bytes: written while the payload is read, a removal
//! needs no `KvCacheEvent`, no buffers of its own and no second encoding,
//! and a block no `KvBlock`, no token buffer of its own and no second pass
//! over its tokens: the live state keeps the block's bytes as written here.
//! The buffers are reused from payload to payload.

use std::ops::Range;

use super::normalize::{Normalized, Normalizer};
use crate::proto::common::{KvBlocksStored, KvCacheEvent, kv_cache_event::Data};
use crate::wire::event::{
    BlockFields, EncodedBlock, RemovedFields, encode_removal_event, encode_store_event,
    split_entries,
};

/// One payload's events in engine order, blocks and removals as bytes.
#[derive(Debug, Default)]
pub struct TranscodedPayload {
    /// The envelope's `ts` (Unix seconds).
    pub timestamp: f64,
    /// The envelope's rank; `None` when absent or nil.
    pub dp_rank: Option<u32>,
    /// Every forwarded event, in engine order.
    order: Vec<Transcoded>,
    /// The built events (clears, and stores without their blocks), in the
    /// order `order` names them.
    built: Vec<KvCacheEvent>,
    /// The removals' encoded event bodies and the stores' encoded `blocks`
    /// entries, end to end.
    encoded: Vec<u8>,
    /// The removals' and the stored blocks' hashes, end to end.
    hashes: Vec<i64>,
    /// The last removal's fields after its hashes, as written; kept from
    /// payload to payload.
    last_placement: WrittenPlacement,
}

/// A removal's fields after its hashes, as written, and what they were
/// written from: the next removal placed alike (a full engine's are, but
/// for their hashes) copies the bytes instead of writing its fields again.
#[derive(Debug, Default)]
struct WrittenPlacement {
    /// `None` before the first removal.
    scalars: Option<PlacementScalars>,
    medium: Option<String>,
    ownership: Option<String>,
    bytes: Vec<u8>,
}

/// A removal's `cache_level`, `tier`, `group_idx` and `locality`.
type PlacementScalars = (Option<i32>, Option<i32>, Option<u32>, Option<i32>);

impl WrittenPlacement {
    /// `fields`' placement as written: the last one's bytes if it is the
    /// same, else written anew.
    fn of(&mut self, fields: &RemovedFields<'_>) -> &[u8] {
        let scalars = (
            fields.cache_level,
            fields.tier,
            fields.group_idx,
            fields.locality,
        );
        if self.scalars != Some(scalars)
            || self.medium.as_deref() != fields.medium
            || self.ownership.as_deref() != fields.ownership
        {
            self.scalars = Some(scalars);
            keep(&mut self.medium, fields.medium);
            keep(&mut self.ownership, fields.ownership);
            self.bytes.clear();
            fields.encode_placement(&mut self.bytes);
        }
        &self.bytes
    }

    /// Forgets an outsized placement (an engine's removal may name an
    /// owner of any length), so its buffers are not kept for good.
    fn shrink(&mut self) {
        let kept = |text: &Option<String>| text.as_ref().map_or(0, String::capacity);
        if self
            .bytes
            .capacity()
            .max(kept(&self.medium))
            .max(kept(&self.ownership))
            > KEPT_PLACEMENT_BYTES
        {
            *self = WrittenPlacement::default();
        }
    }
}

/// Bytes a kept placement's buffers may hold between payloads: every
/// medium and owner engines name is far shorter.
const KEPT_PLACEMENT_BYTES: usize = 256;

/// Sets `slot` to `text`, in the buffer it has.
fn keep(slot: &mut Option<String>, text: Option<&str>) {
    match text {
        Some(text) => {
            let kept = slot.get_or_insert_with(String::new);
            kept.clear();
            kept.push_str(text);
        }
        None => *slot = None,
    }
}

/// One forwarded event of a [`TranscodedPayload`].
#[derive(Debug, Clone, Copy)]
enum Transcoded {
    /// The next of the built events: a clear.
    Built,
    /// The next of the built events, a store without its blocks, and its blocks.
    Store(Store),
    Removal(Removal),
}

/// A removal written as bytes: where its bytes and hashes lie.
#[derive(Debug, Clone, Copy)]
struct Removal {
    tier: Option<i32>,
    body: Span,
    hashes: Span,
}

/// A store's blocks written as bytes: where they lie, and what every block
/// of the store shares.
#[derive(Debug, Clone, Copy)]
struct Store {
    tier: Option<i32>,
    parent: Option<i64>,
    entries: Span,
    hashes: Span,
    lora_id: Option<i64>,
    cache_level: Option<i32>,
}

/// One event handed out by [`TranscodedPayload::drain`].
#[derive(Debug)]
pub enum Forwarded<'p> {
    /// A clear, built.
    Event(KvCacheEvent),
    /// A store: built without its blocks, which are written.
    Store {
        /// The `KvCacheEvent` of the store, its `blocks` empty.
        event: KvCacheEvent,
        /// Its blocks.
        blocks: StoredBlocks<'p>,
    },
    /// A removal, written.
    Removal {
        /// The encoded body of its `KvCacheEvent`.
        body: &'p [u8],
        /// The `tier` it carries.
        tier: Option<i32>,
        /// The hashes of the blocks it removes.
        hashes: &'p [i64],
    },
}

/// The blocks of a transcoded store.
#[derive(Debug, Clone, Copy)]
pub struct StoredBlocks<'p> {
    /// The blocks as the store's `blocks` entries, encoded end to end.
    entries: &'p [u8],
    hashes: &'p [i64],
    /// Every block's, as the engine gives them per store.
    pub lora_id: Option<i64>,
    /// Every block's, as the engine gives them per store.
    pub cache_level: Option<i32>,
}

impl<'p> StoredBlocks<'p> {
    /// Appends the body of the `KvCacheEvent` numbered `event_id` that
    /// carries `stored` (its own `blocks` empty) with these blocks: the
    /// bytes `wire::event` writes for that store with its blocks built.
    pub fn encode_event(&self, event_id: u64, stored: &KvBlocksStored, out: &mut Vec<u8>) {
        let entries = self.entries;
        encode_store_event(event_id, stored, entries.len(), out, |out| {
            out.extend_from_slice(entries);
        });
    }

    /// Each block as written, in the store's order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = EncodedBlock<'p>> + use<'p> {
        split_entries(self.entries, self.hashes)
    }
}

impl TranscodedPayload {
    /// Empties the payload, keeping its buffers as large as an ordinary
    /// payload needs: what an outsized one needed is not kept for good,
    /// whether it was drained or failed.
    pub(super) fn clear(&mut self) {
        self.timestamp = 0.0;
        self.dp_rank = None;
        self.order.clear();
        self.built.clear();
        self.encoded.clear();
        self.hashes.clear();
        self.order.shrink_to(KEPT_EVENTS);
        self.built.shrink_to(KEPT_EVENTS);
        self.encoded.shrink_to(KEPT_BYTES);
        self.hashes.shrink_to(KEPT_BYTES / size_of::<i64>());
        self.last_placement.shrink();
    }

    /// Room for `events` more events.
    pub(super) fn reserve(&mut self, events: usize) {
        self.order.reserve(events);
    }

    /// Adds a forwarded event, writing a store's blocks and a removal as
    /// bytes.
    pub(super) fn push(
        &mut self,
        normalizer: &mut Normalizer,
        event_id: u64,
        event: Normalized<'_>,
    ) {
        match event {
            Normalized::Built(data) => {
                self.built.push(KvCacheEvent {
                    event_id,
                    data: Some(data),
                });
                self.order.push(Transcoded::Built);
            }
            Normalized::Stored(fields) => {
                let header = fields.header(&mut normalizer.spare_buffers);
                let (entries_start, hashes_start) = (self.encoded.len(), self.hashes.len());
                let (block_size, lora_id, cache_level) =
                    (fields.block_size, fields.lora_id, fields.cache_level);
                self.hashes.extend_from_slice(fields.hashes);
                let encoded = &mut self.encoded;
                fields.for_each_block(|hash, tokens, keys| {
                    let block = BlockFields {
                        hash,
                        tokens,
                        block_size,
                        lora_id,
                        cache_level,
                        extra_keys: &keys,
                    };
                    block.encode_entry(encoded);
                });
                self.order.push(Transcoded::Store(Store {
                    tier: header.tier,
                    parent: header.parent_block_hash,
                    entries: span(entries_start..self.encoded.len()),
                    hashes: span(hashes_start..self.hashes.len()),
                    lora_id,
                    cache_level,
                }));
                self.built.push(KvCacheEvent {
                    event_id,
                    data: Some(Data::Stored(header)),
                });
            }
            Normalized::Removed(fields) => {
                let body_start = self.encoded.len();
                let placement = self.last_placement.of(&fields);
                encode_removal_event(event_id, fields.hashes, placement, &mut self.encoded);
                let hashes_start = self.hashes.len();
                self.hashes.extend_from_slice(fields.hashes);
                self.order.push(Transcoded::Removal(Removal {
                    tier: fields.tier,
                    body: span(body_start..self.encoded.len()),
                    hashes: span(hashes_start..self.hashes.len()),
                }));
            }
        }
    }

    /// The tier and hashes of every block the events look up in the state,
    /// in engine order: each store's parent (its LoRA and salt may come
    /// from it) and blocks, each removal's blocks.
    pub fn lookups(&self) -> impl Iterator<Item = (Option<i32>, &[i64])> + Clone + '_ {
        self.order.iter().flat_map(|event| {
            let (tier, parent, hashes) = match event {
                Transcoded::Store(store) => (store.tier, store.parent.as_slice(), store.hashes),
                Transcoded::Removal(removal) => (removal.tier, &[][..], removal.hashes),
                Transcoded::Built => (None, &[][..], (0, 0)),
            };
            [(tier, parent), (tier, &self.hashes[range(hashes)])]
        })
    }

    /// Whether the first event is an ownerless clear.
    pub fn starts_with_ownerless_clear(&self) -> bool {
        matches!(self.order.first(), Some(Transcoded::Built))
            && self
                .built
                .first()
                .is_some_and(KvCacheEvent::is_ownerless_clear)
    }

    /// Hands each event to `each`, in engine order, and empties the payload
    /// (its buffers are kept for the next one).
    pub fn drain(&mut self, mut each: impl FnMut(Forwarded<'_>)) {
        let mut built = self.built.drain(..);
        for event in self.order.drain(..) {
            match event {
                Transcoded::Built => {
                    if let Some(event) = built.next() {
                        each(Forwarded::Event(event));
                    }
                }
                Transcoded::Store(store) => {
                    if let Some(event) = built.next() {
                        let blocks = StoredBlocks {
                            entries: &self.encoded[range(store.entries)],
                            hashes: &self.hashes[range(store.hashes)],
                            lora_id: store.lora_id,
                            cache_level: store.cache_level,
                        };
                        each(Forwarded::Store { event, blocks });
                    }
                }
                Transcoded::Removal(removal) => each(Forwarded::Removal {
                    body: &self.encoded[range(removal.body)],
                    tier: removal.tier,
                    hashes: &self.hashes[range(removal.hashes)],
                }),
            }
        }
        drop(built);
        self.clear();
    }
}

/// Events a payload's buffers keep room for between payloads: more than
/// engines put in one (vLLM's 3,000-event batches are the largest seen).
const KEPT_EVENTS: usize = 4096;

/// Bytes each of the byte and hash buffers keeps between payloads: 4,096
/// one-block removals take about 160 kB of bytes and 32 kB of hashes; 64
/// stores of 64 blocks of 16 tokens, about 200 kB of bytes and 32 kB of
/// hashes.
const KEPT_BYTES: usize = 256 << 10;

/// A range of a payload's buffers (a `Range` is not `Copy`).
type Span = (usize, usize);

fn span(range: Range<usize>) -> Span {
    (range.start, range.end)
}

fn range((start, end): Span) -> Range<usize> {
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::{Converter, Tally};
    use kvgate_sim::SimEvent;

    fn removals(count: u64) -> Vec<u8> {
        let events: Vec<SimEvent> = (1..=count)
            .map(|hash| SimEvent::Removed { hashes: vec![hash] })
            .collect();
        let mut payload = Vec::new();
        kvgate_sim::encode_batch(1.0, &events, Some(0), &mut payload);
        payload
    }

    fn capacities(payload: &TranscodedPayload) -> [usize; 4] {
        [
            payload.order.capacity(),
            payload.built.capacity(),
            payload.encoded.capacity(),
            payload.hashes.capacity() * size_of::<i64>(),
        ]
    }

    #[test]
    fn an_outsized_payload_s_buffers_are_given_back_once_it_is_drained() {
        let mut converter = Converter::new();
        let mut payload = TranscodedPayload::default();
        let mut handed_out = 0;
        let mut transcode_and_drain = |payload: &mut TranscodedPayload, bytes: &[u8]| {
            converter
                .transcode(0, bytes, &mut Tally::default(), payload)
                .unwrap();
            payload.drain(|_| handed_out += 1);
        };
        transcode_and_drain(&mut payload, &removals(100_000));
        let [order, built, encoded, hashes] = capacities(&payload);
        assert!(order <= KEPT_EVENTS && built <= KEPT_EVENTS);
        assert!(encoded <= KEPT_BYTES && hashes <= KEPT_BYTES);
        // An ordinary payload's room is kept: the next one allocates nothing.
        transcode_and_drain(&mut payload, &removals(64));
        let kept = capacities(&payload);
        transcode_and_drain(&mut payload, &removals(64));
        assert_eq!(capacities(&payload), kept);
        assert_eq!(handed_out, 100_128);
    }

    #[test]
    fn an_outsized_store_s_bytes_are_given_back_once_it_is_drained() {
        let blocks = 20_000u64;
        let store = SimEvent::Stored {
            hashes: (1..=blocks).collect(),
            parent: None,
            tokens: vec![300_000; blocks as usize * 16],
            block_size: 16,
        };
        let mut bytes = Vec::new();
        kvgate_sim::encode_batch(1.0, &[store], Some(0), &mut bytes);
        let mut converter = Converter::new();
        let mut payload = TranscodedPayload::default();
        converter
            .transcode(0, &bytes, &mut Tally::default(), &mut payload)
            .unwrap();
        assert!(payload.encoded.len() > 1 << 20);
        let mut stored = 0;
        payload.drain(|event| {
            if let Forwarded::Store { blocks, .. } = event {
                stored += blocks.iter().len();
            }
        });
        assert_eq!(stored, blocks as usize);
        assert!(payload.encoded.capacity() <= KEPT_BYTES);
        assert!(payload.hashes.capacity() * size_of::<i64>() <= KEPT_BYTES);
    }

    #[test]
    fn an_outsized_owner_s_placement_is_not_kept_once_its_payload_is_drained() {
        let mut payload = Vec::new();
        rmp::encode::write_array_len(&mut payload, 3).unwrap();
        rmp::encode::write_f64(&mut payload, 1.0).unwrap();
        rmp::encode::write_array_len(&mut payload, 1).unwrap();
        rmp::encode::write_map_len(&mut payload, 3).unwrap();
        for (key, value) in [
            ("type", "BlockRemoved"),
            ("ownership", &"o".repeat(100_000)),
        ] {
            rmp::encode::write_str(&mut payload, key).unwrap();
            rmp::encode::write_str(&mut payload, value).unwrap();
        }
        rmp::encode::write_str(&mut payload, "block_hashes").unwrap();
        rmp::encode::write_array_len(&mut payload, 1).unwrap();
        rmp::encode::write_uint(&mut payload, 1).unwrap();
        rmp::encode::write_uint(&mut payload, 0).unwrap();
        let mut converter = Converter::new();
        let mut out = TranscodedPayload::default();
        converter
            .transcode(0, &payload, &mut Tally::default(), &mut out)
            .unwrap();
        assert!(out.last_placement.bytes.len() > 100_000);
        let mut removals = 0;
        out.drain(|_| removals += 1);
        assert_eq!(removals, 1);
        assert!(out.last_placement.bytes.capacity() <= KEPT_PLACEMENT_BYTES);
        assert!(out.last_placement.ownership.is_none());
    }

    #[test]
    fn an_outsized_payload_that_fails_gives_its_buffers_back_too() {
        let mut converter = Converter::new();
        let mut payload = TranscodedPayload::default();
        let mut cut = removals(100_000);
        cut.truncate(cut.len() - 3);
        let failed = converter.transcode(0, &cut, &mut Tally::default(), &mut payload);
        assert!(failed.is_err());
        let [order, built, encoded, hashes] = capacities(&payload);
        assert!(order <= KEPT_EVENTS && built <= KEPT_EVENTS);
        assert!(encoded <= KEPT_BYTES && hashes <= KEPT_BYTES);
    }
}
