//! Reading an engine publisher's message counter.
//!
//! Each publisher numbers its messages 0, 1, 2, … and starts over at 0 when
//! the engine restarts. Comparing each number with the last one seen tells
//! whether the message follows on, whether some were lost in between, or
//! whether the publisher started over (contract section 4).
//!
//! Priming complicates this: the live socket subscribes before the replay
//! that primes kvgate is served, so it may deliver again messages the replay
//! already gave. Invariant: such a copy is recognised as an echo only if its
//! number lies in the primed run and its payload hashes (64 bits) like the
//! primed one; anything else under a primed number is a restarted engine,
//! never silently skipped.
//!
//! A counter that leaps further ahead than an engine could publish
//! (`MAX_PLAUSIBLE_GAP`) did not lose those messages: its numbers no longer
//! relate to the last one (garbage, or a publisher that started over from a
//! number of its own). Such a jump is told apart from a gap, so a lost
//! range is never counted larger than that bound.

use std::hash::BuildHasher;
use std::ops::RangeInclusive;

use bytes::Bytes;
use rustc_hash::FxBuildHasher;

/// The most numbers a gap may skip and still be taken for lost messages:
/// 2^32, over 49 days of an engine publishing a thousand messages a second
/// while kvgate heard none of them.
pub const MAX_PLAUSIBLE_GAP: u64 = 1 << 32;

/// How a message's engine sequence number relates to the previous one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Continuity {
    /// The first message seen from this publisher.
    First,
    /// Exactly the previous number + 1.
    Follows,
    /// Numbers in `missing` (at most `MAX_PLAUSIBLE_GAP`) never arrived.
    Gap { missing: RangeInclusive<u64> },
    /// The counter leapt more than `MAX_PLAUSIBLE_GAP` ahead: no message
    /// was lost, the numbers start over from here.
    Jumped,
    /// The counter went backwards: the publisher (engine) restarted.
    Restarted,
    /// A primed message delivered again by the live socket.
    Echo,
}

/// The last engine sequence number seen from one publisher.
#[derive(Clone, Debug, Default)]
pub struct PublisherCursor {
    last: Option<u64>,
    /// Set from priming until the live socket delivers a number past it.
    primed: Option<PrimedRun>,
}

/// Fingerprints of the primed messages: the live socket's copies are told
/// apart from a restarted engine's messages under the same numbers, without
/// holding the payloads for as long as the engine stays idle.
#[derive(Clone, Debug)]
struct PrimedRun {
    first: u64,
    fingerprints: Vec<u64>,
}

impl PrimedRun {
    fn repeats(&self, sequence: u64, payload: &[u8]) -> bool {
        sequence
            .checked_sub(self.first)
            .and_then(|index| self.fingerprints.get(usize::try_from(index).ok()?))
            .is_some_and(|&fingerprint| fingerprint == FxBuildHasher.hash_one(payload))
    }
}

impl PublisherCursor {
    #[cfg(test)]
    fn last(&self) -> Option<u64> {
        self.last
    }

    /// Takes `messages` (consecutive, from replay, forwarded before any live
    /// one) as seen.
    pub fn prime(&mut self, messages: &[(u64, Bytes)]) {
        let (Some((first, _)), Some((last, _))) = (messages.first(), messages.last()) else {
            return;
        };
        self.last = Some(*last);
        self.primed = Some(PrimedRun {
            first: *first,
            fingerprints: messages
                .iter()
                .map(|(_, payload)| FxBuildHasher.hash_one(payload.as_ref()))
                .collect(),
        });
    }

