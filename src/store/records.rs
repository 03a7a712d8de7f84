//! The records of the state directory's files, each encoded with
//! [`super::format`]'s framing.
//!
//! Invariant: decoding is total: any payload either decodes into a value
//! whose counts were checked against its length, or is `Damage::Malformed`.

use std::collections::BTreeMap;

use bytes::Bytes;

use super::format::{Damage, Fields, Reader};
use crate::source::continuity::ResumePoint;

/// Record kinds.
pub mod kind {
    /// A segment's first record: who wrote it and where it starts.
    pub const SEGMENT_HEADER: u8 = 1;
    /// One published batch.
    pub const BATCH: u8 = 2;
    /// The end of a drain cycle: every batch before it was announced
    /// together, with the engine's counters as of then.
    pub const CYCLE: u8 = 3;
    /// A checkpoint's first record.
    pub const CHECKPOINT_META: u8 = 4;
    /// One snapshot chunk of a checkpoint.
    pub const CHUNK: u8 = 5;
    /// A checkpoint's last record.
    pub const CHECKPOINT_END: u8 = 6;
    /// The `synced` file's record.
    pub const SYNCED: u8 = 7;
}

/// Longest boot id kept (the kernel's is 36 characters).
const MAX_BOOT_ID: usize = 64;

/// What every segment starts with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    /// The boot id of the machine when the segment was written.
    pub boot_id: Vec<u8>,
    /// The first sequence number of the numbering the batches belong to.
    pub seed: u64,
    /// The position of its first batch.
    pub first_position: u64,
}

impl SegmentHeader {
    pub fn encode(&self) -> Vec<u8> {
        let mut fields = Fields::default();
        fields
            .bytes(&self.boot_id)
            .u64(self.seed)
            .u64(self.first_position);
        fields.0
    }

    pub fn decode(payload: &[u8]) -> Result<Self, Damage> {
        let mut reader = Reader(payload);
        Ok(Self {
            boot_id: read_boot_id(&mut reader)?,
            seed: reader.u64()?,
            first_position: reader.u64()?,
        })
    }
}

/// One published batch as the log holds it.
#[derive(Clone, Debug)]
pub struct BatchRecord {
    pub position: u64,
    pub rank: u32,
    pub sequence: u64,
    /// The encoded `KvEventBatch`, byte for byte as subscribers got it.
    pub encoded: Bytes,
}

impl BatchRecord {
    /// Bytes of the fields before `encoded`.
    pub const HEADER_BYTES: usize = 20;

    /// The fields the payload starts with; `encoded` follows them.
    pub fn header(position: u64, rank: u32, sequence: u64) -> [u8; Self::HEADER_BYTES] {
        let mut header = [0; Self::HEADER_BYTES];
        header[..8].copy_from_slice(&position.to_le_bytes());
        header[8..12].copy_from_slice(&rank.to_le_bytes());
        header[12..].copy_from_slice(&sequence.to_le_bytes());
        header
    }

    pub fn decode(payload: Vec<u8>) -> Result<Self, Damage> {
        let mut reader = Reader(&payload);
        let position = reader.u64()?;
        let rank = reader.u32()?;
        let sequence = reader.u64()?;
        let mut encoded = Bytes::from(payload);
        let _ = encoded.split_to(Self::HEADER_BYTES);
        Ok(Self {
            position,
            rank,
            sequence,
            encoded,
        })
    }
}

/// What kvgate knew of one engine publisher at a cycle's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankMark {
    /// The first engine message of kvgate's record (`unknown_before`).
    pub first: u64,
    /// Where the record ends.
    pub resume: ResumePoint,
}

/// Every rank's mark, by rank.
pub type Marks = BTreeMap<u32, RankMark>;

fn encode_marks<'a>(
    fields: &mut Fields,
    marks: impl ExactSizeIterator<Item = (&'a u32, &'a RankMark)>,
) {
    fields.u32(marks.len() as u32);
    for (&rank, mark) in marks {
        fields
            .u32(rank)
            .u64(mark.first)
            .u64(mark.resume.last)
            .u32(mark.resume.fingerprint);
    }
}

fn decode_marks(reader: &mut Reader<'_>) -> Result<Marks, Damage> {
    let count = reader.count(24)?;
    let mut marks = Marks::new();
    for _ in 0..count {
        let rank = reader.u32()?;
        let first = reader.u64()?;
        let last = reader.u64()?;
        let fingerprint = reader.u32()?;
        marks.insert(
            rank,
            RankMark {
                first,
                resume: ResumePoint { last, fingerprint },
            },
        );
    }
    Ok(marks)
}

/// The end of one drain cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CycleRecord {
    /// The last position published in or before the cycle.
    pub position: u64,
    pub marks: Marks,
}

impl CycleRecord {
    #[cfg(test)]
    pub fn encode(&self) -> Vec<u8> {
        let mut fields = Fields::default();
        Self::encode_parts(&mut fields, self.position, self.marks.iter());
        fields.0
    }

