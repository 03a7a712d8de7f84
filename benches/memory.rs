//! Memory per live block and per history entry, and the ingestion stall a
//! snapshot cut causes, measured with a counting allocator. Prints a table;
//! `make bench` runs it after the criterion benchmarks.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvgate::convert::{Converter, Tally};
use kvgate::drain::Drain;
use kvgate::drain::batcher::BatchLimits;
use kvgate::hub::{HistoryLimits, hub};
use kvgate::metrics::Metrics;
use kvgate::source::{EngineMessage, SourceEvent};
use kvgate::state::LiveState;
use kvgate_sim::{SteadyState, WorkloadShape};

struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const BLOCK_SIZE: usize = 16;
const BLOCKS: usize = 1 << 20;

fn shape(live_blocks: usize) -> WorkloadShape {
    WorkloadShape {
        blocks_per_store: 64,
        block_size: BLOCK_SIZE as u32,
        live_blocks,
    }
}

/// Bytes the live state takes per block, beside the tokens' own bytes
/// (counted as requested from the allocator; malloc's own headers not).
fn state_bytes_per_block() -> f64 {
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
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    let mut state = LiveState::default();
    for event in &mut events {
        state.apply(0, event);
    }
    let after = LIVE_BYTES.load(Ordering::Relaxed);
    let blocks = state.rank(0).map_or(0, |rank| rank.counts().total()) as usize;
    assert_eq!(blocks, BLOCKS);
    let token_bytes = blocks * BLOCK_SIZE * 4;
    (after - before - token_bytes) as f64 / blocks as f64
}

/// Bytes one history entry takes beside its encoded batch.
fn history_bytes_per_entry() -> f64 {
    let entries = 10_000;
    let encoded = Bytes::from(vec![0u8; 1024]);
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    let (mut writer, reader) = hub(
        16,
        HistoryLimits {
            batches: entries,
            bytes: usize::MAX,
        },
    );
    for sequence in 1..=entries as u64 {
        // Each entry holds its own bytes, as encoded batches do.
        writer.publish(0, sequence, Bytes::copy_from_slice(&encoded));
    }
    let after = LIVE_BYTES.load(Ordering::Relaxed);
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

fn main() {
    // `cargo test --benches` runs bench targets too: keep that quick.
    if std::env::args().any(|arg| arg == "--test" || arg == "--list") {
        return;
    }
    println!(
        "state: {:.1} bytes per live block beside its tokens ({BLOCKS} blocks of {BLOCK_SIZE} tokens)",
        state_bytes_per_block()
    );
    println!(
        "history: {:.1} bytes per entry beside its encoded batch",
        history_bytes_per_entry()
    );
    let (cut, normal, after_cut) = snapshot_stall();
    println!(
        "snapshot of {BLOCKS} blocks: cut {cut:?}; slowest 64-block drain cycle {normal:?} without a cut, {after_cut:?} while one is held"
    );
}