    /// Classifies a live message and, unless it is an echo, makes its number
    /// the new last one.
    pub fn observe(&mut self, sequence: u64, payload: &[u8]) -> Continuity {
        if self
            .primed
            .as_ref()
            .is_some_and(|primed| primed.repeats(sequence, payload))
        {
            return Continuity::Echo;
        }
        // Past the primed run the live socket has caught up; under a primed
        // number with other bytes, the engine restarted. No echo can follow.
        self.primed = None;
        let previous = self.last.replace(sequence);
        match previous {
            None => Continuity::First,
            Some(last) if sequence <= last => Continuity::Restarted,
            Some(last) if sequence == last + 1 => Continuity::Follows,
            Some(last) if sequence - last - 1 > MAX_PLAUSIBLE_GAP => Continuity::Jumped,
            Some(last) => Continuity::Gap {
                missing: last + 1..=sequence - 1,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_numbers_follow_on() {
        let mut cursor = PublisherCursor::default();
        assert_eq!(cursor.observe(0, b""), Continuity::First);
        assert_eq!(cursor.observe(1, b""), Continuity::Follows);
        assert_eq!(cursor.observe(2, b""), Continuity::Follows);
        assert_eq!(cursor.last(), Some(2));
    }

    #[test]
    fn skipped_numbers_are_a_gap_naming_what_is_missing() {
        let mut cursor = PublisherCursor::default();
        cursor.observe(4, b"");
        assert_eq!(cursor.observe(8, b""), Continuity::Gap { missing: 5..=7 });
    }

    #[test]
    fn a_leap_past_the_plausible_gap_is_a_jump_and_the_count_goes_on_from_it() {
        let mut cursor = PublisherCursor::default();
        cursor.observe(10, b"");
        let farthest_gap = 10 + MAX_PLAUSIBLE_GAP + 1;
        assert_eq!(
            cursor.observe(farthest_gap, b""),
            Continuity::Gap {
                missing: 11..=farthest_gap - 1
            }
        );
        assert_eq!(
            cursor.observe(farthest_gap + MAX_PLAUSIBLE_GAP + 2, b""),
            Continuity::Jumped
        );
        assert_eq!(cursor.observe(u64::MAX, b""), Continuity::Jumped);
        assert_eq!(cursor.observe(3, b""), Continuity::Restarted);
        assert_eq!(cursor.observe(4, b""), Continuity::Follows);
    }

    #[test]
    fn a_counter_that_goes_backwards_or_repeats_is_a_restart() {
        let mut cursor = PublisherCursor::default();
        cursor.observe(10, b"");
        assert_eq!(cursor.observe(0, b""), Continuity::Restarted);
        assert_eq!(cursor.observe(1, b""), Continuity::Follows);
        assert_eq!(cursor.observe(1, b""), Continuity::Restarted);
    }

    fn primed(run: RangeInclusive<u64>) -> PublisherCursor {
        let messages: Vec<(u64, Bytes)> = run
            .map(|seq| (seq, Bytes::from(format!("payload {seq}"))))
            .collect();
        let mut cursor = PublisherCursor::default();
        cursor.prime(&messages);
        cursor
    }

    fn payload(seq: u64) -> Vec<u8> {
        format!("payload {seq}").into_bytes()
    }

    #[test]
    fn priming_continues_the_count_from_the_last_primed_number() {
        let mut cursor = primed(3..=5);
        assert_eq!(cursor.last(), Some(5));
        assert_eq!(cursor.observe(6, &payload(6)), Continuity::Follows);

        let mut cursor = primed(3..=5);
        assert_eq!(
            cursor.observe(8, &payload(8)),
            Continuity::Gap { missing: 6..=7 }
        );
    }

    #[test]
    fn live_copies_of_primed_messages_are_echoes_until_a_newer_number_arrives() {
        let mut cursor = primed(3..=5);
        assert_eq!(cursor.observe(4, &payload(4)), Continuity::Echo);
        assert_eq!(cursor.observe(5, &payload(5)), Continuity::Echo);
        assert_eq!(cursor.last(), Some(5));
        assert_eq!(cursor.observe(6, &payload(6)), Continuity::Follows);
        // Past the primed run, the same bytes again are a repeat, hence a restart.
        assert_eq!(cursor.observe(5, &payload(5)), Continuity::Restarted);
    }

    #[test]
    fn other_bytes_under_a_primed_number_are_a_restarted_engine() {
        let mut cursor = primed(3..=5);
        assert_eq!(cursor.observe(4, &payload(4)), Continuity::Echo);
        assert_eq!(cursor.observe(0, b"new engine"), Continuity::Restarted);
        assert_eq!(cursor.observe(1, &payload(4)), Continuity::Follows);

        let mut cursor = primed(3..=5);
        assert_eq!(cursor.observe(4, b"new engine"), Continuity::Restarted);
    }

    #[test]
    fn priming_with_nothing_leaves_the_cursor_unset() {
        let mut cursor = PublisherCursor::default();
        cursor.prime(&[]);
        assert_eq!(cursor.last(), None);
        assert_eq!(cursor.observe(7, b""), Continuity::First);
    }
}
