//! Memory per live block and per history entry, and the ingestion stall a
//! snapshot cut causes, measured with a counting allocator; with
//! `--state-dir`, the stall while checkpoints of 1M blocks run back to
//! back, and how long a restart takes to serve again. Prints a table;
//! `make bench` runs it after the criterion benchmarks.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvgate::convert::{Converter, Tally};
use kvgate::drain::Drain;
use kvgate::drain::batcher::BatchLimits;
use kvgate::hub::{FramedBatch, HistoryLimits, hub};
use kvgate::metrics::Metrics;
use kvgate::source::{EngineMessage, SourceEvent};
use kvgate::state::LiveState;
use kvgate::state::snapshot::SnapshotEncoder;
use kvgate::store::{StoreConfig, StoreLimits};
use kvgate_sim::{SteadyState, WorkloadShape};

#[path = "common/counting_allocator.rs"]
mod counting_allocator;
use counting_allocator::live_bytes;

const BLOCK_SIZE: usize = 16;
const BLOCKS: usize = 1 << 20;

fn shape(live_blocks: usize) -> WorkloadShape {
    WorkloadShape {
        blocks_per_store: 64,
        block_size: BLOCK_SIZE as u32,
        live_blocks,
    }
}

/// Bytes glibc's malloc holds for the program, its chunk headers and
/// alignment included (`mallinfo2`: every arena's chunks in use, and the
/// blocks it mapped on their own).
fn malloc_in_use() -> usize {
    // SAFETY: mallinfo2 only reads malloc's own counters, under its locks.
    let info = unsafe { libc::mallinfo2() };
    info.uordblks + info.hblkhd
}

/// Bytes the live state takes per block, in all: as requested from the
/// allocator, and as glibc's malloc (the binary's heap, `kvgate::allocator`)
/// holds them, its own headers included.
fn state_bytes_per_block() -> (f64, f64) {
    let mut workload = SteadyState::new(shape(usize::MAX), 1);
    let mut converter = Converter::new();
    let payloads: Vec<Vec<u8>> = (0..BLOCKS / 64)
        .map(|_| workload.next_payload(1.0, 0))
        .collect();
    let mut events = Vec::new();
    for payload in &payloads {
        events.extend(
            converter
                .convert(0, payload, &mut Tally::default())
                .unwrap()
                .events,
        );
    }
    drop(payloads);
    let before = live_bytes();
    let malloc_before = malloc_in_use();
    let mut state = LiveState::default();
    for event in &mut events {
        state.apply(0, event);
    }
    let after = live_bytes();
    let malloc_after = malloc_in_use();
    let blocks = state.rank(0).map_or(0, |rank| rank.counts().total()) as usize;
    assert_eq!(blocks, BLOCKS);
    let per_block = |bytes: usize| bytes as f64 / blocks as f64;
    (
        per_block(after - before),
        per_block(malloc_after - malloc_before),
    )
}

/// Bytes one history entry takes beside its encoded batch.
fn history_bytes_per_entry() -> f64 {
    let entries = 10_000;
    let encoded = vec![0u8; 1024];
    let before = live_bytes();
    let (mut writer, reader) = hub(
        16,
        HistoryLimits {
            batches: entries,
            bytes: usize::MAX,
        },
    );
    for sequence in 1..=entries as u64 {
        // Each entry holds its own bytes, as framed batches do.
        writer.publish(0, sequence, FramedBatch::new(&encoded));
    }
    let after = live_bytes();
    drop(reader);
    (after - before - entries * encoded.len()) as f64 / entries as f64
}

/// The longest the drain is held up by a snapshot: the cut itself, then
/// the slowest drain cycle while the cut is still held (its first writes
/// copy the shards they touch).
fn snapshot_stall() -> (Duration, Duration, Duration) {
    let mut workload = SteadyState::new(shape(BLOCKS), 2);
    let (writer, _reader) = hub(
        16,
        HistoryLimits {
            batches: 1000,
            bytes: 64 << 20,
        },
    );
    let limits = BatchLimits {
        max_events: 1024,
        max_bytes: 1 << 20,
    };
    let mut drain = Drain::new(limits, 1, writer, Metrics::default());
    let mut engine_sequence = 0;
    let mut cycle = |drain: &mut Drain| {
        let payload = Bytes::from(workload.next_payload(1.0, 0));
        let started = Instant::now();
        drain.ingest(SourceEvent::Message(EngineMessage {
            rank: 0,
            engine_sequence,
            payload,
        }));
        drain.flush();
        engine_sequence += 1;
        started.elapsed()
    };
    for _ in 0..BLOCKS / 64 + 1000 {
        cycle(&mut drain);
    }
    let normal = (0..1000).map(|_| cycle(&mut drain)).max().unwrap();
    let started = Instant::now();
    let cut = drain.cut();
    let cut_time = started.elapsed();
    let after_cut = (0..1000).map(|_| cycle(&mut drain)).max().unwrap();
    drop(cut);
    (cut_time, normal, after_cut)
}

