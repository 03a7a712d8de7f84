//! Engine payload bytes (frame 3 of a ZMQ KV-event message) → proto events.
//!
//! Invariant: a payload converts as a whole or leaves no trace. It is read
//! in one pass, envelope `[ts, events, dp_rank, ...]` and events together
//! (the bytes are walked once: this is the hot path); if it turns out
//! truncated or foreign anywhere, the event ids it spent, the group kinds it
//! taught and its counts are all undone, and nothing is returned. Inside a
//! good payload each event fails alone: it is dropped and counted by reason,
//! and still consumes its `event_id`. Nothing is reserved for a claimed
//! length beyond what the remaining bytes could hold.
//!
//! Envelope leniency (contract section 2): 2 slots (vLLM 0.9.0), a nil rank
//! and extra trailing slots are accepted; `ts` may be any number. Bytes after
//! the envelope are ignored: the envelope itself is complete, and engines
//! never send any, so they cost nothing to tolerate.
//!
//! Two outputs share that one pass: [`Converter::convert`] builds every
//! event as a `KvCacheEvent`; [`Converter::transcode`], the drain's, writes
//! each removal and each stored block straight into its protobuf bytes
//! instead (`transcoded.rs`), the same bytes the drain writes for the event
//! `convert` builds.
//!
//! Files: `msgpack.rs` reads bytes, `event.rs` reads one event, `normalize.rs`
//! applies the contract's policy, `hash.rs` folds hashes, `tally.rs` counts,
//! `spare_buffers.rs` keeps sent events' token, hash and text buffers for the
//! next events, `transcoded.rs` holds a payload with its blocks and removals as bytes,
//! `removal_memo.rs` lets a payload's removals that differ only in their
//! hashes be read and judged once, `distinct_hashes.rs` finds a store's
//! repeated hashes, `multimodal.rs` turns TensorRT-LLM's multimodal block
//! keys into the ones vLLM's `extra_keys` give.

mod distinct_hashes;
mod event;
mod hash;
mod msgpack;
mod multimodal;
mod normalize;
mod removal_memo;
mod spare_buffers;
mod tally;
#[cfg(test)]
mod tests;
mod transcoded;

pub use normalize::{Alignment, UnnamedGroups};
pub use tally::{DropReason, EventKind, Tally};
pub use transcoded::{Forwarded, StoredBlocks, TranscodedPayload};

use crate::proto::common::KvCacheEvent;
use event::Event;
use msgpack::{Item, Reader};
use normalize::{Normalized, Normalizer, forwarded_removal};
use removal_memo::RemovalMemo;

/// The smallest event that can be forwarded, `["AllBlocksCleared"]`: the
/// output never needs room for more events than the payload has bytes for.
const MIN_FORWARDED_EVENT_BYTES: usize = 18;

/// Turns engine payloads into proto events; one per kvgate, fed by every rank.
#[derive(Debug)]
pub struct Converter {
    /// The id the next decoded engine event gets (forwarded or dropped).
    next_event_id: u64,
    normalizer: Normalizer,
    scratch: event::Scratch,
}

/// One payload's worth of output.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertedPayload {
    /// The envelope's `ts` (Unix seconds).
    pub timestamp: f64,
    /// The envelope's rank; `None` when absent or nil.
    pub dp_rank: Option<u32>,
    /// The forwarded events, in engine order, ids increasing (with holes
    /// where events were dropped).
    pub events: Vec<KvCacheEvent>,
}

/// Why a whole payload produced nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// Not complete msgpack (truncated, or the reserved byte).
    #[error("payload is not msgpack: {0}")]
    NotMsgpack(&'static str),
    /// Msgpack, but not a `[ts, events, dp_rank]` batch.
    #[error("payload is not a [ts, events, dp_rank] batch: {0}")]
    BadEnvelope(&'static str),
}

impl PayloadError {
    /// Every label [`PayloadError::reason`] returns.
    pub const REASONS: [&'static str; 2] = ["not_msgpack", "bad_envelope"];

    /// A metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            PayloadError::NotMsgpack(_) => "not_msgpack",
            PayloadError::BadEnvelope(_) => "bad_envelope",
        }
    }
}

