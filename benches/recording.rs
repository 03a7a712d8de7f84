//! Criterion benchmarks of record and replay: writing and reading back a
//! recording, and the trace player's simulated prefix cache. Results are
//! in BENCHMARKS.md; run with `cargo bench --bench recording`.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BatchSize, Criterion, Throughput, criterion_group};
use kvgate::proto::common::{KvBlock, KvBlocksStored, KvCacheEvent, KvEventBatch, kv_cache_event};
use kvgate::recording::{Header, Recording, Writer, WriterLimits};
use kvgate::source::prefix_cache::PrefixCache;
use prost::Message as _;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BATCHES: u64 = 2_000;

/// Batches shaped as the load tool's steady mix reaches a router: one
/// store of 64 16-token blocks each, random hashes and token ids.
fn batches() -> Vec<Vec<u8>> {
    let mut rng = SmallRng::seed_from_u64(7);
    (0..BATCHES)
        .map(|seq| {
            let blocks = (0..64)
                .map(|_| KvBlock {
                    block_hash: rng.random(),
                    token_ids: (0..16).map(|_| rng.random_range(0..150_000)).collect(),
                    block_size: 16,
                    ..Default::default()
                })
                .collect();
            KvEventBatch {
                sequence_number: seq,
                timestamp: 1.0,
                dp_rank: Some(0),
                events: vec![KvCacheEvent {
                    event_id: seq,
                    data: Some(kv_cache_event::Data::Stored(KvBlocksStored {
                        blocks,
                        ..Default::default()
                    })),
                }],
                ..Default::default()
            }
            .encode_to_vec()
        })
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("record-bench-{name}-{}", std::process::id()))
}

fn header() -> Header {
    Header {
        kvgate_version: "bench".into(),
        source: "bench".into(),
        service: "kvgate.v1.KvGate".into(),
        started_unix_ms: 0,
        dp_size: 1,
        part: 0,
    }
}

const LIMITS: WriterLimits = WriterLimits {
    rotate_bytes: 1 << 40,
    frame_bytes: 256 << 10,
};

fn write(path: &PathBuf, batches: &[Vec<u8>]) {
    let _ = std::fs::remove_file(path);
    let mut writer = Writer::create(path, header(), LIMITS).unwrap();
    for (at, batch) in (0..).zip(batches) {
        writer.batch(at, batch).unwrap();
    }
    writer.finish().unwrap();
}

fn recording(c: &mut Criterion) {
    let batches = batches();
    let raw: u64 = batches.iter().map(|batch| batch.len() as u64).sum();
    let path = scratch("file");
    let mut group = c.benchmark_group("recording");
    group.throughput(Throughput::Bytes(raw));
    group.bench_function("write 2000 batches of 64 blocks", |b| {
        b.iter(|| write(&path, black_box(&batches)));
    });
    write(&path, &batches);
    let on_disk = std::fs::metadata(&path).unwrap().len();
    eprintln!(
        "recording: {raw} bytes of batches, {on_disk} on disk ({:.2}x)",
        raw as f64 / on_disk as f64
    );
    group.bench_function("read 2000 batches of 64 blocks", |b| {
        b.iter(|| {
            let recording = Recording::open(std::slice::from_ref(&path)).unwrap();
            black_box(recording.count())
        });
    });
    group.finish();
    let _ = std::fs::remove_file(&path);
}

/// Requests of 40 blocks: a shared prefix of 8 from one of 16 families,
/// then 32 of their own, against a cache of 16384 blocks that evicts.
fn prefix_cache(c: &mut Criterion) {
    const REQUESTS: usize = 1024;
    let mut rng = SmallRng::seed_from_u64(7);
    let mut next_id = 1_000_000_i64;
    let requests: Vec<Vec<i64>> = (0..REQUESTS)
        .map(|_| {
            let family = rng.random_range(0..16_i64);
            (0..8)
                .map(|block| family * 8 + block)
                .chain((0..32).map(|_| {
                    next_id += 1;
                    next_id
                }))
                .collect()
        })
        .collect();
    let mut group = c.benchmark_group("trace");
    group.throughput(Throughput::Elements((REQUESTS * 40) as u64));
    group.bench_function("prefix cache: 1024 requests of 40 blocks", |b| {
        b.iter_batched_ref(
            || {
                let mut cache = PrefixCache::new(16_384);
                // Full, so every request evicts.
                for request in &requests {
                    cache.admit(request);
                }
                cache
            },
            |cache| {
                for request in &requests {
                    black_box(cache.admit(request));
                }
            },
            BatchSize::LargeInput,
        );
    });
    group.finish();
}

criterion_group!(benches, recording, prefix_cache);
fn main() {
    kvgate::allocator::bench_on_the_gateways_heap(); // `criterion_main!`
    benches();
    Criterion::default().configure_from_args().final_summary();
}
