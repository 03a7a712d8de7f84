//! A hash map from block hash to where its record is, whose clone costs
//! one handle per shard however large it is, and whose lookups can be
//! brought into the cache a step at a time before they are made.
//!
//! Invariant: the map is split into `SHARDS` shards, each a
//! `triomphe::Arc` of one table. A clone shares every shard; the first
//! write to a shared shard copies that shard alone (about 1/`SHARDS` of the
//! map), so a snapshot cut never stalls the writer for more than one shard
//! copy, and with no snapshot outstanding a write is a plain table write.
//!
//! A shard's table is open addressing with linear probing: its buckets are
//! a power of two long, at most 5/8 of them full, and every key sits in
//! the run of full buckets that starts at the bucket its hash names (its
//! home); a removal shifts the keys after it back, so no bucket is ever a
//! tombstone. A bucket holds the key beside its slot, 16 bytes, four to a
//! cache line, so a lookup reads the line at its home and seldom the next.
//! A shard's handle is a fat pointer that carries where its buckets are
//! and how many, so a caller that knows its keys ahead fetches each key's
//! home line from the handle alone, and then reads them: the drain's
//! lookups wait for memory together, once per payload, instead of one
//! after the other for each block, as with `hashbrown`'s tables (their
//! control bytes and their buckets are two lines, the second found from
//! the first, and their address is not given). The table's header (its
//! count of full buckets and the handle count) shares the allocation and
//! the first line with the buckets: a lookup touches two lines, the handle
//! and its home (a separate header made it three, and the drain's ingest
//! 4-5% slower), at the price of a clone that writes each shard's line
//! instead of a dense array of headers.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
// Not std's: its uniqueness check is a compare-and-swap (it must rule out
// weak references), one per write here; triomphe's is a load.
use triomphe::{Arc, HeaderSlice};

use super::prefetch::prefetch;

const SHARD_BITS: u32 = 14;
const SHARDS: usize = 1 << SHARD_BITS;
/// Buckets of a shard's first table: two cache lines.
const FIRST_BUCKETS: usize = 8;

/// Where a record is: its page and its place in the page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    pub(crate) page: u32,
    pub(crate) offset: u32,
}

impl Slot {
    /// What an empty bucket holds. Page ids index a vector of pages of
    /// 1,024 records each, so none comes near it.
    const VACANT: Self = Self {
        page: u32::MAX,
        offset: 0,
    };
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    key: i64,
    slot: Slot,
}

impl Bucket {
    const EMPTY: Self = Self {
        key: 0,
        slot: Slot::VACANT,
    };

    fn is_empty(&self) -> bool {
        self.slot.page == Slot::VACANT.page
    }
}

/// A shard's table in one allocation: how many buckets are full (at most
/// 5/8 of them, so every probe meets an empty one), then the buckets, a
/// power of two long, or none before the shard's first key.
type Table = HeaderSlice<usize, [Bucket]>;

/// One shard. The handle is fat: it carries where the buckets are and how
/// many, so a lookup reads the bucket at its key's home straight from the
/// map's array of handles, and the line holding the count of full buckets
/// and the handle count is read only by writes.
#[derive(Clone, Debug)]
struct Shard(Arc<Table>);

/// Where the probe for `hash` starts in `buckets` (not empty).
fn home(buckets: &[Bucket], hash: u64) -> usize {
    hash as usize & (buckets.len() - 1)
}

/// The bucket of `buckets` holding `key`, or the empty one where it would go.
fn probe(buckets: &[Bucket], key: i64, hash: u64) -> Result<usize, usize> {
    if buckets.is_empty() {
        return Err(0);
    }
    let mask = buckets.len() - 1;
    let mut at = home(buckets, hash);
    loop {
        let bucket = &buckets[at];
        if bucket.is_empty() {
            return Err(at);
        }
        if bucket.key == key {
            return Ok(at);
        }
        at = (at + 1) & mask;
    }
}

impl Shard {
    fn buckets(&self) -> &[Bucket] {
        &self.0.slice
    }

    fn probe(&self, key: i64, hash: u64) -> Result<usize, usize> {
        probe(self.buckets(), key, hash)
    }

    /// Whether one more key leaves the table at most 5/8 full.
    fn has_room_for_one(&self) -> bool {
        (self.0.header + 1) * 8 <= self.buckets().len() * 5
    }

