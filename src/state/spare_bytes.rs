//! Block buffers of removed records, refilled for the next new records.
//!
//! Invariant: at most [`MAX_SPARE_BUFFERS`] buffers of at most
//! [`MAX_SPARE_BYTES`] bytes are kept (1.4 MiB at most), each one no cut
//! shares (its count is one: a record in a page a cut shares keeps its
//! bytes shared, and such a buffer is dropped as before), and a spare is
//! refilled only by bytes of its own size class, so a record never holds
//! more than a class's slack. In a full engine's steady state every store
//! is a new record and every eviction drops one: a buffer passed from the
//! one to the other saves an allocation and a free per block.
//!
//! A buffer's size is its class, not its bytes: a block's bytes vary with
//! its tokens' widths, and buffers of exact lengths would rarely match.
//! The classes step by 16 bytes where glibc's chunks do: a buffer asks
//! for 16 bytes of count and length besides its class, glibc adds 8 of
//! its own and rounds to 16, so a class fills its chunk exactly and its
//! slack costs no memory beside what malloc rounds up anyway. Only the
//! spare kept last is tried: where an engine's blocks fall in two classes,
//! a spare of the other one is freed, as an exact length's would be.

use triomphe::{Arc, ThinArc};

/// About 16 payloads of 64 evictions, the drain's usual cycle.
const MAX_SPARE_BUFFERS: usize = 1024;
/// The class of the largest block engines use (256 tokens) at its widest
/// tokens, with room for its other fields.
const MAX_SPARE_BYTES: usize = size_class(256 * 5 + 64);

/// The buffer size that holds `len` bytes: 8 bytes short of a multiple of
/// 16, as glibc's chunk sizes fall for a `ThinArc`'s allocation.
pub(crate) const fn size_class(len: usize) -> usize {
    (len + 8).next_multiple_of(16) - 8
}

#[derive(Debug, Default)]
pub(crate) struct SpareBytes {
    buffers: Vec<ThinArc<(), u8>>,
    /// A new buffer's bytes padded to their class, so the buffer is made
    /// with one copy rather than byte by byte.
    padded: Vec<u8>,
}

impl SpareBytes {
    /// A shared buffer whose first bytes are `bytes`: a spare of their
    /// class refilled, or a new one.
    pub(crate) fn filled(&mut self, bytes: &[u8]) -> ThinArc<(), u8> {
        let class = size_class(bytes.len());
        if let Some(mut spare) = self.buffers.pop() {
            let refilled = spare.with_arc_mut(|arc| {
                Arc::get_mut(arc)
                    .filter(|inner| inner.length() == class)
                    .map(|inner| inner.slice_mut()[..bytes.len()].copy_from_slice(bytes))
                    .is_some()
            });
            if refilled {
                return spare;
            }
        }
        self.padded.clear();
        self.padded.extend_from_slice(bytes);
        self.padded.resize(class, 0);
        let new = ThinArc::from_header_and_slice((), &self.padded);
        self.padded.shrink_to(MAX_SPARE_BYTES);
        new
    }

    /// Keeps `buffer` if no cut shares it and it is within the bounds.
    pub(crate) fn keep(&mut self, mut buffer: ThinArc<(), u8>) {
        if self.buffers.len() < MAX_SPARE_BUFFERS
            && (1..=MAX_SPARE_BYTES).contains(&buffer.slice.len())
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

    fn buffer(bytes: &[u8]) -> ThinArc<(), u8> {
        ThinArc::from_header_and_slice((), bytes)
    }

    #[test]
    fn a_buffer_holds_its_bytes_in_the_class_malloc_would_round_them_to() {
        assert_eq!(size_class(1), 8);
        assert_eq!(size_class(8), 8);
        assert_eq!(size_class(9), 24);
        assert_eq!(size_class(50), 56);
        assert_eq!(size_class(56), 56);
        assert_eq!(size_class(57), 72);
        let mut spare = SpareBytes::default();
        let filled = spare.filled(&[1, 2, 3]);
        assert_eq!(filled.slice.len(), 8);
        assert_eq!(filled.slice[..3], [1, 2, 3]);
    }

    /// What glibc's malloc gives a buffer of each class is what it asked
    /// for, in whole 16-byte steps: a class wastes none of a chunk. (A free
    /// chunk one step larger may be handed out whole, whatever the request,
    /// so the steps are what is checked, not the exact size.)
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn a_class_fills_the_chunk_glibc_gives_it() {
        let mut spare = SpareBytes::default();
        for len in 0..=MAX_SPARE_BYTES {
            let buffer = spare.filled(&vec![1; len]);
            let header = buffer.slice.as_ptr() as usize - buffer.ptr() as usize;
            // SAFETY: `ptr` is the start of the buffer's live allocation,
            // made by the global allocator: glibc's malloc.
            let usable = unsafe { libc::malloc_usable_size(buffer.ptr().cast_mut()) };
            let slack = usable - (header + size_class(len));
            assert_eq!(slack % 16, 0, "{len} bytes: {usable} usable");
        }
        assert_eq!(size_class(MAX_SPARE_BYTES), MAX_SPARE_BYTES);
    }

    #[test]
    fn a_kept_buffer_is_refilled_in_place_by_bytes_of_its_class() {
        let mut spare = SpareBytes::default();
        let kept = spare.filled(&[1; 50]);
        let address = kept.ptr();
        spare.keep(kept);
        let refilled = spare.filled(&[7; 43]);
        assert_eq!(refilled.ptr(), address, "no new allocation");
        assert_eq!(refilled.slice[..43], [7; 43]);
        assert!(spare.buffers.is_empty());
    }

    #[test]
    fn a_spare_of_another_class_is_never_refilled() {
        let mut spare = SpareBytes::default();
        let kept = spare.filled(&[9; 50]);
        spare.keep(kept);
        let other = spare.filled(&[4; 60]);
        assert_eq!(other.slice.len(), 72);
        assert_eq!(other.slice[..60], [4; 60]);
        assert!(spare.buffers.is_empty(), "the spare of class 56 is freed");
    }

    #[test]
    fn a_buffer_a_cut_still_shares_is_not_kept() {
        let mut spare = SpareBytes::default();
        let in_cut = buffer(&[1, 2]);
        spare.keep(in_cut.clone());
        assert!(spare.buffers.is_empty());
        assert_eq!(spare.filled(&[5, 6]).slice[..2], [5, 6]);
        assert_eq!(in_cut.slice, [1, 2], "the cut's bytes are untouched");
    }

    #[test]
    fn no_more_buffers_and_no_longer_ones_than_the_bounds_are_kept() {
        let mut spare = SpareBytes::default();
        spare.keep(buffer(&[7; MAX_SPARE_BYTES + 1]));
        spare.keep(buffer(&[]));
        assert!(spare.buffers.is_empty());
        for _ in 0..MAX_SPARE_BUFFERS + 3 {
            spare.keep(buffer(&[1]));
        }
        assert_eq!(spare.buffers.len(), MAX_SPARE_BUFFERS);
    }
}
