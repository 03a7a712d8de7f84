//! Engine payload bytes (frame 3 of a ZMQ KV-event message) → proto events.
//!
//! Invariant: a payload converts as a whole or leaves no trace. The envelope
//! `[ts, events, dp_rank, ...]` is walked completely first (every claimed
//! length checked against the bytes actually there); only a payload that
//! passes is decoded event by event, so a truncated or foreign payload spends
//! no event ids, teaches no group kinds and adds nothing to the [`Tally`].
//! Inside a good payload each event fails alone: it is dropped and counted by
//! reason, and still consumes its `event_id`.
//!
//! Envelope leniency (contract section 2): 2 slots (vLLM 0.9.0), a nil rank
//! and extra trailing slots are accepted; `ts` may be any number. Bytes after
//! the envelope are ignored: the envelope itself is complete, and engines
//! never send any, so they cost nothing to tolerate.
//!
//! Files: `msgpack.rs` reads bytes, `event.rs` reads one event, `normalize.rs`
//! applies the contract's policy, `hash.rs` folds hashes, `tally.rs` counts.

mod event;
mod hash;
mod msgpack;
mod normalize;
mod tally;
#[cfg(test)]
mod tests;

use std::ops::Range;

pub use hash::{fold_bytes, fold_int};
pub use tally::{DropReason, EventKind, Tally};

use crate::proto::common::KvCacheEvent;
use msgpack::{Item, Reader};

/// Turns engine payloads into proto events; one per kvgate, fed by every rank.
#[derive(Debug)]
pub struct Converter {
    /// The id the next decoded engine event gets (forwarded or dropped).
    next_event_id: u64,
    normalizer: normalize::Normalizer,
    scratch: event::Scratch,
    /// Where each event of the payload being converted starts and ends.
    spans: Vec<Range<usize>>,
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
    pub fn new() -> Self {
        Converter {
            next_event_id: 1,
            normalizer: normalize::Normalizer::default(),
            scratch: event::Scratch::default(),
            spans: Vec::new(),
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
        let (timestamp, dp_rank) = scan_envelope(payload, &mut self.spans)?;
        // Every forwardable event takes at least `["AllBlocksCleared"]`'s 18
        // bytes, so this never reserves for events the bytes cannot hold.
        let mut events = Vec::with_capacity(self.spans.len().min(payload.len() / 18));
        for span in &self.spans {
            let event_id = self.next_event_id;
            self.next_event_id += 1;
            let converted = event::decode(&payload[span.clone()], &mut self.scratch)
                .and_then(|event| self.normalizer.normalize(rank, event));
            match converted {
                Ok((kind, data)) => {
                    tally.count_forwarded(kind);
                    events.push(KvCacheEvent {
                        event_id,
                        data: Some(data),
                    });
                }
                Err(reason) => tally.count_dropped(reason),
            }
        }
        Ok(ConvertedPayload {
            timestamp,
            dp_rank,
            events,
        })
    }

    /// Forgets what `rank`'s cache groups were (call when its engine
    /// restarts: the new one may serve another model).
    pub fn forget_rank(&mut self, rank: u32) {
        self.normalizer.forget_rank(rank);
    }
}

/// Walks the whole envelope, recording each event's span; returns `ts` and
/// the rank.
fn scan_envelope(
    payload: &[u8],
    spans: &mut Vec<Range<usize>>,
) -> Result<(f64, Option<u32>), PayloadError> {
    spans.clear();
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
    for _ in 0..count {
        let start = r.position();
        r.skip_values(1)?;
        spans.push(start..r.position());
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
