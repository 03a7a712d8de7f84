//! When a connection last moved a byte, so one that stalls can be closed.
//!
//! Invariant: every read or write that moves at least one byte counts as
//! progress, whichever side stalls (a peer that trickles nothing, or one
//! that stops reading a response); nothing else does.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// The moment of a connection's last progress, shared with its watchdog.
#[derive(Clone)]
pub(crate) struct Progress {
    since: Instant,
    /// Milliseconds from `since` to the last progress.
    last: Arc<AtomicU64>,
}

impl Progress {
    pub(crate) fn new() -> Self {
        Self {
            since: Instant::now(),
            last: Arc::default(),
        }
    }

    fn made(&self) {
        let now = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(now, Ordering::Relaxed);
    }

    /// Resolves once no byte has moved for `timeout`.
    pub(crate) async fn stalled_for(&self, timeout: Duration) {
        loop {
            let last = self.since + Duration::from_millis(self.last.load(Ordering::Relaxed));
            let deadline = last + timeout;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// A byte stream that records its progress.
pub(crate) struct Watched<Io> {
    pub(crate) io: Io,
    pub(crate) progress: Progress,
}

impl<Io: AsyncRead + Unpin> AsyncRead for Watched<Io> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.progress.made();
        }
        read
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Watched<Io> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.progress.made();
        }
        written
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.progress.made();
        }
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_stream_is_stalled_only_once_no_byte_moved_for_the_timeout() {
        let (mut peer, io) = tokio::io::duplex(4);
        let progress = Progress::new();
        let mut watched = Watched {
            io,
            progress: progress.clone(),
        };
        let timeout = Duration::from_secs(10);
        let start = Instant::now();
        tokio::time::advance(Duration::from_secs(6)).await;
        peer.write_all(b"ab").await.unwrap();
        let mut two = [0; 2];
        watched.read_exact(&mut two).await.unwrap();
        tokio::time::advance(Duration::from_secs(6)).await;
        watched.write_all(b"cd").await.unwrap();
        // The peer stops reading: a full pipe moves nothing.
        progress.stalled_for(timeout).await;
        assert_eq!(start.elapsed(), Duration::from_secs(22));
    }
}
