//! Writes a recording: records gathered into zstd frames, each frame
//! appended whole, parts rotated at a size.
//!
//! Invariant: the file only ever grows by whole frames (a record waits in
//! memory until its frame is written), and a part is rotated only between
//! frames, after a `Next` record naming its successor; so whatever a killed
//! writer left reads back up to its last complete frame.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::{FORMAT_VERSION, Header, Kind, MAGIC, MAX_RECORD_BYTES, RECORD_FIXED_BYTES, part_path};

/// zstd's default level: about 3× on protobuf batches at hundreds of MB/s.
const ZSTD_LEVEL: i32 = 3;

/// When the writer closes a frame and a part.
#[derive(Clone, Copy, Debug)]
pub struct WriterLimits {
    /// A part reaching this many bytes is closed and the next one opened.
    pub rotate_bytes: u64,
    /// A frame is written once its records hold this many bytes (and
    /// whenever [`Writer::flush`] is called).
    pub frame_bytes: usize,
}

/// An open recording.
pub struct Writer {
    first: PathBuf,
    header: Header,
    limits: WriterLimits,
    file: File,
    path: PathBuf,
    part_bytes: u64,
    written: u64,
    /// Records of the frame being gathered.
    pending: Vec<u8>,
}

impl Writer {
    /// Creates part 0 at `first` with `header` (its `part` is set here).
    /// Refuses to overwrite: `first` and `first.1` must not exist.
    pub fn create(first: &Path, mut header: Header, limits: WriterLimits) -> anyhow::Result<Self> {
        let next = part_path(first, 1);
        anyhow::ensure!(
            !next.exists(),
            "{} exists (a part of an earlier recording): choose another file or remove it",
            next.display()
        );
        header.part = 0;
        let (file, part_bytes) = open_part(first, &header)?;
        Ok(Self {
            first: first.to_owned(),
            header,
            limits,
            file,
            path: first.to_owned(),
            part_bytes,
            written: part_bytes,
            pending: Vec::new(),
        })
    }

    /// Adds a batch received at `received_unix_micros`.
    pub fn batch(&mut self, received_unix_micros: u64, bytes: &[u8]) -> anyhow::Result<()> {
        self.push(received_unix_micros, Kind::Batch, bytes)
    }

    /// Marks a resync: the cursor was refused with `reason`, a snapshot
    /// follows.
    pub fn resync(&mut self, received_unix_micros: u64, reason: &str) -> anyhow::Result<()> {
        self.push(received_unix_micros, Kind::Resync, reason.as_bytes())
    }

    /// Bytes written to disk so far, every part and header included.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Writes the records gathered so far as a frame (nothing if none),
    /// then rotates if the part is full.
    pub fn flush(&mut self) -> anyhow::Result<()> {
        self.write_frame()?;
        if self.part_bytes >= self.limits.rotate_bytes {
            self.rotate()?;
        }
        Ok(())
    }

    /// Closes the recording cleanly: an `End` record, the last frame, and
    /// the data synced to disk.
    pub fn finish(mut self) -> anyhow::Result<()> {
        self.append(crate::clock::unix_micros_now(), Kind::End, &[]);
        self.write_frame()?;
        self.file
            .sync_all()
            .with_context(|| format!("{}: cannot sync", self.path.display()))
    }

    fn push(&mut self, at: u64, kind: Kind, payload: &[u8]) -> anyhow::Result<()> {
        anyhow::ensure!(
            payload.len() <= (MAX_RECORD_BYTES - RECORD_FIXED_BYTES) as usize,
            "a record of {} bytes is over the format's limit of {MAX_RECORD_BYTES}",
            payload.len()
        );
        self.append(at, kind, payload);
        if self.pending.len() >= self.limits.frame_bytes {
            self.flush()?;
        }
        Ok(())
    }

    fn append(&mut self, at: u64, kind: Kind, payload: &[u8]) {
        let length = RECORD_FIXED_BYTES as usize + payload.len();
        let mut body = Vec::with_capacity(length);
        body.extend_from_slice(&at.to_le_bytes());
        body.push(kind as u8);
        body.extend_from_slice(payload);
        // `push` bounds the payload; markers are a few bytes.
        self.pending
            .extend_from_slice(&(length as u32).to_le_bytes());
        self.pending
            .extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        self.pending.extend_from_slice(&body);
    }

    fn write_frame(&mut self) -> anyhow::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let compressed = zstd::bulk::compress(&self.pending, ZSTD_LEVEL)
            .with_context(|| format!("{}: cannot compress a frame", self.path.display()))?;
        let mut frame = Vec::with_capacity(8 + compressed.len());
        frame.extend_from_slice(&u32::try_from(compressed.len())?.to_le_bytes());
        frame.extend_from_slice(&crc32c::crc32c(&compressed).to_le_bytes());
        frame.extend_from_slice(&compressed);
        // One write of the whole frame: a kill leaves it whole or torn at
        // the end of the file, where the reader cuts it.
        self.file
            .write_all(&frame)
            .with_context(|| format!("{}: cannot write", self.path.display()))?;
        self.part_bytes += frame.len() as u64;
        self.written += frame.len() as u64;
        self.pending.clear();
        Ok(())
    }

    fn rotate(&mut self) -> anyhow::Result<()> {
        let part = self.header.part + 1;
        let next = part_path(&self.first, part);
        let name = next
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default();
        self.append(crate::clock::unix_micros_now(), Kind::Next, name.as_bytes());
        self.write_frame()?;
        self.file
            .sync_all()
            .with_context(|| format!("{}: cannot sync", self.path.display()))?;
        self.header.part = part;
        let (file, part_bytes) = open_part(&next, &self.header)?;
        self.file = file;
        self.path = next;
        self.part_bytes = part_bytes;
        self.written += part_bytes;
        Ok(())
    }
}

/// Creates a part (never over an existing file) and writes its header;
/// returns the file and the header's size.
fn open_part(path: &Path, header: &Header) -> anyhow::Result<(File, u64)> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("{}: cannot create", path.display()))?;
    let json = serde_json::to_vec(header)?;
    let mut bytes = Vec::with_capacity(MAGIC.len() + 10 + json.len());
    bytes.extend_from_slice(&MAGIC);
    bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    bytes.extend_from_slice(&u32::try_from(json.len())?.to_le_bytes());
    bytes.extend_from_slice(&json);
    bytes.extend_from_slice(&crc32c::crc32c(&json).to_le_bytes());
    file.write_all(&bytes)
        .with_context(|| format!("{}: cannot write", path.display()))?;
    Ok((file, bytes.len() as u64))
}
