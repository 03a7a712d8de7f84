//! A simulated vLLM prefix cache that reports what it does as KV events.
//!
//! Invariants: applying the events of every step, in order, to an empty set
//! (a store adds its hashes, a removal deletes them, a clear empties the set)
//! gives exactly [`SimEngine::live_blocks`]; a stored block's parent is live
//! when the store is reported, an evicted block was live, and a live block's
//! parent is live; the same config (seed included) gives the same events.
//!
//! The model: each scheduler step admits a few requests. A request is one of
//! a few shared system prompts (prompt families, identical for every seed, so
//! the engines of several DP ranks share prefixes as a real deployment's do)
//! followed by a unique suffix of whole blocks. Blocks are hashed as a chain
//! like vLLM's: a block's hash mixes its parent's hash with its own tokens.
//! The request's cached prefix is reused and refreshed; its remaining blocks
//! are allocated and reported in one `BlockStored`, whose parent is the last
//! reused block. Requests finish within their step, so afterwards every block
//! is evictable.
//!
//! Eviction: when an allocation needs room, the least recently used *leaf*
//! goes first, one `BlockRemoved` per block, reported before the store that
//! needed the room (vLLM evicts when it hands a block out and reports the
//! store once the block is full). vLLM's free queue is ordered by free time
//! and a finished request frees its blocks tail first, so children leave
//! before their parents in practice; evicting only leaves makes that strict.

use std::collections::{BTreeSet, HashMap};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::payload::SimEvent;

/// Token ids are drawn below this (Qwen's vocabulary size), so they look real.
const VOCAB: u32 = 151_936;
/// Chain seed of a root block (vLLM's `NONE_HASH` plays this role).
const NONE_HASH: u64 = 0x766c_6c6d_6e6f_6e65;

/// What the simulated engine serves and how big its cache is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Drives request arrival and suffix tokens (not the system prompts).
    pub seed: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks the cache holds before it evicts; at least one request's worth.
    pub capacity_blocks: usize,
    /// Number of shared system prompts requests start with.
    pub prompt_families: usize,
    /// Length of each system prompt, in blocks (the shared prefix).
    pub family_prompt_blocks: usize,
    /// Each request adds 1..=this many unique blocks after its system prompt.
    pub max_suffix_blocks: usize,
    /// [`SimEngine::step`] admits 1..=this many requests.
    pub max_requests_per_step: usize,
    /// Reset the whole cache (`AllBlocksCleared`) every this many steps.
    pub clear_every: Option<u64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            block_size: 16,
            capacity_blocks: 1024,
            prompt_families: 8,
            family_prompt_blocks: 4,
            max_suffix_blocks: 8,
            max_requests_per_step: 4,
            clear_every: None,
        }
    }
}

/// A [`SimConfig`] that cannot be simulated.
#[derive(Debug, thiserror::Error)]
#[error("invalid simulated engine config: {0}")]
pub struct ConfigError(&'static str);

impl SimConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let checks = [
            (self.block_size > 0, "block_size must be positive"),
            (self.prompt_families > 0, "prompt_families must be positive"),
            // Every request then stores at least one block, so `step_events`
            // always makes progress.
            (
                self.max_suffix_blocks > 0,
                "max_suffix_blocks must be positive",
            ),
            (
                self.max_requests_per_step > 0,
                "max_requests_per_step must be positive",
            ),
            (self.clear_every != Some(0), "clear_every must be positive"),
            // Eviction only takes blocks of earlier requests, so the largest
            // request has to fit on its own.
            (
                self.capacity_blocks >= self.family_prompt_blocks + self.max_suffix_blocks,
                "capacity_blocks must hold the longest request",
            ),
        ];
        match checks.into_iter().find(|(ok, _)| !ok) {
            Some((_, problem)) => Err(ConfigError(problem)),
            None => Ok(()),
        }
    }
}

struct Block {
    parent: Option<u64>,
    children: u32,
    last_used: u64,
}

