//! Removals that differ only in their hashes, read and judged once per
//! payload.
//!
//! A full engine evicts one block per `BlockRemoved`, and the removals of
//! one payload differ only in that hash: the same keys, medium and group
//! (vLLM writes `{type, block_hashes, medium, group_idx}` for every one).
//! Reading one in full (its keys matched, its placement's strings checked)
//! and judging it (its medium's tier, its group's kind) cost more than the
//! rest of its way through the drain. So the last removal read and judged
//! in full leaves its bytes around its hash list and its verdict here, and
//! a later event of the payload whose bytes match those around a hash list
//! of its own takes that verdict with its own hashes, read by the same
//! code. Only the last is kept: removals of two shapes taking turns are
//! each read in full.
//!
//! Invariant: a verdict taken from the memo is the one reading and judging
//! the event in full would give. Reading is a function of the event's bytes
//! alone (a look past its end only ever picks between paths that read the
//! same): the hash list is one self-delimiting value, so bytes that match
//! before and after it read the same fields, and the memo only serves an
//! event whose list reads as hashes, as the remembered one's did. Judging a
//! removal depends on those fields, the rank (one per payload, as is the
//! memo) and the cache-group kinds the normalizer knows. The memo keeps the
//! normalizer's stamp of those kinds as the judgement left them, and serves
//! only while it holds: judging the removal again would then find the kinds
//! as it left them, learn nothing, and give the same verdict.

use std::ops::Range;

use super::event::{self, Scratch};
use super::msgpack::Reader;
use super::tally::DropReason;
use crate::wire::event::RemovedFields;

/// The last removal of a payload read and judged in full.
#[derive(Debug, Clone, Copy)]
pub(super) struct RemovalMemo<'a> {
    /// The event's bytes before its hash list.
    before: &'a [u8],
    /// The event's bytes after its hash list.
    after: &'a [u8],
    /// The normalizer's groups stamp once the removal was judged.
    groups_stamp: u64,
    /// The removal as forwarded, its hashes empty, or why it was dropped.
    verdict: Result<RemovedFields<'a>, DropReason>,
}

impl<'a> RemovalMemo<'a> {
    /// Remembers the removal `event` (its whole bytes), whose only hash list
    /// lies at `hash_list` within them and read as hashes, judged `verdict`
    /// under `groups_stamp`.
    pub(super) fn new(
        event: &'a [u8],
        hash_list: Range<usize>,
        groups_stamp: u64,
        verdict: Result<RemovedFields<'a>, DropReason>,
    ) -> Self {
        RemovalMemo {
            before: &event[..hash_list.start],
            after: &event[hash_list.end..],
            groups_stamp,
            verdict,
        }
    }

    /// Reads the next event as the remembered removal: its verdict and the
    /// event's own hashes, if its bytes match the remembered ones around a
    /// list of hashes and the groups are still as they were
    /// (`groups_stamp`). Otherwise returns `None` with the reader where it
    /// was (the scratch's hashes may have been overwritten), and the event
    /// is read in full: a broken payload shows there.
    pub(super) fn reuse<'s>(
        &self,
        r: &mut Reader<'a>,
        scratch: &'s mut Scratch,
        groups_stamp: u64,
    ) -> Option<(Result<RemovedFields<'a>, DropReason>, &'s [i64])> {
        if groups_stamp != self.groups_stamp {
            return None;
        }
        let start = r.position();
        if !r.eat(self.before) {
            return None;
        }
        match event::read_hash_list(r, scratch) {
            Ok(Some(hashes)) if r.eat(self.after) => Some((self.verdict, hashes)),
            _ => {
                r.rewind(start);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::event::Event;
    use crate::convert::normalize::Normalizer;

    /// vLLM's removal of `hashes` on `medium`, as its publisher writes it.
    fn vllm_removal(hashes: &[u64], medium: &str) -> Vec<u8> {
        use rmp::encode::*;
        let mut out = Vec::new();
        write_map_len(&mut out, 4).unwrap();
        write_str(&mut out, "type").unwrap();
        write_str(&mut out, "BlockRemoved").unwrap();
        write_str(&mut out, "block_hashes").unwrap();
        write_array_len(&mut out, hashes.len() as u32).unwrap();
        for &hash in hashes {
            write_u64(&mut out, hash).unwrap();
        }
        write_str(&mut out, "medium").unwrap();
        write_str(&mut out, medium).unwrap();
        write_str(&mut out, "group_idx").unwrap();
        write_uint(&mut out, 0).unwrap();
        out
    }

    /// The memo of the removal `event`, read and judged in full.
    fn remembered<'a>(event: &'a [u8], normalizer: &mut Normalizer) -> RemovalMemo<'a> {
        let mut r = Reader::new(event);
        let mut scratch = Scratch::default();
        let read = event::read(&mut r, &mut scratch).unwrap();
        let (Ok(Event::Removed(removed)), Some(hash_list)) = (read.event, read.removal_hash_list)
        else {
            panic!("a removal with one hash list");
        };
        let verdict = normalizer.removed(0, &removed.placement);
        RemovalMemo::new(event, hash_list, normalizer.groups_stamp(), verdict)
    }

    #[test]
    fn a_removal_alike_but_for_its_hashes_is_read_through_the_memo_to_its_end() {
        let mut normalizer = Normalizer::default();
        let first = vllm_removal(&[1], "GPU");
        let memo = remembered(&first, &mut normalizer);
        let second = vllm_removal(&[u64::MAX, 7], "GPU");
        let mut payload = second.clone();
        payload.push(0xc0);
        let mut r = Reader::new(&payload);
        let mut scratch = Scratch::default();
        let (verdict, hashes) = memo
            .reuse(&mut r, &mut scratch, normalizer.groups_stamp())
            .expect("taken from the memo");
        assert_eq!(hashes, [-1, 7]);
        assert_eq!(verdict.unwrap().medium, Some("GPU"));
        assert_eq!(r.position(), second.len(), "the event read to its end");
    }

    #[test]
    fn an_event_that_differs_beside_its_hashes_or_under_other_groups_is_left_for_the_full_read() {
        let mut normalizer = Normalizer::default();
        let first = vllm_removal(&[1], "GPU");
        let memo = remembered(&first, &mut normalizer);
        let stamp = normalizer.groups_stamp();
        let alike = vllm_removal(&[2], "GPU");
        let mut no_hash = vllm_removal(&[2], "GPU");
        // The hash cell's `uint 64` marker made a fixstr of its 8 bytes:
        // the bytes around the list still match, the list holds no hash.
        let cell = no_hash.iter().position(|&byte| byte == 0xcf).unwrap();
        no_hash[cell] = 0xa8;
        for (event, stamp) in [
            (vllm_removal(&[2], "CPU"), stamp),
            (alike.clone(), stamp + 1),
            (no_hash, stamp),
            (alike[..alike.len() - 1].to_vec(), stamp),
        ] {
            let mut r = Reader::new(&event);
            assert!(
                memo.reuse(&mut r, &mut Scratch::default(), stamp).is_none(),
                "{event:x?}"
            );
            assert_eq!(r.position(), 0, "the reader left where it was");
        }
    }
}