    /// The table for writing, copied first if a clone shares it.
    fn make_mut(&mut self) -> &mut Table {
        if !self.0.is_unique() {
            self.0 = Arc::from_header_and_slice(self.0.header, &self.0.slice);
        }
        Arc::get_mut(&mut self.0).expect("a table no clone shares")
    }

    /// The table twice as long (or first made), with the same keys. A
    /// table a clone shares is left to it, not copied first.
    fn grow(&mut self, hash_of: impl Fn(i64) -> u64) {
        let buckets = (self.buckets().len() * 2).max(FIRST_BUCKETS);
        let mut grown =
            Arc::from_header_and_iter(self.0.header, std::iter::repeat_n(Bucket::EMPTY, buckets));
        let table = Arc::get_mut(&mut grown).expect("a table just made");
        for bucket in self.buckets().iter().filter(|bucket| !bucket.is_empty()) {
            let Err(at) = probe(&table.slice, bucket.key, hash_of(bucket.key)) else {
                unreachable!("a table holds each key once");
            };
            table.slice[at] = *bucket;
        }
        self.0 = grown;
    }

    /// Empties bucket `hole`, moving back each key after it that may sit
    /// there (whose home is not between the hole and the key).
    fn remove_at(&mut self, mut hole: usize, hash_of: impl Fn(i64) -> u64) {
        let table = self.make_mut();
        let buckets = &mut table.slice;
        let mask = buckets.len() - 1;
        let mut at = hole;
        loop {
            at = (at + 1) & mask;
            let bucket = buckets[at];
            if bucket.is_empty() {
                break;
            }
            let home = home(buckets, hash_of(bucket.key));
            if at.wrapping_sub(home) & mask >= at.wrapping_sub(hole) & mask {
                buckets[hole] = bucket;
                hole = at;
            }
        }
        buckets[hole] = Bucket::EMPTY;
        table.header -= 1;
    }
}

#[derive(Debug, Default)]
pub struct CowMap {
    /// Empty until the first insert: most maps (tiers, ranks) stay empty.
    shards: Box<[Shard]>,
    /// Keys are block hashes the engine chose. A publisher that picked
    /// colliding ones could pile them into one shard (every cut's first
    /// write would copy them all) or one probe run (every lookup a scan),
    /// so the hash is keyed by a seed drawn per map at random: colliding
    /// keys cannot be chosen in advance. foldhash is not a cryptographic
    /// hash (a publisher that could time lookups might still learn
    /// collisions), but it costs one multiply per key, as the unkeyed
    /// FxHash did, where SipHash showed in the drain's profile. A clone
    /// keeps it: the shards it shares are filed under its hashes.
    hasher: RandomState,
}

/// How many shards ahead of the one a clone shares it fetches the line
/// holding a shard's handle count.
const CLONE_AHEAD: usize = 16;

impl Clone for CowMap {
    /// Shares every shard. Sharing one writes its handle count, which
    /// sits in the shard's own allocation, one cache line per shard spread
    /// over the whole map: those lines are fetched some shards ahead, so a
    /// 1M-block map's clone waits for memory a few lines at a time rather
    /// than each of 16,384 lines in turn (Criterion: 0.53-0.55 ms that
    /// way, 0.42-0.47 ms fetching ahead; 0.20 ms when the counts were a
    /// dense array apart from the tables).
    fn clone(&self) -> Self {
        let shards = self
            .shards
            .iter()
            .enumerate()
            .map(|(at, shard)| {
                if let Some(ahead) = self.shards.get(at + CLONE_AHEAD) {
                    prefetch(&ahead.0.header);
                }
                shard.clone()
            })
            .collect();
        Self {
            shards,
            hasher: self.hasher.clone(),
        }
    }
}

/// Where `key` goes: its shard and the hash its shard's table files it
/// under, both from one keyed hash. The shard is the hash's low bits; the
/// table sees the bits above them, which differ within a shard.
#[derive(Clone, Copy)]
struct Place {
    shard: usize,
    hash: u64,
}

impl Place {
    fn of(hasher: &RandomState, key: i64) -> Self {
        let hash = hasher.hash_one(key);
        Self {
            shard: (hash & (SHARDS as u64 - 1)) as usize,
            hash: hash >> SHARD_BITS,
        }
    }
}

impl CowMap {
    pub fn get(&self, key: i64) -> Option<&Slot> {
        let place = Place::of(&self.hasher, key);
        let shard = self.shards.get(place.shard)?;
        let at = shard.probe(key, place.hash).ok()?;
        Some(&shard.buckets()[at].slot)
    }

