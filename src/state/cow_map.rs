//! A hash map from block hash to where its record is, whose clone costs a
//! few microseconds however large it is.
//!
//! Invariant: the map is split into `SHARDS` shards, each a
//! `triomphe::Arc` of a plain hash map. A clone shares every shard; the
//! first write to a shared shard copies that shard alone (about 1/`SHARDS`
//! of the map), so a snapshot cut never stalls the writer for more than one
//! shard copy, and with no snapshot outstanding a write is a plain hash-map
//! write. Each entry keeps its key beside its value, so a reader can hold
//! `&(key, value)` instead of the key and a second lookup.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
// Not std's: its uniqueness check is a compare-and-swap (it must rule out
// weak references), one per write here; triomphe's is a load.
use triomphe::Arc;

use super::prefetch::prefetch;

const SHARD_BITS: u32 = 14;
const SHARDS: usize = 1 << SHARD_BITS;

/// Entries keep their key beside the value, so a reader can hold one
/// `&(key, value)` and need no second lookup to find either.
type Shard<V> = HashTable<(i64, V)>;

#[derive(Debug)]
pub struct CowMap<V> {
    /// Empty until the first insert: most maps (tiers, ranks) stay empty.
    shards: Box<[Arc<Shard<V>>]>,
    /// Keys are block hashes the engine chose. A publisher that picked
    /// colliding ones could pile them into one shard (every cut's first
    /// write would copy them all) or one probe sequence (every lookup a
    /// scan), so the hash is keyed by a seed drawn per map at random:
    /// colliding keys cannot be chosen in advance. foldhash is not a
    /// cryptographic hash (a publisher that could time lookups might still
    /// learn collisions), but it costs one multiply per key, as the
    /// unkeyed FxHash did, where SipHash showed in the drain's profile.
    hasher: RandomState,
}

impl<V> Clone for CowMap<V> {
    fn clone(&self) -> Self {
        Self {
            shards: self.shards.clone(),
            // The shared shards are filed under this map's hashes.
            hasher: self.hasher.clone(),
        }
    }
}

impl<V> Default for CowMap<V> {
    fn default() -> Self {
        Self {
            shards: Box::default(),
            hasher: RandomState::default(),
        }
    }
}

/// Where `key` goes: its shard and the hash its shard's table files it
/// under, both from one keyed hash. The shard is the hash's low bits; the
/// table sees the hash rotated so that neither its bucket index (low bits)
/// nor its 7-bit tag (hashbrown takes the top 7) uses a shard bit, which
/// is the same for every key of a shard.
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
            hash: hash.rotate_right(SHARD_BITS + 7),
        }
    }
}

fn is_key<V>(key: i64) -> impl Fn(&(i64, V)) -> bool {
    move |entry| entry.0 == key
}

impl<V: Clone> CowMap<V> {
    pub fn get(&self, key: i64) -> Option<&V> {
        self.entry(key).map(|(_, value)| value)
    }

    /// The stored `(key, value)` of `key`.
    pub fn entry(&self, key: i64) -> Option<&(i64, V)> {
        let place = Place::of(&self.hasher, key);
        self.shards.get(place.shard)?.find(place.hash, is_key(key))
    }

    /// Asks the CPU to fetch the header of the shard `key` falls in, so a
    /// lookup that follows does not wait for it.
    pub fn prefetch_shard(&self, key: i64) {
        if let Some(shard) = self.shards.get(Place::of(&self.hasher, key).shard) {
            prefetch::<Shard<V>>(&**shard);
        }
    }

    /// The value of `key` for writing; copies its shard first if a clone
    /// still shares it (and only if `key` is there).
    pub fn get_mut(&mut self, key: i64) -> Option<&mut V> {
        let place = Place::of(&self.hasher, key);
        self.shard_holding(key, place)?
            .find_mut(place.hash, is_key(key))
            .map(|(_, value)| value)
    }

    /// The shard holding `key`, for writing, or `None` if no shard does. A
    /// miss must not copy a shard a clone shares, so a shared shard is
    /// looked in before it is copied.
    fn shard_holding(&mut self, key: i64, place: Place) -> Option<&mut Shard<V>> {
        let shard = self.shards.get_mut(place.shard)?;
        if Arc::get_mut(shard).is_none() {
            shard.find(place.hash, is_key(key))?;
        }
        Some(Arc::make_mut(shard))
    }