/// The simulated engine's prefix cache; see the module docs for the model.
pub struct SimEngine {
    config: SimConfig,
    rng: SmallRng,
    /// One token sequence per prompt family.
    prompts: Vec<Vec<u32>>,
    blocks: HashMap<u64, Block>,
    /// Blocks without a live child, by (last use, hash): the eviction order.
    leaves: BTreeSet<(u64, u64)>,
    /// Bumped per request, so a request's own blocks are always the newest.
    tick: u64,
    steps: u64,
}

impl SimEngine {
    pub fn new(config: SimConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let prompt_len = config.family_prompt_blocks * config.block_size as usize;
        let prompts = (0..config.prompt_families as u64)
            .map(|family| {
                (0..prompt_len as u64)
                    .map(|i| token(mix((family << 32) | i)))
                    .collect()
            })
            .collect();
        Ok(Self {
            rng: SmallRng::seed_from_u64(config.seed),
            config,
            prompts,
            blocks: HashMap::new(),
            leaves: BTreeSet::new(),
            tick: 0,
            steps: 0,
        })
    }

    /// One scheduler step: 1..=`max_requests_per_step` requests.
    pub fn step(&mut self) -> Vec<SimEvent> {
        let requests = self.rng.random_range(1..=self.config.max_requests_per_step);
        let mut events = self.begin_step();
        for _ in 0..requests {
            self.admit_request(&mut events);
        }
        events
    }

    /// One scheduler step that admits requests until it has reported at least
    /// `min_events` events (for driving a consumer at a given event rate).
    pub fn step_events(&mut self, min_events: usize) -> Vec<SimEvent> {
        let mut events = self.begin_step();
        while events.len() < min_events {
            self.admit_request(&mut events);
        }
        events
    }

    /// The engine's load as SGLang's scheduler would report it after a
    /// step that reported `step_events` events: the cache's blocks in use
    /// against its capacity, and the step's work as running requests.
    pub fn load_stat(&self, dp_rank: u32, step_events: usize) -> crate::LoadStat {
        let block_size = i64::from(self.config.block_size);
        let tokens = |blocks: usize| i64::try_from(blocks).unwrap_or(i64::MAX) * block_size;
        let running = i64::try_from(step_events.min(64)).unwrap_or(64);
        crate::LoadStat {
            num_running_reqs: running,
            num_waiting_reqs: 0,
            num_tokens: tokens(self.blocks.len()),
            max_total_num_tokens: tokens(self.config.capacity_blocks),
            attn_dp_rank: Some(i64::from(dp_rank)),
            num_waiting_uncached_tokens: 0,
            num_total_tokens: tokens(self.blocks.len()),
            max_running_requests: 64,
            total_prefill_uncached_tokens: 0,
            total_prefill_busy_us: 0,
        }
    }