    /// Appends the payload of a cycle's end at `position` to `fields`
    /// (the log writer's buffer, reused from one cycle to the next).
    pub fn encode_parts<'a>(
        fields: &mut Fields,
        position: u64,
        marks: impl ExactSizeIterator<Item = (&'a u32, &'a RankMark)>,
    ) {
        fields.u64(position);
        encode_marks(fields, marks);
    }

    pub fn decode(payload: &[u8]) -> Result<Self, Damage> {
        let mut reader = Reader(payload);
        Ok(Self {
            position: reader.u64()?,
            marks: decode_marks(&mut reader)?,
        })
    }
}

/// What a checkpoint holds besides its chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointMeta {
    /// The position of the last batch the state includes.
    pub position: u64,
    /// The numbering the state's sequence numbers belong to.
    pub seed: u64,
    /// Each rank's last sequence number at the cut.
    pub last_sequences: BTreeMap<u32, u64>,
    pub marks: Marks,
}

impl CheckpointMeta {
    pub fn encode(&self) -> Vec<u8> {
        let mut fields = Fields::default();
        fields.u64(self.position).u64(self.seed);
        fields.u32(self.last_sequences.len() as u32);
        for (&rank, &sequence) in &self.last_sequences {
            fields.u32(rank).u64(sequence);
        }
        encode_marks(&mut fields, self.marks.iter());
        fields.0
    }

    pub fn decode(payload: &[u8]) -> Result<Self, Damage> {
        let mut reader = Reader(payload);
        let position = reader.u64()?;
        let seed = reader.u64()?;
        let count = reader.count(12)?;
        let mut last_sequences = BTreeMap::new();
        for _ in 0..count {
            let rank = reader.u32()?;
            last_sequences.insert(rank, reader.u64()?);
        }
        Ok(Self {
            position,
            seed,
            last_sequences,
            marks: decode_marks(&mut reader)?,
        })
    }
}

/// A checkpoint's last record: how many chunks came before it.
pub fn encode_checkpoint_end(chunks: u64, blocks: u64) -> Vec<u8> {
    let mut fields = Fields::default();
    fields.u64(chunks).u64(blocks);
    fields.0
}

/// (chunks, blocks) of a checkpoint's last record.
pub fn decode_checkpoint_end(payload: &[u8]) -> Result<(u64, u64), Damage> {
    let mut reader = Reader(payload);
    Ok((reader.u64()?, reader.u64()?))
}

/// How far the log was on disk at the last fsync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncedRecord {
    pub boot_id: Vec<u8>,
    pub seed: u64,
    /// Every batch up to this position was on disk.
    pub through: u64,
    /// Written at a clean shutdown: nothing was published after `through`.
    pub clean: bool,
}

impl SyncedRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut fields = Fields::default();
        fields
            .bytes(&self.boot_id)
            .u64(self.seed)
            .u64(self.through)
            .u8(u8::from(self.clean));
        fields.0
    }

    pub fn decode(payload: &[u8]) -> Result<Self, Damage> {
        let mut reader = Reader(payload);
        Ok(Self {
            boot_id: read_boot_id(&mut reader)?,
            seed: reader.u64()?,
            through: reader.u64()?,
            clean: match reader.u8()? {
                0 => false,
                1 => true,
                _ => return Err(Damage::Malformed),
            },
        })
    }
}

/// A boot id field, no longer than any kvgate writes.
fn read_boot_id(reader: &mut Reader<'_>) -> Result<Vec<u8>, Damage> {
    let boot_id = reader.bytes()?;
    if boot_id.len() > MAX_BOOT_ID {
        return Err(Damage::Malformed);
    }
    Ok(boot_id.to_vec())
}

/// This machine's boot id: equal across kvgate restarts until the machine
/// reboots (and with it the page cache). Empty when unreadable, which
/// never matches.
pub fn boot_id() -> Vec<u8> {
    let mut id = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    id.truncate(MAX_BOOT_ID);
    while id.last().is_some_and(u8::is_ascii_whitespace) {
        id.pop();
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_record_decodes_to_what_was_encoded() {
        let marks = Marks::from([(
            3,
            RankMark {
                first: 7,
                resume: ResumePoint {
                    last: 99,
                    fingerprint: 0xdead_beef,
                },
            },
        )]);
        let cycle = CycleRecord {
            position: 12,
            marks: marks.clone(),
        };
        assert_eq!(CycleRecord::decode(&cycle.encode()).unwrap(), cycle);
        let meta = CheckpointMeta {
            position: 5,
            seed: 1000,
            last_sequences: BTreeMap::from([(0, 1004), (3, 1001)]),
            marks,
        };
        assert_eq!(CheckpointMeta::decode(&meta.encode()).unwrap(), meta);
        let synced = SyncedRecord {
            boot_id: boot_id(),
            seed: 9,
            through: 10,
            clean: true,
        };
        assert_eq!(SyncedRecord::decode(&synced.encode()).unwrap(), synced);
        let header = SegmentHeader {
            boot_id: b"b".to_vec(),
            seed: 1,
            first_position: 2,
        };
        assert_eq!(SegmentHeader::decode(&header.encode()).unwrap(), header);
    }

    #[test]
    fn a_count_larger_than_its_payload_is_malformed() {
        let mut fields = Fields::default();
        fields.u64(1).u32(u32::MAX);
        assert_eq!(
            CycleRecord::decode(&fields.0).unwrap_err(),
            Damage::Malformed
        );
    }
}
