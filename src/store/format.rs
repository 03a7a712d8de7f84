//! The framing every file in the state directory shares.
//!
//! A file is an 8-byte magic naming its kind, a version byte, then records.
//! A record is `[len: u32][len_check: u32][crc: u32][kind: u8][payload]`,
//! little-endian, where `len` counts kind and payload, `len_check` is the
//! CRC32C of the four `len` bytes and `crc` the CRC32C of kind and payload.
//!
//! Invariants: nothing is allocated for a record before its length is
//! checked against `MAX_RECORD_BYTES` and its own checksum, so no file can
//! make kvgate allocate more than that. A reader tells a torn tail (the file
//! ends inside a record whose length verified: a write cut short by a killed
//! process, never announced) from damage (a checksum that fails on bytes
//! that are all there), because only the first may be cut silently. A run
//! of zeros is read past holes (`SEEK_DATA`: a sparse file of any size
//! costs nothing to read) and for at most `MAX_ZERO_RUN_BYTES` of zeros
//! on disk; a longer run is damage, so no file makes a restore read long.

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::os::unix::io::AsRawFd;

/// The only version of every file this build writes and reads; any other
/// is set aside, never guessed at.
pub const VERSION: u8 = 1;

/// The largest record kvgate writes: a batch is at most the router's 4 MiB
/// limit, a snapshot chunk about 1 MiB.
pub const MAX_RECORD_BYTES: usize = 16 << 20;

/// The most zero bytes read (holes aside) to tell a torn tail of zeros
/// from zeros before data: a tail a file system extended before its data
/// landed is at most what was being written, a drain cycle (far less
/// than this); a longer run is damage.
pub const MAX_ZERO_RUN_BYTES: u64 = 64 << 20;

/// Zeros read between two looks for the next data past a hole.
const HOLE_LOOK_BYTES: u64 = 1 << 20;

/// Bytes of a record's header before its body.
pub const RECORD_HEADER_BYTES: usize = 12;

/// Bytes of a file's header (magic and version).
pub const FILE_HEADER_BYTES: usize = 9;

/// The kind of a file, by its magic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// `segment-*.log`: published batches and cycle marks.
    Segment,
    /// `checkpoint-*.ckpt`: the live state at one position.
    Checkpoint,
    /// `synced`: how far the log was on disk at the last fsync.
    Synced,
}

impl FileKind {
    fn magic(self) -> &'static [u8; 8] {
        match self {
            Self::Segment => b"KVGLOG\0\0",
            Self::Checkpoint => b"KVGCKPT\0",
            Self::Synced => b"KVGSYNC\0",
        }
    }
}

/// Why a file or record does not verify.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    /// A checksum failed on bytes that are all there.
    Checksum,
    /// A version byte this build does not know.
    UnknownVersion,
    /// A directory or other non-file where a file belongs.
    NotAFile,
    /// Wrong magic, a record that does not parse, or a file cut short
    /// where no torn write can leave it.
    Malformed,
    /// A checkpoint of a numbering this directory's log and records never
    /// used: another directory's, copied in.
    Foreign,
}

impl Damage {
    /// Every kind, in label order.
    pub const ALL: [Damage; 5] = [
        Self::Checksum,
        Self::UnknownVersion,
        Self::NotAFile,
        Self::Malformed,
        Self::Foreign,
    ];

    /// The `reason` label of `state_damaged_total`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Checksum => "checksum",
            Self::UnknownVersion => "unknown_version",
            Self::NotAFile => "not_a_file",
            Self::Malformed => "malformed",
            Self::Foreign => "foreign",
        }
    }
}

/// The header of a new file of `kind`.
pub fn file_header(kind: FileKind) -> [u8; FILE_HEADER_BYTES] {
    let mut header = [0; FILE_HEADER_BYTES];
    header[..8].copy_from_slice(kind.magic());
    header[8] = VERSION;
    header
}

