//! The prefix index's cost on a vLLM-shaped fleet, in-process: heap bytes
//! per live block (a counting allocator), CPU per ingested block (the local
//! hash and the tree's store) and CPU per query walk, on one core. Prints a
//! table; `cargo bench --bench index`. The side-by-side with Dynamo's
//! indexer over HTTP is `benchmarks/dynamo-index/peer.py`.

use std::hint::black_box;
use std::time::Instant;

use kvgate::index::block_hash::HashSeed;
use kvgate::index::tier::Tier;
use kvgate::index::tree::{RankKey, Tree};

#[path = "common/counting_allocator.rs"]
mod counting_allocator;
use counting_allocator::live_bytes;

/// The fleet Dynamo's indexer was measured on (BENCHMARKS.md): 33 ranks
/// holding 264k live blocks.
const RANKS: u32 = 33;
const BLOCKS_PER_RANK: usize = 8_000;
const BLOCK_SIZE: usize = 16;
/// Blocks per request chain; the first `SHARED` are a prefix every rank shares.
const CHAIN: usize = 64;
const SHARED: usize = 8;

/// A request's tokens: a shared system prompt, then its own.
fn request_tokens(request: u64) -> Vec<u32> {
    (0..CHAIN * BLOCK_SIZE)
        .map(|position| {
            if position < SHARED * BLOCK_SIZE {
                position as u32
            } else {
                (request as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(position as u32)
            }
        })
        .collect()
}

fn main() {
    let seed = HashSeed::new(None, None);
    let before = live_bytes();
    let mut tree = Tree::new();
    let started = Instant::now();
    let mut ingested = 0u64;
    let mut request_ids = Vec::new();
    for rank in 0..RANKS {
        let key = RankKey {
            worker: u64::from(rank),
            rank: 0,
        };
        for chain in 0..BLOCKS_PER_RANK / CHAIN {
            let request = u64::from(rank) * 1_000 + chain as u64;
            let tokens = request_tokens(request);
            let blocks: Vec<(i64, u64)> = tokens
                .chunks_exact(BLOCK_SIZE)
                .enumerate()
                .map(|(index, block)| {
                    let local = seed.block(block);
                    // Engines name a block by its prefix: shared blocks share it.
                    let engine = if index < SHARED {
                        index as i64
                    } else {
                        (request << 8 | index as u64) as i64
                    };
                    (engine, local)
                })
                .collect();
            tree.store(key, None, Tier::Device, &blocks);
            // As the writer does after each step.
            if let Some(rebuilt) = tree.rebuilt_map(key) {
                tree.install_map(rebuilt);
            }
            ingested += blocks.len() as u64;
            request_ids.push(request);
        }
    }
    let ingest = started.elapsed();
    let bytes = live_bytes() - before;
    let live = tree.held_blocks();

    // Prompts of stored requests, made after the heap was counted.
    let prompts: Vec<Vec<u32>> = (0..256)
        .map(|query| request_tokens(request_ids[(query * 7919) % request_ids.len()]))
        .collect();
    let queries = 20_000;
    let started = Instant::now();
    for query in 0..queries {
        let tokens = &prompts[query % prompts.len()];
        let locals = seed.blocks(tokens, BLOCK_SIZE as u32);
        black_box(tree.overlap(&locals));
    }
    let per_query = started.elapsed() / queries as u32;

    println!("| figure | value |");
    println!("|---|---|");
    println!("| ranks, live blocks (rank, block) | {RANKS}, {live} |");
    println!("| tree nodes | {} |", tree.nodes());
    println!(
        "| heap bytes per live block | {:.1} |",
        bytes as f64 / live as f64
    );
    println!(
        "| CPU per ingested block (hash + store) | {:.2} µs |",
        ingest.as_secs_f64() * 1e6 / ingested as f64
    );
    println!(
        "| CPU per query ({CHAIN} blocks of {BLOCK_SIZE} tokens: hash + walk) | {:.2} µs |",
        per_query.as_secs_f64() * 1e6
    );
}
