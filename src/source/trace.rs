//! A Mooncake trace (`--trace-file`) as the event source: the stores and
//! evictions one engine's prefix cache would publish while serving the
//! trace's requests, at the trace's pace.
//!
//! The model, and its limits (docs/recordings.md says more):
//! each JSON line is one request (`timestamp` in ms, `input_length`,
//! `output_length`, `hash_ids`: one id per 512-token block, shared by
//! requests that share the prefix). It goes to rank hash(request) mod
//! `--dp-size`; that rank's [`PrefixCache`] of `--trace-cache-blocks`
//! blocks serves it at once on arrival: the longest cached prefix hits, the
//! full blocks after it are stored as one chain (a removal of the evicted
//! blocks first, when the cache is full). Blocks are `--trace-block-tokens`
//! tokens; a 512-token trace block becomes 512 / that many engine blocks.
//! Not modelled: the partial last block and generated tokens (their hashes
//! are not in the trace), request duration (blocks of running requests are
//! evictable), and anything about token ids.
//!
//! Invariant: a malformed or oversized line is counted and skipped, never
//! the end of the stream; the cache never holds more than its capacity, and
//! no request more than that many blocks (capped before they are
//! collected, whatever its line claims); the requests read ahead hold at
//! most `READ_AHEAD_BYTES` of blocks (or the one request being read). The
//! trace is a regular file, opened without waiting for anything else.

use std::hash::{Hash as _, Hasher as _};
use std::io::{BufRead as _, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::pace::{self, Pacer, Pass, Played, Speed};
use super::prefix_cache::{Admission, PrefixCache};
use super::{DrainGone, SourceEvent, send};
use crate::metrics::Metrics;
use crate::proto::common::{
    KvBlock, KvBlocksRemoved, KvBlocksStored, KvCacheEvent, KvCacheTier, kv_cache_event::Data,
};

/// The bad-message reason of a trace line that is not a request, or is
/// longer than `--trace-max-line-bytes`.
pub const MALFORMED_LINE: &str = "trace_line_malformed";

/// Tokens of one trace block (the Mooncake traces' block size).
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// Requests read ahead of the pacer.
const READ_AHEAD: usize = 1024;

/// Bytes of blocks those requests may hold: a request holds at most
/// `--trace-cache-blocks` blocks of 8 bytes, so at the default a full read
/// ahead (1024 × 128 KiB) would be 128 MiB. One request larger than this
/// is still read, alone.
const READ_AHEAD_BYTES: usize = 32 << 20;

/// Which trace to play, and the engine to simulate.
#[derive(Clone, Debug)]
pub struct TraceConfig {
    /// The JSON-lines trace.
    pub file: PathBuf,
    /// How fast.
    pub speed: Speed,
    /// Start over at the end, forever.
    pub looped: bool,
    /// Each rank's cache capacity, in blocks.
    pub cache_blocks: usize,
    /// Tokens per engine block: divides [`TRACE_BLOCK_TOKENS`].
    pub block_tokens: u32,
    /// Ranks the requests are spread over.
    pub dp_size: u32,
    /// Longest line read; a longer one is skipped.
    pub max_line_bytes: usize,
}

/// One request of a trace.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct TraceRequest {
    /// Arrival, milliseconds from the trace's start.
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens (not modelled).
    #[serde(default)]
    pub output_length: u64,
    /// One id per 512-token block of the prompt.
    pub hash_ids: Vec<i64>,
}

impl TraceRequest {
    /// The rank of `dp_size` that serves it: a hash of the whole request.
    pub fn rank(&self, dp_size: u32) -> u32 {
        let mut hasher = rustc_hash::FxHasher::default();
        self.timestamp.to_bits().hash(&mut hasher);
        self.input_length.hash(&mut hasher);
        self.hash_ids.hash(&mut hasher);
        (hasher.finish() % u64::from(dp_size.max(1))) as u32
    }

    /// How many engine blocks of `block_tokens` its prompt fills: those its
    /// hash ids cover, up to the prompt's length.
    pub fn block_count(&self, block_tokens: u32) -> u64 {
        let per_trace_block = u64::from(TRACE_BLOCK_TOKENS / block_tokens.max(1));
        let covered = (self.hash_ids.len() as u64).saturating_mul(per_trace_block);
        covered.min(self.input_length / u64::from(block_tokens.max(1)))
    }