    /// The value of `key` for writing, or, if it has none, `make()` stored
    /// under it: one probe either way.
    ///
    /// Inlined into the store loop, its caller, with `make`: out of line,
    /// ingest was 10-15% slower (alternating Criterion runs).
    #[inline]
    pub fn find_or_insert_with(&mut self, key: i64, make: impl FnOnce() -> V) -> Found<'_, V> {
        if self.shards.is_empty() {
            self.share_one_empty_shard();
        }
        let place = Place::of(&self.hasher, key);
        let hasher = &self.hasher;
        let shard = Arc::make_mut(&mut self.shards[place.shard]);
        match shard.entry(place.hash, is_key(key), |entry| {
            Place::of(hasher, entry.0).hash
        }) {
            Entry::Occupied(occupied) => Found::Existing(&mut occupied.into_mut().1),
            Entry::Vacant(vacant) => {
                vacant.insert((key, make()));
                Found::Inserted
            }
        }
    }

    /// Every shard starts as the same empty map; writes split them off.
    #[cold]
    fn share_one_empty_shard(&mut self) {
        let empty = Arc::new(Shard::default());
        self.shards = (0..SHARDS).map(|_| Arc::clone(&empty)).collect();
    }

    pub fn remove(&mut self, key: i64) -> Option<V> {
        let place = Place::of(&self.hasher, key);
        let found = self
            .shard_holding(key, place)?
            .find_entry(place.hash, is_key(key))
            .ok()?;
        let ((_, value), _) = found.remove();
        Some(value)
    }
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
    fn keys<V>(map: &CowMap<V>) -> Vec<i64> {
        map.shards
            .iter()
            .flat_map(|shard| shard.iter().map(|(key, _)| *key))
            .collect()
    }

    #[test]
    fn it_behaves_as_a_map() {
        let mut map = CowMap::default();
        for key in -500..500 {
            map.find_or_insert_with(key, || key * 2);
        }
        assert_eq!(keys(&map).len(), 1000);
        assert!(matches!(
            map.find_or_insert_with(-7, || unreachable!()),
            Found::Existing(-14)
        ));
        assert_eq!(map.get(-7), Some(&-14));
        assert_eq!(map.entry(-7), Some(&(-7, -14)));
        assert_eq!(keys(&map).len(), 1000);
        *map.get_mut(3).unwrap() = 0;
        assert_eq!(map.get(3), Some(&0));
        assert_eq!(map.remove(3), Some(0));
        assert_eq!(map.remove(3), None);
        assert!(map.get_mut(3).is_none());
        assert_eq!(keys(&map).len(), 999);
        let mut sorted = keys(&map);
        sorted.sort();
        assert_eq!(sorted.len(), 999);
        assert_eq!(sorted[0], -500);
    }

    /// A map of each key in `keys` to itself.
    fn identity_map(keys: std::ops::Range<i64>) -> CowMap<i64> {
        let mut map = CowMap::default();
        for key in keys {
            map.find_or_insert_with(key, || key);
        }
        map
    }

    /// Shards `now` holds that it no longer shares with `then`.
    fn shards_copied(now: &CowMap<i64>, then: &CowMap<i64>) -> usize {
        now.shards
            .iter()
            .zip(then.shards.iter())
            .filter(|(now, then)| !Arc::ptr_eq(now, then))
            .count()
    }

    #[test]
    fn a_clone_keeps_its_contents_while_the_original_changes() {
        let mut map = identity_map(0..10_000);
        let frozen = map.clone();
        for key in 0..5_000 {
            map.remove(key);
        }
        *map.get_mut(9_999).unwrap() = -1;
        map.find_or_insert_with(20_000, || 1);
        assert_eq!(keys(&frozen).len(), 10_000);
        assert_eq!(frozen.get(0), Some(&0));
        assert_eq!(frozen.get(9_999), Some(&9_999));
        assert_eq!(frozen.get(20_000), None);
        assert_eq!(keys(&frozen).len(), 10_000);
        assert_eq!(keys(&map).len(), 5_001);
        assert_eq!(map.get(9_999), Some(&-1));
    }

    #[test]
    fn a_write_to_a_shared_map_copies_only_the_shard_it_touches() {
        let mut map = identity_map(0..100_000);
        let frozen = map.clone();
        map.find_or_insert_with(1_000_000, || 0);
        assert_eq!(shards_copied(&map, &frozen), 1);
    }

    #[test]
    fn each_map_files_keys_under_a_seed_of_its_own() {
        // A publisher that learned one map's layout cannot flood another:
        // the same keys land elsewhere.
        let (one, other) = (CowMap::<()>::default(), CowMap::<()>::default());
        let places = |map: &CowMap<()>| -> Vec<(usize, u64)> {
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
