//! A connection's HTTP/2 streams, run inside the connection's own task.
//!
//! hyper hands every accepted stream (its service call and response body)
//! to an executor; tokio's would make each a task of its own, so a batch
//! would wake the stream's task, which then wakes the connection's task to
//! write it: two task hand-offs per delivery. This executor queues them for
//! the connection task instead, which polls its streams and then the
//! connection in one poll, so a delivery wakes one task and its write
//! follows at once.
//!
//! Invariants:
//! - A stream is polled only by its connection's task, and only when it
//!   was woken (`FuturesUnordered`).
//! - A stream that panics is dropped (its HTTP/2 stream reset), logged, and
//!   takes neither its connection nor the other streams with it, as a
//!   panicking task of its own would not.
//! - The queue holds at most the streams hyper accepted since the last
//!   poll, which `--http2-max-concurrent-streams` bounds.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc;
use tracing::error;

/// The executor handed to hyper: queues each stream for the connection.
#[derive(Clone)]
pub(crate) struct InConnection(mpsc::UnboundedSender<BoxFuture<'static, ()>>);

impl<F: Future<Output = ()> + Send + 'static> hyper::rt::Executor<F> for InConnection {
    fn execute(&self, stream: F) {
        // The receiver lives as long as the connection that calls this.
        let _ = self.0.send(stream.boxed());
    }
}

/// The connection task's side: the streams it runs.
pub(crate) struct Streams {
    queued: mpsc::UnboundedReceiver<BoxFuture<'static, ()>>,
    running: FuturesUnordered<BoxFuture<'static, ()>>,
}

impl Streams {
    /// An executor for one connection, and the streams it will run.
    pub(crate) fn new() -> (InConnection, Self) {
        let (queue, queued) = mpsc::unbounded_channel();
        let streams = Self {
            queued,
            running: FuturesUnordered::new(),
        };
        (InConnection(queue), streams)
    }

    /// Polls every woken stream (and any newly queued one) until none can
    /// make progress.
    fn poll_streams(&mut self, cx: &mut Context<'_>) {
        while let Poll::Ready(Some(stream)) = self.queued.poll_recv(cx) {
            self.running.push(
                AssertUnwindSafe(stream)
                    .catch_unwind()
                    .map(|ended| {
                        if ended.is_err() {
                            error!("gRPC port: a stream panicked; it was reset");
                        }
                    })
                    .boxed(),
            );
        }
        while let Poll::Ready(Some(())) = self.running.poll_next_unpin(cx) {}
    }

    /// Runs `connection` to its end, and the streams it starts meanwhile.
    pub(crate) async fn drive<C: Future>(&mut self, connection: Pin<&mut C>) -> C::Output {
        let mut connection = connection;
        std::future::poll_fn(|cx| {
            // Streams first: what they send is then written in this poll.
            self.poll_streams(cx);
            connection.as_mut().poll(cx)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::pin::pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use hyper::rt::Executor;
    use tokio::sync::oneshot;

    use super::*;

    #[tokio::test]
    async fn streams_run_in_the_connection_task_and_one_that_panics_takes_no_other_down() {
        let (executor, mut streams) = Streams::new();
        let finished = Arc::new(AtomicUsize::new(0));
        let (release, released) = oneshot::channel::<()>();
        executor.execute(async { panic!("injected stream panic") });
        let waiting = Arc::clone(&finished);
        executor.execute(async move {
            released.await.unwrap();
            waiting.fetch_add(1, Ordering::SeqCst);
        });
        let counted = Arc::clone(&finished);
        // The "connection": it starts one more stream, lets the waiting one
        // go, and ends once both have run, which only the driving task can
        // make happen.
        let connection = pin!(async move {
            let late = Arc::clone(&counted);
            executor.execute(async move {
                late.fetch_add(1, Ordering::SeqCst);
            });
            release.send(()).unwrap();
            std::future::poll_fn(|cx| {
                if counted.load(Ordering::SeqCst) == 2 {
                    Poll::Ready(())
                } else {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            })
            .await;
        });
        streams.drive(connection).await;
        assert_eq!(finished.load(Ordering::SeqCst), 2);
    }
}
