//! A directory for one test's Unix socket files (`ipc://` endpoints),
//! removed with what is in it however the test ends.

use std::path::PathBuf;

/// The most bytes a Unix socket address holds for a path.
const MAX_SOCKET_PATH_BYTES: usize = 107;

/// The directory (see the module doc).
pub struct SocketDir(PathBuf);

impl SocketDir {
    /// A fresh directory named after `test` and this process.
    pub fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvg-{test}-{}", std::process::id()));
        // Room for a socket's name under it.
        assert!(
            dir.as_os_str().len() + 16 <= MAX_SOCKET_PATH_BYTES,
            "{} leaves no room for socket names within {MAX_SOCKET_PATH_BYTES} bytes: set TMPDIR shorter",
            dir.display()
        );
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        SocketDir(dir)
    }

    /// `ipc://` at `name` in the directory.
    pub fn endpoint(&self, name: &str) -> String {
        format!("ipc://{}", self.path(name).display())
    }

    /// The path of `name` in the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
