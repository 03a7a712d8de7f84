//! Fuzzing the engine payload decoder and the batcher (proptest; the stable
//! toolchain has no `cargo fuzz`). Inputs are the golden fixtures and the
//! seeds of `tests/fuzz/corpus`, mutated byte-wise, plus generated
//! well-formed payloads with adversarial shapes (huge salts, huge blocks,
//! long removals), batched under random limits. For every input:
//! conversion and batching end without a panic; every batch decodes, holds
//! at most `max_events` events, stays within `max_bytes` unless it is one
//! event alone, and within the router's 4 MiB; and every block and hash
//! converted comes out, in order, or is reported oversized.
//!
//! `make test` runs 256 cases of each property (a few seconds);
//! `make fuzz` runs many more. Failures are kept in
//! `tests/fuzz/regressions.txt` and replayed first on every run.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvgate::convert::{Converter, Forwarded, Tally, TranscodedPayload};
use kvgate::drain::batcher::{BatchLimits, Batcher, Output};
use kvgate::proto::common::{KvCacheEvent, KvEventBatch, kv_cache_event::Data};
use kvgate::wire::batch::ROUTER_MAX_MESSAGE_BYTES;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::FileFailurePersistence;
use prost::Message;

fn msgpack_files(dir: &Path, into: &mut Vec<Vec<u8>>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            msgpack_files(&path, into);
        } else if path.extension().is_some_and(|ext| ext == "msgpack") {
            into.push(std::fs::read(&path).unwrap());
        }
    }
}

/// The golden fixtures and the fuzz corpus.
fn seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests");
        let mut seeds = Vec::new();
        msgpack_files(&root.join("fixtures/wire"), &mut seeds);
        msgpack_files(&root.join("fuzz/corpus"), &mut seeds);
        assert!(seeds.len() > 60, "{} seeds", seeds.len());
        seeds
    })
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(256);
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/fuzz/regressions.txt",
        ))),
        ..ProptestConfig::default()
    }
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    /// A byte msgpack gives meaning to: container and length headers.
    Marker(Index, u8),
    Insert(Index, Vec<u8>),
    Remove(Index, usize),
    Duplicate(Index, usize, Index),
    Truncate(Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let marker = prop::sample::select(vec![
        0x90, 0x9f, 0x80, 0x8f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc4, 0xc5, 0xc6, 0xca, 0xcb, 0xcc, 0xcd,
        0xce, 0xcf, 0xd0, 0xd3, 0xd9, 0xda, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xff, 0x00,
    ]);
    prop_oneof![
        (any::<Index>(), 0..8u8).prop_map(|(at, bit)| Mutation::Flip(at, bit)),
        (any::<Index>(), marker).prop_map(|(at, byte)| Mutation::Marker(at, byte)),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert(at, bytes)),
        (any::<Index>(), 1..64usize).prop_map(|(at, len)| Mutation::Remove(at, len)),
        (any::<Index>(), 1..256usize, any::<Index>())
            .prop_map(|(at, len, to)| Mutation::Duplicate(at, len, to)),
        any::<Index>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutation: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    let len = bytes.len();
    match mutation {
        Mutation::Flip(at, bit) => bytes[at.index(len)] ^= 1 << bit,
        Mutation::Marker(at, byte) => bytes[at.index(len)] = *byte,
        Mutation::Insert(at, inserted) => {
            let at = at.index(len + 1);
            bytes.splice(at..at, inserted.iter().copied());
        }
        Mutation::Remove(at, count) => {
            let at = at.index(len);
            bytes.drain(at..(at + count).min(len));
        }
        Mutation::Duplicate(at, count, to) => {
            let at = at.index(len);
            let copied = bytes[at..(at + count).min(len)].to_vec();
            let to = to.index(len + 1);
            bytes.splice(to..to, copied);
        }
        Mutation::Truncate(at) => bytes.truncate(at.index(len)),
    }
}

fn limits() -> impl Strategy<Value = BatchLimits> {
    let max_bytes = prop_oneof![1..64usize, 64..8192usize, Just(4096), Just(1 << 20)];
    (1..=1024usize, max_bytes).prop_map(|(max_events, max_bytes)| BatchLimits {
        max_events,
        max_bytes,
    })
}

