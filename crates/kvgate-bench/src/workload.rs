//! What the simulated engine publishes: the steady synthetic mix, or the
//! traffic of a recording or a Mooncake trace (`--workload FILE`).
//!
//! A file's traffic is loaded once (at most [`MAX_PAYLOADS`] payloads) and
//! published in order at the run's `--rate`: the events and their sizes
//! are the file's, the pace is the run's. A recording gives each recorded
//! batch's events as one payload; a trace gives each request's evictions
//! and store as one, from the same simulated prefix cache `kvgate serve
//! --trace-file` uses (65536 blocks of 16 tokens, the steady mix's). Token
//! ids a file does not have are made up from the block hash as each payload
//! goes out, so memory holds hashes only. The sequence repeats, each pass
//! after an `AllBlocksCleared`, as an engine restart would, so the state
//! kvgate holds stays the file's.

use std::io::BufReader;
use std::path::Path;

use anyhow::Context as _;
use kvgate::proto::common::{KvCacheEvent, KvEventBatch, kv_cache_event::Data};
use kvgate::recording::{Entry, OpenError, Recording};
use kvgate::source::prefix_cache::PrefixCache;
use kvgate::source::trace::{TRACE_BLOCK_TOKENS, requests};
use kvgate_sim::{SimEvent, SteadyState, WorkloadShape};
use prost::Message as _;

/// Most payloads a file's workload holds in memory.
pub const MAX_PAYLOADS: usize = 1 << 20;

/// Longest trace line read.
const MAX_TRACE_LINE_BYTES: usize = 1 << 20;

pub enum Workload {
    Steady(SteadyState),
    File(Replayed),
}

/// A file's payloads, published in a loop.
pub struct Replayed {
    payloads: Vec<Vec<SimEvent>>,
    next: usize,
}

impl Workload {
    /// The steady mix of `shape`, or the traffic of `file`.
    pub fn new(shape: WorkloadShape, seed: u64, file: Option<&Path>) -> anyhow::Result<Self> {
        let Some(file) = file else {
            return Ok(Self::Steady(SteadyState::new(shape, seed)));
        };
        let payloads = match Recording::open(&[file.to_owned()]) {
            Ok(recording) => recorded(recording)?,
            Err(OpenError::Foreign { .. }) => traced(file, shape)?,
            Err(error) => return Err(error.into()),
        };
        anyhow::ensure!(
            !payloads.is_empty(),
            "{}: no events to publish",
            file.display()
        );
        Ok(Self::File(Replayed { payloads, next: 0 }))
    }

    /// The next payload's events.
    pub fn next_events(&mut self) -> Vec<SimEvent> {
        match self {
            Self::Steady(steady) => steady.next_events(),
            Self::File(replayed) => {
                let at = replayed.next % replayed.payloads.len();
                replayed.next += 1;
                let events = replayed.payloads[at].iter().cloned().map(with_tokens);
                if at == 0 && replayed.next > 1 {
                    std::iter::once(SimEvent::Cleared).chain(events).collect()
                } else {
                    events.collect()
                }
            }
        }
    }
}

/// A store held without tokens gets made-up ones.
fn with_tokens(mut event: SimEvent) -> SimEvent {
    if let SimEvent::Stored {
        hashes,
        tokens,
        block_size,
        ..
    } = &mut event
        && tokens.is_empty()
    {
        *tokens = made_up_tokens(hashes, *block_size);
    }
    event
}

/// Each recorded batch with events, as an engine payload.
fn recorded(mut recording: Recording) -> anyhow::Result<Vec<Vec<SimEvent>>> {
    let mut payloads = Vec::new();
    for record in recording.by_ref() {
        let Entry::Batch(bytes) = record.entry else {
            continue;
        };
        let batch = KvEventBatch::decode(bytes).context("a recorded batch")?;
        if !batch.events.is_empty() {
            payloads.push(batch.events.iter().filter_map(sim_event).collect());
        }
        if payloads.len() == MAX_PAYLOADS {
            break;
        }
    }
    if let Some(ending @ kvgate::recording::Ending::Cut { .. }) = recording.ending() {
        eprintln!("kvgate-bench: {ending}");
    }
    Ok(payloads)
}