    /// The first `max_blocks` of the engine blocks its prompt fills, as
    /// hashes: trace block `id` becomes `id * k + j` for its k blocks of
    /// `block_tokens`. A cache of `max_blocks` can hold no more of one
    /// request's chain, and a line of a few bytes a hash id may claim
    /// hundreds of thousands of blocks: the cap comes before anything is
    /// collected.
    pub fn blocks(&self, block_tokens: u32, max_blocks: usize) -> Vec<i64> {
        let per_trace_block = TRACE_BLOCK_TOKENS / block_tokens.max(1);
        let count = usize::try_from(self.block_count(block_tokens))
            .unwrap_or(usize::MAX)
            .min(max_blocks);
        let mut blocks = Vec::with_capacity(count);
        blocks.extend(
            self.hash_ids
                .iter()
                .flat_map(|id| {
                    (0..per_trace_block).map(move |j| {
                        id.wrapping_mul(i64::from(per_trace_block))
                            .wrapping_add(i64::from(j))
                    })
                })
                .take(count),
        );
        blocks
    }
}

impl TraceConfig {
    /// Checks the settings and that the file opens and starts with a
    /// request; the message says what is wrong (the caller names the flag).
    pub fn check(&self) -> Result<(), String> {
        if self.block_tokens == 0 || !TRACE_BLOCK_TOKENS.is_multiple_of(self.block_tokens) {
            return Err(format!(
                "{} tokens does not divide the trace's {TRACE_BLOCK_TOKENS}-token blocks",
                self.block_tokens
            ));
        }
        let file = open(&self.file)?;
        let empty = file.metadata().is_ok_and(|metadata| metadata.len() == 0);
        // Line 1 only: a file of one endless line is not read to its end.
        let first = BufReader::new(file.take(self.max_line_bytes as u64 + 1));
        match Lines::new(first, self.max_line_bytes).next() {
            Some(Ok(_)) => Ok(()),
            Some(Err(what)) => Err(format!(
                "{}: line 1 is not a Mooncake trace request ({what})",
                self.file.display()
            )),
            None if empty => Err(format!("{}: empty trace", self.file.display())),
            None => Err(format!(
                "{}: no request in its first {} bytes",
                self.file.display(),
                self.max_line_bytes
            )),
        }
    }
}

/// Opens the trace: a regular file only, without waiting for anything else
/// ([`crate::regular_file`]).
fn open(file: &Path) -> Result<std::fs::File, String> {
    crate::regular_file::open(file).map_err(|refused| format!("{}: {refused}", file.display()))
}

/// A trace's requests, read from `reader` a line at a time, each line at
/// most `max_line_bytes`; a line that is not a request is an `Err` saying
/// why, and reading goes on after it.
pub fn requests<R: std::io::BufRead>(
    reader: R,
    max_line_bytes: usize,
) -> impl Iterator<Item = Result<TraceRequest, String>> {
    Lines::new(reader, max_line_bytes)
}

/// A trace's lines as requests, each line bounded.
struct Lines<R> {
    reader: R,
    max_line_bytes: usize,
    line: Vec<u8>,
}

impl<R: std::io::BufRead> Lines<R> {
    fn new(reader: R, max_line_bytes: usize) -> Self {
        Self {
            reader,
            max_line_bytes,
            line: Vec::new(),
        }
    }
}

impl<R: std::io::BufRead> Iterator for Lines<R> {
    /// A request, or why the line is not one.
    type Item = Result<TraceRequest, String>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.line.clear();
            let limit = self.max_line_bytes as u64 + 1;
            let read = (&mut self.reader)
                .take(limit)
                .read_until(b'\n', &mut self.line);
            match read {
                Ok(0) => return None,
                Ok(_) => {}
                Err(error) => return Some(Err(error.to_string())),
            }
            if self.line.len() > self.max_line_bytes && self.line.last() != Some(&b'\n') {
                // Skip the rest of the line without holding it.
                let mut rest = Vec::new();
                loop {
                    rest.clear();
                    match (&mut self.reader).take(limit).read_until(b'\n', &mut rest) {
                        Ok(0) | Err(_) => break,
                        Ok(_) if rest.last() == Some(&b'\n') => break,
                        Ok(_) => {}
                    }
                }
                return Some(Err(format!(
                    "a line longer than {} bytes",
                    self.max_line_bytes
                )));
            }
            let text = self.line.trim_ascii();
            if text.is_empty() {
                continue;
            }
            return Some(serde_json::from_slice(text).map_err(|error| error.to_string()));
        }
    }
}

/// What a pass did, for the log.
#[derive(Debug, Default)]
struct PassFigures {
    requests: u64,
    malformed: u64,
    blocks: u64,
    hits: u64,
    stored: u64,
    evicted: u64,
    /// Blocks the caches hold at the end.
    held: u64,
}