/// The stored block hashes and removed hashes of `events`, in order, and
/// how many clears.
#[derive(Debug, Default, PartialEq)]
struct Content {
    stored: Vec<i64>,
    removed: Vec<i64>,
    clears: usize,
}

impl Content {
    fn add(&mut self, event: &KvCacheEvent) {
        match &event.data {
            Some(Data::Stored(stored)) => self
                .stored
                .extend(stored.blocks.iter().map(|block| block.block_hash)),
            Some(Data::Removed(removed)) => self.removed.extend(&removed.block_hashes),
            Some(Data::Cleared(_)) => self.clears += 1,
            None => {}
        }
    }
}

/// Converts `payload` and batches its events under `limits`, checking every
/// invariant of the module doc.
fn check(payload: &[u8], limits: BatchLimits) {
    let Ok(converted) = Converter::new().convert(0, payload, &mut Tally::default()) else {
        return;
    };
    let mut input = Content::default();
    let mut sent = Vec::new();
    let mut batches = Vec::new();
    let mut oversized = Content::default();
    let mut batcher = Batcher::new(limits);
    for event in converted.events {
        input.add(&event);
        let mut pieces = Content::default();
        let parent = match &event.data {
            Some(Data::Stored(stored)) => stored.parent_block_hash,
            _ => None,
        };
        let mut expected_parent = parent;
        batcher.push(event, 1.0, &mut |output| match output {
            Output::Batch(batch) => batches.push(batch),
            Output::Sent(piece) => {
                if let Some(Data::Stored(stored)) = &piece.data {
                    assert_eq!(stored.parent_block_hash, expected_parent, "a broken chain");
                    expected_parent = stored.blocks.last().map(|block| block.block_hash);
                }
                pieces.add(piece);
                sent.push(piece.clone());
            }
            Output::Oversized {
                event: piece,
                bytes,
            } => {
                assert!(bytes > ROUTER_MAX_MESSAGE_BYTES - 64);
                if let Some(Data::Stored(stored)) = &piece.data {
                    expected_parent = stored.blocks.last().map(|block| block.block_hash);
                }
                oversized.add(piece);
            }
        });
    }
    batches.extend(batcher.close());

    let mut out = Content::default();
    let mut batched = Vec::new();
    let mut encoded_batches = Vec::new();
    for (sequence, batch) in batches.into_iter().enumerate() {
        let events_len = batch.events_len();
        let encoded = batch.encode(0, sequence as u64 + 1, None);
        encoded_batches.push(encoded.clone());
        assert!(encoded.len() <= ROUTER_MAX_MESSAGE_BYTES);
        let decoded = KvEventBatch::decode(encoded).expect("a batch decodes");
        assert!(!decoded.events.is_empty());
        assert!(decoded.events.len() <= limits.max_events);
        assert!(
            events_len <= limits.max_bytes || decoded.events.len() == 1,
            "{} events in {events_len} bytes over {}",
            decoded.events.len(),
            limits.max_bytes
        );
        batched.extend(decoded.events);
    }
    assert_eq!(
        batched, sent,
        "batches carry exactly what was sent, in order"
    );
    for event in &batched {
        out.add(event);
    }
    // Conserved: what was not sent is reported oversized (checked apart:
    // an oversized piece's hashes sit between sent ones).
    let mut accounted = out.stored.clone();
    accounted.extend(&oversized.stored);
    accounted.sort_unstable();
    let mut stored = input.stored.clone();
    stored.sort_unstable();
    assert_eq!(accounted, stored);
    assert_eq!(
        out.removed.len() + oversized.removed.len(),
        input.removed.len()
    );
    assert_eq!(out.clears + oversized.clears, input.clears);
    assert_eq!(
        transcoded_batches(payload, limits),
        encoded_batches,
        "the drain's path (removals and stores transcoded) batches the same bytes"
    );
}

