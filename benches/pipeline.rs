//! Criterion benchmarks of each stage of kvgate's hot path. Results and the
//! method are in BENCHMARKS.md; run with `make bench`.

use std::hint::black_box;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{BatchSize, Criterion, Throughput, criterion_group};
use kvgate::convert::{Converter, Forwarded, Tally, TranscodedPayload};
use kvgate::drain::Drain;
use kvgate::drain::batcher::BatchLimits;
use kvgate::hub::{FramedBatch, HistoryLimits, hub};
use kvgate::metrics::Metrics;
use kvgate::proto::common::KvBlocksStored;
use kvgate::proto::common::kv_cache_event::Data;
use kvgate::source::{EngineMessage, SourceEvent};
use kvgate::state::LiveState;
use kvgate::state::snapshot::SnapshotEncoder;
use kvgate::store::{StoreConfig, StoreLimits};
use kvgate::wire::EncodedBlock;
use kvgate_sim::{SimEvent, SteadyState, WorkloadShape};

const LIMITS: BatchLimits = BatchLimits {
    max_events: 1024,
    max_bytes: 1 << 20,
};

/// Evicting payloads prepared for the long-running engine (2M blocks), and
/// how many one sample ingests.
const LONG_RUNNING_PAYLOADS: usize = 16_384;
const SAMPLE_PAYLOADS: usize = 64;

fn history() -> HistoryLimits {
    HistoryLimits {
        batches: 10_000,
        bytes: 256 << 20,
    }
}

/// The sim's steady workload as payloads, with how many blocks (stored or
/// removed) each carries: 64 stored 16-token blocks each, and from the
/// 1,025th on, the evictions (one-block removals) that keep the engine at
/// 64k live blocks.
fn workload_payloads(count: usize) -> Vec<(Bytes, u64)> {
    let mut workload = SteadyState::new(WorkloadShape::default(), 7);
    (0..count)
        .map(|_| {
            let events = workload.next_events();
            let blocks = events
                .iter()
                .map(|event| match event {
                    SimEvent::Stored { hashes, .. } | SimEvent::Removed { hashes } => {
                        hashes.len() as u64
                    }
                    SimEvent::Cleared => 0,
                })
                .sum::<u64>();
            let mut out = Vec::new();
            kvgate_sim::encode_batch(1.0, &events, Some(0), &mut out);
            (Bytes::from(out), blocks)
        })
        .collect()
}

