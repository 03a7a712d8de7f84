//! Reads a recording back, as untrusted input.
//!
//! Invariant: nothing is allocated for a length field before it is checked
//! against its fixed bound and against the bytes left in the file; a part
//! that is not a recording, or of a newer format, is refused whole; damage
//! after the header (a torn tail, a flipped bit, a bad length) ends the
//! reading at the last intact record, and [`Ending`] names the file and the
//! offset. No input makes it panic.

use std::fmt;
use std::fs::File;
use std::io::{BufReader, Read as _};
use std::path::{Path, PathBuf};

use bytes::{Buf as _, Bytes};

use crate::regular_file::OpenRefused;

use super::{
    Entry, FORMAT_VERSION, Header, Kind, MAGIC, MAX_FRAME_BYTES, MAX_FRAME_RAW_BYTES,
    MAX_HEADER_BYTES, MAX_RECORD_BYTES, RECORD_FIXED_BYTES, Record,
};

/// zstd's window may not exceed 8 MiB: the writer's level uses 2 MiB at
/// most, and a hostile frame asking for more is refused rather than given
/// the memory.
const WINDOW_LOG_MAX: u32 = 23;

/// Why a part cannot be read at all.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// No file was given.
    #[error("no recording file given")]
    NoFile,
    /// The file cannot be opened or read.
    #[error("{path}: {error}")]
    Io {
        /// The part.
        path: String,
        /// What the system said (in the message, so not the `source`: as
        /// both, `{:#}` printed it twice).
        error: std::io::Error,
    },
    /// The path is no regular file: it is refused without waiting for it
    /// (a FIFO would hang the reader, a device feed it for ever).
    #[error("{path}: {kind}, not a regular file")]
    NotRegular {
        /// The part.
        path: String,
        /// What it is.
        kind: crate::regular_file::NotRegular,
    },
    /// The file does not start with the recording magic.
    #[error("{path}: not a kvgate recording (no recording header at offset 0)")]
    Foreign {
        /// The part.
        path: String,
    },
    /// Written by a newer kvgate.
    #[error(
        "{path}: recording format version {version} is newer than this kvgate reads \
         ({FORMAT_VERSION}); read it with a newer kvgate"
    )]
    FutureVersion {
        /// The part.
        path: String,
        /// The version it claims.
        version: u16,
    },
    /// The header is damaged.
    #[error("{path}: damaged recording header at offset {offset}: {what}")]
    BadHeader {
        /// The part.
        path: String,
        /// Where the damage is.
        offset: u64,
        /// What is wrong.
        what: String,
    },
}

/// How a reading ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The recorder closed the recording cleanly.
    Closed,
    /// The last part ends on a whole frame without the closing record: the
    /// recorder was killed, or is still writing.
    Unclosed {
        /// The last part read.
        path: String,
        /// Its size.
        offset: u64,
    },
    /// Damage: the reading stopped at the last intact record before it.
    Cut {
        /// The damaged part.
        path: String,
        /// Where the damaged frame (or header) starts.
        offset: u64,
        /// What is wrong.
        what: String,
    },
}

impl fmt::Display for Ending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Closed => f.write_str("closed cleanly"),
            Self::Unclosed { path, offset } => write!(
                f,
                "{path}: not closed (the recorder was killed or is still writing); read up to offset {offset}"
            ),
            Self::Cut { path, offset, what } => write!(
                f,
                "{path}: damaged at offset {offset} ({what}); read up to the last intact record before it"
            ),
        }
    }
}

/// How one part ended.
#[derive(Debug)]
enum PartEnd {
    End,
    Next,
    Over(Ending),
}

/// One part, read frame by frame.
struct PartReader {
    path: String,
    file: BufReader<File>,
    /// Where the next frame starts.
    offset: u64,
    len: u64,
    header: Header,
    /// What is left of the frame being read: records are split off it one
    /// at a time, as they are asked for, so a frame of millions of tiny
    /// records costs its own bytes and nothing more.
    frame: Bytes,
    /// Where that frame starts, for a message about damage in it.
    frame_at: u64,
    /// Its next record's index.
    in_frame: usize,
    end: Option<PartEnd>,
}

