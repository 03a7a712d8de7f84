//! The response body of a `SubscribeKvEvents` stream, handing hyper the
//! hub's framed bytes.
//!
//! Invariants:
//! - A batch or `load_only` record reaches hyper as the `Bytes` the hub
//!   framed once for every subscriber: nothing is copied per subscriber,
//!   unless several are ready at once, when they go out as one DATA frame
//!   of up to [`COALESCE_BYTES`] (a copy that saves a write each, as tonic's
//!   encoder did).
//! - The stream ends as tonic's would: trailers with `grpc-status` (and
//!   `grpc-message`), OK when kvgate shuts down, DATA_LOSS when the
//!   subscriber fell behind the history, INTERNAL when its snapshot failed
//!   to encode; nothing follows an error.
//! - The subscriber is counted (and holds its `--max-subscribers` slot)
//!   until its stream ends or its client goes away, whichever is first.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use futures::Stream;
use futures::stream::BoxStream;
use http::HeaderMap;
use http_body::{Body, Frame};
use tokio::sync::OwnedSemaphorePermit;
use tonic::Status;
use tracing::info;

use crate::hub::published::frame;
use crate::hub::subscription::{Step, Subscription};
use crate::metrics::Metrics;

/// Snapshot chunks, each one encoded `KvEventBatch` (not framed yet).
pub(crate) type SnapshotChunks = BoxStream<'static, Result<Bytes, Status>>;

/// The most bytes of ready messages joined into one DATA frame (tonic's
/// own threshold for yielding its buffer).
pub(crate) const COALESCE_BYTES: usize = 32 << 10;

/// Counts a subscriber and holds its `--max-subscribers` slot for as long
/// as its stream exists.
pub(crate) struct Connected {
    metrics: Metrics,
    _slot: OwnedSemaphorePermit,
}

impl Connected {
    pub(crate) fn new(metrics: Metrics, slot: OwnedSemaphorePermit) -> Self {
        metrics.subscribers.inc();
        Self {
            metrics,
            _slot: slot,
        }
    }
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.metrics.subscribers.dec();
    }
}

/// One subscriber's messages: its snapshot's chunks if it asked for one,
/// then its subscription's batches, then the trailers.
pub struct SubscribeBody {
    snapshot: Option<SnapshotChunks>,
    live: Option<(Subscription, Connected)>,
    /// How the stream ends, once known but not sent yet (after the data
    /// gathered with it).
    ending: Option<Status>,
    /// The trailers were sent (or there is nothing to send: a refusal's
    /// status travels in its headers).
    ended: bool,
}

/// The body of a refusal: empty, its status travels in the headers.
impl Default for SubscribeBody {
    fn default() -> Self {
        Self {
            snapshot: None,
            live: None,
            ending: None,
            ended: true,
        }
    }
}

impl SubscribeBody {
    /// `chunks` (if any), then `subscription` until it ends.
    pub(crate) fn new(
        chunks: Option<SnapshotChunks>,
        subscription: Subscription,
        connected: Connected,
    ) -> Self {
        Self {
            snapshot: chunks,
            live: Some((subscription, connected)),
            ending: None,
            ended: false,
        }
    }

    /// The next message of the subscription, framed; `None` once it ended
    /// (`ending` then says how).
    fn poll_live(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let Some((subscription, connected)) = &mut self.live else {
            return Poll::Ready(None);
        };
        let ending = match ready!(subscription.poll_next(cx)) {
            Step::Batch(batch) => return Poll::Ready(Some(batch.framed().clone())),
            Step::LoadOnly(record) => return Poll::Ready(Some(record.framed().clone())),
            Step::Lost { position } => {
                connected.metrics.subscribers_lost.inc();
                info!(
                    position,
                    subscriber = subscription.id(),
                    "subscriber fell behind the history"
                );
                Status::data_loss("fell behind kvgate's history; resubscribe with 0 for a snapshot")
            }
            Step::Closed => Status::ok(""),
        };
        self.end(ending);
        Poll::Ready(None)
    }

    /// The stream ends with `status` after what was already gathered.
    fn end(&mut self, status: Status) {
        self.snapshot = None;
        self.live = None;
        self.ending = Some(status);
    }

    /// `first` and whatever else is ready now, up to `COALESCE_BYTES`.
    fn coalesce(&mut self, first: Bytes, cx: &mut Context<'_>) -> Bytes {
        let mut joined: Option<BytesMut> = None;
        while joined.as_ref().map_or(first.len(), BytesMut::len) < COALESCE_BYTES {
            let Poll::Ready(Some(next)) = self.poll_live(cx) else {
                break;
            };
            joined
                .get_or_insert_with(|| BytesMut::from(&first[..]))
                .extend_from_slice(&next);
        }
        joined.map_or(first, BytesMut::freeze)
    }
}

