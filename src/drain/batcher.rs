//! Packing converted events into outgoing batches.
//!
//! Invariants: a batch holds events of one rank only, at most
//! `max_events` of them, and its encoded events take at most `max_bytes`
//! (the router refuses messages over 4 MiB). An event too large on its own
//! is split into several events of the same kind first: a store into a
//! parent-linked chain of stores, a removal into several removals. Events are
//! encoded once, here, as they arrive; closing a batch only prepends its
//! header.

use prost::Message;
use prost::encoding;

use crate::hub::batch::{EventLen, OpenBatch};
use crate::hub::wire;
use crate::proto::common::{KvCacheEvent, kv_cache_event::Data};

/// Limits of one outgoing batch.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    pub max_events: usize,
    pub max_bytes: usize,
}

/// Fills batches for one rank, handing over each full one.
#[derive(Debug)]
pub struct Batcher {
    limits: BatchLimits,
    open: OpenBatch,
    /// The event being added, encoded (reused from event to event).
    encoded: Vec<u8>,
    scratch: Vec<u8>,
}

impl Batcher {
    pub fn new(limits: BatchLimits) -> Self {
        Self {
            limits,
            open: OpenBatch::default(),
            encoded: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Adds `event`; every batch that becomes full on the way goes to `full`.
    pub fn push(
        &mut self,
        mut event: KvCacheEvent,
        timestamp: f64,
        full: &mut impl FnMut(OpenBatch),
    ) {
        wire::encode_event(&mut event, &mut self.encoded, &mut self.scratch);
        let len = EventLen::of_body(self.encoded.len());
        if len.entry > self.limits.max_bytes {
            for piece in split(event, self.limits.max_bytes) {
                self.push(piece, timestamp, full);
            }
            return;
        }
        if !self
            .open
            .fits(self.limits.max_events, self.limits.max_bytes, len.entry)
        {
            full(std::mem::take(&mut self.open));
        }
        self.open.push_encoded(&self.encoded, timestamp);
    }

    /// Hands over the batch being filled, if it has any event.
    pub fn close(&mut self) -> Option<OpenBatch> {
        (!self.open.is_empty()).then(|| std::mem::take(&mut self.open))
    }
}

/// Splits an event whose encoding exceeds `max_bytes` into events that fit.
/// Stores are cut into consecutive runs of blocks, each run's parent being
/// the previous run's last block, so the chain stays intact.
fn split(event: KvCacheEvent, max_bytes: usize) -> Vec<KvCacheEvent> {
    let event_id = event.event_id;
    let wrap = |data: Data| KvCacheEvent {
        event_id,
        data: Some(data),
    };
    match event.data {
        Some(Data::Stored(stored)) if stored.blocks.len() > 1 => {
            let mut pieces = Vec::new();
            let template = crate::proto::common::KvBlocksStored {
                blocks: Vec::new(),
                ..stored.clone()
            };
            let overhead = template.encoded_len() + 16;
            let mut current = template.clone();
            let mut size = overhead;
            for block in stored.blocks {
                let block_len = encoding::message::encoded_len(1, &block);
                if !current.blocks.is_empty() && size + block_len > max_bytes {
                    let last_hash = current.blocks.last().map(|b| b.block_hash);
                    let finished = std::mem::replace(&mut current, template.clone());
                    current.parent_block_hash = last_hash;
                    size = overhead;
                    pieces.push(wrap(Data::Stored(finished)));
                }
                size += block_len;
                current.blocks.push(block);
            }
            pieces.push(wrap(Data::Stored(current)));
            pieces
        }
        Some(Data::Removed(removed)) if removed.block_hashes.len() > 1 => {
            // An int64 takes at most 10 bytes as a varint.
            let per_piece = (max_bytes.saturating_sub(128) / 10).max(1);
            removed
                .block_hashes
                .chunks(per_piece)
                .map(|hashes| {
                    wrap(Data::Removed(crate::proto::common::KvBlocksRemoved {
                        block_hashes: hashes.to_vec(),
                        ..removed.clone()
                    }))
                })
                .collect()
        }
        // A single block larger than a batch cannot be split further; it goes
        // alone and the router's own limit decides.
        data => vec![KvCacheEvent { event_id, data }],
    }
}

#[cfg(test)]
mod tests {
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

    fn collect(limits: BatchLimits, events: Vec<KvCacheEvent>) -> Vec<KvEventBatch> {
        let mut batcher = Batcher::new(limits);
        let mut batches = Vec::new();
        for event in events {
            batcher.push(event, 1.5, &mut |batch| batches.push(batch));
        }
        batches.extend(batcher.close());
        batches
            .into_iter()
            .enumerate()
            .map(|(i, batch)| KvEventBatch::decode(batch.encode(2, 100 + i as u64, None)).unwrap())
            .collect()
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
    fn a_batch_stays_under_the_byte_limit() {
        let limits = BatchLimits {
            max_events: 1024,
            max_bytes: 4096,
        };
        let events: Vec<_> = (0..100).map(|i| stored(i..i + 1, 64)).collect();
        let mut batcher = Batcher::new(limits);
        let mut batches = Vec::new();
        for event in events {
            batcher.push(event, 0.0, &mut |batch| batches.push(batch));
        }
        batches.extend(batcher.close());
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
}