impl From<msgpack::Error> for PayloadError {
    fn from(error: msgpack::Error) -> Self {
        PayloadError::NotMsgpack(error.as_str())
    }
}

impl Default for Converter {
    fn default() -> Self {
        Self::new()
    }
}

impl Converter {
    /// A converter that knows no rank yet.
    pub fn new() -> Self {
        Converter {
            next_event_id: 1,
            normalizer: Normalizer::default(),
            scratch: event::Scratch::default(),
        }
    }

    /// Converts one engine payload (frame 3) published by rank `rank`'s socket.
    ///
    /// `rank` keys the remembered cache-group kinds (the payload's own
    /// `dp_rank` is only reported back). Forwarded and dropped events are
    /// added to `tally`; a payload error adds nothing.
    pub fn convert(
        &mut self,
        rank: u32,
        payload: &[u8],
        tally: &mut Tally,
    ) -> Result<ConvertedPayload, PayloadError> {
        let mut events = Vec::new();
        let (timestamp, dp_rank) = self.convert_undoably(rank, payload, tally, &mut events)?;
        Ok(ConvertedPayload {
            timestamp,
            dp_rank,
            events,
        })
    }

    /// Converts one payload as [`Converter::convert`] does into `out`
    /// (emptied first), its removals written as their encoded events and
    /// its stores' blocks as their encoded entries. On a
    /// payload error `out` holds nothing to send.
    pub fn transcode(
        &mut self,
        rank: u32,
        payload: &[u8],
        tally: &mut Tally,
        out: &mut TranscodedPayload,
    ) -> Result<(), PayloadError> {
        out.clear();
        match self.convert_undoably(rank, payload, tally, out) {
            Ok((timestamp, dp_rank)) => {
                out.timestamp = timestamp;
                out.dp_rank = dp_rank;
                Ok(())
            }
            Err(error) => {
                out.clear();
                Err(error)
            }
        }
    }

    /// Converts a payload into `sink`, or undoes everything it did.
    fn convert_undoably(
        &mut self,
        rank: u32,
        payload: &[u8],
        tally: &mut Tally,
        sink: &mut impl Sink,
    ) -> Result<(f64, Option<u32>), PayloadError> {
        let first_event_id = self.next_event_id;
        let mut counted = Tally::default();
        let converted = self.convert_payload(rank, payload, &mut counted, sink);
        if converted.is_ok() {
            tally.add(&counted);
            self.normalizer.commit();
        } else {
            self.next_event_id = first_event_id;
            self.normalizer.roll_back();
        }
        converted
    }

    /// A converter that reads misaligned stores by `alignment`.
    pub fn with_alignment(alignment: Alignment) -> Self {
        let mut converter = Self::new();
        converter.normalizer.alignment = alignment;
        converter
    }

    /// This converter, reading a kind-less event of a never-named group by
    /// `unnamed_groups`.
    pub fn with_unnamed_groups(mut self, unnamed_groups: UnnamedGroups) -> Self {
        self.normalizer.unnamed_groups = unnamed_groups;
        self
    }

    /// Forgets what `rank`'s cache groups were (call when its engine
    /// restarts: the new one may serve another model).
    pub fn forget_rank(&mut self, rank: u32) {
        self.normalizer.forget_rank(rank);
    }

    /// Takes back the token, hash and text buffers of an event the caller
    /// is done with, so the next events fill them instead of allocating.
    pub fn recycle(&mut self, event: &mut KvCacheEvent) {
        self.normalizer.spare_buffers.give_back(event);
    }

