//! One owner per state directory: an advisory lock on `DIR/lock`.
//!
//! Invariant: while a [`DirLock`] lives, no other kvgate process holds the
//! directory; the kernel drops the lock on any exit, so a killed process
//! never leaves it held. The holder writes its pid into the file so the
//! refused process can name it.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

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

/// The held lock; released when dropped or when the process ends.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// The lock file's name in the directory.
pub const LOCK_FILE: &str = "lock";

impl DirLock {
    /// Takes `dir`'s lock without waiting and writes this process's pid.
    pub fn take(dir: &Path) -> Result<Self, LockError> {
        let path = dir.join(LOCK_FILE);
        let io = |error| LockError::Io {
            path: path.clone(),
            error,
        };
        if std::fs::symlink_metadata(&path).is_ok_and(|metadata| !metadata.is_file()) {
            let kept = super::files::damaged_path(&path, super::format::Damage::NotAFile);
            tracing::warn!(file = %path.display(), kept = %kept.display(), "the lock file is not a file: set aside");
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
        Ok(Self { _file: file })
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
    fn a_directory_where_the_lock_file_belongs_is_set_aside() {
        let dir = std::env::temp_dir().join(format!("continuity-lock-dir-{}", std::process::id()));
        std::fs::create_dir_all(dir.join(LOCK_FILE)).unwrap();
        DirLock::take(&dir).expect("locked once the directory is aside");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