/// A record's header and kind byte, for a payload that is the
/// concatenation of `parts`: the checksum is computed over the parts where
/// they lie, so they can be written after it without being copied.
pub fn record_head(kind: u8, parts: &[&[u8]]) -> [u8; RECORD_HEADER_BYTES + 1] {
    let payload_len: usize = parts.iter().map(|part| part.len()).sum();
    let len = u32::try_from(payload_len + 1).expect("records are far below 4 GiB");
    let len_bytes = len.to_le_bytes();
    let crc = parts.iter().fold(crc32c::crc32c(&[kind]), |crc, part| {
        crc32c::crc32c_append(crc, part)
    });
    let mut head = [0; RECORD_HEADER_BYTES + 1];
    head[..4].copy_from_slice(&len_bytes);
    head[4..8].copy_from_slice(&crc32c::crc32c(&len_bytes).to_le_bytes());
    head[8..12].copy_from_slice(&crc.to_le_bytes());
    head[12] = kind;
    head
}

/// Appends one record of `kind` to `out`, its payload the concatenation of
/// `parts`.
pub fn put_record(out: &mut Vec<u8>, kind: u8, parts: &[&[u8]]) {
    out.extend_from_slice(&record_head(kind, parts));
    for part in parts {
        out.extend_from_slice(part);
    }
}

/// What reading the next record found.
#[derive(Debug)]
pub enum Next {
    /// A record that verified: its kind and payload.
    Record(u8, Vec<u8>),
    /// The file ends cleanly between records.
    End,
    /// The file ends inside a record (a write cut short).
    Torn,
    /// A record that does not verify.
    Damaged(Damage),
}

/// Reads records from a file whose header was checked.
pub struct RecordReader<R> {
    input: R,
    /// Bytes read so far, header included: where the last good record ends.
    pub offset: u64,
}

/// An input that can skip the holes of a sparse file.
pub trait Holes: Read {
    /// Moves to the next byte, at or after the current one, that is not in
    /// a hole; `false` when only a hole is left to the end.
    fn skip_hole(&mut self) -> io::Result<bool>;
}

impl Holes for &[u8] {
    fn skip_hole(&mut self) -> io::Result<bool> {
        Ok(true)
    }
}

impl Holes for BufReader<File> {
    fn skip_hole(&mut self) -> io::Result<bool> {
        let position = self.stream_position()?;
        let offset = i64::try_from(position).map_err(io::Error::other)?;
        // SAFETY: lseek on a descriptor this reader owns; its buffer is
        // discarded by the seek below, whatever lseek did to the offset.
        let data = unsafe { libc::lseek(self.get_ref().as_raw_fd(), offset, libc::SEEK_DATA) };
        if data < 0 {
            let error = io::Error::last_os_error();
            self.seek(SeekFrom::Start(position))?;
            // ENXIO: nothing but a hole to the end. Any other error (a
            // file system without SEEK_DATA): read on.
            return Ok(error.raw_os_error() != Some(libc::ENXIO));
        }
        self.seek(SeekFrom::Start(position.max(data.unsigned_abs())))?;
        Ok(true)
    }
}

impl<R: Holes> RecordReader<R> {
    /// Checks `input`'s file header against `kind`; `Ok(None)` when the
    /// file ends inside it (created, never written).
    pub fn open(mut input: R, kind: FileKind) -> io::Result<Result<Option<Self>, Damage>> {
        let mut header = [0; FILE_HEADER_BYTES];
        match read_full(&mut input, &mut header)? {
            Filled::Short => return Ok(Ok(None)),
            Filled::Full => {}
        }
        if &header[..8] != kind.magic() {
            return Ok(Err(Damage::Malformed));
        }
        if header[8] != VERSION {
            return Ok(Err(Damage::UnknownVersion));
        }
        Ok(Ok(Some(Self {
            input,
            offset: FILE_HEADER_BYTES as u64,
        })))
    }