    /// Asks the CPU to fetch what a lookup of `key` reads, and a write
    /// after it: the buckets it reads first (its home and the two after
    /// it, which may start the next cache line) and its shard's count of
    /// full buckets, so neither waits for them.
    pub fn prefetch(&self, key: i64) {
        let place = Place::of(&self.hasher, key);
        let Some(shard) = self.shards.get(place.shard) else {
            return;
        };
        prefetch(&shard.0.header);
        let buckets = shard.buckets();
        if !buckets.is_empty() {
            let home = home(buckets, place.hash);
            prefetch(&buckets[home]);
            prefetch(&buckets[(home + 2) & (buckets.len() - 1)]);
        }
    }

    /// The slot of `key` for writing; copies its shard first if a clone
    /// still shares it (and only if `key` is there).
    pub fn get_mut(&mut self, key: i64) -> Option<&mut Slot> {
        let (shard, at) = shard_holding(&mut self.shards, &self.hasher, key)?;
        Some(&mut shard.make_mut().slice[at].slot)
    }

    /// The slot of `key` for writing, or, if it has none, `make()` stored
    /// under it: one probe either way (two when the shard's table grows).
    ///
    /// Inlined into the store loop, its caller, with `make`: out of line,
    /// ingest was 10-15% slower (alternating Criterion runs).
    #[inline]
    pub fn find_or_insert_with(
        &mut self,
        key: i64,
        make: impl FnOnce() -> Slot,
    ) -> Found<'_, Slot> {
        if self.shards.is_empty() {
            self.share_one_empty_shard();
        }
        let place = Place::of(&self.hasher, key);
        let hasher = &self.hasher;
        let shard = &mut self.shards[place.shard];
        let vacant = match shard.probe(key, place.hash) {
            Ok(at) => return Found::Existing(&mut shard.make_mut().slice[at].slot),
            Err(at) if shard.has_room_for_one() => at,
            Err(_) => {
                shard.grow(|key| Place::of(hasher, key).hash);
                shard
                    .probe(key, place.hash)
                    .expect_err("the key was not there before the table grew")
            }
        };
        let slot = make();
        assert!(slot != Slot::VACANT, "no page id is u32::MAX");
        let table = shard.make_mut();
        table.slice[vacant] = Bucket { key, slot };
        table.header += 1;
        Found::Inserted
    }

    /// Every shard starts as the same empty table; writes split them off.
    #[cold]
    fn share_one_empty_shard(&mut self) {
        let empty = Shard(Arc::from_header_and_slice(0, &[]));
        self.shards = vec![empty; SHARDS].into_boxed_slice();
    }

    pub fn remove(&mut self, key: i64) -> Option<Slot> {
        let hasher = &self.hasher;
        let (shard, at) = shard_holding(&mut self.shards, hasher, key)?;
        let slot = shard.buckets()[at].slot;
        shard.remove_at(at, |key| Place::of(hasher, key).hash);
        Some(slot)
    }
}

/// The shard of `shards` holding `key` and its bucket, or `None` if none
/// does, the shard not yet copied: a miss must not copy a shard a clone
/// shares, so the caller copies it only once the key is found.
fn shard_holding<'s>(
    shards: &'s mut [Shard],
    hasher: &RandomState,
    key: i64,
) -> Option<(&'s mut Shard, usize)> {
    let place = Place::of(hasher, key);
    let shard = shards.get_mut(place.shard)?;
    let at = shard.probe(key, place.hash).ok()?;
    Some((shard, at))
}

