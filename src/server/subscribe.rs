//! `SubscribeKvEvents`, served from the hub under every service name.
//!
//! The call is admitted or refused before any message: a cursor that cannot
//! be honoured fails with OUT_OF_RANGE. Afterwards the stream only ever
//! carries bytes the drain encoded, ends with DATA_LOSS if the subscriber fell
//! behind the history, and ends cleanly when kvgate shuts down.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::body::Body;
use tonic::{Request, Response, Status};
use tracing::{debug, error, info};

use super::codec::PreEncodedCodec;
use super::request_limit::LimitedRequest;
use crate::clock::unix_now;
use crate::hub::HubReader;
use crate::hub::subscription::{Step, Subscription};
use crate::metrics::Metrics;
use crate::proto::common::SubscribeKvEventsRequest;
use crate::state::snapshot::SnapshotEncoder;

type BatchStream = BoxStream<'static, Result<Bytes, Status>>;

/// Largest `SubscribeKvEventsRequest` accepted: its fields take a few
/// dozen bytes, so anything near this is not a real request.
pub const MAX_REQUEST_BYTES: usize = 4096;

/// How many streams and snapshot encodes may run at once.
#[derive(Clone, Copy, Debug)]
pub struct SubscribeLimits {
    /// `--max-subscribers`: streams open at once.
    pub subscribers: usize,
    /// `--max-snapshot-encodes`: snapshot chunks encoded at once.
    pub snapshot_encodes: usize,
}

/// The HTTP-level service mounted at `/<service>/SubscribeKvEvents`.
#[derive(Clone)]
pub struct SubscribeService {
    hub: HubReader,
    metrics: Metrics,
    limits: SubscribeLimits,
    /// One permit per stream; a stream holds its permit until it ends.
    subscriber_slots: Arc<Semaphore>,
    /// One permit per snapshot chunk being encoded.
    encode_slots: Arc<Semaphore>,
}

impl SubscribeService {
    pub fn new(hub: HubReader, metrics: Metrics, limits: SubscribeLimits) -> Self {
        Self {
            hub,
            metrics,
            limits,
            subscriber_slots: Arc::new(Semaphore::new(limits.subscribers)),
            encode_slots: Arc::new(Semaphore::new(limits.snapshot_encodes)),
        }
    }

    async fn open(
        self,
        request: Request<SubscribeKvEventsRequest>,
    ) -> Result<Response<BatchStream>, Status> {
        let cursor = request.get_ref().start_sequence_number;
        let early_load_records = request.get_ref().load_records_before_first_batch;
        debug!(cursor, "subscriber joined");
        let slot = Arc::clone(&self.subscriber_slots)
            .try_acquire_owned()
            .map_err(|_| {
                self.metrics.subscribers_refused.inc();
                let limit = self.limits.subscribers;
                info!(limit, "refused a subscriber: --max-subscribers reached");
                Status::resource_exhausted(format!(
                    "kvgate already serves {limit} subscribers (--max-subscribers {limit}); retry later"
                ))
            })?;
        let connected = Connected::new(self.metrics.clone(), slot);
        if cursor != 0 {
            let subscription = Subscription::resume(&self.hub, cursor)
                .map_err(|refusal| {
                    info!(cursor, ?refusal, "refused a resume cursor");
                    Status::out_of_range(refusal.describe(cursor))
                })?
                .with_early_load_records(early_load_records);
            return Ok(Response::new(stream(subscription, connected)));
        }
        // Subscribe before the cut so every batch after it reaches us.
        let live = self.hub.subscribe_live();
        let cut = self
            .hub
            .cut()
            .await
            .ok_or_else(|| Status::unavailable("kvgate is shutting down"))?;
        let subscription = Subscription::after_cut(&self.hub, live, cut.position)
            .with_early_load_records(early_load_records);
        if cut.last_sequences.is_empty() {
            // Nothing was ever seen: live only.
            return Ok(Response::new(stream(subscription, connected)));
        }
        self.metrics.snapshots_served.inc();
        let cut = Arc::new(cut);
        let timestamp = unix_now();
        let chunks = lazily_encoded(
            move || SnapshotEncoder::plan(cut, timestamp),
            self.encode_slots,
        );
        Ok(Response::new(
            chunks.chain(stream(subscription, connected)).boxed(),
        ))
    }
}

impl tower::Service<http::Request<Body>> for SubscribeService {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let service = self.clone();
        let request = request.map(|body| Body::new(LimitedRequest::new(body, MAX_REQUEST_BYTES)));
        Box::pin(async move {
            let handler = tower::service_fn(move |request| service.clone().open(request));
            let mut grpc =
                tonic::server::Grpc::new(PreEncodedCodec::<SubscribeKvEventsRequest>::default());
            Ok(grpc.server_streaming(handler, request).await)
        })
    }
}

