//! The announcement mark: how far the drain has announced, kept in shared
//! memory (`/dev/shm`) beside the state directory rather than in it, so that
//! no fault of the directory's disk (a write that fails, hangs or finds the
//! disk full, a file system shut down or frozen) keeps it from being raised.
//!
//! Invariants: the drain raises the mark (a store into a mapped page: no
//! system call, nothing that can fail or wait) before it announces a
//! position, and a killed process leaves it where it was, since the page
//! belongs to the file, not to the process. A restart continues the old
//! numbering after an unclean stop only when the mark names that numbering
//! and the log holds every position it names (`restore`); a mark that is
//! missing, damaged, of another directory or another boot proves nothing.
//! So the proof that a numbering may go on is written before each
//! announcement, never after a fault: a disk that accepts nothing at all
//! cannot make a restart reuse a number. A mark names the process that
//! keeps it (pid and start time): while that process runs (its lock was
//! taken from under it), it proves nothing, since it may announce more.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;

/// Where the marks live: memory, gone at a reboot (when only a clean
/// shutdown's `synced` record continues a numbering anyway).
const MARK_DIR: &str = "/dev/shm";

const MAGIC: &[u8; 8] = b"KVGMARK\x01";
const MARK_BYTES: usize = 72;
/// The fixed part (magic, directory, seed, boot, owner), checksummed.
const FIXED_BYTES: usize = 48;
const CHECKSUM_AT: usize = 48;
const THROUGH_AT: usize = 56;
const SEQUENCE_AT: usize = 64;

/// The directory a mark belongs to: its device and inode, as the held
/// directory handle has them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirIdentity {
    pub dev: u64,
    pub ino: u64,
}

/// What a mark says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MarkRecord {
    /// The numbering the marked positions were announced under.
    pub seed: u64,
    /// The last position announced.
    pub through: u64,
    /// The highest sequence number announced.
    pub highest_sequence: u64,
    /// The process that keeps it is still running (its lock was taken
    /// from under it): it may announce more than the mark says.
    pub owner_running: bool,
}

/// A process, by pid and start time (so a reused pid is another one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Owner {
    pid: u32,
    started: u64,
}

impl Owner {
    fn this() -> Self {
        let pid = std::process::id();
        Self {
            pid,
            started: started(pid).unwrap_or(0),
        }
    }

    fn running(self) -> bool {
        self.pid != std::process::id() && started(self.pid) == Some(self.started)
    }
}

/// A process's start time, in clock ticks since boot (`/proc/PID/stat`).
fn started(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name, which may hold anything but ends at the
    // last parenthesis: state is the first field, start time the 20th.
    let fields = &stat[stat.rfind(')')? + 1..];
    fields.split_whitespace().nth(19)?.parse().ok()
}

/// Where the announcement mark of the state directory `dir` lives: what
/// to remove beside a state directory that is deleted for good (the mark
/// outlives every process by design).
pub fn mark_of(dir: &std::path::Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(dir)?;
    Ok(path(DirIdentity {
        dev: metadata.dev(),
        ino: metadata.ino(),
    }))
}

fn path(identity: DirIdentity) -> PathBuf {
    PathBuf::from(MARK_DIR).join(format!(
        "kvgate-announced-{}-{}",
        identity.dev, identity.ino
    ))
}

fn fixed(identity: DirIdentity, boot_id: &[u8], seed: u64, owner: Owner) -> [u8; FIXED_BYTES] {
    let mut bytes = [0; FIXED_BYTES];
    bytes[..8].copy_from_slice(MAGIC);
    bytes[8..16].copy_from_slice(&identity.dev.to_le_bytes());
    bytes[16..24].copy_from_slice(&identity.ino.to_le_bytes());
    bytes[24..32].copy_from_slice(&seed.to_le_bytes());
    bytes[32..36].copy_from_slice(&crc32c::crc32c(boot_id).to_le_bytes());
    bytes[36..40].copy_from_slice(&owner.pid.to_le_bytes());
    bytes[40..48].copy_from_slice(&owner.started.to_le_bytes());
    bytes
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// The mark the last process on this directory left, if it verifies: a
/// regular file of this user, of this directory and this boot.
pub fn read(identity: DirIdentity, boot_id: &[u8]) -> Option<MarkRecord> {
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path(identity))
        .ok()?;
    let metadata = file.metadata().ok()?;
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    if !metadata.is_file() || metadata.uid() != euid || metadata.len() != MARK_BYTES as u64 {
        return None;
    }
    let mut bytes = [0; MARK_BYTES];
    file.read_exact(&mut bytes).ok()?;
    let seed = u64_at(&bytes, 24);
    let owner = Owner {
        pid: u32::from_le_bytes(bytes[36..40].try_into().ok()?),
        started: u64_at(&bytes, 40),
    };
    let checksum = u32::from_le_bytes(bytes[CHECKSUM_AT..CHECKSUM_AT + 4].try_into().ok()?);
    let expected = fixed(identity, boot_id, seed, owner);
    (bytes[..FIXED_BYTES] == expected && checksum == crc32c::crc32c(&expected)).then(|| {
        MarkRecord {
            seed,
            through: u64_at(&bytes, THROUGH_AT),
            highest_sequence: u64_at(&bytes, SEQUENCE_AT),
            owner_running: owner.running(),
        }
    })
}