    /// Hashes of the blocks the cache holds now, in no particular order.
    pub fn live_blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.keys().copied()
    }

    fn begin_step(&mut self) -> Vec<SimEvent> {
        self.steps += 1;
        if self
            .config
            .clear_every
            .is_some_and(|every| self.steps.is_multiple_of(every))
        {
            self.blocks.clear();
            self.leaves.clear();
            vec![SimEvent::Cleared]
        } else {
            Vec::new()
        }
    }

    fn admit_request(&mut self, events: &mut Vec<SimEvent>) {
        self.tick += 1;
        let block_size = self.config.block_size as usize;
        let family = self.rng.random_range(0..self.prompts.len());
        let suffix_blocks = self.rng.random_range(1..=self.config.max_suffix_blocks);
        let mut tokens = self.prompts[family].clone();
        tokens.extend((0..suffix_blocks * block_size).map(|_| self.rng.random_range(0..VOCAB)));

        let hashes: Vec<u64> = tokens
            .chunks_exact(block_size)
            .scan(None, |parent, block| {
                let hash = block_hash(*parent, block);
                *parent = Some(hash);
                Some(hash)
            })
            .collect();
        // A live block's parent is live, so the cached blocks form a prefix.
        let cached = hashes
            .iter()
            .take_while(|hash| self.blocks.contains_key(hash))
            .count();
        for &hash in &hashes[..cached] {
            self.touch(hash);
        }

        let new = &hashes[cached..];
        while self.blocks.len() + new.len() > self.config.capacity_blocks {
            let evicted = self.evict_lru_leaf();
            events.push(SimEvent::Removed {
                hashes: vec![evicted],
            });
        }
        let parent = cached.checked_sub(1).map(|last| hashes[last]);
        let mut chain_parent = parent;
        for &hash in new {
            self.insert(hash, chain_parent);
            chain_parent = Some(hash);
        }
        events.push(SimEvent::Stored {
            hashes: new.to_vec(),
            parent,
            tokens: tokens.split_off(cached * block_size),
            block_size: self.config.block_size,
        });
    }

    fn touch(&mut self, hash: u64) {
        let block = self.blocks.get_mut(&hash).expect("touched blocks are live");
        if block.children == 0 {
            self.leaves.remove(&(block.last_used, hash));
            self.leaves.insert((self.tick, hash));
        }
        block.last_used = self.tick;
    }

    fn insert(&mut self, hash: u64, parent: Option<u64>) {
        if let Some(parent) = parent {
            let block = self
                .blocks
                .get_mut(&parent)
                .expect("a stored block's parent is live");
            if block.children == 0 {
                self.leaves.remove(&(block.last_used, parent));
            }
            block.children += 1;
        }
        let block = Block {
            parent,
            children: 0,
            last_used: self.tick,
        };
        self.blocks.insert(hash, block);
        self.leaves.insert((self.tick, hash));
    }

    fn evict_lru_leaf(&mut self) -> u64 {
        let (last_used, hash) = self
            .leaves
            .pop_first()
            .expect("a non-empty cache has a leaf");
        // Blocks of earlier requests always include a leaf while they exist,
        // and the config guarantees the current request fits without them.
        debug_assert!(
            last_used < self.tick,
            "evicting the current request's block"
        );
        let block = self.blocks.remove(&hash).expect("leaves are live");
        if let Some(parent) = block.parent {
            let parent_block = self
                .blocks
                .get_mut(&parent)
                .expect("a live block's parent is live");
            parent_block.children -= 1;
            if parent_block.children == 0 {
                self.leaves.insert((parent_block.last_used, parent));
            }
        }
        hash
    }
}

/// splitmix64's finalizer: a cheap, well-spread 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn token(random: u64) -> u32 {
    (random % u64::from(VOCAB)) as u32
}

fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    tokens
        .iter()
        .fold(mix(parent.unwrap_or(NONE_HASH)), |hash, &token| {
            mix(hash ^ u64::from(token))
        })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn engine(config: SimConfig) -> SimEngine {
        SimEngine::new(config).unwrap()
    }

    fn events(engine: &mut SimEngine, steps: usize) -> Vec<Vec<SimEvent>> {
        (0..steps).map(|_| engine.step()).collect()
    }

    /// Applies one event to a consumer's view, checking it against that view.
    fn apply(view: &mut HashSet<u64>, event: &SimEvent) {
        match event {
            SimEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
            } => {
                assert!(!hashes.is_empty());
                assert_eq!(tokens.len(), hashes.len() * *block_size as usize);
                if let Some(parent) = parent {
                    assert!(
                        view.contains(parent),
                        "stored under a block that is not live"
                    );
                }
                for hash in hashes {
                    assert!(view.insert(*hash), "stored a block that was already live");
                }
            }
            SimEvent::Removed { hashes } => {
                assert_eq!(
                    hashes.len(),
                    1,
                    "the block pool removes one block per event"
                );
                assert!(view.remove(&hashes[0]), "removed a block that was not live");
            }
            SimEvent::Cleared => view.clear(),
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_events_and_another_seed_does_not() {
        let config = SimConfig {
            capacity_blocks: 64,
            ..SimConfig::default()
        };
        let first = events(&mut engine(config.clone()), 300);
        assert_eq!(first, events(&mut engine(config.clone()), 300));
        let other_seed = SimConfig { seed: 1, ..config };
        assert_ne!(first, events(&mut engine(other_seed), 300));
    }

    #[test]
    fn replaying_the_events_rebuilds_the_live_blocks_exactly() {
        let mut engine = engine(SimConfig {
            capacity_blocks: 48,
            clear_every: Some(150),
            ..SimConfig::default()
        });
        let mut view = HashSet::new();
        let (mut stores, mut removals, mut clears) = (0, 0, 0);
        for _ in 0..1_000 {
            for event in engine.step() {
                apply(&mut view, &event);
                match event {
                    SimEvent::Stored { .. } => stores += 1,
                    SimEvent::Removed { .. } => removals += 1,
                    SimEvent::Cleared => clears += 1,
                }
            }
            assert_eq!(view, engine.live_blocks().collect::<HashSet<_>>());
            assert!(view.len() <= 48, "the cache outgrew its capacity");
        }
        assert!(
            stores > 1_000 && removals > 1_000,
            "{stores} stores, {removals} removals"
        );
        assert_eq!(clears, 6);
    }

    #[test]
    fn a_clear_comes_first_in_its_step_and_empties_the_cache() {
        let mut engine = engine(SimConfig {
            clear_every: Some(3),
            ..SimConfig::default()
        });
        events(&mut engine, 2);
        let step = engine.step();
        assert_eq!(step[0], SimEvent::Cleared);
        assert!(
            step[1..]
                .iter()
                .all(|event| matches!(event, SimEvent::Stored { .. }))
        );
        let stored: HashSet<u64> = step[1..]
            .iter()
            .flat_map(|event| match event {
                SimEvent::Stored { hashes, .. } => hashes.clone(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(stored, engine.live_blocks().collect());
    }

    #[test]
    fn requests_share_their_system_prompt_across_requests_and_seeds() {
        let roots = |seed| {
            let mut engine = engine(SimConfig {
                seed,
                capacity_blocks: 4096,
                ..SimConfig::default()
            });
            events(&mut engine, 200)
                .into_iter()
                .flatten()
                .filter_map(|event| match event {
                    SimEvent::Stored {
                        hashes,
                        parent: None,
                        ..
                    } => Some(hashes[0]),
                    _ => None,
                })
                .collect::<HashSet<_>>()
        };
        let first = roots(0);
        // 200 steps bring hundreds of requests; only the 8 prompts start chains
        // in a cache that never fills.
        assert!(
            !first.is_empty() && first.len() <= 8,
            "{} roots",
            first.len()
        );
        assert_eq!(first, roots(7));
    }

    #[test]
    fn step_events_reports_at_least_the_asked_number_of_events() {
        let mut engine = engine(SimConfig {
            capacity_blocks: 32,
            ..SimConfig::default()
        });
        for _ in 0..50 {
            assert!(engine.step_events(100).len() >= 100);
        }
    }

    #[test]
    fn configs_that_cannot_run_are_refused() {
        let refused = [
            SimConfig {
                block_size: 0,
                ..SimConfig::default()
            },
            SimConfig {
                max_suffix_blocks: 0,
                ..SimConfig::default()
            },
            SimConfig {
                clear_every: Some(0),
                ..SimConfig::default()
            },
            SimConfig {
                capacity_blocks: 11,
                ..SimConfig::default()
            },
        ];
        for config in refused {
            assert!(SimEngine::new(config.clone()).is_err(), "{config:?}");
        }
        assert!(
            SimEngine::new(SimConfig {
                capacity_blocks: 12,
                ..SimConfig::default()
            })
            .is_ok()
        );
    }
}