    /// The next record.
    pub fn next(&mut self) -> io::Result<Next> {
        let mut header = [0; RECORD_HEADER_BYTES];
        match read_full(&mut self.input, &mut header)? {
            Filled::Full => {}
            Filled::Short if header == [0; RECORD_HEADER_BYTES] => return Ok(Next::End),
            Filled::Short => return Ok(Next::Torn),
        }
        let field = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().expect("4 bytes"));
        let (len, len_check, crc) = (field(0), field(4), field(8));
        // A file system may extend a file before the data lands: after a
        // power loss its tail reads as zeros, a write cut short.
        if header == [0; RECORD_HEADER_BYTES] && only_zeros_left(&mut self.input)? {
            return Ok(Next::Torn);
        }
        if crc32c::crc32c(&header[..4]) != len_check {
            return Ok(Next::Damaged(Damage::Checksum));
        }
        let len = len as usize;
        if len == 0 || len > MAX_RECORD_BYTES {
            return Ok(Next::Damaged(Damage::Malformed));
        }
        let mut body = vec![0; len];
        if let Filled::Short = read_full(&mut self.input, &mut body)? {
            return Ok(Next::Torn);
        }
        if crc32c::crc32c(&body) != crc {
            return Ok(Next::Damaged(Damage::Checksum));
        }
        self.offset += (RECORD_HEADER_BYTES + len) as u64;
        let kind = body.remove(0);
        Ok(Next::Record(kind, body))
    }
}