impl Body for SubscribeBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        if let Some(chunks) = &mut this.snapshot {
            match ready!(Pin::new(chunks).poll_next(cx)) {
                Some(Ok(chunk)) => return Poll::Ready(Some(Ok(Frame::data(frame(&chunk))))),
                Some(Err(status)) => this.end(status),
                None => this.snapshot = None,
            }
        }
        if this.ending.is_none()
            && let Some(first) = ready!(this.poll_live(cx))
        {
            return Poll::Ready(Some(Ok(Frame::data(this.coalesce(first, cx)))));
        }
        this.ended = true;
        let status = this.ending.take().unwrap_or_else(|| Status::ok(""));
        let mut trailers = HeaderMap::new();
        // Only a status whose metadata holds a bad header value fails, and
        // kvgate's statuses carry none.
        let _ = status.add_header(&mut trailers);
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures::{FutureExt, StreamExt};
    use tokio::sync::Semaphore;

    use super::*;
    use crate::hub::{FramedBatch, HistoryLimits, HubReader, HubWriter, hub};

    fn small_hub(batches: usize) -> (HubWriter, HubReader) {
        hub(
            1,
            HistoryLimits {
                batches,
                bytes: 64 << 20,
            },
        )
    }

    /// A body of `chunks` then everything published from now on.
    fn body_from_now(
        reader: &HubReader,
        chunks: Option<SnapshotChunks>,
        metrics: &Metrics,
    ) -> SubscribeBody {
        let live = reader.subscribe_live();
        let subscription = Subscription::after_cut(reader, live, reader.history().newest());
        let slot = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        SubscribeBody::new(chunks, subscription, Connected::new(metrics.clone(), slot))
    }

    /// The body's next frame if it has one ready; `None` while it waits.
    fn ready_frame(body: &mut SubscribeBody) -> Option<Option<Frame<Bytes>>> {
        std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx))
            .now_or_never()
            .map(|frame| frame.map(|frame| frame.unwrap()))
    }

    fn data(body: &mut SubscribeBody) -> Bytes {
        let frame = ready_frame(body)
            .expect("a frame is ready")
            .expect("not ended");
        frame.into_data().expect("a data frame")
    }

    fn trailers(body: &mut SubscribeBody) -> HeaderMap {
        let frame = ready_frame(body)
            .expect("a frame is ready")
            .expect("not ended");
        let trailers = frame.into_trailers().expect("the trailers");
        assert!(matches!(ready_frame(body), Some(None)), "nothing follows");
        assert!(body.is_end_stream());
        trailers
    }

    #[tokio::test]
    async fn a_batch_reaches_hyper_as_the_bytes_the_hub_framed_not_a_copy() {
        let (mut writer, reader) = small_hub(8);
        let metrics = Metrics::default();
        let mut body = body_from_now(&reader, None, &metrics);
        assert!(ready_frame(&mut body).is_none(), "nothing published yet");
        writer.publish(0, 7, FramedBatch::new(b"batch"));
        let sent = data(&mut body);
        let held = reader.published(1).unwrap();
        assert_eq!(&sent, held.framed());
        assert_eq!(sent.as_ptr(), held.framed().as_ptr(), "the same allocation");
        assert_eq!(&sent[5..], b"batch");
    }

    #[tokio::test]
    async fn batches_ready_at_once_leave_in_order_as_one_data_frame() {
        let (mut writer, reader) = small_hub(8);
        let metrics = Metrics::default();
        let mut body = body_from_now(&reader, None, &metrics);
        for sequence in 1..=3 {
            writer.publish(0, sequence, FramedBatch::new(&[sequence as u8; 300]));
        }
        let expected: Vec<u8> = (1..=3)
            .flat_map(|position| reader.published(position).unwrap().framed().to_vec())
            .collect();
        assert_eq!(data(&mut body), expected);
        assert!(ready_frame(&mut body).is_none(), "then it waits");
    }

    #[tokio::test]
    async fn a_closed_hub_ends_the_stream_with_grpc_status_ok_and_frees_the_subscriber() {
        let (mut writer, reader) = small_hub(8);
        let metrics = Metrics::default();
        let mut body = body_from_now(&reader, None, &metrics);
        assert_eq!(metrics.subscribers.get(), 1);
        writer.publish(0, 1, FramedBatch::new(b"last"));
        writer.close();
        // Shutting down, a stream ends at once rather than after its backlog.
        let trailers = trailers(&mut body);
        assert_eq!(trailers["grpc-status"], "0");
        assert!(trailers.get("grpc-message").is_none());
        assert_eq!(metrics.subscribers.get(), 0);
    }

    #[tokio::test]
    async fn a_subscriber_behind_the_history_is_ended_with_data_loss_and_counted() {
        let (mut writer, reader) = small_hub(2);
        let metrics = Metrics::default();
        let mut body = body_from_now(&reader, None, &metrics);
        for sequence in 1..=5 {
            writer.publish(0, sequence, FramedBatch::new(b"batch"));
        }
        let trailers = trailers(&mut body);
        assert_eq!(trailers["grpc-status"], "15");
        let message = trailers["grpc-message"].to_str().unwrap();
        assert!(message.contains("resubscribe%20with%200"), "{message}");
        assert_eq!(metrics.subscribers_lost.get(), 1);
        assert_eq!(metrics.subscribers.get(), 0);
    }

    #[tokio::test]
    async fn a_snapshot_chunk_is_framed_and_a_failed_snapshot_ends_the_stream_before_any_batch() {
        let (mut writer, reader) = small_hub(8);
        let metrics = Metrics::default();
        let chunks = futures::stream::iter([
            Ok(Bytes::from_static(b"chunk")),
            Err(Status::internal("failed")),
        ]);
        let mut body = body_from_now(&reader, Some(chunks.boxed()), &metrics);
        writer.publish(0, 1, FramedBatch::new(b"batch"));
        assert_eq!(data(&mut body), frame(b"chunk"));
        assert_eq!(trailers(&mut body)["grpc-status"], "13");
    }

    #[test]
    fn a_refusal_has_an_empty_body() {
        assert!(SubscribeBody::default().is_end_stream());
        assert!(matches!(
            ready_frame(&mut SubscribeBody::default()),
            Some(None)
        ));
    }
}
