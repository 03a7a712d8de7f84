//! Buffers of events already sent, refilled for the next events.
//!
//! Invariant: each kind of buffer keeps at most [`MAX_SPARE_BUFFERS`]
//! buffers of a bounded capacity ([`MAX_SPARE_TOKENS`] tokens,
//! [`MAX_SPARE_HASHES`] hashes, [`MAX_SPARE_TEXT`] bytes of text), so what
//! is kept is bounded whatever the engines send (1.6 MiB at most); a buffer
//! beyond either bound is freed as before. Every stored block of a payload
//! needs its own token buffer, every removal its own hash list and medium
//! name (vLLM sends one removal per evicted block), and the drain is done
//! with them a few microseconds later. A buffer handed back and refilled
//! saves an allocation and a free on the hot path; fewer small frees also
//! leave glibc fewer chunks to merge at the next large allocation.

use crate::proto::common::{KvCacheEvent, kv_cache_event::Data};

/// Enough for 16 payloads of 64-block stores, the drain's usual cycle.
const MAX_SPARE_BUFFERS: usize = 1024;
/// The largest block size engines use (256 tokens).
const MAX_SPARE_TOKENS: usize = 256;
/// A removal names one block, or a few (SGLang); longer lists are rare.
const MAX_SPARE_HASHES: usize = 64;
/// Media, attention kinds, owners and session ids; long LoRA names are rare.
const MAX_SPARE_TEXT: usize = 64;

/// Spare buffers for stored blocks' tokens, removals' hashes and events'
/// text fields.
#[derive(Debug, Default)]
pub(crate) struct SpareBuffers {
    tokens: Spares<Vec<u32>, MAX_SPARE_TOKENS>,
    hashes: Spares<Vec<i64>, MAX_SPARE_HASHES>,
    texts: Spares<String, MAX_SPARE_TEXT>,
}

impl SpareBuffers {
    /// A buffer holding `tokens`, a spare one if any is left.
    pub(crate) fn tokens(&mut self, tokens: &[u32]) -> Vec<u32> {
        self.tokens.filled(tokens)
    }

    /// A buffer holding `hashes`, a spare one if any is left.
    pub(crate) fn hashes(&mut self, hashes: &[i64]) -> Vec<i64> {
        self.hashes.filled(hashes)
    }

    /// A string holding `text`, if any, a spare one if any is left.
    pub(crate) fn text(&mut self, text: Option<&str>) -> Option<String> {
        text.map(|text| self.texts.filled(text))
    }

    /// Keeps the buffers of `event`, which it gives up.
    pub(crate) fn give_back(&mut self, event: &mut KvCacheEvent) {
        match event.data.as_mut() {
            Some(Data::Stored(stored)) => {
                for text in [
                    &mut stored.medium,
                    &mut stored.kv_cache_spec_kind,
                    &mut stored.ownership,
                    &mut stored.session_id,
                    &mut stored.lora_name,
                    &mut stored.cache_salt,
                ] {
                    self.keep_text(text);
                }
                for block in &mut stored.blocks {
                    self.tokens.keep(&mut block.token_ids);
                }
            }
            Some(Data::Removed(removed)) => {
                self.keep_text(&mut removed.medium);
                self.keep_text(&mut removed.ownership);
                self.hashes.keep(&mut removed.block_hashes);
            }
            Some(Data::Cleared(_)) | None => {}
        }
    }

    fn keep_text(&mut self, text: &mut Option<String>) {
        if let Some(text) = text {
            self.texts.keep(text);
        }
    }
}

/// A buffer that can be emptied and filled again without allocating.
trait Buffer: Default {
    type Items: ?Sized;
    fn refill(&mut self, items: &Self::Items);
    fn capacity(&self) -> usize;
}

impl<T: Copy> Buffer for Vec<T> {
    type Items = [T];

    fn refill(&mut self, items: &[T]) {
        self.clear();
        self.extend_from_slice(items);
    }

    fn capacity(&self) -> usize {
        Vec::capacity(self)
    }
}

impl Buffer for String {
    type Items = str;

    fn refill(&mut self, text: &str) {
        self.clear();
        self.push_str(text);
    }