/// A drain on the state directory `dir` (created, or read back), keeping
/// `history` and checkpointing every `checkpoint_bytes` of log.
fn drain_on_state_dir(
    dir: &std::path::Path,
    history: HistoryLimits,
    checkpoint_bytes: u64,
    metrics: &Metrics,
) -> (Drain, kvgate::hub::HubReader) {
    let config = StoreConfig {
        dir: dir.to_owned(),
        sync_interval: Duration::from_millis(1000),
        io_timeout: Duration::from_millis(500),
        limits: StoreLimits {
            segment_bytes: 64 << 20,
            checkpoint_bytes,
        },
        history,
    };
    let opened = kvgate::store::open(config, metrics, 1).expect("state dir");
    let (writer, reader) = hub(16, history);
    let limits = BatchLimits {
        max_events: 1024,
        max_bytes: 1 << 20,
    };
    let drain = Drain::new(limits, opened.seed(), writer, metrics.clone()).with_state_dir(opened);
    (drain, reader)
}

/// How long this thread has waited for a CPU while runnable (the second
/// field of `/proc/thread-self/schedstat`); `None` where the kernel keeps
/// no scheduler statistics.
fn runqueue_wait() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let nanos = stat.split_whitespace().nth(1)?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

/// One drain cycle's time, and the part of it the drain spent runnable
/// but waiting for a CPU (preempted by another thread or process): on two
/// vCPUs a cycle can take a scheduler tick or more for that alone, which
/// no checkpoint's work explains.
struct CycleTime {
    wall: Duration,
    waiting_for_cpu: Option<Duration>,
}

impl CycleTime {
    /// The time the drain was held by its own work or by a lock (a
    /// checkpoint's, the page cache's): the cycle less its wait for a CPU.
    fn held(&self) -> Duration {
        self.wall
            .saturating_sub(self.waiting_for_cpu.unwrap_or_default())
    }
}

fn ingest_one(
    drain: &mut Drain,
    workload: &mut SteadyState,
    engine_sequence: &mut u64,
) -> CycleTime {
    let payload = Bytes::from(workload.next_payload(1.0, 0));
    let waited_before = runqueue_wait();
    let started = Instant::now();
    drain.ingest(SourceEvent::Message(EngineMessage {
        rank: 0,
        engine_sequence: *engine_sequence,
        payload,
    }));
    drain.flush();
    let wall = started.elapsed();
    *engine_sequence += 1;
    let waiting_for_cpu = waited_before
        .zip(runqueue_wait())
        .map(|(before, after)| after.saturating_sub(before));
    CycleTime {
        wall,
        waiting_for_cpu,
    }
}

/// With `--state-dir` on tmpfs and checkpoints of `BLOCKS` live blocks
/// running back to back (a 64 KiB checkpoint threshold): the slowest drain
/// cycle while two checkpoints are written (and its wait for a CPU), the
/// slowest less its wait for a CPU, and how long one checkpoint took.
fn checkpoint_stall() -> (CycleTime, Duration, Duration) {
    let dir =
        std::path::Path::new("/dev/shm").join(format!("continuity-stall-{}", std::process::id()));
    let metrics = Metrics::default();
    let history = HistoryLimits {
        batches: 1000,
        bytes: 64 << 20,
    };
    // Filled without checkpoints, then one is asked for every 64 KiB.
    let (mut drain, _reader) = drain_on_state_dir(&dir, history, 64 << 30, &metrics);
    let mut workload = SteadyState::new(shape(BLOCKS), 2);
    let mut engine_sequence = 0;
    for _ in 0..BLOCKS / 64 + 1000 {
        ingest_one(&mut drain, &mut workload, &mut engine_sequence);
    }
    drop(drain);
    let _ = std::fs::remove_file(dir.join("lock"));
    let (mut drain, _reader) = drain_on_state_dir(&dir, history, 64 << 10, &metrics);
    let mut slowest = CycleTime {
        wall: Duration::ZERO,
        waiting_for_cpu: None,
    };
    let mut slowest_held = Duration::ZERO;
    let started = Instant::now();
    while metrics.state_checkpoints.get() < 2 {
        let cycle = ingest_one(&mut drain, &mut workload, &mut engine_sequence);
        slowest_held = slowest_held.max(cycle.held());
        if cycle.wall > slowest.wall {
            slowest = cycle;
        }
    }
    let per_checkpoint = started.elapsed() / 2;
    drop(drain);
    let _ = std::fs::remove_dir_all(&dir);
    (slowest, slowest_held, per_checkpoint)
}