fn sim_event(event: &KvCacheEvent) -> Option<SimEvent> {
    Some(match event.data.as_ref()? {
        Data::Stored(stored) => {
            let hashes: Vec<u64> = stored.blocks.iter().map(|b| b.block_hash as u64).collect();
            let block_size = stored
                .blocks
                .first()
                .map_or(16, |block| block.block_size.max(1) as u32);
            let mut tokens: Vec<u32> = stored
                .blocks
                .iter()
                .flat_map(|block| block.token_ids.iter().copied())
                .collect();
            if tokens.len() != hashes.len() * block_size as usize {
                tokens.clear();
            }
            SimEvent::Stored {
                parent: stored.parent_block_hash.map(|hash| hash as u64),
                hashes,
                tokens,
                block_size,
            }
        }
        Data::Removed(removed) => SimEvent::Removed {
            hashes: removed.block_hashes.iter().map(|&h| h as u64).collect(),
        },
        Data::Cleared(_) => SimEvent::Cleared,
    })
}

/// Token ids for blocks whose tokens are unknown: the right count, made up
/// from each block's hash.
fn made_up_tokens(hashes: &[u64], block_size: u32) -> Vec<u32> {
    hashes
        .iter()
        .flat_map(|&hash| (0..block_size).map(move |i| (hash as u32).wrapping_add(i) & 0x1_ffff))
        .collect()
}

/// Each trace request's evictions and store, as an engine payload.
fn traced(file: &Path, shape: WorkloadShape) -> anyhow::Result<Vec<Vec<SimEvent>>> {
    anyhow::ensure!(
        shape.block_size > 0 && TRACE_BLOCK_TOKENS.is_multiple_of(shape.block_size),
        "--block-size {} does not divide the trace's {TRACE_BLOCK_TOKENS}-token blocks",
        shape.block_size
    );
    let reader = BufReader::new(
        kvgate::regular_file::open(file)
            .with_context(|| format!("--workload {}", file.display()))?,
    );
    let mut cache = PrefixCache::new(shape.live_blocks);
    let mut payloads = Vec::new();
    for (line, request) in requests(reader, MAX_TRACE_LINE_BYTES).enumerate() {
        let request = request.map_err(|what| {
            anyhow::anyhow!(
                "--workload {}: line {} is neither a recording nor a trace request ({what})",
                file.display(),
                line + 1
            )
        })?;
        let admission = cache.admit(&request.blocks(shape.block_size, shape.live_blocks));
        let mut events = Vec::with_capacity(2);
        if !admission.evicted.is_empty() {
            events.push(SimEvent::Removed {
                hashes: admission.evicted.iter().map(|&h| h as u64).collect(),
            });
        }
        if !admission.stored.is_empty() {
            let hashes: Vec<u64> = admission.stored.iter().map(|&h| h as u64).collect();
            events.push(SimEvent::Stored {
                tokens: Vec::new(),
                parent: admission.parent.map(|hash| hash as u64),
                hashes,
                block_size: shape.block_size,
            });
        }
        if !events.is_empty() {
            payloads.push(events);
        }
        if payloads.len() == MAX_PAYLOADS {
            break;
        }
    }
    Ok(payloads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_workload_repeats_after_a_clear_with_stores_from_shared_prefixes() {
        let dir = std::env::temp_dir().join(format!("record-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("trace.jsonl");
        std::fs::write(
            &file,
            "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\
             {\"timestamp\": 5, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1, 3]}\n",
        )
        .unwrap();
        let shape = WorkloadShape {
            block_size: 256,
            ..WorkloadShape::default()
        };
        let mut workload = Workload::new(shape, 7, Some(&file)).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let first = workload.next_events();
        assert!(
            matches!(&first[..], [SimEvent::Stored { hashes, parent: None, tokens, .. }]
                if hashes == &[2, 3, 4, 5] && tokens.len() == 4 * 256)
        );
        let second = workload.next_events();
        assert!(
            matches!(&second[..], [SimEvent::Stored { hashes, parent: Some(3), .. }]
                if hashes == &[6, 7])
        );
        assert!(matches!(workload.next_events()[0], SimEvent::Cleared));
    }
}
