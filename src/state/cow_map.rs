//! A hash map from block hash to where its record is, whose clone costs a
//! few microseconds however large it is, and whose lookups can be brought
//! into the cache a step at a time before they are made.
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
//! The map notes beside each shard where its buckets are, so a caller
//! that knows its keys ahead fetches each key's shard header and home line
//! in one step and then reads them: the drain's lookups wait for memory
//! together, once per payload, instead of one after the other for each
//! block, as with `hashbrown`'s tables (their control bytes and their
//! buckets are two lines, the second found from the first, and their
//! address is not given).

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
// Not std's: its uniqueness check is a compare-and-swap (it must rule out
// weak references), one per write here; triomphe's is a load.
use triomphe::Arc;

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

/// One shard's table.
#[derive(Clone, Debug, Default)]
struct Shard {
    /// A power of two long, or empty before the shard's first key.
    buckets: Box<[Bucket]>,
    /// Full buckets: at most 5/8 of them, so every probe meets an empty one.
    len: usize,
}

impl Shard {
    /// Where the probe for `hash` starts. Only for a shard with buckets.
    fn home(&self, hash: u64) -> usize {
        hash as usize & (self.buckets.len() - 1)
    }

    /// The bucket holding `key`, or the empty one where it would go.
    fn probe(&self, key: i64, hash: u64) -> Result<usize, usize> {
        if self.buckets.is_empty() {
            return Err(0);
        }
        let mask = self.buckets.len() - 1;
        let mut at = self.home(hash);
        loop {
            let bucket = &self.buckets[at];
            if bucket.is_empty() {
                return Err(at);
            }
            if bucket.key == key {
                return Ok(at);
            }
            at = (at + 1) & mask;
        }
    }

    /// Room for one more key: the table doubles past 5/8 full.
    fn reserve_one(&mut self, hash_of: impl Fn(i64) -> u64) {
        let buckets = self.buckets.len();
        if (self.len + 1) * 8 <= buckets * 5 {
            return;
        }
        let old = std::mem::replace(
            &mut self.buckets,
            vec![Bucket::EMPTY; (buckets * 2).max(FIRST_BUCKETS)].into_boxed_slice(),
        );
        for bucket in old.iter().filter(|bucket| !bucket.is_empty()) {
            let Err(at) = self.probe(bucket.key, hash_of(bucket.key)) else {
                unreachable!("a table holds each key once");
            };
            self.buckets[at] = *bucket;
        }
    }

    /// Empties bucket `hole`, moving back each key after it that may sit
    /// there (whose home is not between the hole and the key).
    fn remove_at(&mut self, mut hole: usize, hash_of: impl Fn(i64) -> u64) {
        let mask = self.buckets.len() - 1;
        let mut at = hole;
        loop {
            at = (at + 1) & mask;
            let bucket = self.buckets[at];
            if bucket.is_empty() {
                break;
            }
            let home = self.home(hash_of(bucket.key));
            if at.wrapping_sub(home) & mask >= at.wrapping_sub(hole) & mask {
                self.buckets[hole] = bucket;
                hole = at;
            }
        }
        self.buckets[hole] = Bucket::EMPTY;
        self.len -= 1;
    }
}

/// A shard, and where its buckets are.
#[derive(Clone, Debug)]
struct ShardRef {
    shard: Arc<Shard>,
    /// The address of the shard's first bucket and how many it has, as of
    /// its last write: with them, [`CowMap::prefetch`] fetches a key's home
    /// line in the same step as the shard's header, not after it. Nothing
    /// is read through them (a prefetch cannot fault), so an address a
    /// write has moved on from is harmless; each write notes the new one.
    buckets_at: usize,
    buckets: usize,
}

impl ShardRef {
    fn new(shard: Arc<Shard>) -> Self {
        let mut shard = Self {
            shard,
            buckets_at: 0,
            buckets: 0,
        };
        shard.note_buckets();
        shard
    }

    fn note_buckets(&mut self) {
        self.buckets_at = self.shard.buckets.as_ptr() as usize;
        self.buckets = self.shard.buckets.len();
    }

