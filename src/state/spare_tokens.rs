//! Token buffers of removed records, refilled for the next new records.
//!
//! Invariant: at most [`MAX_SPARE_TOKENS`] buffers are kept, each one no
//! cut shares (its count is one: a record copied into a cut's shard keeps
//! its tokens shared, and such a buffer is dropped as before), and a spare
//! is refilled only by tokens of its own length, so a record never sees
//! another's tokens. In a full engine's steady state every store is a new
//! record and every eviction drops one: a buffer passed from the one to the
//! other saves an allocation and a free per block.

use triomphe::{Arc, ThinArc};

/// About 16 payloads of 64 evictions, the drain's usual cycle; at 16
/// tokens a block, 80 KiB.
const MAX_SPARE_TOKENS: usize = 1024;

#[derive(Debug, Default)]
pub(crate) struct SpareTokens {
    buffers: Vec<ThinArc<(), u32>>,
}

impl SpareTokens {
    /// A shared buffer holding `tokens`: a spare of that length refilled,
    /// or a new one.
    pub(crate) fn filled(&mut self, tokens: &[u32]) -> ThinArc<(), u32> {
        if let Some(mut spare) = self.buffers.pop() {
            let refilled = spare.with_arc_mut(|arc| {
                Arc::get_mut(arc)
                    .filter(|inner| inner.length() == tokens.len())
                    .map(|inner| inner.slice_mut().copy_from_slice(tokens))
                    .is_some()
            });
            if refilled {
                return spare;
            }
        }
        ThinArc::from_header_and_iter((), tokens.iter().copied())
    }

    /// Keeps `buffer` if no cut shares it and fewer than the bound are kept.
    pub(crate) fn keep(&mut self, mut buffer: ThinArc<(), u32>) {
        let unique = buffer.with_arc_mut(|arc| Arc::get_mut(arc).is_some());
        if unique && self.buffers.len() < MAX_SPARE_TOKENS {
            self.buffers.push(buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(tokens: &[u32]) -> ThinArc<(), u32> {
        ThinArc::from_header_and_iter((), tokens.iter().copied())
    }

    #[test]
    fn a_kept_buffer_is_refilled_in_place_with_exactly_the_new_tokens() {
        let mut spare = SpareTokens::default();
        let kept = buffer(&[1, 2, 3]);
        let address = kept.ptr();
        spare.keep(kept);
        let refilled = spare.filled(&[7, 8, 9]);
        assert_eq!(refilled.ptr(), address, "no new allocation");
        assert_eq!(refilled.slice, [7, 8, 9]);
        assert!(spare.buffers.is_empty());
    }

    #[test]
    fn a_spare_of_another_length_is_never_refilled() {
        let mut spare = SpareTokens::default();
        spare.keep(buffer(&[1, 2, 3]));
        assert_eq!(spare.filled(&[4, 5]).slice, [4, 5]);
        assert!(spare.buffers.is_empty(), "the spare of 3 tokens is freed");
    }

    #[test]
    fn a_buffer_a_cut_still_shares_is_not_kept() {
        let mut spare = SpareTokens::default();
        let in_cut = buffer(&[1, 2]);
        spare.keep(in_cut.clone());
        assert!(spare.buffers.is_empty());
        assert_eq!(spare.filled(&[5, 6]).slice, [5, 6]);
        assert_eq!(in_cut.slice, [1, 2], "the cut's tokens are untouched");
    }

    #[test]
    fn no_more_than_the_bound_are_kept() {
        let mut spare = SpareTokens::default();
        for _ in 0..MAX_SPARE_TOKENS + 3 {
            spare.keep(buffer(&[1]));
        }
        assert_eq!(spare.buffers.len(), MAX_SPARE_TOKENS);
    }
}
