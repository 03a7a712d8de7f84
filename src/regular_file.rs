//! Opening a file the operator named (a credential, a recording and each of
//! its parts, a trace): only a regular file is read, and opening never
//! waits.
//!
//! A FIFO blocks an ordinary `open` until a writer shows up (for ever, at
//! start, with no port bound and SIGTERM not yet handled), and a device
//! such as `/dev/zero` feeds a reader for ever. So the file is opened with
//! `O_NONBLOCK` (a FIFO then opens at once) and never as a controlling
//! terminal, its kind is checked on the opened descriptor (no race with a
//! rename between a check and the open), and `O_NONBLOCK` is cleared before
//! the file is handed over, so reads behave as on any regular file.
//!
//! Invariant: what [`open`] returns is an open regular file in blocking
//! mode; a refusal says what the path is instead.

use std::fmt;
use std::fs::File;
use std::path::Path;

/// What a path that is not a regular file is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotRegular {
    /// A named pipe.
    Fifo,
    /// A directory.
    Directory,
    /// A Unix socket.
    Socket,
    /// A character device (`/dev/zero`, a terminal).
    CharacterDevice,
    /// A block device (a disk).
    BlockDevice,
}

impl fmt::Display for NotRegular {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fifo => "a FIFO",
            Self::Directory => "a directory",
            Self::Socket => "a socket",
            Self::CharacterDevice => "a character device",
            Self::BlockDevice => "a block device",
        })
    }
}

/// Why a file was not opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenRefused {
    /// The system refused the open (missing, no permission, ...).
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The path is something else than a regular file.
    #[error("{0}, not a regular file")]
    NotRegular(NotRegular),
}

/// Opens `path` for reading if it is a regular file, without waiting for
/// whatever it is (module docs).
pub fn open(path: &Path) -> Result<File, OpenRefused> {
    use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        return Err(OpenRefused::NotRegular(if kind.is_fifo() {
            NotRegular::Fifo
        } else if kind.is_dir() {
            NotRegular::Directory
        } else if kind.is_socket() {
            NotRegular::Socket
        } else if kind.is_block_device() {
            NotRegular::BlockDevice
        } else {
            NotRegular::CharacterDevice
        }));
    }
    clear_nonblocking(&file)?;
    Ok(file)
}

/// Puts `file` back in blocking mode.
fn clear_nonblocking(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl reads and sets the flags of a descriptor `file` owns
    // and keeps open for the duration of the calls.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_a_directory_and_a_device_are_refused_without_waiting() {
        let dir = std::env::temp_dir().join(format!("kvgate-regular-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path it is given.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let refused = |path: &Path| match open(path) {
            Err(OpenRefused::NotRegular(kind)) => kind,
            other => panic!("{}: {other:?}", path.display()),
        };
        assert_eq!(refused(&fifo), NotRegular::Fifo);
        assert_eq!(refused(&dir), NotRegular::Directory);
        assert_eq!(refused(Path::new("/dev/zero")), NotRegular::CharacterDevice);
        assert_eq!(
            OpenRefused::NotRegular(NotRegular::Fifo).to_string(),
            "a FIFO, not a regular file"
        );
        let regular = dir.join("regular");
        std::fs::write(&regular, b"kept").unwrap();
        let file = open(&regular).unwrap();
        use std::os::fd::AsRawFd as _;
        // SAFETY: reads the flags of a descriptor `file` keeps open.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0, "handed over in blocking mode");
        assert!(matches!(
            open(&dir.join("missing")),
            Err(OpenRefused::Io(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
