//! kvgate's own sequence numbers, one counter per data-parallel rank.
//!
//! Invariants: each rank's numbers go up by exactly 1 per batch; 0 is never
//! used (the router reads it as "no cursor"); and a process starts every rank
//! at [`crate::clock::epoch_seed`]: (Unix milliseconds at start) × 1000, so its numbers are above anything
//! an earlier kvgate process could have sent unless that one averaged over
//! 1000 batches a millisecond on a rank. An old cursor therefore can never
//! alias a position of the new process.

use std::collections::BTreeMap;

#[derive(Debug)]
pub struct Sequencer {
    seed: u64,
    /// Next number per rank; a rank appears with its first batch.
    next: BTreeMap<u32, u64>,
}

impl Sequencer {
    pub fn new(seed: u64) -> Self {
        Self {
            seed: seed.max(1),
            next: BTreeMap::new(),
        }
    }

    /// Continues a numbering of the same seed where each rank in `last`
    /// stopped (a state directory kept them).
    pub fn resume(&mut self, last: &BTreeMap<u32, u64>) {
        for (&rank, &sequence) in last {
            self.next.insert(rank, sequence.max(self.seed - 1) + 1);
        }
    }

    /// Takes the next number of `rank`.
    pub fn assign(&mut self, rank: u32) -> u64 {
        let next = self.next.entry(rank).or_insert(self.seed);
        let sequence = *next;
        *next += 1;
        sequence
    }

    /// The last number `rank` was given; before its first batch, the number
    /// just below its first (so a snapshot can end there and live batches
    /// continue with no gap).
    pub fn last(&self, rank: u32) -> u64 {
        self.next.get(&rank).copied().unwrap_or(self.seed) - 1
    }

    /// The last number `rank` was given, if it was given any.
    pub fn sent(&self, rank: u32) -> Option<u64> {
        self.next.get(&rank).map(|next| next - 1)
    }

    /// Ranks that have been given at least one number.
    pub fn ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.next.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_counts_up_by_one_from_the_process_seed() {
        let mut sequencer = Sequencer::new(5000);
        assert_eq!(sequencer.assign(0), 5000);
        assert_eq!(sequencer.assign(1), 5000);
        assert_eq!(sequencer.assign(0), 5001);
        assert_eq!(sequencer.last(0), 5001);
        assert_eq!(sequencer.last(1), 5000);
        assert_eq!(sequencer.last(7), 4999);
        assert_eq!(sequencer.sent(1), Some(5000));
        assert_eq!(sequencer.sent(7), None);
        assert_eq!(sequencer.ranks().collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn a_resumed_numbering_goes_on_after_each_ranks_last_number() {
        let mut sequencer = Sequencer::new(5000);
        sequencer.resume(&BTreeMap::from([(0, 5009), (2, 5000)]));
        assert_eq!(sequencer.assign(0), 5010);
        assert_eq!(sequencer.assign(2), 5001);
        assert_eq!(sequencer.assign(1), 5000);
    }

    #[test]
    fn zero_is_never_a_sequence_number() {
        let mut sequencer = Sequencer::new(0);
        assert_eq!(sequencer.assign(0), 1);
    }
}