impl PartReader {
    fn open(path: &Path) -> Result<Self, OpenError> {
        let shown = path.display().to_string();
        let io = |error| OpenError::Io {
            path: shown.clone(),
            error,
        };
        let file = crate::regular_file::open(path).map_err(|refused| match refused {
            OpenRefused::Io(error) => io(error),
            OpenRefused::NotRegular(kind) => OpenError::NotRegular {
                path: shown.clone(),
                kind,
            },
        })?;
        let len = file.metadata().map_err(io)?.len();
        let mut file = BufReader::new(file);
        let bad = |offset: u64, what: String| OpenError::BadHeader {
            path: shown.clone(),
            offset,
            what,
        };
        let mut magic = [0; 8];
        if len < MAGIC.len() as u64 {
            return Err(OpenError::Foreign { path: shown });
        }
        file.read_exact(&mut magic).map_err(io)?;
        if magic != MAGIC {
            return Err(OpenError::Foreign { path: shown });
        }
        let mut fixed = [0; 6];
        if len < 14 {
            return Err(bad(8, "the file ends inside the header".into()));
        }
        file.read_exact(&mut fixed).map_err(io)?;
        let version = u16::from_le_bytes([fixed[0], fixed[1]]);
        if version > FORMAT_VERSION {
            return Err(OpenError::FutureVersion {
                path: shown,
                version,
            });
        }
        if version == 0 {
            return Err(bad(8, "format version 0".into()));
        }
        let json_len = u32::from_le_bytes([fixed[2], fixed[3], fixed[4], fixed[5]]);
        if json_len > MAX_HEADER_BYTES || u64::from(json_len) + 4 > len - 14 {
            return Err(bad(
                10,
                format!(
                    "header length {json_len} is over the limit ({MAX_HEADER_BYTES}) or past the end of the file"
                ),
            ));
        }
        let mut json = vec![0; json_len as usize + 4];
        file.read_exact(&mut json).map_err(io)?;
        let crc = json.split_off(json_len as usize);
        if crc32c::crc32c(&json).to_le_bytes()[..] != crc[..] {
            return Err(bad(14, "header checksum mismatch".into()));
        }
        let header: Header = serde_json::from_slice(&json)
            .map_err(|error| bad(14, format!("header is not the expected JSON: {error}")))?;
        Ok(Self {
            path: shown,
            file,
            offset: 18 + u64::from(json_len),
            len,
            header,
            frame: Bytes::new(),
            frame_at: 0,
            in_frame: 0,
            end: None,
        })
    }

    /// The next record of this part; `None` once `end` is set.
    fn next_record(&mut self) -> Option<Record> {
        loop {
            if self.end.is_some() {
                return None;
            }
            if !self.frame.has_remaining() {
                self.read_frame();
                continue;
            }
            match self.split_record() {
                Ok(Some(record)) => return Some(record),
                Ok(None) => {}
                Err(what) => self.cut(self.frame_at, what),
            }
        }
    }

    fn cut(&mut self, offset: u64, what: String) {
        self.frame = Bytes::new();
        self.end = Some(PartEnd::Over(Ending::Cut {
            path: self.path.clone(),
            offset,
            what,
        }));
    }

    /// Reads the next frame into `frame`, or sets `end`.
    fn read_frame(&mut self) {
        let at = self.offset;
        let left = self.len - at;
        if left == 0 {
            self.end = Some(PartEnd::Over(Ending::Unclosed {
                path: self.path.clone(),
                offset: at,
            }));
            return;
        }
        if left < 8 {
            return self.cut(at, format!("torn frame header: {left} bytes left"));
        }
        let mut fixed = [0; 8];
        if let Err(error) = self.file.read_exact(&mut fixed) {
            return self.cut(at, error.to_string());
        }
        let length = u32::from_le_bytes([fixed[0], fixed[1], fixed[2], fixed[3]]);
        let crc = u32::from_le_bytes([fixed[4], fixed[5], fixed[6], fixed[7]]);
        if length == 0 || length > MAX_FRAME_BYTES {
            return self.cut(
                at,
                format!("frame length {length} outside 1..={MAX_FRAME_BYTES}"),
            );
        }
        if u64::from(length) > left - 8 {
            return self.cut(
                at,
                format!(
                    "torn tail: a frame of {length} bytes with {} left",
                    left - 8
                ),
            );
        }
        let mut compressed = vec![0; length as usize];
        if let Err(error) = self.file.read_exact(&mut compressed) {
            return self.cut(at, error.to_string());
        }
        if crc32c::crc32c(&compressed) != crc {
            return self.cut(at, "frame checksum mismatch".into());
        }
        let raw = match decompress(&compressed) {
            Ok(raw) => raw,
            Err(what) => return self.cut(at, what),
        };
        self.offset = at + 8 + u64::from(length);
        self.frame = Bytes::from(raw);
        self.frame_at = at;
        self.in_frame = 0;
    }