/// Removes the mark of `identity`: a process that cannot keep its own must
/// not leave an older one to vouch for it.
pub fn remove(identity: DirIdentity) {
    let _ = std::fs::remove_file(path(identity));
}

/// This process's mark, mapped: raised before every announcement.
pub struct AnnouncedMark {
    map: MmapMut,
}

impl AnnouncedMark {
    /// Replaces the directory's mark with one for `seed`, announced through
    /// `record.through`. Written whole under a temporary name and renamed,
    /// so a process killed meanwhile leaves the old mark or the new one.
    pub fn create(identity: DirIdentity, boot_id: &[u8], record: MarkRecord) -> io::Result<Self> {
        let target = path(identity);
        let temporary = target.with_extension(format!("tmp-{}", std::process::id()));
        let mut bytes = [0; MARK_BYTES];
        let head = fixed(identity, boot_id, record.seed, Owner::this());
        bytes[..FIXED_BYTES].copy_from_slice(&head);
        bytes[CHECKSUM_AT..CHECKSUM_AT + 4].copy_from_slice(&crc32c::crc32c(&head).to_le_bytes());
        bytes[THROUGH_AT..THROUGH_AT + 8].copy_from_slice(&record.through.to_le_bytes());
        bytes[SEQUENCE_AT..SEQUENCE_AT + 8].copy_from_slice(&record.highest_sequence.to_le_bytes());
        let written = (|| {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&temporary)?;
            // Every page the map will touch exists before it is mapped: a
            // store into it can then never fault for want of room.
            file.write_all(&bytes)?;
            std::fs::rename(&temporary, &target)?;
            Ok::<File, io::Error>(file)
        })();
        let file = written.inspect_err(|_| {
            let _ = std::fs::remove_file(&temporary);
        })?;
        // SAFETY: the file is this process's own in a directory of
        // memory; nothing else maps or truncates it while the process runs
        // (the state directory's lock keeps a second kvgate away).
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(Self { map })
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        let bytes = &self.map[at..at + 8];
        // SAFETY: the map is page-aligned and `at` a multiple of 8, so the
        // word is aligned; it lives as long as `self`, and is only ever
        // accessed through atomics.
        unsafe { &*(bytes.as_ptr().cast::<AtomicU64>()) }
    }

    /// Records that positions through `through` and sequence numbers up to
    /// `sequence` are about to be announced.
    pub fn raise(&self, through: u64, sequence: u64) {
        let highest = self.word(SEQUENCE_AT);
        if sequence > u64::from_le(highest.load(Ordering::Relaxed)) {
            highest.store(sequence.to_le(), Ordering::Release);
        }
        self.word(THROUGH_AT)
            .store(through.to_le(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_reads_back_as_raised_and_only_for_its_directory_and_boot() {
        let identity = DirIdentity {
            dev: u64::MAX - 1,
            ino: u64::from(std::process::id()),
        };
        let record = MarkRecord {
            seed: 1000,
            through: 4,
            highest_sequence: 1003,
            owner_running: false,
        };
        let mark = AnnouncedMark::create(identity, b"boot", record).unwrap();
        assert_eq!(read(identity, b"boot"), Some(record));
        mark.raise(9, 1010);
        drop(mark);
        assert_eq!(
            read(identity, b"boot"),
            Some(MarkRecord {
                seed: 1000,
                through: 9,
                highest_sequence: 1010,
                owner_running: false,
            }),
            "the mark outlives the process's map"
        );
        assert_eq!(read(identity, b"other boot"), None);
        let other = DirIdentity {
            ino: identity.ino + 1,
            ..identity
        };
        assert_eq!(read(other, b"boot"), None);
        remove(identity);
        assert_eq!(read(identity, b"boot"), None);
    }
}