/// Whether `input` holds nothing but zero bytes to its end, holes
/// skipped; `false` too past `MAX_ZERO_RUN_BYTES` of zeros read.
fn only_zeros_left(input: &mut impl Holes) -> io::Result<bool> {
    let mut buffer = [0; 4096];
    let mut zeros = 0u64;
    let mut next_look = 0u64;
    loop {
        if zeros >= next_look {
            if !input.skip_hole()? {
                return Ok(true);
            }
            next_look = zeros + HOLE_LOOK_BYTES;
        }
        match input.read(&mut buffer) {
            Ok(0) => return Ok(true),
            Ok(read) if buffer[..read].iter().any(|&byte| byte != 0) => return Ok(false),
            Ok(read) => {
                zeros += read as u64;
                if zeros > MAX_ZERO_RUN_BYTES {
                    return Ok(false);
                }
            }
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
}

enum Filled {
    Full,
    /// The input ended first; whatever came is in the buffer's front.
    Short,
}

fn read_full(input: &mut impl Read, buffer: &mut [u8]) -> io::Result<Filled> {
    let mut filled = 0;
    while filled < buffer.len() {
        match input.read(&mut buffer[filled..]) {
            Ok(0) => return Ok(Filled::Short),
            Ok(read) => filled += read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(Filled::Full)
}

/// Little-endian fields appended to a payload.
#[derive(Default)]
pub struct Fields(pub Vec<u8>);

impl Fields {
    pub fn u8(&mut self, value: u8) -> &mut Self {
        self.0.push(value);
        self
    }

    pub fn u32(&mut self, value: u32) -> &mut Self {
        self.0.extend_from_slice(&value.to_le_bytes());
        self
    }

    pub fn u64(&mut self, value: u64) -> &mut Self {
        self.0.extend_from_slice(&value.to_le_bytes());
        self
    }

    /// A length-prefixed byte string.
    pub fn bytes(&mut self, value: &[u8]) -> &mut Self {
        self.u32(u32::try_from(value.len()).expect("short fields"));
        self.0.extend_from_slice(value);
        self
    }
}

/// A payload read field by field; every read is bounds-checked.
pub struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Damage> {
        if self.0.len() < n {
            return Err(Damage::Malformed);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    pub fn u8(&mut self) -> Result<u8, Damage> {
        Ok(self.take(1)?[0])
    }

    pub fn u32(&mut self) -> Result<u32, Damage> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    pub fn u64(&mut self) -> Result<u64, Damage> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    /// A length-prefixed byte string, its length checked against what is left.
    pub fn bytes(&mut self) -> Result<&'a [u8], Damage> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    /// A count of items of at least `item_bytes` each, checked against what
    /// is left so a bad count cannot make a caller allocate.
    pub fn count(&mut self, item_bytes: usize) -> Result<usize, Damage> {
        let count = self.u32()? as usize;
        if count.saturating_mul(item_bytes) > self.0.len() {
            return Err(Damage::Malformed);
        }
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(records: &[(u8, &[u8])]) -> Vec<u8> {
        let mut out = file_header(FileKind::Segment).to_vec();
        for (kind, payload) in records {
            put_record(&mut out, *kind, &[payload]);
        }
        out
    }

    fn read_all(bytes: &[u8]) -> (Vec<(u8, Vec<u8>)>, Next) {
        let mut reader = RecordReader::open(bytes, FileKind::Segment)
            .unwrap()
            .unwrap()
            .unwrap();
        let mut records = Vec::new();
        loop {
            match reader.next().unwrap() {
                Next::Record(kind, payload) => records.push((kind, payload)),
                other => return (records, other),
            }
        }
    }

    #[test]
    fn records_read_back_as_written_and_a_cut_record_is_a_torn_tail() {
        let bytes = file(&[(1, b"one"), (2, b"two")]);
        let (records, end) = read_all(&bytes);
        assert_eq!(records, vec![(1, b"one".to_vec()), (2, b"two".to_vec())]);
        assert!(matches!(end, Next::End));
        for cut in FILE_HEADER_BYTES + 1..bytes.len() {
            let (records, end) = read_all(&bytes[..cut]);
            assert!(records.len() < 2);
            assert!(
                matches!(end, Next::Torn | Next::End),
                "cut at {cut}: {end:?}"
            );
        }
    }

    #[test]
    fn a_zero_filled_tail_is_a_torn_write_and_zeros_before_data_are_damage() {
        let mut bytes = file(&[(1, b"one")]);
        bytes.extend_from_slice(&[0; 3 * RECORD_HEADER_BYTES + 5]);
        let (records, end) = read_all(&bytes);
        assert_eq!(records, vec![(1, b"one".to_vec())]);
        assert!(matches!(end, Next::Torn), "{end:?}");

        let last = bytes.len() - 1;
        bytes[last] = 1;
        let (records, end) = read_all(&bytes);
        assert_eq!(records.len(), 1);
        assert!(matches!(end, Next::Damaged(Damage::Checksum)), "{end:?}");
    }

    #[test]
    fn every_flipped_bit_of_a_record_is_damage_or_a_torn_tail_never_a_record() {
        let bytes = file(&[(1, b"payload")]);
        for at in FILE_HEADER_BYTES..bytes.len() {
            for bit in 0..8 {
                let mut flipped = bytes.clone();
                flipped[at] ^= 1 << bit;
                let (records, end) = read_all(&flipped);
                assert!(records.is_empty(), "byte {at} bit {bit}");
                assert!(
                    matches!(end, Next::Damaged(_)),
                    "byte {at} bit {bit}: {end:?}"
                );
            }
        }
    }

    #[test]
    fn an_unknown_version_or_magic_is_refused() {
        let mut bytes = file(&[]);
        bytes[8] = VERSION + 1;
        assert_eq!(
            RecordReader::open(&bytes[..], FileKind::Segment)
                .unwrap()
                .err(),
            Some(Damage::UnknownVersion)
        );
        assert_eq!(
            RecordReader::open(&bytes[..], FileKind::Checkpoint)
                .unwrap()
                .err(),
            Some(Damage::Malformed)
        );
    }

    #[test]
    fn a_huge_length_is_damage_before_anything_is_allocated() {
        let mut bytes = file_header(FileKind::Segment).to_vec();
        let len = u32::MAX.to_le_bytes();
        bytes.extend_from_slice(&len);
        bytes.extend_from_slice(&crc32c::crc32c(&len).to_le_bytes());
        bytes.extend_from_slice(&[0; 4]);
        let (_, end) = read_all(&bytes);
        assert!(matches!(end, Next::Damaged(Damage::Malformed)));
    }
}
