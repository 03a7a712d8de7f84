//! Token buffers of blocks already sent, refilled for the next stores.
//!
//! Invariant: at most [`MAX_SPARE_BUFFERS`] buffers of at most
//! [`MAX_SPARE_TOKENS`] tokens' capacity each are kept (1 MiB at most), so
//! what is kept is bounded whatever the engines send; a buffer beyond either
//! bound is freed as before. Every stored block of a payload needs its own
//! token buffer, and the drain is done with it a few microseconds later: a
//! buffer handed back and refilled saves an allocation and a free per
//! block on the hot path.

use crate::proto::common::{KvCacheEvent, kv_cache_event::Data};

/// Enough for 16 payloads of 64-block stores, the drain's usual cycle.
const MAX_SPARE_BUFFERS: usize = 1024;
/// The largest block size engines use (256 tokens).
const MAX_SPARE_TOKENS: usize = 256;

#[derive(Debug, Default)]
pub(crate) struct SpareTokens {
    buffers: Vec<Vec<u32>>,
}

impl SpareTokens {
    /// A buffer holding `tokens`, a spare one if any is left.
    pub(crate) fn filled(&mut self, tokens: &[u32]) -> Vec<u32> {
        match self.buffers.pop() {
            Some(mut buffer) => {
                buffer.clear();
                buffer.extend_from_slice(tokens);
                buffer
            }
            None => tokens.to_vec(),
        }
    }

    /// Keeps the token buffers of `event`'s blocks, which it gives up.
    pub(crate) fn give_back(&mut self, event: &mut KvCacheEvent) {
        let Some(Data::Stored(stored)) = event.data.as_mut() else {
            return;
        };
        for block in &mut stored.blocks {
            if self.buffers.len() == MAX_SPARE_BUFFERS {
                return;
            }
            // An empty buffer would take a slot and save no allocation.
            if (1..=MAX_SPARE_TOKENS).contains(&block.token_ids.capacity()) {
                self.buffers.push(std::mem::take(&mut block.token_ids));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::{KvBlock, KvBlocksStored};

    fn store(blocks: usize, tokens_each: usize) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 1,
            data: Some(Data::Stored(KvBlocksStored {
                blocks: (0..blocks)
                    .map(|hash| KvBlock {
                        block_hash: hash as i64,
                        token_ids: vec![7; tokens_each],
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            })),
        }
    }

    #[test]
    fn a_buffer_given_back_is_refilled_with_exactly_the_new_tokens() {
        let mut spare = SpareTokens::default();
        let mut sent = store(1, 16);
        spare.give_back(&mut sent);
        assert_eq!(spare.buffers.len(), 1);
        assert_eq!(spare.filled(&[1, 2, 3]), vec![1, 2, 3]);
        assert!(spare.buffers.is_empty());
        assert_eq!(spare.filled(&[4]), vec![4], "none left: a new buffer");
    }

    #[test]
    fn no_more_buffers_and_no_larger_ones_than_the_bounds_are_kept() {
        let mut spare = SpareTokens::default();
        spare.give_back(&mut store(3, MAX_SPARE_TOKENS + 1));
        spare.give_back(&mut store(3, 0));
        assert!(spare.buffers.is_empty());
        for _ in 0..3 {
            spare.give_back(&mut store(MAX_SPARE_BUFFERS / 2, 16));
        }
        assert_eq!(spare.buffers.len(), MAX_SPARE_BUFFERS);
    }
}
