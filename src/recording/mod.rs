//! Recordings: a gateway's stream kept in a file (`kvgate record`), read
//! back by `kvgate tail --file`, `kvgate record --stats` and the replay
//! source (`kvgate serve --replay-file`). `docs/recording-format.md` is the
//! byte-level description.
//!
//! A recording is one or more parts (`FILE`, `FILE.1`, `FILE.2`, ...). Each
//! part starts with a self-describing header (magic, format version, then a
//! checksummed JSON object), followed by length-prefixed, CRC32C-checksummed
//! zstd frames; each frame holds length-prefixed, CRC32C-checksummed records
//! carrying a receive time and either a batch's protobuf bytes exactly as
//! received or a marker (a resync, the end, the next part).
//!
//! Invariants: the writer only ever appends whole frames, so a killed
//! recorder leaves a file whose every complete frame reads back; the reader
//! treats the file as untrusted input: every length is checked against a
//! fixed bound and against what is left of the file before anything is
//! allocated for it, and damage ends the reading at the last intact record
//! with a message naming the file and the offset, never a panic.

mod reader;
mod writer;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use reader::{Ending, OpenError, Recording};
pub use writer::{Writer, WriterLimits};

/// The first bytes of every part: a high-bit byte (a 7-bit channel mangles
/// it) and a trailing newline (a line-ending conversion mangles it), as PNG.
pub const MAGIC: [u8; 8] = *b"\x89KVGREC\n";

/// The format version this kvgate writes and reads.
pub const FORMAT_VERSION: u16 = 1;

/// Largest header JSON accepted.
pub const MAX_HEADER_BYTES: u32 = 64 << 10;

/// Largest compressed frame accepted.
pub const MAX_FRAME_BYTES: u32 = 64 << 20;

/// Largest decompressed frame accepted (a writer closes a frame once it
/// holds `frame_bytes`, so a frame is at most that plus one record).
pub const MAX_FRAME_RAW_BYTES: u64 = 64 << 20;

/// Largest record accepted: a batch is at most the router's 4 MiB message
/// limit; the rest is headroom.
pub const MAX_RECORD_BYTES: u32 = 16 << 20;

/// Bytes of a record's fixed part: receive time (8) and kind (1).
const RECORD_FIXED_BYTES: u32 = 9;

/// What a part's header says about the recording.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// The kvgate version that wrote it.
    pub kvgate_version: String,
    /// The gateway recorded, as given to `--addr`.
    pub source: String,
    /// The service name `SubscribeKvEvents` was called on.
    pub service: String,
    /// When the recording started, Unix milliseconds.
    pub started_unix_ms: u64,
    /// The engine's data-parallel ranks, as the recorder was told.
    pub dp_size: u32,
    /// 0 for `FILE`, n for `FILE.n`.
    pub part: u32,
}

/// One record: what was received, and when.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// Receive time, microseconds since the Unix epoch.
    pub received_unix_micros: u64,
    /// What was received.
    pub entry: Entry,
}

impl Record {
    /// The bytes its entry holds.
    pub fn size(&self) -> usize {
        match &self.entry {
            Entry::Batch(bytes) => bytes.len(),
            Entry::Resync(reason) => reason.len(),
        }
    }
}

/// A record's content.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// A `KvEventBatch`, its protobuf bytes exactly as received.
    Batch(bytes::Bytes),
    /// The gateway could not honour the recorder's cursor: the recorder
    /// started over from a snapshot, which follows. Carries the refusal.
    Resync(String),
}

/// The record kinds on disk. End and Next never reach a reader's caller:
/// they say how a part ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Batch = 1,
    Resync = 2,
    /// The recorder closed the recording cleanly.
    End = 3,
    /// The recording goes on in the next part (payload: its file name).
    Next = 4,
}

impl Kind {
    fn from_byte(byte: u8) -> Option<Self> {
        [Self::Batch, Self::Resync, Self::End, Self::Next]
            .into_iter()
            .find(|kind| *kind as u8 == byte)
    }
}

/// Part `n` of the recording whose first part is `first`: `FILE.n`.
pub fn part_path(first: &Path, n: u32) -> PathBuf {
    if n == 0 {
        return first.to_owned();
    }
    let mut name = first.as_os_str().to_owned();
    name.push(format!(".{n}"));
    PathBuf::from(name)
}

/// The parts to read: the files as given when there are several, else the
/// one file and every `FILE.n` after it that exists.
pub fn parts(files: &[PathBuf]) -> Vec<PathBuf> {
    match files {
        [first] => (0..)
            .map(|n| part_path(first, n))
            .enumerate()
            .take_while(|(n, path)| *n == 0 || path.exists())
            .map(|(_, path)| path)
            .collect(),
        _ => files.to_vec(),
    }
}

/// A recorded batch, decoded; `n` counts the recording's batches from 1,
/// for the message.
pub fn decode_batch(bytes: &[u8], n: u64) -> anyhow::Result<crate::proto::common::KvEventBatch> {
    use anyhow::Context as _;
    use prost::Message as _;
    crate::proto::common::KvEventBatch::decode(bytes)
        .with_context(|| format!("recorded batch {n} is not a KvEventBatch"))
}

/// How a reading ended, as a command's result: damage is an error (after
/// what was intact was used); an unclosed recording is only worth a
/// warning.
pub fn ending_result(ending: Option<&Ending>) -> anyhow::Result<()> {
    match ending {
        Some(ending @ Ending::Cut { .. }) => Err(anyhow::anyhow!("{ending}")),
        Some(ending @ Ending::Unclosed { .. }) => {
            tracing::warn!("{ending}");
            Ok(())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
