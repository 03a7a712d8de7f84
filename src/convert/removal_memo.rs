//! Removals that differ only in their hashes, read and judged once per
//! payload.
//!
//! A full engine evicts one block per `BlockRemoved`, and the removals of
//! one payload differ only in that hash: the same keys, medium and group
//! (vLLM writes `{type, block_hashes, medium, group_idx}` for every one).
//! Reading one in full (its keys matched, its placement's strings checked)
//! and judging it (its medium's tier, its group's kind) cost more than the
//! rest of its way through the drain. So a removal read and judged in full
//! leaves its bytes around its hash list and its verdict here, and the next
//! event whose bytes match those around a hash list of its own takes that
//! verdict with its own hashes, read by the same code.
//!
//! Invariant: a verdict taken from the memo is the one reading and judging
//! the event in full would give. Reading is a function of the event's bytes
//! alone: the hash list is one self-delimiting value, so bytes that match
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
    /// (`groups_stamp`); otherwise leaves
    /// the reader where it was and returns `None`, and the event is read in
    /// full (a broken payload shows there).
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