/// The first `count` payloads of the workload (no evictions yet), and
/// their blocks.
fn steady_payloads(count: usize) -> (Vec<Bytes>, u64) {
    assert!(count <= 1024, "payloads past the 1,024th carry evictions");
    let payloads = workload_payloads(count);
    let blocks = payloads.iter().map(|(_, blocks)| blocks).sum();
    (
        payloads.into_iter().map(|(payload, _)| payload).collect(),
        blocks,
    )
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!(
        "{}/tests/fixtures/wire/{name}.msgpack",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

fn convert(c: &mut Criterion) {
    let mut group = c.benchmark_group("convert");
    for name in [
        "vllm-0.33.0/stored-int-root",
        "vllm-0.33.0/batch-3000-events",
        "sglang-0.5.23/batch-3000-events",
        "vllm-legacy-array/batch-3000-events",
    ] {
        let payload = fixture(name);
        group.throughput(Throughput::Bytes(payload.len() as u64));
        group.bench_function(name, |b| {
            let mut converter = Converter::new();
            b.iter(|| {
                let mut tally = Tally::default();
                black_box(
                    converter
                        .convert(0, black_box(&payload), &mut tally)
                        .unwrap(),
                );
            });
        });
    }
    let (payloads, blocks) = steady_payloads(256);
    group.throughput(Throughput::Elements(blocks));
    group.bench_function("steady-64-block-stores", |b| {
        let mut converter = Converter::new();
        b.iter(|| {
            for payload in &payloads {
                let mut tally = Tally::default();
                black_box(converter.convert(0, payload, &mut tally).unwrap());
            }
        });
    });
    group.finish();
}

/// Where the `…-state-*` benches keep `--state-dir`: tmpfs, and the disk
/// the repository is on.
const STATE_PARENTS: [(&str, &str); 2] = [("tmpfs", "/dev/shm"), ("disk", "target")];

/// A drain on a new state directory under `parent` (the default flags),
/// which is removed when the returned guard drops.
fn drain_with_state(parent: &str) -> (Drain, kvgate::hub::HubReader, StateDirGuard) {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::path::Path::new(parent).join(format!(
        "continuity-bench-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let config = StoreConfig {
        dir: dir.clone(),
        sync_interval: std::time::Duration::from_millis(1000),
        io_timeout: std::time::Duration::from_millis(500),
        limits: StoreLimits {
            segment_bytes: 64 << 20,
            checkpoint_bytes: 256 << 20,
        },
        history: history(),
    };
    let metrics = Metrics::default();
    let opened = kvgate::store::open(config, &metrics, 1).expect("state dir");
    let (writer, reader) = hub(1024, history());
    let drain = Drain::new(LIMITS, opened.seed(), writer, metrics).with_state_dir(opened);
    (drain, reader, StateDirGuard(dir))
}

struct StateDirGuard(std::path::PathBuf);

impl Drop for StateDirGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Ingests `payloads` as rank 0's, one drain cycle each.
///
/// With a state directory, the cycles still out to the log writer at the
/// end are waited for and announced (`settle`) inside the caller's timed
/// region: the last cycle's write is timed, and no sample leaves work to
/// the next.
fn ingest_all(drain: &mut Drain, payloads: &[Bytes], engine_sequence: &mut u64) {
    for payload in payloads {
        drain.ingest(SourceEvent::Message(EngineMessage {
            rank: 0,
            engine_sequence: *engine_sequence,
            payload: payload.clone(),
        }));
        *engine_sequence += 1;
        drain.flush();
    }
    drain.settle();
}

/// Ingests one sample's payloads, as [`ingest_all`], and how long that
/// took. Never inlined, so a profile can be collected inside it alone
/// (`valgrind --tool=callgrind --toggle-collect=pipeline::timed_sample`),
/// without the engine's untimed refills.
#[inline(never)]
fn timed_sample(
    drain: &mut Drain,
    payloads: &[Bytes],
    engine_sequence: &mut u64,
) -> std::time::Duration {
    let start = std::time::Instant::now();
    ingest_all(drain, payloads, engine_sequence);
    start.elapsed()
}

/// The whole drain: convert, apply to the live state, batch, encode once,
/// append to the history, broadcast.
fn ingest(c: &mut Criterion) {
    let (payloads, blocks) = steady_payloads(1024);
    let mut group = c.benchmark_group("ingest");
    group.throughput(Throughput::Elements(blocks));
    group.sample_size(20);
    // The same 1,024 payloads again and again: after the first pass every
    // store finds its blocks live, and nothing is removed.
    group.bench_function("drain-steady-64-block-stores", |b| {
        let (writer, reader) = hub(1024, history());
        let mut drain = Drain::new(LIMITS, 1, writer, Metrics::default());
        let mut engine_sequence = 0;
        b.iter(|| ingest_all(&mut drain, &payloads, &mut engine_sequence));
        drop(reader);
    });
    // A serving engine's steady state: each payload evicts the oldest
    // 64-block chain (64 one-block removals) and stores a new one, so every
    // stored block is a new record and every removed one is dropped. Each
    // sample starts from an engine filled by the payloads before (untimed).
    let workload = workload_payloads(2048);
    let (filling, evicting) = workload.split_at(1024);
    let filling: Vec<Bytes> = filling.iter().map(|(payload, _)| payload.clone()).collect();
    let evicting_blocks = evicting.iter().map(|(_, blocks)| blocks).sum();
    let evicting: Vec<Bytes> = evicting
        .iter()
        .map(|(payload, _)| payload.clone())
        .collect();
    group.throughput(Throughput::Elements(evicting_blocks));
    group.bench_function("drain-evicting-64-block-stores", |b| {
        b.iter_batched(
            || {
                let (writer, reader) = hub(1024, history());
                let mut drain = Drain::new(LIMITS, 1, writer, Metrics::default());
                let mut engine_sequence = 0;
                ingest_all(&mut drain, &filling, &mut engine_sequence);
                (drain, reader, engine_sequence)
            },
            |(mut drain, reader, mut engine_sequence)| {
                ingest_all(&mut drain, &evicting, &mut engine_sequence);
                (drain, reader)
            },
            BatchSize::PerIteration,
        );
    });
    // The same steady state on one long-running engine, as a sidecar sees
    // it: the engine is filled once and then only evicts and stores, so
    // no sample starts from a fresh heap and a profile holds only the
    // drain's own work (an engine is filled again, untimed, each time the
    // prepared payloads run out).
    let workload = workload_payloads(1024 + LONG_RUNNING_PAYLOADS);
    let (filling, evicting) = workload.split_at(1024);
    let filling: Vec<Bytes> = filling.iter().map(|(payload, _)| payload.clone()).collect();
    let sample: &[(Bytes, u64)] = &evicting[..SAMPLE_PAYLOADS];
    group.throughput(Throughput::Elements(
        sample.iter().map(|(_, blocks)| blocks).sum(),
    ));
    let evicting: Vec<Bytes> = evicting
        .iter()
        .map(|(payload, _)| payload.clone())
        .collect();
    // Without a state directory, then with one on tmpfs and on the disk
    // (every batch also appended to the log, checkpoints in the background).
    let states: [(String, Option<&str>); 3] = [
        ("drain-evicting-long-running".into(), None),
        (
            format!("drain-evicting-long-running-state-{}", STATE_PARENTS[0].0),
            Some(STATE_PARENTS[0].1),
        ),
        (
            format!("drain-evicting-long-running-state-{}", STATE_PARENTS[1].0),
            Some(STATE_PARENTS[1].1),
        ),
    ];
    for (name, state_parent) in states {
        // Criterion calls the routine once per sample: the engine lives
        // outside it, so a sample goes on from where the one before ended.
        let mut engine = None;
        let mut next = 0;
        group.bench_function(name, |b| {
            let filled = || {
                let (mut drain, reader, guard) = match state_parent {
                    Some(parent) => {
                        let (drain, reader, guard) = drain_with_state(parent);
                        (drain, reader, Some(guard))
                    }
                    None => {
                        let (writer, reader) = hub(1024, history());
                        (
                            Drain::new(LIMITS, 1, writer, Metrics::default()),
                            reader,
                            None,
                        )
                    }
                };
                let mut engine_sequence = 0;
                ingest_all(&mut drain, &filling, &mut engine_sequence);
                (drain, (reader, guard), engine_sequence)
            };
            // The hub's reader (and the state directory) live as long as
            // their drain.
            let (drain, kept, engine_sequence) = engine.get_or_insert_with(&filled);
            b.iter_custom(|samples| {
                let mut timed = std::time::Duration::ZERO;
                for _ in 0..samples {
                    if next + SAMPLE_PAYLOADS > evicting.len() {
                        (*drain, *kept, *engine_sequence) = filled();
                        next = 0;
                    }
                    let payloads = &evicting[next..next + SAMPLE_PAYLOADS];
                    timed += timed_sample(drain, payloads, engine_sequence);
                    next += SAMPLE_PAYLOADS;
                }
                timed
            });
        });
    }
    group.finish();
}

fn state(c: &mut Criterion) {
    let (payloads, blocks) = steady_payloads(1024);
    let mut converter = Converter::new();
    let events: Vec<_> = payloads
        .iter()
        .flat_map(|payload| {
            converter
                .convert(0, payload, &mut Tally::default())
                .unwrap()
                .events
        })
        .collect();
    let mut group = c.benchmark_group("state");
    group.throughput(Throughput::Elements(blocks));
    group.sample_size(20);
    // Built events, as a restart applies a checkpoint's.
    group.bench_function("apply-steady-64-block-stores", |b| {
        b.iter_batched(
            || (LiveState::default(), events.clone()),
            |(mut state, mut events)| {
                for event in &mut events {
                    state.apply(0, event);
                }
                state
            },
            BatchSize::LargeInput,
        );
    });
    // Blocks as the converter wrote them, as the drain applies them.
    let written: Vec<WrittenPayload> = payloads
        .iter()
        .map(|payload| WrittenPayload::of(&mut converter, payload))
        .collect();
    group.bench_function("apply-written-steady-64-block-stores", |b| {
        b.iter_batched(
            LiveState::default,
            |mut state| {
                for payload in &written {
                    payload.apply(&mut state);
                }
                state
            },
            BatchSize::LargeInput,
        );
    });
    group.finish();
}

/// One payload's events as the drain hands them to the state: each store's
/// fields and its blocks' bytes as the converter wrote them, each removal's
/// tier and hashes.
struct WrittenPayload {
    events: Vec<WrittenEvent>,
    /// Every store's blocks' bytes after their hashes, end to end.
    rests: Vec<u8>,
}

enum WrittenEvent {
    Store {
        stored: Box<KvBlocksStored>,
        shared: (Option<i64>, Option<i32>),
        hashes: Vec<i64>,
        /// Where each block's bytes lie in `rests`.
        ranges: Vec<std::ops::Range<usize>>,
    },
    Removal {
        tier: Option<i32>,
        hashes: Vec<i64>,
    },
}

impl WrittenPayload {
    fn of(converter: &mut Converter, payload: &[u8]) -> Self {
        let mut transcoded = TranscodedPayload::default();
        converter
            .transcode(0, payload, &mut Tally::default(), &mut transcoded)
            .unwrap();
        let mut written = Self {
            events: Vec::new(),
            rests: Vec::new(),
        };
        transcoded.drain(|event| match event {
            Forwarded::Store { event, blocks } => {
                let Some(Data::Stored(stored)) = event.data else {
                    unreachable!("a store")
                };
                let (hashes, ranges) = blocks
                    .iter()
                    .map(|block| {
                        let start = written.rests.len();
                        written.rests.extend_from_slice(block.rest);
                        (block.hash, start..written.rests.len())
                    })
                    .unzip();
                written.events.push(WrittenEvent::Store {
                    stored: Box::new(stored),
                    shared: (blocks.lora_id, blocks.cache_level),
                    hashes,
                    ranges,
                });
            }
            Forwarded::Removal { tier, hashes, .. } => {
                written.events.push(WrittenEvent::Removal {
                    tier,
                    hashes: hashes.to_vec(),
                });
            }
            Forwarded::Event(_) => unreachable!("the steady workload never clears"),
        });
        written
    }

    /// What the drain does to the state for this payload: what it looks up
    /// prefetched (each store's parent and blocks, each removal's blocks),
    /// then each event applied.
    fn apply(&self, state: &mut LiveState) {
        let lookups = self.events.iter().flat_map(|event| match event {
            WrittenEvent::Store { stored, hashes, .. } => [
                (stored.tier, stored.parent_block_hash.as_slice()),
                (stored.tier, hashes.as_slice()),
            ],
            WrittenEvent::Removal { tier, hashes } => {
                [(*tier, &[][..]), (*tier, hashes.as_slice())]
            }
        });
        state.prefetch_lookups(0, lookups);
        for event in &self.events {
            match event {
                WrittenEvent::Store {
                    stored,
                    shared,
                    hashes,
                    ranges,
                } => {
                    let blocks = hashes
                        .iter()
                        .zip(ranges)
                        .map(|(&hash, range)| EncodedBlock {
                            hash,
                            rest: &self.rests[range.clone()],
                        });
                    state.store_blocks(0, stored, *shared, blocks);
                }
                WrittenEvent::Removal { tier, hashes } => state.remove_blocks(0, *tier, hashes),
            }
        }
    }
}

/// A live state of `blocks` 16-token blocks on rank 0.
fn state_of(blocks: usize) -> (Drain, kvgate::hub::HubReader) {
    let shape = WorkloadShape {
        blocks_per_store: 64,
        block_size: 16,
        live_blocks: blocks,
    };
    let mut workload = SteadyState::new(shape, 3);
    let (writer, reader) = hub(16, history());
    let mut drain = Drain::new(LIMITS, 1, writer, Metrics::default());
    for engine_sequence in 0..(blocks / 64) as u64 {
        drain.ingest(SourceEvent::Message(EngineMessage {
            rank: 0,
            engine_sequence,
            payload: Bytes::from(workload.next_payload(1.0, 0)),
        }));
        drain.flush();
    }
    (drain, reader)
}

fn snapshot(c: &mut Criterion) {
    let (drain, _reader) = state_of(1 << 20);
    let mut group = c.benchmark_group("snapshot-1M-blocks");
    group.sample_size(10);
    group.bench_function("cut", |b| b.iter(|| black_box(drain.cut())));
    // How long a subscriber waits for the snapshot's first bytes.
    group.bench_function("first-chunk", |b| {
        let cut = Arc::new(drain.cut());
        b.iter(|| black_box(SnapshotEncoder::plan(Arc::clone(&cut), 1.0).next()));
    });
    group.throughput(Throughput::Elements(1 << 20));
    group.bench_function("encode", |b| {
        let cut = Arc::new(drain.cut());
        b.iter(|| black_box(SnapshotEncoder::plan(Arc::clone(&cut), 1.0).collect::<Vec<_>>()));
    });
    group.finish();
}

/// What the drain pays per batch with N subscribers: its one copy into a
/// framed batch, one history store and one channel push, whatever N.
fn fan_out(c: &mut Criterion) {
    let mut group = c.benchmark_group("fan-out-publish");
    let encoded = vec![0u8; 4096];
    for subscribers in [0usize, 1, 8, 64] {
        group.bench_function(format!("{subscribers}-subscribers"), |b| {
            let (mut writer, reader) = hub(1024, history());
            let receivers: Vec<_> = (0..subscribers).map(|_| reader.subscribe_live()).collect();
            let mut sequence = 1;
            b.iter(|| {
                writer.publish(0, sequence, FramedBatch::new(&encoded));
                sequence += 1;
            });
            drop(receivers);
        });
    }
    group.finish();
    let mut group = c.benchmark_group("fan-out-receive");
    group.bench_function("one-subscriber-per-batch", |b| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (mut writer, reader) = hub(1 << 16, history());
        let live = reader.subscribe_live();
        let mut subscription = kvgate::hub::subscription::Subscription::after_cut(&reader, live, 0);
        let mut sequence = 1;
        b.iter(|| {
            writer.publish(0, sequence, FramedBatch::new(&encoded));
            sequence += 1;
            let step = runtime.block_on(subscription.next());
            black_box(step);
        });
    });
    group.finish();
}

/// What this host's memory costs, to read beside the ingest figures: a
/// random cache line of a working set about the evicting engine's live
/// state (16 MiB), read once the line before it is (the latency of one
/// miss), and read with many others in flight (the most the CPU overlaps
/// them: what the drain's passes over a payload's lookups can reach at
/// best). BENCHMARKS.md, "The evicting ingest on `xeon-167`".
fn host(c: &mut Criterion) {
    const LINES: usize = (16 << 20) / 64;
    const READS: usize = 1 << 16;
    // Each sample reads the next `READS` lines of the order, round it all.
    const _: () = assert!(LINES.is_multiple_of(READS));
    #[derive(Clone, Copy)]
    #[repr(align(64))]
    struct Line {
        next: usize,
    }
    // Every line linked to the next in a random order (a shuffle from a
    // fixed seed, splitmix64), so the chain visits them all.
    let mut seed = 7u64;
    let mut random = |below: usize| {
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % below as u64) as usize
    };
    let mut order: Vec<usize> = (0..LINES).collect();
    for i in (1..LINES).rev() {
        order.swap(i, random(i + 1));
    }
    let mut lines = vec![Line { next: 0 }; LINES];
    for (i, &line) in order.iter().enumerate() {
        lines[line].next = order[(i + 1) % LINES];
    }
    let mut group = c.benchmark_group("host");
    group.throughput(Throughput::Elements(READS as u64));
    group.bench_function("random-line-after-the-last-16MiB", |b| {
        let mut at = 0;
        b.iter(|| {
            for _ in 0..READS {
                at = black_box(&lines)[at].next;
            }
            at
        });
    });
    group.bench_function("random-lines-together-16MiB", |b| {
        let mut start = 0;
        b.iter(|| {
            let reads = &order[start..start + READS];
            start = (start + READS) % LINES;
            reads.iter().map(|&line| lines[line].next).sum::<usize>()
        });
    });
    group.finish();
}

criterion_group!(benches, convert, ingest, state, snapshot, fan_out, host);
fn main() {
    kvgate::allocator::bench_on_the_gateways_heap(); // `criterion_main!`
    benches();
    Criterion::default().configure_from_args().final_summary();
}