    /// Reads the envelope `[ts, events, dp_rank, ...]` and its events in one
    /// pass, returning `ts` and `dp_rank`; any error leaves the caller to
    /// undo what the events did.
    fn convert_payload(
        &mut self,
        rank: u32,
        payload: &[u8],
        tally: &mut Tally,
        sink: &mut impl Sink,
    ) -> Result<(f64, Option<u32>), PayloadError> {
        let mut r = Reader::new(payload);
        let slots = match r.item()? {
            Item::Array(slots) if slots >= 2 => slots,
            Item::Array(_) => return Err(PayloadError::BadEnvelope("fewer than 2 slots")),
            _ => return Err(PayloadError::BadEnvelope("not an array")),
        };
        let timestamp = match r.item()? {
            Item::Float(ts) => ts,
            Item::Int(ts) => ts as f64,
            _ => return Err(PayloadError::BadEnvelope("ts is not a number")),
        };
        let Item::Array(count) = r.item()? else {
            return Err(PayloadError::BadEnvelope("events is not an array"));
        };
        sink.reserve(r.room_for(count, MIN_FORWARDED_EVENT_BYTES));
        let mut memo: Option<RemovalMemo<'_>> = None;
        for _ in 0..count {
            let event_id = self.next_event_id;
            self.next_event_id += 1;
            let groups_stamp = self.normalizer.groups_stamp();
            let remembered = memo
                .as_ref()
                .and_then(|memo| memo.reuse(&mut r, &mut self.scratch, groups_stamp));
            let converted = match remembered {
                Some((verdict, hashes)) => verdict.map(|fields| forwarded_removal(fields, hashes)),
                None => {
                    let start = r.position();
                    let read = event::read(&mut r, &mut self.scratch)?;
                    match (read.event, read.removal_hash_list) {
                        // Judged as `normalize` judges a removal, but here:
                        // the memo keeps the verdict, which borrows only the
                        // payload, not the scratch its hashes are in.
                        (Ok(Event::Removed(removed)), Some(hash_list)) => {
                            let verdict = self.normalizer.removed(rank, &removed.placement);
                            memo = Some(RemovalMemo::new(
                                r.read_since(start),
                                hash_list.start - start..hash_list.end - start,
                                self.normalizer.groups_stamp(),
                                verdict,
                            ));
                            verdict.map(|fields| forwarded_removal(fields, removed.hashes))
                        }
                        (event, _) => {
                            event.and_then(|event| self.normalizer.normalize(rank, event))
                        }
                    }
                }
            };
            match converted {
                Ok((kind, event)) => {
                    tally.count_forwarded(kind);
                    sink.forward(&mut self.normalizer, event_id, event);
                }
                Err(reason) => tally.count_dropped(reason),
            }
        }
        let dp_rank = if slots >= 3 {
            match r.item()? {
                Item::Nil => None,
                Item::Int(rank) => Some(
                    u32::try_from(rank)
                        .map_err(|_| PayloadError::BadEnvelope("dp_rank out of range"))?,
                ),
                _ => return Err(PayloadError::BadEnvelope("dp_rank is not an int")),
            }
        } else {
            None
        };
        r.skip_values(u64::from(slots).saturating_sub(3))?;
        Ok((timestamp, dp_rank))
    }
}

/// Where a payload's forwarded events go.
trait Sink {
    /// Room for `events` more events.
    fn reserve(&mut self, events: usize);
    fn forward(&mut self, normalizer: &mut Normalizer, event_id: u64, event: Normalized<'_>);
}

impl Sink for Vec<KvCacheEvent> {
    fn reserve(&mut self, events: usize) {
        Vec::reserve(self, events);
    }

    fn forward(&mut self, normalizer: &mut Normalizer, event_id: u64, event: Normalized<'_>) {
        let data = match event {
            Normalized::Built(data) => data,
            Normalized::Stored(stored) => normalizer.stored_data(stored),
            Normalized::Removed(removed) => normalizer.removed_data(&removed),
        };
        self.push(KvCacheEvent {
            event_id,
            data: Some(data),
        });
    }
}

impl Sink for TranscodedPayload {
    fn reserve(&mut self, events: usize) {
        TranscodedPayload::reserve(self, events);
    }

    fn forward(&mut self, normalizer: &mut Normalizer, event_id: u64, event: Normalized<'_>) {
        self.push(normalizer, event_id, event);
    }
}
