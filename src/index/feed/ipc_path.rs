//! What is at an `ipc://` worker's socket path while its feed is not
//! connected: the reason `/workers` gives.
//!
//! A TCP dial that fails says little more than "refused"; a path says
//! exactly what is wrong: nothing there yet (the engine has not bound it),
//! something that is not a socket, a socket nobody accepts on, or a path
//! kvgate may not reach. Invariant: looking never blocks the feed's task
//! (the file system is asked on tokio's blocking pool, and the feed waits
//! for the answer beside its events, so a hung mount delays only the
//! reason) and changes nothing at the path; the socket goes on redialling
//! whatever it finds.

use std::fmt;
use std::io;
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};

/// What a look at the path found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AtPath {
    /// No file at the path (the engine has not bound it, or removed it).
    Nothing(PathBuf),
    /// A file that is not a socket, e.g. `"a regular file"`.
    NotASocket(PathBuf, &'static str),
    /// A socket, with no ZMQ publisher answering on it yet.
    Socket(PathBuf),
    /// The path cannot be looked at (permissions, a bad component).
    Unreachable(PathBuf, io::ErrorKind),
}

impl AtPath {
    /// Looks at `path`, following symbolic links as a dial does.
    pub async fn look(path: &Path) -> Self {
        let path = path.to_owned();
        match tokio::fs::metadata(&path).await {
            Ok(metadata) if metadata.file_type().is_socket() => Self::Socket(path),
            Ok(metadata) => Self::NotASocket(path, kind_of(metadata.file_type())),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Self::Nothing(path),
            Err(error) => Self::Unreachable(path, error.kind()),
        }
    }
}

/// What a file that is not a socket is, for the reason.
fn kind_of(file_type: std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_file() {
        "a regular file"
    } else {
        "a device"
    }
}

impl fmt::Display for AtPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Nothing(path) => write!(
                f,
                "no socket at {} (the engine has not bound it yet)",
                path.display()
            ),
            Self::NotASocket(path, kind) => write!(
                f,
                "{} is {kind}, not a socket (an engine binding the path replaces it)",
                path.display()
            ),
            Self::Socket(path) => write!(
                f,
                "a socket is at {} but no ZMQ publisher answers on it",
                path.display()
            ),
            Self::Unreachable(path, kind) => {
                write!(f, "cannot look at {}: {kind}", path.display())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_kind_of_path_is_told_apart() {
        let dir = std::env::temp_dir().join(format!("kvgate-at-path-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.sock");
        assert_eq!(AtPath::look(&missing).await, AtPath::Nothing(missing));
        let file = dir.join("file.sock");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(
            AtPath::look(&file).await,
            AtPath::NotASocket(file, "a regular file")
        );
        let socket = dir.join("bound.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        assert_eq!(AtPath::look(&socket).await, AtPath::Socket(socket));
        assert_eq!(
            AtPath::look(&dir).await,
            AtPath::NotASocket(dir.clone(), "a directory")
        );
        let under_a_file = dir.join("file.sock").join("x.sock");
        assert!(matches!(
            AtPath::look(&under_a_file).await,
            AtPath::Unreachable(_, io::ErrorKind::NotADirectory)
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
