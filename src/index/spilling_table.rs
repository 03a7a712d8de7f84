//! A hash table that grows by about half at a time, not by doubling.
//!
//! A rank's map holds one entry per live block, so its free slots are most
//! of what a block costs beyond its node. A table that doubles is under
//! half full right after growing, and stays so until it has taken as many
//! entries again (8,000 entries sit in 16,384 slots).
//!
//! Invariants:
//! - Every value is in `main` or in `spill`, once.
//! - `main` never grows by itself. A value goes to `main` while it has room,
//!   else to `spill`. Removals may leave `main`'s room taken by tombstones:
//!   once `main` is full and more than an eighth of the room it was built
//!   with is lost so, `main` is due to be built again at the same size.
//! - Once `spill` holds half as many values as `main` was built for, both
//!   are due to be merged into a new `main` sized for all of them, about
//!   two thirds full (8,000 entries: 9,216 slots, where doubling takes
//!   16,384).
//! - A merge or a rebuild is never made by an insert: its owner asks for
//!   it ([`SpillingTable::rebuilt`]) while the table can only be read, and
//!   puts the result in place ([`SpillingTable::install`]) with nothing
//!   changed in between. So the table's readers are held up by a swap, not
//!   by a pass over every value: reading back the hashes of a rank's
//!   32,768 values, each from a node elsewhere in memory, took 1–3 ms.
//! - Hashes are read back as a doubling table's growth reads them: every
//!   value's once at a merge or a rebuild, the spill's own at its growth.

use hashbrown::HashTable;

/// The fewest values `spill` takes before a merge, so a small table does
/// not merge at every insert.
const MIN_SPILL: usize = 16;

#[derive(Clone, Debug, Default)]
pub struct SpillingTable<T> {
    main: HashTable<T>,
    /// Values `main` had no room for.
    spill: HashTable<T>,
    /// Values `main` could take when it was built (its capacity then):
    /// what tombstones are counted against.
    main_room: usize,
}

impl<T> SpillingTable<T> {
    pub fn len(&self) -> usize {
        self.main.len() + self.spill.len()
    }

    /// The value `eq` accepts among those of `hash`.
    pub fn find(&self, hash: u64, mut eq: impl FnMut(&T) -> bool) -> Option<&T> {
        self.main
            .find(hash, &mut eq)
            .or_else(|| self.spill.find(hash, eq))
    }

    /// Takes out the value `eq` accepts among those of `hash`.
    pub fn remove(&mut self, hash: u64, mut eq: impl FnMut(&T) -> bool) -> Option<T> {
        if let Ok(entry) = self.main.find_entry(hash, &mut eq) {
            return Some(entry.remove().0);
        }
        self.spill
            .find_entry(hash, eq)
            .ok()
            .map(|entry| entry.remove().0)
    }

    /// Adds `value` (of `hash`), which is not in the table; `hasher` gives
    /// any value's hash.
    pub fn insert_unique(&mut self, hash: u64, value: T, hasher: impl Fn(&T) -> u64) {
        if self.main.len() < self.main.capacity() {
            self.main.insert_unique(hash, value, &hasher);
        } else {
            self.spill.insert_unique(hash, value, &hasher);
        }
    }

    /// Whether `main` and `spill` are due to be merged.
    fn merge_due(&self) -> bool {
        self.spill.len() >= (self.main_room / 2).max(MIN_SPILL)
    }

    /// Whether `main` is full and tombstones took more than an eighth of
    /// its room.
    fn rebuild_due(&self) -> bool {
        self.main.len() == self.main.capacity()
            && self.main_room - self.main.len() > self.main_room / 8
    }

    /// A new `main` for the table's values when a merge or a rebuild is
    /// due, built from a shared borrow; `hasher` gives any value's hash.
    pub fn rebuilt(&self, hasher: impl Fn(&T) -> u64) -> Option<Rebuilt<T>>
    where
        T: Copy,
    {
        if self.merge_due() {
            Some(Rebuilt {
                main: table_of(self.iter().copied(), self.len(), &hasher),
                spill_kept: false,
            })
        } else if self.rebuild_due() {
            Some(Rebuilt {
                main: table_of(self.main.iter().copied(), self.main_room, &hasher),
                spill_kept: true,
            })
        } else {
            None
        }
    }

    /// Puts `rebuilt`, made by [`SpillingTable::rebuilt`] of this table
    /// with nothing changed since, in place.
    pub fn install(&mut self, rebuilt: Rebuilt<T>) {
        let values = if rebuilt.spill_kept {
            self.main.len()
        } else {
            self.len()
        };
        debug_assert_eq!(
            rebuilt.main.len(),
            values,
            "the table changed after its rebuild"
        );
        self.main = rebuilt.main;
        self.main_room = self.main.capacity();
        if !rebuilt.spill_kept {
            self.spill = HashTable::new();
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.main.iter().chain(self.spill.iter())
    }
}

impl<T> IntoIterator for SpillingTable<T> {
    type Item = T;
    type IntoIter =
        std::iter::Chain<hashbrown::hash_table::IntoIter<T>, hashbrown::hash_table::IntoIter<T>>;