/// A kvgate with `BLOCKS` live blocks and a full 256 MiB history, its
/// state directory on the disk, stopped without a word (as by SIGKILL) and
/// started again: the time to read the directory back, and to the first
/// snapshot chunk for a new subscriber.
fn restart_time() -> (Duration, Duration, u64) {
    let parent = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let dir = parent.join(format!("continuity-restart-{}", std::process::id()));
    let history = HistoryLimits {
        batches: 1_000_000,
        bytes: 256 << 20,
    };
    let metrics = Metrics::default();
    let (mut drain, _reader) = drain_on_state_dir(&dir, history, 128 << 20, &metrics);
    let mut workload = SteadyState::new(shape(BLOCKS), 3);
    let mut engine_sequence = 0;
    // 1M blocks, then 256 MiB of history and more.
    while engine_sequence < (BLOCKS / 64) as u64 || metrics.state_checkpoints.get() < 2 {
        ingest_one(&mut drain, &mut workload, &mut engine_sequence);
    }
    drop(drain);
    // The old process is gone: its lock goes with the file it was on.
    let _ = std::fs::remove_file(dir.join("lock"));
    let started = Instant::now();
    let restarted = Metrics::default();
    let (drain, reader) = drain_on_state_dir(&dir, history, 128 << 20, &restarted);
    let read_back = started.elapsed();
    let cut = std::sync::Arc::new(drain.cut());
    let first_chunk = SnapshotEncoder::plan(cut, 1.0)
        .next()
        .map(|chunk| chunk.len());
    let serving = started.elapsed();
    assert!(first_chunk.is_some());
    let batches = reader.history().span();
    drop((drain, reader));
    let _ = std::fs::remove_dir_all(&dir);
    (read_back, serving, batches.1 + 1 - batches.0)
}

fn main() {
    // The counting wrapper changes none of the heap.
    kvgate::allocator::bench_on_the_gateways_heap();
    // `cargo test --benches` runs bench targets too: keep that quick.
    if std::env::args().any(|arg| arg == "--test" || arg == "--list") {
        return;
    }
    let (requested, held) = state_bytes_per_block();
    // The engine's tokens as 32-bit ids, what the target is stated beside.
    let token_ids = (BLOCK_SIZE * 4) as f64;
    println!(
        "state: {requested:.1} bytes per live block in all, {:.1} beside its tokens as 32-bit ids ({BLOCKS} blocks of {BLOCK_SIZE} tokens); {held:.1} in all as malloc holds them, its headers included",
        requested - token_ids
    );
    println!(
        "history: {:.1} bytes per entry beside its encoded batch",
        history_bytes_per_entry()
    );
    let (cut, normal, after_cut) = snapshot_stall();
    println!(
        "snapshot of {BLOCKS} blocks: cut {cut:?}; slowest 64-block drain cycle {normal:?} without a cut, {after_cut:?} while one is held"
    );
    let (slowest, slowest_held, per_checkpoint) = checkpoint_stall();
    let waiting = slowest
        .waiting_for_cpu
        .map_or("unknown (no schedstat)".to_owned(), |wait| {
            format!("{wait:?}")
        });
    println!(
        "--state-dir on tmpfs, checkpoints of {BLOCKS} blocks back to back: slowest 64-block drain cycle {:?}, of it waiting for a CPU {waiting}; slowest held (a cycle less its wait for a CPU) {slowest_held:?}; one checkpoint took {per_checkpoint:?}",
        slowest.wall
    );
    let (read_back, serving, batches) = restart_time();
    println!(
        "restart with {BLOCKS} live blocks and a 256 MiB history ({batches} batches) on disk: read back in {read_back:?}, first snapshot chunk at {serving:?}"
    );
}