    fn capacity(&self) -> usize {
        String::capacity(self)
    }
}

/// Up to [`MAX_SPARE_BUFFERS`] buffers of at most `MAX_CAPACITY` items.
#[derive(Debug)]
struct Spares<B, const MAX_CAPACITY: usize> {
    buffers: Vec<B>,
}

impl<B, const MAX_CAPACITY: usize> Default for Spares<B, MAX_CAPACITY> {
    fn default() -> Self {
        Self {
            buffers: Vec::new(),
        }
    }
}

impl<B: Buffer, const MAX_CAPACITY: usize> Spares<B, MAX_CAPACITY> {
    fn filled(&mut self, items: &B::Items) -> B {
        let mut buffer = self.buffers.pop().unwrap_or_default();
        buffer.refill(items);
        buffer
    }

    /// Takes `buffer`, leaving it empty, if it is within bounds.
    fn keep(&mut self, buffer: &mut B) {
        // An empty buffer would take a slot and save no allocation.
        if self.buffers.len() < MAX_SPARE_BUFFERS && (1..=MAX_CAPACITY).contains(&buffer.capacity())
        {
            self.buffers.push(std::mem::take(buffer));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::{KvBlock, KvBlocksRemoved, KvBlocksStored};

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
                medium: Some("GPU".into()),
                ..Default::default()
            })),
        }
    }

    fn removal(hashes: usize, medium: &str) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 2,
            data: Some(Data::Removed(KvBlocksRemoved {
                block_hashes: vec![5; hashes],
                medium: Some(medium.into()),
                ..Default::default()
            })),
        }
    }

    #[test]
    fn a_buffer_given_back_is_refilled_with_exactly_the_new_tokens() {
        let mut spare = SpareBuffers::default();
        let mut sent = store(1, 16);
        spare.give_back(&mut sent);
        assert_eq!(spare.tokens.buffers.len(), 1);
        assert_eq!(spare.tokens(&[1, 2, 3]), vec![1, 2, 3]);
        assert!(spare.tokens.buffers.is_empty());
        assert_eq!(spare.tokens(&[4]), vec![4], "none left: a new buffer");
    }

    #[test]
    fn a_removal_s_hashes_and_medium_given_back_are_refilled_with_exactly_the_new_ones() {
        let mut spare = SpareBuffers::default();
        spare.give_back(&mut removal(1, "GPU"));
        assert_eq!(spare.hashes.buffers.len(), 1);
        assert_eq!(spare.texts.buffers.len(), 1);
        assert!(spare.tokens.buffers.is_empty());
        assert_eq!(spare.hashes(&[-9, 8]), vec![-9, 8]);
        assert_eq!(
            spare.text(Some("CPU_PINNED")).as_deref(),
            Some("CPU_PINNED")
        );
        assert_eq!(spare.text(None), None);
        assert!(spare.hashes.buffers.is_empty() && spare.texts.buffers.is_empty());
    }

    #[test]
    fn no_more_buffers_and_no_larger_ones_than_the_bounds_are_kept() {
        let mut spare = SpareBuffers::default();
        spare.give_back(&mut store(3, MAX_SPARE_TOKENS + 1));
        spare.give_back(&mut store(3, 0));
        spare.give_back(&mut removal(
            MAX_SPARE_HASHES + 1,
            &"x".repeat(MAX_SPARE_TEXT + 1),
        ));
        spare.give_back(&mut removal(0, ""));
        assert!(spare.tokens.buffers.is_empty());
        assert!(spare.hashes.buffers.is_empty());
        assert_eq!(spare.texts.buffers.len(), 2, "the stores' media");
        for _ in 0..3 {
            spare.give_back(&mut store(MAX_SPARE_BUFFERS / 2, 16));
        }
        for _ in 0..MAX_SPARE_BUFFERS + 5 {
            spare.give_back(&mut removal(1, "GPU"));
        }
        assert_eq!(spare.tokens.buffers.len(), MAX_SPARE_BUFFERS);
        assert_eq!(spare.hashes.buffers.len(), MAX_SPARE_BUFFERS);
        assert_eq!(spare.texts.buffers.len(), MAX_SPARE_BUFFERS);
    }
}
