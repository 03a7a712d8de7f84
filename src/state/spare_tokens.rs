//! Token buffers of removed records, refilled for the next new records.
//!
//! Invariant: at most [`MAX_SPARE_BUFFERS`] buffers of at most
//! [`MAX_SPARE_TOKENS`] tokens are kept (1.1 MiB at most), each one no cut
//! shares (its count is one: a record in a page a cut shares keeps its
//! tokens shared, and such a buffer is dropped as before), and a spare is
//! refilled only by tokens of its own length, so a record never sees
//! another's tokens. In a full engine's steady state every store is a new
//! record and every eviction drops one: a buffer passed from the one to the
//! other saves an allocation and a free per block. One engine's blocks
//! share a length; where lengths alternate (groups of different block
//! sizes), a spare of the other length is freed as before.

use triomphe::{Arc, ThinArc};

/// About 16 payloads of 64 evictions, the drain's usual cycle.
const MAX_SPARE_BUFFERS: usize = 1024;
/// The largest block size engines use (256 tokens).
const MAX_SPARE_TOKENS: usize = 256;

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

    /// Keeps `buffer` if no cut shares it and it is within the bounds.
    pub(crate) fn keep(&mut self, mut buffer: ThinArc<(), u32>) {
        if self.buffers.len() < MAX_SPARE_BUFFERS
            && (1..=MAX_SPARE_TOKENS).contains(&buffer.slice.len())
            && buffer.with_arc_mut(|arc| Arc::get_mut(arc).is_some())
        {
            self.buffers.push(buffer);
        }
    }

    /// Buffers kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.buffers.len()
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
    fn no_more_buffers_and_no_longer_ones_than_the_bounds_are_kept() {
        let mut spare = SpareTokens::default();
        spare.keep(buffer(&[7; MAX_SPARE_TOKENS + 1]));
        spare.keep(buffer(&[]));
        assert!(spare.buffers.is_empty());
        for _ in 0..MAX_SPARE_BUFFERS + 3 {
            spare.keep(buffer(&[1]));
        }
        assert_eq!(spare.buffers.len(), MAX_SPARE_BUFFERS);
    }
}
