//! A steady-state event stream for benchmarks and the load tool.
//!
//! Invariant: after warm-up the engine holds `live_blocks` blocks: each
//! payload stores one chain of `blocks_per_store` new blocks (16-token
//! blocks by default) and evicts the oldest chain, one `BlockRemoved` per
//! hash as vLLM's block pool does. Hashes are random 64-bit values, half of
//! them above 2^63 like real vLLM hashes.

use std::collections::VecDeque;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::payload::{SimEvent, encode_batch};

#[derive(Clone, Copy, Debug)]
pub struct WorkloadShape {
    pub blocks_per_store: usize,
    pub block_size: u32,
    /// Blocks kept live before the oldest chains are evicted.
    pub live_blocks: usize,
}

impl Default for WorkloadShape {
    fn default() -> Self {
        Self {
            blocks_per_store: 64,
            block_size: 16,
            live_blocks: 65_536,
        }
    }
}

/// Produces vLLM 0.33 payloads of the shape asked for.
pub struct SteadyState {
    shape: WorkloadShape,
    rng: SmallRng,
    chains: VecDeque<Vec<u64>>,
    live: usize,
}

impl SteadyState {
    pub fn new(shape: WorkloadShape, seed: u64) -> Self {
        Self {
            shape,
            rng: SmallRng::seed_from_u64(seed),
            chains: VecDeque::new(),
            live: 0,
        }
    }

    /// The next payload's events: evictions (once full), then one store.
    pub fn next_events(&mut self) -> Vec<SimEvent> {
        let mut events = Vec::new();
        while self.live + self.shape.blocks_per_store > self.shape.live_blocks {
            let Some(oldest) = self.chains.pop_front() else {
                break;
            };
            self.live -= oldest.len();
            events.extend(
                oldest
                    .into_iter()
                    .map(|hash| SimEvent::Removed { hashes: vec![hash] }),
            );
        }
        let hashes: Vec<u64> = (0..self.shape.blocks_per_store)
            .map(|_| self.rng.random())
            .collect();
        let tokens = (0..hashes.len() * self.shape.block_size as usize)
            .map(|_| self.rng.random_range(0..150_000))
            .collect();
        events.push(SimEvent::Stored {
            hashes: hashes.clone(),
            parent: self.chains.back().and_then(|chain| chain.last().copied()),
            tokens,
            block_size: self.shape.block_size,
        });
        self.live += hashes.len();
        self.chains.push_back(hashes);
        events
    }

    /// The next payload, encoded as frame 3 of a ZMQ message.
    pub fn next_payload(&mut self, timestamp: f64, dp_rank: u32) -> Vec<u8> {
        let mut out = Vec::new();
        encode_batch(timestamp, &self.next_events(), Some(dp_rank), &mut out);
        out
    }

    /// Blocks the simulated engine holds now.
    pub fn live_blocks(&self) -> usize {
        self.live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_live_block_count_levels_off_at_the_target() {
        let shape = WorkloadShape {
            blocks_per_store: 8,
            block_size: 4,
            live_blocks: 64,
        };
        let mut workload = SteadyState::new(shape, 1);
        let mut stored = 0;
        let mut removed = 0;
        for _ in 0..100 {
            for event in workload.next_events() {
                match event {
                    SimEvent::Stored { hashes, tokens, .. } => {
                        assert_eq!(tokens.len(), hashes.len() * 4);
                        stored += hashes.len();
                    }
                    SimEvent::Removed { hashes } => removed += hashes.len(),
                    SimEvent::Cleared => unreachable!(),
                }
            }
            assert!(workload.live_blocks() <= 64);
        }
        assert_eq!(stored - removed, workload.live_blocks());
        assert_eq!(workload.live_blocks(), 64);
    }
}