/// What [`CowMap::find_or_insert_with`] did.
pub enum Found<'a, V> {
    /// `key` had a value, here for writing.
    Existing(&'a mut V),
    /// `key` had none and now has the one made.
    Inserted,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key of `map`, in no particular order.
    fn keys(map: &CowMap) -> Vec<i64> {
        map.shards
            .iter()
            .flat_map(|shard| shard.buckets().iter())
            .filter(|bucket| !bucket.is_empty())
            .map(|bucket| bucket.key)
            .collect()
    }

    /// The slot standing for `value` in these tests.
    fn slot(value: i64) -> Slot {
        Slot {
            page: value as u32,
            offset: 0,
        }
    }

    #[test]
    fn it_behaves_as_a_map() {
        let mut map = CowMap::default();
        for key in -500..500 {
            map.find_or_insert_with(key, || slot(key + 1_000));
        }
        assert_eq!(keys(&map).len(), 1000);
        assert!(matches!(
            map.find_or_insert_with(-7, || unreachable!()),
            Found::Existing(found) if *found == slot(993)
        ));
        assert_eq!(map.get(-7), Some(&slot(993)));
        assert_eq!(keys(&map).len(), 1000);
        *map.get_mut(3).unwrap() = slot(0);
        assert_eq!(map.get(3), Some(&slot(0)));
        assert_eq!(map.remove(3), Some(slot(0)));
        assert_eq!(map.remove(3), None);
        assert!(map.get_mut(3).is_none());
        assert_eq!(keys(&map).len(), 999);
        let mut sorted = keys(&map);
        sorted.sort();
        assert_eq!(sorted.len(), 999);
        assert_eq!(sorted[0], -500);
    }

    #[test]
    fn it_agrees_with_a_plain_map_through_growth_and_removals_in_any_order() {
        // Enough keys that every shard's table grows several times and its
        // probe runs wrap around, then removals from the middle of runs.
        let mut map = CowMap::default();
        let mut model = std::collections::BTreeMap::new();
        let mut key = 0x9e37_79b9_7f4a_7c15_u64;
        for round in 0..400_000_u32 {
            key = key.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let chosen = (key >> 40) as i64 - (1 << 23);
            if round % 3 == 2 {
                assert_eq!(map.remove(chosen), model.remove(&chosen));
            } else if let Found::Existing(found) =
                map.find_or_insert_with(chosen, || slot(round.into()))
            {
                assert_eq!(Some(&*found), model.get(&chosen));
            } else {
                assert!(model.insert(chosen, slot(round.into())).is_none());
            }
        }
        assert_eq!(keys(&map).len(), model.len());
        for (&key, value) in &model {
            assert_eq!(map.get(key), Some(value));
        }
        for probe in -(1 << 23)..-(1 << 23) + 10_000 {
            assert_eq!(map.get(probe), model.get(&probe));
        }
    }

    /// A map of each key in `keys` to its own slot.
    fn identity_map(keys: std::ops::Range<i64>) -> CowMap {
        let mut map = CowMap::default();
        for key in keys {
            map.find_or_insert_with(key, || slot(key));
        }
        map
    }

    /// Shards `now` holds that it no longer shares with `then`.
    fn shards_copied(now: &CowMap, then: &CowMap) -> usize {
        now.shards
            .iter()
            .zip(then.shards.iter())
            .filter(|(now, then)| !Arc::ptr_eq(&now.0, &then.0))
            .count()
    }

    #[test]
    fn a_clone_keeps_its_contents_while_the_original_changes() {
        let mut map = identity_map(0..10_000);
        let frozen = map.clone();
        for key in 0..5_000 {
            map.remove(key);
        }
        *map.get_mut(9_999).unwrap() = slot(7);
        map.find_or_insert_with(20_000, || slot(1));
        assert_eq!(keys(&frozen).len(), 10_000);
        assert_eq!(frozen.get(0), Some(&slot(0)));
        assert_eq!(frozen.get(9_999), Some(&slot(9_999)));
        assert_eq!(frozen.get(20_000), None);
        assert_eq!(keys(&frozen).len(), 10_000);
        assert_eq!(keys(&map).len(), 5_001);
        assert_eq!(map.get(9_999), Some(&slot(7)));
    }

    #[test]
    fn a_write_to_a_shared_map_copies_only_the_shard_it_touches() {
        let mut map = identity_map(0..100_000);
        let frozen = map.clone();
        map.find_or_insert_with(1_000_000, || slot(0));
        assert_eq!(shards_copied(&map, &frozen), 1);
    }

    #[test]
    fn each_map_files_keys_under_a_seed_of_its_own() {
        // A publisher that learned one map's layout cannot flood another:
        // the same keys land elsewhere.
        let (one, other) = (CowMap::default(), CowMap::default());
        let places = |map: &CowMap| -> Vec<(usize, u64)> {
            (0..64)
                .map(|key| Place::of(&map.hasher, key))
                .map(|place| (place.shard, place.hash))
                .collect()
        };
        assert_ne!(places(&one), places(&other));
    }

    #[test]
    fn looking_for_an_absent_key_to_write_copies_nothing() {
        let mut map = identity_map(0..1_000);
        let frozen = map.clone();
        assert!(map.get_mut(5_000).is_none());
        assert!(map.remove(5_000).is_none());
        assert_eq!(shards_copied(&map, &frozen), 0);
    }
}
