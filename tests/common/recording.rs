//! Recordings made for tests: a scratch directory, batches that store one
//! block each, and a writer's header and limits.

use std::path::{Path, PathBuf};

use kvgate::proto::common::kv_cache_event::Data;
use kvgate::proto::common::{KvBlock, KvBlocksStored, KvCacheEvent, KvEventBatch};
use kvgate::recording::{Header, Writer, WriterLimits};
use prost::Message as _;

/// A scratch directory under /tmp, removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kvgate-test-{name}-{}-{}",
            std::process::id(),
            kvgate::clock::unix_micros_now()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A batch of rank 0 numbered `seq` that stores block `seq`.
pub fn store_batch(seq: u64) -> KvEventBatch {
    KvEventBatch {
        sequence_number: seq,
        dp_rank: Some(0),
        events: vec![KvCacheEvent {
            event_id: seq,
            data: Some(Data::Stored(KvBlocksStored {
                blocks: vec![KvBlock {
                    block_hash: seq as i64,
                    block_size: 16,
                    ..Default::default()
                }],
                ..Default::default()
            })),
        }],
        ..Default::default()
    }
}

/// Part 0's header of a recording of one rank.
pub fn header() -> Header {
    Header {
        kvgate_version: "test".into(),
        source: "127.0.0.1:1".into(),
        service: "kvgate.v1.KvGate".into(),
        started_unix_ms: 0,
        dp_size: 1,
        part: 0,
    }
}

/// A writer of one part, frames of 4 KiB.
pub fn writer(path: &Path) -> Writer {
    let limits = WriterLimits {
        rotate_bytes: 1 << 30,
        frame_bytes: 4096,
    };
    Writer::create(path, header(), limits).unwrap()
}

/// A closed recording of `batches`, received 1 ms apart, a frame every 10.
pub fn write_batches(path: &Path, batches: impl IntoIterator<Item = KvEventBatch>) {
    let mut writer = writer(path);
    for (n, batch) in (0_u64..).zip(batches) {
        writer.batch(n * 1000, &batch.encode_to_vec()).unwrap();
        if n % 10 == 9 {
            writer.flush().unwrap();
        }
    }
    writer.finish().unwrap();
}
