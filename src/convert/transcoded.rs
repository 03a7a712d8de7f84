//! A payload converted for the drain: its removals already protobuf bytes.
//!
//! Invariant: each removal's bytes are the body of the `KvCacheEvent` that
//! [`Converter::convert`](super::Converter::convert) would have built for
//! it, byte for byte as prost encodes that event, and its hashes and tier
//! are that event's. A full engine sends one removal per evicted block, most
//! of its events: written while the payload is read, a removal needs no
//! `KvCacheEvent`, no buffers of its own and no second encoding. Stores and
//! clears are built as before (the drain completes a store from the state
//! before it is encoded). The buffers are reused from payload to payload.

use std::ops::Range;

use super::normalize::Normalized;
use crate::proto::common::KvCacheEvent;

/// One payload's events in engine order, removals as bytes.
#[derive(Debug, Default)]
pub struct TranscodedPayload {
    /// The envelope's `ts` (Unix seconds).
    pub timestamp: f64,
    /// The envelope's rank; `None` when absent or nil.
    pub dp_rank: Option<u32>,
    /// Every forwarded event, in engine order.
    order: Vec<Transcoded>,
    /// The built events, in the order `order` names them.
    built: Vec<KvCacheEvent>,
    /// The removals' encoded event bodies, end to end.
    encoded: Vec<u8>,
    /// The removals' block hashes, end to end.
    hashes: Vec<i64>,
}

/// One forwarded event of a [`TranscodedPayload`].
#[derive(Debug, Clone, Copy)]
enum Transcoded {
    /// The next of the built events.
    Built,
    Removal(Removal),
}

/// A removal written as bytes: where its bytes and hashes lie.
#[derive(Debug, Clone, Copy)]
struct Removal {
    tier: Option<i32>,
    body: Span,
    hashes: Span,
}

/// One event handed out by [`TranscodedPayload::drain`].
#[derive(Debug)]
pub enum Forwarded<'p> {
    /// A store or a clear, built.
    Event(KvCacheEvent),
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
    }

    /// Room for `events` more events.
    pub(super) fn reserve(&mut self, events: usize) {
        self.order.reserve(events);
    }

    /// Adds a forwarded event, writing a removal as bytes.
    pub(super) fn push(&mut self, event_id: u64, event: Normalized<'_>) {
        match event {
            Normalized::Built(data) => {
                self.built.push(KvCacheEvent {
                    event_id,
                    data: Some(data),
                });
                self.order.push(Transcoded::Built);
            }
            Normalized::Removed(fields) => {
                let body_start = self.encoded.len();
                fields.encode_event(event_id, &mut self.encoded);
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

    /// The built events (stores and clears), in engine order.
    pub fn built(&self) -> &[KvCacheEvent] {
        &self.built
    }

    /// Each removal's tier and hashes, in engine order.
    pub fn removals(&self) -> impl Iterator<Item = (Option<i32>, &[i64])> + Clone + '_ {
        self.order.iter().filter_map(|event| match event {
            Transcoded::Removal(removal) => {
                Some((removal.tier, &self.hashes[range(removal.hashes)]))
            }
            Transcoded::Built => None,
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

/// Bytes the removals' buffers keep between payloads: 4,096 one-block
/// removals take about 160 kB of bytes and 32 kB of hashes.
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