    /// Splits the frame's next record off: a batch or a resync, or `None`
    /// for a record that ends the part (then `end` is set). An error names
    /// the bad record (the records before it were handed out).
    fn split_record(&mut self) -> Result<Option<Record>, String> {
        let index = self.in_frame;
        self.in_frame += 1;
        let raw = &mut self.frame;
        if raw.remaining() < 8 {
            return Err(format!("record {index}: torn record header"));
        }
        let length = raw.get_u32_le();
        let crc = raw.get_u32_le();
        if !(RECORD_FIXED_BYTES..=MAX_RECORD_BYTES).contains(&length)
            || length as usize > raw.remaining()
        {
            return Err(format!(
                "record {index}: length {length} outside {RECORD_FIXED_BYTES}..={MAX_RECORD_BYTES} \
                 or past the frame's end"
            ));
        }
        let mut body = raw.split_to(length as usize);
        if crc32c::crc32c(&body) != crc {
            return Err(format!("record {index}: checksum mismatch"));
        }
        let received_unix_micros = body.get_u64_le();
        let kind = body.get_u8();
        let entry = match Kind::from_byte(kind) {
            // A copy: a slice would pin the whole decompressed frame
            // (up to 64 MiB) for as long as the batch waits to be played.
            Some(Kind::Batch) => Entry::Batch(Bytes::copy_from_slice(&body)),
            Some(Kind::Resync) => Entry::Resync(String::from_utf8_lossy(&body).into_owned()),
            Some(last @ (Kind::End | Kind::Next)) => {
                if raw.has_remaining() {
                    return Err(format!(
                        "record {} follows the part's last record",
                        index + 1
                    ));
                }
                self.end = Some(if last == Kind::End {
                    PartEnd::End
                } else {
                    PartEnd::Next
                });
                return Ok(None);
            }
            None => return Err(format!("record {index}: unknown kind {kind}")),
        };
        Ok(Some(Record {
            received_unix_micros,
            entry,
        }))
    }
}

/// A frame's records, at most [`MAX_FRAME_RAW_BYTES`] of them.
fn decompress(compressed: &[u8]) -> Result<Vec<u8>, String> {
    let mut decoder = zstd::stream::read::Decoder::with_buffer(compressed)
        .map_err(|error| format!("zstd: {error}"))?;
    decoder
        .window_log_max(WINDOW_LOG_MAX)
        .map_err(|error| format!("zstd: {error}"))?;
    let mut raw = Vec::new();
    decoder
        .take(MAX_FRAME_RAW_BYTES + 1)
        .read_to_end(&mut raw)
        .map_err(|error| format!("frame does not decompress: {error}"))?;
    if raw.len() as u64 > MAX_FRAME_RAW_BYTES {
        return Err(format!(
            "frame decompresses to more than {MAX_FRAME_RAW_BYTES} bytes"
        ));
    }
    Ok(raw)
}

/// A whole recording, part after part: an iterator of its intact records.
pub struct Recording {
    parts: Vec<PathBuf>,
    index: usize,
    reader: PartReader,
    header: Header,
    ending: Option<Ending>,
}

impl Recording {
    /// Opens the recording made of `files` (see [`super::parts`]); part 0
    /// must be readable.
    pub fn open(files: &[PathBuf]) -> Result<Self, OpenError> {
        let parts = super::parts(files);
        let first = parts.first().ok_or(OpenError::NoFile)?;
        let reader = PartReader::open(first)?;
        Ok(Self {
            header: reader.header.clone(),
            parts,
            index: 0,
            reader,
            ending: None,
        })
    }

    /// Part 0's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// How the reading ended, once the iterator returned `None`.
    pub fn ending(&self) -> Option<&Ending> {
        self.ending.as_ref()
    }

    fn next_part(&mut self) -> Result<(), Ending> {
        let here = |what: String| Ending::Cut {
            path: self.reader.path.clone(),
            offset: self.reader.offset,
            what,
        };
        let Some(expected) = self.reader.header.part.checked_add(1) else {
            return Err(here(format!(
                "part {} says the recording goes on, past the last part number",
                u32::MAX
            )));
        };
        let Some(path) = self.parts.get(self.index + 1) else {
            return Err(here(format!(
                "the part says the recording goes on in {}, which is missing",
                super::part_path(&self.parts[0], expected).display()
            )));
        };
        let cut = |what: String| Ending::Cut {
            path: path.display().to_string(),
            offset: 0,
            what,
        };
        let reader = PartReader::open(path).map_err(|error| cut(error.to_string()))?;
        if reader.header.part != expected {
            return Err(cut(format!(
                "part {} where part {expected} was expected",
                reader.header.part
            )));
        }
        self.index += 1;
        self.reader = reader;
        Ok(())
    }
}

impl Iterator for Recording {
    type Item = Record;

    fn next(&mut self) -> Option<Record> {
        loop {
            if self.ending.is_some() {
                return None;
            }
            if let Some(record) = self.reader.next_record() {
                return Some(record);
            }
            // `next_record` returns `None` only once the part's end is set.
            self.ending = match self.reader.end.take().unwrap_or(PartEnd::End) {
                PartEnd::Next => self.next_part().err(),
                PartEnd::End => Some(Ending::Closed),
                PartEnd::Over(ending) => Some(ending),
            };
        }
    }
}
