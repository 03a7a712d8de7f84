//! Open streams per connection, so a connection with none can be closed
//! after the idle timeout.
//!
//! Invariant: a stream counts as open from the moment its request reaches
//! the service until its response body is dropped (finished, reset by the
//! client, or abandoned with the connection), whichever way it ends.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use tokio::sync::watch;

/// The open-stream count of one connection.
#[derive(Clone)]
pub(crate) struct Activity {
    open: Arc<watch::Sender<usize>>,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            open: Arc::new(watch::channel(0).0),
        }
    }
}

impl Activity {
    /// Counts a stream as open until the returned guard is dropped.
    pub(crate) fn stream_opened(&self) -> OpenStream {
        self.open.send_modify(|open| *open += 1);
        OpenStream(Arc::clone(&self.open))
    }

    /// Resolves once no stream has been open for `timeout`.
    pub(crate) async fn idle_for(&self, timeout: Duration) {
        let mut open = self.open.subscribe();
        loop {
            // The sender lives in `self`, so neither wait can fail.
            let _ = open.wait_for(|open| *open == 0).await;
            if tokio::time::timeout(timeout, open.changed()).await.is_err() {
                return;
            }
        }
    }
}

/// Held while a stream is open.
pub(crate) struct OpenStream(Arc<watch::Sender<usize>>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.send_modify(|open| *open -= 1);
    }
}

/// A response body that keeps its stream counted as open.
pub(crate) struct Tracked<B> {
    pub(crate) body: B,
    pub(crate) _stream: OpenStream,
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_after_its_last_stream_ends_and_the_timeout_passes() {
        let activity = Activity::default();
        let stream = activity.stream_opened();
        let timeout = Duration::from_secs(10);
        let idle = tokio::spawn({
            let activity = activity.clone();
            async move { activity.idle_for(timeout).await }
        });
        tokio::time::sleep(timeout * 3).await;
        assert!(!idle.is_finished(), "a stream is open");
        drop(stream);
        tokio::time::sleep(timeout / 2).await;
        assert!(!idle.is_finished(), "not idle for long enough yet");
        tokio::time::sleep(timeout).await;
        tokio::task::yield_now().await;
        assert!(idle.is_finished());
    }
}