    /// The shard for writing, copied first if a clone shares it. The caller
    /// notes its buckets again once it is done writing.
    fn make_mut(&mut self) -> &mut Shard {
        Arc::make_mut(&mut self.shard)
    }
}

#[derive(Clone, Debug, Default)]
pub struct CowMap {
    /// Empty until the first insert: most maps (tiers, ranks) stay empty.
    shards: Box<[ShardRef]>,
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
        let shard = &self.shards.get(place.shard)?.shard;
        let at = shard.probe(key, place.hash).ok()?;
        Some(&shard.buckets[at].slot)
    }

    /// Asks the CPU to fetch what a lookup of `key` reads: its shard's
    /// header and the buckets it reads first (its home and the two after
    /// it, which may start the next cache line), so a lookup that follows
    /// does not wait for them.
    pub fn prefetch(&self, key: i64) {
        let place = Place::of(&self.hasher, key);
        let Some(shard) = self.shards.get(place.shard) else {
            return;
        };
        prefetch::<Shard>(&*shard.shard);
        if shard.buckets > 0 {
            let home = place.hash as usize & (shard.buckets - 1);
            let buckets = shard.buckets_at as *const Bucket;
            prefetch(buckets.wrapping_add(home));
            prefetch(buckets.wrapping_add((home + 2) & (shard.buckets - 1)));
        }
    }

    /// The slot of `key` for writing; copies its shard first if a clone
    /// still shares it (and only if `key` is there).
    pub fn get_mut(&mut self, key: i64) -> Option<&mut Slot> {
        let place = Place::of(&self.hasher, key);
        let (shard, at) = shard_holding(&mut self.shards, key, place)?;
        Some(&mut shard.buckets[at].slot)
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
        let shard_ref = &mut self.shards[place.shard];
        let shard = shard_ref.make_mut();
        let found = match shard.probe(key, place.hash) {
            Ok(at) => Ok(at),
            Err(at) if (shard.len + 1) * 8 <= shard.buckets.len() * 5 => Err(at),
            Err(_) => {
                shard.reserve_one(|key| Place::of(hasher, key).hash);
                Err(shard
                    .probe(key, place.hash)
                    .expect_err("the key was not there before the table grew"))
            }
        };
        shard_ref.note_buckets();
        let shard = shard_ref.make_mut();
        let vacant = match found {
            Ok(at) => return Found::Existing(&mut shard.buckets[at].slot),
            Err(at) => at,
        };
        let slot = make();
        assert!(slot != Slot::VACANT, "no page id is u32::MAX");
        shard.buckets[vacant] = Bucket { key, slot };
        shard.len += 1;
        Found::Inserted
    }

    /// Every shard starts as the same empty map; writes split them off.
    #[cold]
    fn share_one_empty_shard(&mut self) {
        let empty = ShardRef::new(Arc::new(Shard::default()));
        self.shards = vec![empty; SHARDS].into_boxed_slice();
    }

    pub fn remove(&mut self, key: i64) -> Option<Slot> {
        let place = Place::of(&self.hasher, key);
        let (shard, at) = shard_holding(&mut self.shards, key, place)?;
        let hasher = &self.hasher;
        let slot = shard.buckets[at].slot;
        shard.remove_at(at, |key| Place::of(hasher, key).hash);
        Some(slot)
    }
}

/// The shard of `shards` holding `key`, for writing, and its bucket, or
/// `None` if no shard does. A miss must not copy a shard a clone shares, so
/// a shared shard is looked in before it is copied.
fn shard_holding(shards: &mut [ShardRef], key: i64, place: Place) -> Option<(&mut Shard, usize)> {
    let shard = shards.get_mut(place.shard)?;
    let at = shard.shard.probe(key, place.hash).ok()?;
    // A copy moves the buckets; a write to a slot does not.
    shard.make_mut();
    shard.note_buckets();
    Some((shard.make_mut(), at))
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
            .flat_map(|shard| shard.shard.buckets.iter())
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
            .filter(|(now, then)| !Arc::ptr_eq(&now.shard, &then.shard))
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
