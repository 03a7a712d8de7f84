//! The state directory's file names, listing, atomic replacement and
//! setting damaged files aside.
//!
//! Invariants: a file kvgate replaces is written under a temporary name,
//! fsynced, renamed over the old one and the directory fsynced, so a crash
//! leaves the old file or the new one, never a mix. A damaged file is
//! renamed, never deleted, so it can be inspected.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::format::Damage;

/// The `synced` file's name.
pub const SYNCED_FILE: &str = "synced";

/// What a file in the directory is, by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Named {
    /// `segment-<first position>.log`, or `….log.unfinished` as earlier
    /// versions renamed a segment whose write failed (read as a log whose
    /// end proves nothing).
    Segment {
        first_position: u64,
        unfinished: bool,
    },
    /// `checkpoint-<position>.ckpt`.
    Checkpoint { position: u64 },
    /// `synced`.
    Synced,
    /// A temporary file a crash left behind.
    Temporary,
}

const SEGMENT_PREFIX: &str = "segment-";
const SEGMENT_SUFFIX: &str = ".log";
const UNFINISHED_SUFFIX: &str = ".unfinished";
const CHECKPOINT_PREFIX: &str = "checkpoint-";
const CHECKPOINT_SUFFIX: &str = ".ckpt";
const TEMPORARY_SUFFIX: &str = ".tmp";

/// A segment's file name.
pub fn segment_name(first_position: u64) -> String {
    format!("{SEGMENT_PREFIX}{first_position:020}{SEGMENT_SUFFIX}")
}

/// The name a segment took once it was unfinished (as earlier versions
/// marked a segment whose write failed; still read as unproven).
#[cfg(test)]
pub fn unfinished_name(first_position: u64) -> String {
    format!("{}{UNFINISHED_SUFFIX}", segment_name(first_position))
}

/// A checkpoint's file name.
pub fn checkpoint_name(position: u64) -> String {
    format!("{CHECKPOINT_PREFIX}{position:020}{CHECKPOINT_SUFFIX}")
}

fn number(digits: &str) -> Option<u64> {
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// What `name` is, if it is one of kvgate's files.
pub fn classify(name: &str) -> Option<Named> {
    if name == SYNCED_FILE {
        return Some(Named::Synced);
    }
    if name.ends_with(TEMPORARY_SUFFIX) {
        return Some(Named::Temporary);
    }
    if let Some(rest) = name.strip_prefix(SEGMENT_PREFIX) {
        let (rest, unfinished) = match rest.strip_suffix(UNFINISHED_SUFFIX) {
            Some(rest) => (rest, true),
            None => (rest, false),
        };
        let first_position = number(rest.strip_suffix(SEGMENT_SUFFIX)?)?;
        return Some(Named::Segment {
            first_position,
            unfinished,
        });
    }
    let position = number(
        name.strip_prefix(CHECKPOINT_PREFIX)?
            .strip_suffix(CHECKPOINT_SUFFIX)?,
    )?;
    Some(Named::Checkpoint { position })
}

/// One of kvgate's files in the directory.
#[derive(Clone, Debug)]
pub struct Listed {
    pub named: Named,
    pub path: PathBuf,
    /// A regular file (anything else where a file belongs is damage).
    pub is_file: bool,
    pub bytes: u64,
}

/// kvgate's files in `dir`, in name order.
pub fn list(dir: &Path) -> io::Result<Vec<Listed>> {
    let mut listed = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let Some(named) = entry.file_name().to_str().and_then(classify) else {
            continue;
        };
        // Not followed: a symlink where a file belongs is not a file.
        let metadata = match fs::symlink_metadata(entry.path()) {
            Ok(metadata) => metadata,
            // Deleted since it was listed (a checkpoint's clean-up).
            Err(error) if error.kind() == io::ErrorKind::NotFound => continue,
            Err(error) => return Err(error),
        };
        listed.push(Listed {
            named,
            path: entry.path(),
            is_file: metadata.is_file(),
            bytes: metadata.len(),
        });
    }
    listed.sort_by_key(|file| file.named);
    Ok(listed)
}

/// Bytes of kvgate's files in `dir` (damaged ones set aside excluded).
pub fn bytes_on_disk(dir: &Path) -> u64 {
    list(dir)
        .map(|files| files.iter().map(|file| file.bytes).sum())
        .unwrap_or(0)
}

/// Writes `bytes` as `dir/name`, replacing any old file atomically.
pub fn replace(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let temporary = dir.join(format!("{name}{TEMPORARY_SUFFIX}"));
    let mut file = File::create(&temporary)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&temporary, dir.join(name))?;
    sync_dir(dir)
}

/// Makes the directory's entries (new, renamed, removed files) durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The name a damaged file is kept under.
pub fn damaged_path(path: &Path, damage: Damage) -> PathBuf {
    let stamp = crate::clock::unix_micros_now() / 1000;
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(format!(".damaged-{}-{stamp}", damage.as_str()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back_as_what_they_name() {
        assert_eq!(
            classify(&segment_name(42)),
            Some(Named::Segment {
                first_position: 42,
                unfinished: false
            })
        );
        assert_eq!(
            classify(&unfinished_name(42)),
            Some(Named::Segment {
                first_position: 42,
                unfinished: true
            })
        );
        assert_eq!(
            classify(&checkpoint_name(7)),
            Some(Named::Checkpoint { position: 7 })
        );
        assert_eq!(classify("synced"), Some(Named::Synced));
        assert_eq!(classify("synced.tmp"), Some(Named::Temporary));
        for other in [
            "lock",
            "segment-1.log",
            "checkpoint-00000000000000000007.ckpt.damaged-checksum-1",
            "notes.txt",
        ] {
            assert_eq!(classify(other), None, "{other}");
        }
    }
}