    fn into_iter(self) -> Self::IntoIter {
        self.main.into_iter().chain(self.spill)
    }
}

/// A new `main` for a [`SpillingTable`], to be installed in it.
pub struct Rebuilt<T> {
    main: HashTable<T>,
    /// It holds `main`'s values only (a rebuild), not the spill's too (a
    /// merge).
    spill_kept: bool,
}

/// A table of `values`, with room for `room`.
fn table_of<T>(
    values: impl Iterator<Item = T>,
    room: usize,
    hasher: &impl Fn(&T) -> u64,
) -> HashTable<T> {
    let mut table = HashTable::with_capacity(room);
    for value in values {
        table.insert_unique(hasher(&value), value, hasher);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(value: &u64) -> u64 {
        value.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// An insert, and the merge or rebuild it made due, as the table's
    /// owner makes them.
    fn insert(table: &mut SpillingTable<u64>, value: u64) {
        table.insert_unique(hash(&value), value, hash);
        if let Some(rebuilt) = table.rebuilt(hash) {
            table.install(rebuilt);
        }
    }

    fn has(table: &SpillingTable<u64>, value: u64) -> bool {
        table.find(hash(&value), |&other| other == value).is_some()
    }

    proptest::proptest! {
        /// Values whose hashes collide (a hash of a 64th of the value
        /// range), added and removed in any order, against a set.
        #[test]
        fn it_holds_what_a_set_holds_whatever_the_collisions(
            ops in proptest::collection::vec((proptest::bool::ANY, 0..2_000_u64), 1..2_000)
        ) {
            let colliding = |value: &u64| value % 64;
            let mut table = SpillingTable::default();
            let mut model = std::collections::BTreeSet::new();
            for (add, value) in ops {
                let hash = colliding(&value);
                if add && model.insert(value) {
                    table.insert_unique(hash, value, colliding);
                    if let Some(rebuilt) = table.rebuilt(colliding) {
                        table.install(rebuilt);
                    }
                } else if !add {
                    let removed = table.remove(hash, |&other| other == value);
                    proptest::prop_assert_eq!(removed.is_some(), model.remove(&value));
                }
                proptest::prop_assert_eq!(table.len(), model.len());
            }
            for value in 0..2_000_u64 {
                let found = table.find(colliding(&value), |&other| other == value);
                proptest::prop_assert_eq!(found.is_some(), model.contains(&value));
            }
            let mut listed: Vec<u64> = table.iter().copied().collect();
            listed.sort_unstable();
            proptest::prop_assert!(listed.iter().eq(model.iter()));
        }
    }

    #[test]
    fn an_insert_never_merges_it_leaves_the_merge_to_the_tables_owner() {
        let mut table = SpillingTable::default();
        for value in 0..1_000 {
            table.insert_unique(hash(&value), value, hash);
        }
        assert_eq!((table.main.len(), table.spill.len()), (0, 1_000));
        let rebuilt = table.rebuilt(hash).expect("a merge is due");
        table.install(rebuilt);
        assert_eq!((table.main.len(), table.spill.len()), (1_000, 0));
        assert!(table.rebuilt(hash).is_none());
        assert!((0..1_000).all(|value| has(&table, value)));
    }

    #[test]
    fn eight_thousand_values_take_nine_thousand_slots_where_doubling_takes_sixteen() {
        let mut table = SpillingTable::default();
        for value in 0..8_000 {
            insert(&mut table, value);
        }
        assert_eq!(table.len(), 8_000);
        assert!((0..8_000).all(|value| has(&table, value)));
        assert!(!has(&table, 8_000));
        let slots = |capacity: usize| (capacity * 8 / 7).next_power_of_two();
        assert_eq!(
            slots(table.main.capacity()) + slots(table.spill.capacity()),
            9_216
        );
        let mut doubling = HashTable::new();
        for value in 0..8_000_u64 {
            doubling.insert_unique(hash(&value), value, hash);
        }
        assert_eq!(slots(doubling.capacity()), 16_384);
    }

    #[test]
    fn every_value_is_found_once_through_merges_rebuilds_and_removals() {
        let mut table = SpillingTable::default();
        let mut live = std::collections::BTreeSet::new();
        // Churn at a steady size leaves tombstones in `main`: they must be
        // rebuilt away rather than spill forever.
        for round in 0..50_000_u64 {
            insert(&mut table, round);
            live.insert(round);
            if round >= 3_000 {
                let gone = round - 3_000;
                assert_eq!(
                    table.remove(hash(&gone), |&value| value == gone),
                    Some(gone)
                );
                live.remove(&gone);
            }
        }
        assert_eq!(table.len(), live.len());
        let mut listed: Vec<u64> = table.iter().copied().collect();
        listed.sort_unstable();
        assert!(listed.iter().eq(live.iter()));
        assert!(table.main.capacity() + table.spill.capacity() < 2 * 3_584);
        assert_eq!(table.remove(hash(&1), |&value| value == 1), None);
        let mut owned: Vec<u64> = table.into_iter().collect();
        owned.sort_unstable();
        assert!(owned.iter().eq(live.iter()));
    }
}
