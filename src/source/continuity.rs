//! Reading an engine publisher's message counter.
//!
//! Each publisher numbers its messages 0, 1, 2, … and starts over at 0 when
//! the engine restarts. Comparing each number with the last one seen tells
//! whether the message follows on, whether some were lost in between, or
//! whether the publisher started over (contract section 4).

use std::ops::RangeInclusive;

/// How a message's engine sequence number relates to the previous one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Continuity {
    /// The first message seen from this publisher.
    First,
    /// Exactly the previous number + 1.
    Follows,
    /// Numbers in `missing` never arrived.
    Gap { missing: RangeInclusive<u64> },
    /// The counter went backwards: the publisher (engine) restarted.
    Restarted,
}

/// The last engine sequence number seen from one publisher.
#[derive(Clone, Debug, Default)]
pub struct PublisherCursor {
    last: Option<u64>,
}

impl PublisherCursor {
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Classifies `sequence` and makes it the new last number.
    pub fn observe(&mut self, sequence: u64) -> Continuity {
        let previous = self.last.replace(sequence);
        match previous {
            None => Continuity::First,
            Some(last) if sequence <= last => Continuity::Restarted,
            Some(last) if sequence == last + 1 => Continuity::Follows,
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
        assert_eq!(cursor.observe(0), Continuity::First);
        assert_eq!(cursor.observe(1), Continuity::Follows);
        assert_eq!(cursor.observe(2), Continuity::Follows);
        assert_eq!(cursor.last(), Some(2));
    }

    #[test]
    fn skipped_numbers_are_a_gap_naming_what_is_missing() {
        let mut cursor = PublisherCursor::default();
        cursor.observe(4);
        assert_eq!(cursor.observe(8), Continuity::Gap { missing: 5..=7 });
    }

    #[test]
    fn a_counter_that_goes_backwards_or_repeats_is_a_restart() {
        let mut cursor = PublisherCursor::default();
        cursor.observe(10);
        assert_eq!(cursor.observe(0), Continuity::Restarted);
        assert_eq!(cursor.observe(1), Continuity::Follows);
        assert_eq!(cursor.observe(1), Continuity::Restarted);
    }
}