/// The chunks `start` yields, each encoded on a blocking thread while it
/// holds one of `slots`; a chunk is encoded only when the client is ready
/// for it (the stream is polled as the HTTP/2 window allows), and the
/// permit is released when the chunk is encoded, before it waits for its
/// reader. Encoding that panics ends the stream with INTERNAL: an empty or
/// partial snapshot followed by live batches would leave a router with a
/// wrong index.
fn lazily_encoded<Chunks>(
    start: impl FnOnce() -> Chunks + Send + 'static,
    slots: Arc<Semaphore>,
) -> BatchStream
where
    Chunks: Iterator<Item = Bytes> + Send + 'static,
{
    enum Encoding<Chunks, Start> {
        NotStarted(Start),
        Started(Chunks),
    }
    let first = Encoding::NotStarted(start);
    futures::stream::unfold(Some(first), move |encoding| {
        let slots = Arc::clone(&slots);
        async move {
            let encoding = encoding?;
            // The semaphore is never closed.
            let slot = slots.acquire_owned().await.ok()?;
            let encoded = tokio::task::spawn_blocking(move || {
                // Held by the work, not by the stream: a client that goes
                // away mid-encode must not free the slot while the
                // encoding (and what it holds) goes on.
                let _slot = slot;
                let mut chunks = match encoding {
                    Encoding::NotStarted(start) => start(),
                    Encoding::Started(chunks) => chunks,
                };
                let chunk = chunks.next();
                chunk.map(|chunk| (chunk, chunks))
            })
            .await;
            match encoded {
                Ok(Some((chunk, chunks))) => Some((Ok(chunk), Some(Encoding::Started(chunks)))),
                Ok(None) => None,
                Err(failure) => {
                    error!(%failure, "snapshot encoding failed; ending the stream");
                    let status = Status::internal(
                        "kvgate failed to encode the snapshot; resubscribe with 0",
                    );
                    Some((Err(status), None))
                }
            }
        }
    })
    .boxed()
}

/// Counts a subscriber and holds its `--max-subscribers` slot for as long
/// as its stream exists.
struct Connected {
    metrics: Metrics,
    _slot: OwnedSemaphorePermit,
}

impl Connected {
    fn new(metrics: Metrics, slot: OwnedSemaphorePermit) -> Self {
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

fn stream(subscription: Subscription, connected: Connected) -> BatchStream {
    futures::stream::unfold(Some((subscription, connected)), |state| async move {
        let (mut subscription, connected) = state?;
        match subscription.next().await {
            Step::Batch(batch) => {
                Some((Ok(batch.encoded.clone()), Some((subscription, connected))))
            }
            Step::LoadOnly(record) => {
                Some((Ok(record.encoded.clone()), Some((subscription, connected))))
            }
            Step::Lost { position } => {
                connected.metrics.subscribers_lost.inc();
                info!(
                    position,
                    subscriber = subscription.id(),
                    "subscriber fell behind the history"
                );
                let status = Status::data_loss(
                    "fell behind kvgate's history; resubscribe with 0 for a snapshot",
                );
                Some((Err(status), None))
            }
            Step::Closed => None,
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_snapshot_that_fails_to_encode_ends_the_stream_with_internal() {
        let chunks = lazily_encoded(
            || {
                (0..3).map(|index| {
                    assert!(index < 1, "injected encoding failure");
                    Bytes::from_static(b"chunk")
                })
            },
            Arc::new(Semaphore::new(1)),
        );
        let received: Vec<_> = chunks.collect().await;
        assert_eq!(received.len(), 2, "nothing follows the failure");
        assert_eq!(received[0].as_ref().unwrap(), &Bytes::from_static(b"chunk"));
        let failure = received[1].as_ref().unwrap_err();
        assert_eq!(failure.code(), tonic::Code::Internal);
    }

    #[tokio::test]
    async fn a_chunk_waiting_for_its_reader_holds_no_encode_slot() {
        let slots = Arc::new(Semaphore::new(1));
        let mut stalled = lazily_encoded(
            || std::iter::repeat_n(Bytes::from_static(b"chunk"), 3),
            Arc::clone(&slots),
        );
        assert!(stalled.next().await.is_some());
        // `stalled` is never read again, yet another snapshot encodes.
        let other = lazily_encoded(
            || std::iter::repeat_n(Bytes::from_static(b"other"), 2),
            Arc::clone(&slots),
        );
        assert_eq!(other.collect::<Vec<_>>().await.len(), 2);
        assert_eq!(slots.available_permits(), 1);
    }
}