/// `payload` as the drain batches it: removals and stores' blocks
/// transcoded and appended as bytes, or decoded and cut when an event is
/// over the byte limit.
fn transcoded_batches(payload: &[u8], limits: BatchLimits) -> Vec<bytes::Bytes> {
    let mut transcoded = TranscodedPayload::default();
    Converter::new()
        .transcode(0, payload, &mut Tally::default(), &mut transcoded)
        .expect("a payload that converts transcodes");
    let mut batches = Vec::new();
    let mut batcher = Batcher::new(limits);
    let mut keep = |output: Output<'_>| {
        if let Output::Batch(batch) = output {
            batches.push(batch);
        }
    };
    let push_encoded = |batcher: &mut Batcher, body: &[u8], keep: &mut _| {
        if !batcher.push_encoded(body, 1.0, keep) {
            let event = KvCacheEvent::decode(body).expect("a transcoded event decodes");
            batcher.push(event, 1.0, keep);
        }
    };
    let mut store_body = Vec::new();
    transcoded.drain(|forwarded| match forwarded {
        Forwarded::Event(event) => batcher.push(event, 1.0, &mut keep),
        Forwarded::Store { event, blocks } => {
            let Some(Data::Stored(stored)) = &event.data else {
                panic!("a transcoded store is a store: {event:?}");
            };
            store_body.clear();
            blocks.encode_event(event.event_id, stored, &mut store_body);
            push_encoded(&mut batcher, &store_body, &mut keep);
        }
        Forwarded::Removal { body, .. } => push_encoded(&mut batcher, body, &mut keep),
    });
    batches.extend(batcher.close());
    batches
        .into_iter()
        .enumerate()
        .map(|(sequence, batch)| batch.encode(0, sequence as u64 + 1, None))
        .collect()
}

/// A well-formed `[ts, [BlockStored], 0]` with the given shape, in vLLM's
/// map form.
fn store_payload(
    blocks: usize,
    block_size: usize,
    token: u32,
    salt: usize,
    removal: usize,
) -> Vec<u8> {
    use rmp::encode::*;
    let mut out = Vec::new();
    write_array_len(&mut out, 3).unwrap();
    write_f64(&mut out, 1.0).unwrap();
    write_array_len(&mut out, 2).unwrap();
    write_map_len(&mut out, 6).unwrap();
    write_str(&mut out, "type").unwrap();
    write_str(&mut out, "BlockStored").unwrap();
    write_str(&mut out, "block_hashes").unwrap();
    write_array_len(&mut out, blocks as u32).unwrap();
    for hash in 0..blocks as u64 {
        write_uint(&mut out, hash * 7919 + 1).unwrap();
    }
    write_str(&mut out, "parent_block_hash").unwrap();
    write_uint(&mut out, 3).unwrap();
    write_str(&mut out, "token_ids").unwrap();
    write_array_len(&mut out, (blocks * block_size) as u32).unwrap();
    for i in 0..blocks * block_size {
        write_uint(&mut out, u64::from(token) + i as u64 % 3).unwrap();
    }
    write_str(&mut out, "block_size").unwrap();
    write_uint(&mut out, block_size as u64).unwrap();
    write_str(&mut out, "cache_salt").unwrap();
    write_str(&mut out, &"s".repeat(salt)).unwrap();
    write_map_len(&mut out, 2).unwrap();
    write_str(&mut out, "type").unwrap();
    write_str(&mut out, "BlockRemoved").unwrap();
    write_str(&mut out, "block_hashes").unwrap();
    write_array_len(&mut out, removal as u32).unwrap();
    for hash in 0..removal as u64 {
        write_uint(&mut out, hash.wrapping_mul(0x9e37_79b9_7f4a_7c15)).unwrap();
    }
    write_uint(&mut out, 0).unwrap();
    out
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn mutated_engine_payloads_never_panic_and_batch_within_limits(
        seed in any::<Index>(),
        mutations in prop::collection::vec(mutation(), 0..8),
        limits in limits(),
    ) {
        let seeds = seeds();
        let mut payload = seeds[seed.index(seeds.len())].clone();
        for mutation in &mutations {
            mutate(&mut payload, mutation);
        }
        check(&payload, limits);
    }

    #[test]
    fn adversarial_stores_and_removals_are_cut_sent_alone_or_reported_within_limits(
        blocks in 1..32usize,
        block_size in 1..2048usize,
        token in prop_oneof![Just(1u32), Just(200_000), Just(3_000_000), Just(u32::MAX - 3)],
        salt in prop_oneof![0..64usize, 4000..9000usize, Just(600_000)],
        removal in 0..3000usize,
        limits in limits(),
    ) {
        check(&store_payload(blocks, block_size, token, salt, removal), limits);
    }
}
