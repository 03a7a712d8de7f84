//! A model of one engine rank's prefix cache, for playing traces
//! (`--trace-file`): which blocks a request finds, which it stores, and which
//! the stores evict.
//!
//! Invariants: the cache never holds more than its capacity; a request hits
//! the longest cached prefix of its blocks and stores the blocks after it as
//! one chain hanging from the last hit; eviction is least recently used,
//! and a request's blocks are touched tail first, so a parent is always
//! used more recently than its children and a chain is evicted from its
//! tail, never cut in the middle (vLLM's free queue orders blocks the same
//! way). Blocks still in use by running requests are not modelled: every
//! block is evictable once its request was admitted.

use lru::LruCache;

/// What one request did to the cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Blocks found: the request's first `hits` blocks.
    pub hits: usize,
    /// The last block found, which `stored` hangs from.
    pub parent: Option<i64>,
    /// Blocks stored, in chain order.
    pub stored: Vec<i64>,
    /// Blocks evicted to make room, least recently used first.
    pub evicted: Vec<i64>,
}

/// One rank's cache.
pub struct PrefixCache {
    /// Bounded by `capacity` here, not by the map, which would allocate
    /// for its capacity up front.
    blocks: LruCache<i64, ()>,
    capacity: usize,
}

impl PrefixCache {
    /// An empty cache of `capacity` blocks (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            blocks: LruCache::unbounded(),
            capacity: capacity.max(1),
        }
    }

    /// Blocks held.
    pub fn held(&self) -> usize {
        self.blocks.len()
    }

    /// Serves a request for `blocks` (a prefix chain, first block first).
    /// Blocks past what fits beside the hits are not stored.
    pub fn admit(&mut self, blocks: &[i64]) -> Admission {
        let hits = blocks
            .iter()
            .take_while(|block| self.blocks.contains(*block))
            .count();
        let room = self.capacity - hits;
        // Stops at a block already held further down another chain: ids
        // that are prefix hashes never do, and storing it twice would
        // count a copy the engine does not have.
        let stored: Vec<i64> = blocks[hits..]
            .iter()
            .take(room)
            .take_while(|block| !self.blocks.contains(*block))
            .copied()
            .collect();
        self.touch_tail_first(&blocks[..hits]);
        let over = (self.blocks.len() + stored.len()).saturating_sub(self.capacity);
        // The hits were just touched and fit beside `stored`, so they are
        // never among the least recently used `over`.
        let evicted = (0..over)
            .filter_map(|_| self.blocks.pop_lru().map(|(block, ())| block))
            .collect();
        for block in stored.iter().rev() {
            self.blocks.push(*block, ());
        }
        self.touch_tail_first(&blocks[..hits]);
        Admission {
            hits,
            parent: hits.checked_sub(1).map(|last| blocks[last]),
            stored,
            evicted,
        }
    }

    fn touch_tail_first(&mut self, blocks: &[i64]) {
        for block in blocks.iter().rev() {
            self.blocks.promote(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_hits_its_longest_cached_prefix_and_stores_the_rest_as_a_chain() {
        let mut cache = PrefixCache::new(10);
        let first = cache.admit(&[1, 2, 3]);
        assert_eq!(
            (first.hits, first.parent, first.stored),
            (0, None, vec![1, 2, 3])
        );
        let second = cache.admit(&[1, 2, 4, 5]);
        assert_eq!(second.hits, 2);
        assert_eq!(second.parent, Some(2));
        assert_eq!(second.stored, vec![4, 5]);
        assert!(second.evicted.is_empty());
        assert_eq!(cache.held(), 5);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_chains_from_their_tails() {
        let mut cache = PrefixCache::new(4);
        cache.admit(&[1, 2]);
        cache.admit(&[3, 4]);
        cache.admit(&[1, 2]);
        let admission = cache.admit(&[5, 6]);
        assert_eq!(admission.evicted, vec![4, 3], "the older chain, tail first");
        let partial = cache.admit(&[1, 7, 8]);
        assert_eq!(partial.hits, 1);
        assert_eq!(
            partial.evicted,
            vec![2, 6],
            "1's unused child, then 5's chain from its tail"
        );
        assert_eq!(partial.stored, vec![7, 8]);
        assert_eq!(cache.held(), 4);
        assert_eq!(cache.admit(&[1, 2]).hits, 1, "2 went, its parent 1 stayed");
    }

    #[test]
    fn a_request_longer_than_the_cache_stores_what_fits_beside_its_hits() {
        let mut cache = PrefixCache::new(3);
        cache.admit(&[1]);
        let admission = cache.admit(&[1, 2, 3, 4, 5]);
        assert_eq!(admission.hits, 1);
        assert_eq!(admission.stored, vec![2, 3]);
        assert_eq!(cache.held(), 3);
    }
}
