//! One owner per state directory: an advisory lock on `DIR/lock`, and the
//! directory held by a handle of its own.
//!
//! Invariants: while a [`DirLock`] lives, no other kvgate process holds the
//! directory; the kernel drops the lock on any exit, so a killed process
//! never leaves it held. The holder writes its pid into the file so the
//! refused process can name it. Every file the store creates is created
//! through the held handle (`/proc/self/fd/N/name`), never through DIR's
//! path, and only after DIR and `DIR/lock` are checked to be the very
//! inodes (device and inode number) taken at start (`DirLock::checked`): a
//! directory or lock replaced under a running kvgate (unlinked, recreated,
//! and taken by another process) is never written into; the store pauses
//! and says why.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::announced::DirIdentity;

/// Why the directory cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds it.
    #[error("{dir} is in use by another kvgate process (pid {holder})")]
    Held {
        /// The directory.
        dir: PathBuf,
        /// The pid the holder wrote, as read.
        holder: String,
    },
    /// The lock file cannot be opened or locked.
    #[error("cannot lock {path}: {error}")]
    Io {
        /// The lock file.
        path: PathBuf,
        /// What the system said (in the message, so not the `source`: as
        /// both, `{:#}` printed it twice).
        error: std::io::Error,
    },
}

/// The held lock and directory; released when dropped or when the
/// process ends.
#[derive(Debug)]
pub struct DirLock {
    path: PathBuf,
    _lock: File,
    /// The directory itself, so files are created in it whatever its path
    /// names later.
    _dir: File,
    /// `/proc/self/fd/N` of `_dir`.
    via: PathBuf,
    identity: DirIdentity,
    lock_identity: DirIdentity,
}

fn identity_of(metadata: &std::fs::Metadata) -> DirIdentity {
    DirIdentity {
        dev: metadata.dev(),
        ino: metadata.ino(),
    }
}

/// The lock file's name in the directory.
pub const LOCK_FILE: &str = "lock";

impl DirLock {
    /// Takes `dir`'s lock without waiting and writes this process's pid.
    pub fn take(dir: &Path) -> Result<Self, LockError> {
        let held = File::open(dir).map_err(|error| LockError::Io {
            path: dir.to_owned(),
            error,
        })?;
        let via = PathBuf::from(format!("/proc/self/fd/{}", held.as_raw_fd()));
        let path = via.join(LOCK_FILE);
        let shown = dir.join(LOCK_FILE);
        let io = |error| LockError::Io {
            path: shown.clone(),
            error,
        };
        let identity = identity_of(&held.metadata().map_err(io)?);
        if std::fs::symlink_metadata(&path).is_ok_and(|metadata| !metadata.is_file()) {
            let kept = super::files::damaged_path(&path, super::format::Damage::NotAFile);
            tracing::warn!(file = %shown.display(), "the lock file is not a file: set aside");
            std::fs::rename(&path, &kept).map_err(io)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = (&file).take(32).read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(LockError::Held {
                    dir: dir.to_owned(),
                    holder: if holder.is_empty() {
                        "unknown".into()
                    } else {
                        holder.into()
                    },
                });
            }
            Err(TryLockError::Error(error)) => return Err(io(error)),
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        let lock_identity = identity_of(&file.metadata().map_err(io)?);
        Ok(Self {
            path: dir.to_owned(),
            _lock: file,
            _dir: held,
            via,
            identity,
            lock_identity,
        })
    }

    /// The directory's device and inode.
    pub fn identity(&self) -> DirIdentity {
        self.identity
    }

    /// The held directory, unchecked: for reading (listing, sizes).
    pub fn held(&self) -> &Path {
        &self.via
    }

    /// The held directory to create a file in, once DIR and `DIR/lock` are
    /// checked to be the ones taken; else why not (the store pauses).
    pub fn checked(&self) -> std::io::Result<&Path> {
        let replaced = |what: String| {
            std::io::Error::other(format!(
                "{what}; this process no longer writes to {}",
                self.path.display()
            ))
        };
        match std::fs::metadata(&self.path) {
            Ok(metadata) if identity_of(&metadata) == self.identity => {}
            Ok(_) => return Err(replaced("the directory was replaced".into())),
            Err(error) => return Err(replaced(format!("the directory is gone ({error})"))),
        }
        match std::fs::symlink_metadata(self.path.join(LOCK_FILE)) {
            Ok(metadata) if identity_of(&metadata) == self.lock_identity => Ok(&self.via),
            Ok(_) => Err(replaced(format!(
                "{LOCK_FILE} was replaced: another process may own the directory"
            ))),
            Err(error) => Err(replaced(format!("{LOCK_FILE} is gone ({error})"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_held_directory_names_the_holder_pid() {
        let dir = std::env::temp_dir().join(format!("continuity-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let held = DirLock::take(&dir).unwrap();
        let refused = DirLock::take(&dir).unwrap_err().to_string();
        assert!(
            refused.contains(&std::process::id().to_string()),
            "{refused}"
        );
        assert!(refused.contains(&dir.display().to_string()), "{refused}");
        drop(held);
        DirLock::take(&dir).expect("free again once dropped");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_replaced_directory_or_lock_is_refused_and_never_written_into() {
        let dir =
            std::env::temp_dir().join(format!("continuity-lock-moved-{}", std::process::id()));
        let moved = dir.with_extension("moved");
        let _ = std::fs::remove_dir_all(&moved);
        std::fs::create_dir_all(&dir).unwrap();
        let held = DirLock::take(&dir).unwrap();
        std::fs::write(held.checked().unwrap().join("file"), b"held").unwrap();
        assert_eq!(std::fs::read(dir.join("file")).unwrap(), b"held");

        std::fs::remove_file(dir.join(LOCK_FILE)).unwrap();
        let other = DirLock::take(&dir).expect("a new lock file is free");
        let refused = held.checked().unwrap_err().to_string();
        assert!(refused.contains("lock was replaced"), "{refused}");
        drop(other);

        std::fs::rename(&dir, &moved).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        let refused = held.checked().unwrap_err().to_string();
        assert!(refused.contains("directory was replaced"), "{refused}");
        assert!(std::fs::read_dir(&dir).unwrap().next().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&moved).unwrap();
    }

    #[test]
    fn a_directory_where_the_lock_file_belongs_is_set_aside() {
        let dir = std::env::temp_dir().join(format!("continuity-lock-dir-{}", std::process::id()));
        std::fs::create_dir_all(dir.join(LOCK_FILE)).unwrap();
        DirLock::take(&dir).expect("locked once the directory is aside");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