/// Plays the trace until `stop` is cancelled (or the drain is gone).
pub async fn run(
    config: TraceConfig,
    events: mpsc::Sender<SourceEvent>,
    metrics: Metrics,
    ready: watch::Sender<bool>,
    stop: CancellationToken,
) {
    let pass = TracePass {
        config: &config,
        events: &events,
        metrics: &metrics,
    };
    pace::play_passes(config.speed, config.looped, &events, &ready, &stop, pass).await;
}

struct TracePass<'a> {
    config: &'a TraceConfig,
    events: &'a mpsc::Sender<SourceEvent>,
    metrics: &'a Metrics,
}

impl Pass for TracePass<'_> {
    async fn play(&mut self, number: u64, pacer: &mut Pacer) -> Result<Played, DrainGone> {
        let figures = play(self.config, pacer, self.events, self.metrics).await?;
        let hit_rate = figures.hits as f64 / figures.blocks.max(1) as f64;
        // One line a second at most: a short trace looped at max speed
        // plays thousands of passes a second.
        crate::logging::rate_limited("trace pass", || {
            info!(
                pass = number,
                requests = figures.requests,
                malformed = figures.malformed,
                blocks = figures.blocks,
                hits = figures.hits,
                hit_rate = format!("{hit_rate:.3}"),
                stored = figures.stored,
                evicted = figures.evicted,
                held = figures.held,
                "trace played to its end"
            );
        });
        Ok(if figures.stored + figures.evicted > 0 {
            Played::Something
        } else {
            Played::Nothing
        })
    }
}

/// A request as the reader hands it to the pacer: what the caches need of
/// it, its hash ids dropped.
struct Arrival {
    /// Arrival, milliseconds from the trace's start.
    timestamp: f64,
    rank: u32,
    /// Its first blocks, at most what a cache holds.
    blocks: Vec<i64>,
    /// All the blocks its prompt fills.
    block_count: u64,
}

/// One pass over the trace, with every rank's cache empty at the start.
async fn play(
    config: &TraceConfig,
    pacer: &mut Pacer,
    events: &mpsc::Sender<SourceEvent>,
    metrics: &Metrics,
) -> Result<PassFigures, DrainGone> {
    let (arrivals, mut receive) = mpsc::channel(READ_AHEAD);
    // Each request read ahead holds permits for its blocks until played.
    let room = Arc::new(Semaphore::new(READ_AHEAD_BYTES));
    let runtime = tokio::runtime::Handle::current();
    let reading = config.clone();
    // File reads and JSON parsing stay off the runtime's workers.
    let reader = tokio::task::spawn_blocking(move || {
        let file = match open(&reading.file) {
            Ok(file) => file,
            Err(error) => return warn!(%error, "trace unreadable"),
        };
        let lines = Lines::new(BufReader::new(file), reading.max_line_bytes);
        for (index, line) in lines.enumerate() {
            let arrival = line.map(|request| Arrival {
                timestamp: request.timestamp,
                rank: request.rank(reading.dp_size),
                blocks: request.blocks(reading.block_tokens, reading.cache_blocks),
                block_count: request.block_count(reading.block_tokens),
            });
            let bytes = arrival.as_ref().map_or(0, |arrival| {
                (arrival.blocks.len() * size_of::<i64>()).min(READ_AHEAD_BYTES)
            });
            let Ok(held) = runtime.block_on(
                Arc::clone(&room).acquire_many_owned(u32::try_from(bytes).unwrap_or(u32::MAX)),
            ) else {
                return;
            };
            if arrivals.blocking_send((index + 1, arrival, held)).is_err() {
                return;
            }
        }
    });
    let mut caches: Vec<PrefixCache> = (0..config.dp_size)
        .map(|_| PrefixCache::new(config.cache_blocks))
        .collect();
    let mut figures = PassFigures::default();
    let mut event_ids = vec![0_u64; caches.len()];
    while let Some((number, arrival, _held)) = receive.recv().await {
        let arrival = match arrival {
            Ok(arrival) => arrival,
            Err(what) => {
                figures.malformed += 1;
                metrics.count_bad_message(MALFORMED_LINE);
                crate::logging::rate_limited(MALFORMED_LINE, || {
                    warn!(line = number, %what, "trace line skipped");
                });
                continue;
            }
        };
        pacer
            .wait_for((arrival.timestamp.max(0.0) * 1000.0) as u64)
            .await;
        let rank = arrival.rank;
        let admission = caches[rank as usize].admit(&arrival.blocks);
        figures.requests += 1;
        figures.blocks += arrival.block_count;
        figures.hits += admission.hits as u64;
        figures.stored += admission.stored.len() as u64;
        figures.evicted += admission.evicted.len() as u64;
        let cache_events = cache_events(
            admission,
            config.block_tokens,
            &mut event_ids[rank as usize],
        );
        if !cache_events.is_empty() {
            let event = SourceEvent::Events {
                rank,
                timestamp: crate::clock::unix_now(),
                events: cache_events,
            };
            send(events, event).await?;
        }
    }
    // The reader ends once the channel is drained or dropped.
    let _ = reader.await;
    figures.held = caches.iter().map(|cache| cache.held() as u64).sum();
    Ok(figures)
}

