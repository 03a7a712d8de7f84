//! Whether a store's block hashes are all different and none is its
//! parent's: one pass over a reused open-addressing set.
//!
//! Invariant: each check starts from an empty set and inserts the parent,
//! then every hash; the first insert that finds its hash already there
//! answers "no". An empty slot holds 0, so the hash 0 is kept apart, in a
//! flag. The slots are a power of two, at least twice the inserts, so
//! every probe meets an empty slot. Where a hash lands comes from a hash
//! of it seeded at random (per process and per set): the hashes are the
//! engine's, and an engine that could choose them to collide would make a
//! check quadratic. foldhash is not keyed against a peer that watches its
//! output; an engine sees none of it.
//!
//! Why not sort: sorting a store's 64 random hashes mispredicts about half
//! its comparisons (1.3% of the evicting ingest's time in its profile); a
//! probe of a set this sparse almost always finds its slot empty at once.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

/// Slots of the smallest set: a store of a few blocks.
const MIN_SLOTS: usize = 16;
/// Slots kept between checks (32 KiB): a larger store's set is freed once
/// checked, so one huge store does not hold its memory for good.
const KEPT_SLOTS: usize = 4096;

#[derive(Debug, Default)]
pub(crate) struct DistinctHashes {
    slots: Vec<i64>,
    hasher: RandomState,
}

impl DistinctHashes {
    /// Whether `hashes` are all different and none of them is `parent`.
    pub(crate) fn all_distinct(&mut self, hashes: &[i64], parent: Option<i64>) -> bool {
        let inserts = hashes.len() + usize::from(parent.is_some());
        let len = (2 * inserts).next_power_of_two().max(MIN_SLOTS);
        self.slots.clear();
        self.slots.resize(len, 0);
        let mut set = Set {
            slots: &mut self.slots,
            hasher: &self.hasher,
            has_zero: false,
        };
        let distinct = parent.is_none_or(|parent| set.insert(parent))
            && hashes.iter().all(|&hash| set.insert(hash));
        if self.slots.capacity() > KEPT_SLOTS {
            self.slots = Vec::new();
        }
        distinct
    }
}

/// One check's set.
struct Set<'s> {
    /// A power of two long; 0 where empty.
    slots: &'s mut [i64],
    hasher: &'s RandomState,
    /// Whether the hash 0 was inserted.
    has_zero: bool,
}

impl Set<'_> {
    /// Inserts `hash`; false if it was there already.
    fn insert(&mut self, hash: i64) -> bool {
        if hash == 0 {
            return !std::mem::replace(&mut self.has_zero, true);
        }
        let mask = self.slots.len() - 1;
        let mut at = self.hasher.hash_one(hash) as usize & mask;
        loop {
            match self.slots[at] {
                0 => {
                    self.slots[at] = hash;
                    return true;
                }
                held if held == hash => return false,
                _ => at = (at + 1) & mask,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hashes_all_different_and_apart_from_their_parent_are_distinct() {
        let mut check = DistinctHashes::default();
        assert!(check.all_distinct(&[], None));
        assert!(check.all_distinct(&[], Some(0)));
        assert!(check.all_distinct(&[1, 2, 3], Some(4)));
        assert!(check.all_distinct(&[0, -1, i64::MIN, i64::MAX], None));
        assert!(check.all_distinct(&[0, 5], Some(6)));
    }

    #[test]
    fn a_repeated_hash_or_the_parent_among_the_hashes_is_found_wherever_it_is() {
        let mut check = DistinctHashes::default();
        assert!(!check.all_distinct(&[7, 8, 7], None));
        assert!(!check.all_distinct(&[0, 3, 0], None));
        assert!(!check.all_distinct(&[1, 2, 3], Some(3)));
        assert!(!check.all_distinct(&[0], Some(0)));
        let many: Vec<i64> = (1..=1000).collect();
        assert!(check.all_distinct(&many, Some(1001)));
        assert!(!check.all_distinct(&many, Some(500)));
        let mut repeated = many.clone();
        repeated.push(999);
        assert!(!check.all_distinct(&repeated, None));
    }

    #[test]
    fn a_large_store_s_set_is_not_kept_after_its_check() {
        let mut check = DistinctHashes::default();
        let many: Vec<i64> = (1..=10_000).collect();
        assert!(check.all_distinct(&many, None));
        assert!(check.slots.capacity() <= KEPT_SLOTS);
        assert!(check.all_distinct(&many[..64], None));
        assert!(check.slots.capacity() <= KEPT_SLOTS);
    }

    proptest! {
        /// Hashes from a small range, so repeats are common.
        #[test]
        fn the_check_agrees_with_a_sorted_search(
            hashes in proptest::collection::vec(-20i64..20, 0..48),
            parent in proptest::option::of(-20i64..20),
        ) {
            let mut sorted = hashes.clone();
            sorted.sort_unstable();
            let repeats = sorted.windows(2).any(|pair| pair[0] == pair[1]);
            let parent_among = parent.is_some_and(|p| sorted.binary_search(&p).is_ok());
            // A set used before, as the normalizer's is: nothing of the
            // last check may remain.
            let mut check = DistinctHashes::default();
            check.all_distinct(&(-20..20).collect::<Vec<_>>(), Some(0));
            prop_assert_eq!(check.all_distinct(&hashes, parent), !repeats && !parent_among);
        }
    }
}