/// The events an engine publishes for one admission: the evictions, then
/// the store.
fn cache_events(admission: Admission, block_tokens: u32, next_id: &mut u64) -> Vec<KvCacheEvent> {
    let mut events = Vec::with_capacity(2);
    let mut event = |data| {
        *next_id += 1;
        events.push(KvCacheEvent {
            event_id: *next_id,
            data: Some(data),
        });
    };
    if !admission.evicted.is_empty() {
        event(Data::Removed(KvBlocksRemoved {
            block_hashes: admission.evicted,
            tier: Some(KvCacheTier::Device as i32),
            ..Default::default()
        }));
    }
    if !admission.stored.is_empty() {
        event(Data::Stored(KvBlocksStored {
            blocks: admission
                .stored
                .into_iter()
                .map(|block_hash| KvBlock {
                    block_hash,
                    block_size: block_tokens as i32,
                    ..Default::default()
                })
                .collect(),
            parent_block_hash: admission.parent,
            tier: Some(KvCacheTier::Device as i32),
            ..Default::default()
        }));
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input_length: u64, hash_ids: &[i64]) -> TraceRequest {
        TraceRequest {
            timestamp: 0.0,
            input_length,
            output_length: 1,
            hash_ids: hash_ids.to_vec(),
        }
    }

    #[test]
    fn only_full_blocks_of_the_prompt_are_cached_split_to_the_engines_block_size() {
        let partial_last = request(1000, &[7, 8]);
        assert_eq!(partial_last.blocks(512, 100), vec![7]);
        assert_eq!(partial_last.blocks(256, 100), vec![14, 15, 16]);
        assert_eq!(partial_last.block_count(256), 3);
        assert_eq!(request(1024, &[7, 8]).blocks(512, 100), vec![7, 8]);
    }

    #[test]
    fn a_requests_blocks_are_capped_at_what_a_cache_holds_before_they_are_collected() {
        let huge = request(u64::MAX, &vec![3; 500_000]);
        assert_eq!(huge.block_count(1), 500_000 * 512);
        let blocks = huge.blocks(1, 4);
        assert_eq!(blocks, vec![1536, 1537, 1538, 1539]);
        assert_eq!(blocks.capacity(), 4, "nothing collected past the cap");
    }

    #[test]
    fn a_line_too_long_or_not_a_request_is_skipped_and_the_next_one_read() {
        let text = format!(
            "{{\"timestamp\": 1, \"input_length\": 512, \"hash_ids\": [1]}}\n\n\
             not json\n{{\"timestamp\": 2, \"input_length\": 512, \"hash_ids\": [{}]}}\n\
             {{\"timestamp\": 3, \"input_length\": 512, \"output_length\": 9, \"hash_ids\": [3]}}",
            vec!["1"; 100].join(",")
        );
        let lines: Vec<_> = Lines::new(text.as_bytes(), 100).collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[0].as_ref().unwrap().hash_ids, vec![1]);
        assert!(lines[1].is_err());
        assert!(lines[2].as_ref().unwrap_err().contains("longer than 100"));
        assert_eq!(lines[3].as_ref().unwrap().output_length, 9);
    }

    #[test]
    fn evictions_go_out_before_the_store_that_needed_the_room() {
        let admission = Admission {
            hits: 1,
            parent: Some(5),
            stored: vec![6],
            evicted: vec![9],
        };
        let mut id = 0;
        let events = cache_events(admission, 512, &mut id);
        assert!(matches!(&events[0].data, Some(Data::Removed(r)) if r.block_hashes == [9]));
        assert!(matches!(&events[1].data, Some(Data::Stored(s)) if s.parent_block_hash == Some(5)));
        assert_eq!(id, 2);
    }
}
