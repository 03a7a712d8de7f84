//! `SubscribeKvEvents`, served from the hub under every service name.
//!
//! The call is admitted or refused before any message: a cursor that cannot
//! be honoured fails with OUT_OF_RANGE. Afterwards the stream only ever
//! carries bytes the drain encoded (framed once by the hub, see
//! `stream_body`), ends with DATA_LOSS if the subscriber fell behind the
//! history, and ends cleanly when kvgate shuts down. The request is read
//! with tonic's decoder and refused as tonic's server would refuse it.

use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use tokio::sync::Semaphore;
use tonic::Status;
use tonic::body::Body;
use tonic::codec::Streaming;
use tonic::metadata::{GRPC_CONTENT_TYPE, MetadataValue};
use tonic_prost::ProstDecoder;
use tracing::{debug, error, info};

use super::request_limit::LimitedRequest;
use super::stream_body::{Connected, SnapshotChunks, SubscribeBody};
use crate::clock::unix_now;
use crate::hub::HubReader;
use crate::hub::subscription::Subscription;
use crate::metrics::Metrics;
use crate::proto::common::SubscribeKvEventsRequest;
use crate::state::snapshot::SnapshotEncoder;

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

    async fn open(self, request: SubscribeKvEventsRequest) -> Result<SubscribeBody, Status> {
        let cursor = request.start_sequence_number;
        let early_load_records = request.load_records_before_first_batch;
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
            return Ok(SubscribeBody::new(None, subscription, connected));
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
            return Ok(SubscribeBody::new(None, subscription, connected));
        }
        self.metrics.snapshots_served.inc();
        let cut = Arc::new(cut);
        let timestamp = unix_now();
        let chunks = lazily_encoded(
            move || SnapshotEncoder::plan(cut, timestamp),
            self.encode_slots,
        );
        Ok(SubscribeBody::new(Some(chunks), subscription, connected))
    }
}

impl tower::Service<http::Request<Body>> for SubscribeService {
    type Response = http::Response<SubscribeBody>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let service = self.clone();
        let request = request.map(|body| Body::new(LimitedRequest::new(body, MAX_REQUEST_BYTES)));
        Box::pin(async move {
            let opened = match read_request(request).await {
                Ok(request) => service.open(request).await,
                Err(refusal) => Err(refusal),
            };
            Ok(match opened {
                Ok(body) => {
                    let mut response = http::Response::new(body);
                    response
                        .headers_mut()
                        .insert(http::header::CONTENT_TYPE, GRPC_CONTENT_TYPE);
                    response
                }
                Err(refusal) => refusal.into_http(),
            })
        })
    }
}

/// The call's one request message, read as tonic's server reads a unary
/// request (to its end: its trailers too).
async fn read_request<B>(request: http::Request<B>) -> Result<SubscribeKvEventsRequest, Status>
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError>,
{
    refuse_compressed(request.headers())?;
    let decoder = ProstDecoder::<SubscribeKvEventsRequest>::default();
    let mut messages = Streaming::new_request(decoder, request.into_body(), None, None);
    let message = messages
        .message()
        .await?
        .ok_or_else(|| Status::internal("Missing request message."))?;
    messages.trailers().await?;
    Ok(message)
}

/// kvgate takes no compressed request, and says so as tonic's server does
/// with no compression enabled.
fn refuse_compressed(headers: &http::HeaderMap) -> Result<(), Status> {
    let Some(encoding) = headers.get("grpc-encoding") else {
        return Ok(());
    };
    let encoding = encoding.as_bytes();
    if encoding == b"identity" {
        return Ok(());
    }
    let named = std::str::from_utf8(encoding)
        .map_or_else(|_| Cow::Owned(format!("{encoding:?}")), Cow::Borrowed);
    let mut refusal = Status::unimplemented(format!(
        "Content is compressed with `{named}` which isn't supported"
    ));
    refusal.metadata_mut().insert(
        "grpc-accept-encoding",
        MetadataValue::from_static("identity"),
    );
    Err(refusal)
}

/// The chunks `start` yields, each encoded on a blocking thread while it
/// holds one of `slots`; a chunk is encoded only when the client is ready
/// for it (the stream is polled as the HTTP/2 window allows), and the
/// permit is released when the chunk is encoded, before it waits for its
/// reader. Encoding that panics ends the stream with INTERNAL: an empty or
/// partial snapshot followed by live batches would leave a router with a
/// wrong index.
pub(crate) fn lazily_encoded<Chunks>(
    start: impl FnOnce() -> Chunks + Send + 'static,
    slots: Arc<Semaphore>,
) -> SnapshotChunks
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

#[cfg(test)]
mod tests {
    use std::pin::Pin;

    use futures::FutureExt;
    use http_body::Body as _;
    use prost::Message;
    use tower::Service;

    use super::*;
    use crate::hub::published::frame;
    use crate::hub::{FramedBatch, HistoryLimits, HubWriter, hub};

    fn service() -> (HubWriter, SubscribeService) {
        let (writer, reader) = hub(
            8,
            HistoryLimits {
                batches: 8,
                bytes: 1 << 20,
            },
        );
        let limits = SubscribeLimits {
            subscribers: 4,
            snapshot_encodes: 1,
        };
        (
            writer,
            SubscribeService::new(reader, Metrics::default(), limits),
        )
    }

    async fn call(
        service: &mut SubscribeService,
        request: http::Request<Body>,
    ) -> http::Response<SubscribeBody> {
        let Ok(response) = service.call(request).await;
        response
    }

    fn subscribe(cursor: u64) -> http::Request<Body> {
        let message = SubscribeKvEventsRequest {
            start_sequence_number: cursor,
            ..Default::default()
        };
        let body = axum::body::Body::from(frame(&message.encode_to_vec()));
        http::Request::new(Body::new(body))
    }

    /// The headers of a call refused before any message (tonic's
    /// "trailers-only" answer).
    fn refused(response: &http::Response<SubscribeBody>) -> &http::HeaderMap {
        assert_eq!(response.status(), http::StatusCode::OK);
        assert_eq!(response.headers()["content-type"], "application/grpc");
        assert!(response.body().is_end_stream(), "no message, no trailers");
        response.headers()
    }

    #[tokio::test]
    async fn a_resumed_call_is_answered_as_grpc_then_sends_the_hubs_framed_batches() {
        let (mut writer, mut service) = service();
        writer.publish(0, 40, FramedBatch::new(b"first"));
        let mut response = call(&mut service, subscribe(40)).await;
        assert_eq!(response.headers()["content-type"], "application/grpc");
        assert!(response.headers().get("grpc-status").is_none());
        writer.publish(0, 41, FramedBatch::new(b"second"));
        let mut body = Pin::new(response.body_mut());
        let sent = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx))
            .now_or_never()
            .flatten()
            .unwrap()
            .unwrap();
        assert_eq!(sent.into_data().unwrap(), frame(b"second"));
    }

    #[tokio::test]
    async fn an_unknown_cursor_is_refused_with_out_of_range_before_any_message() {
        let (_writer, mut service) = service();
        let response = call(&mut service, subscribe(7)).await;
        let headers = refused(&response);
        assert_eq!(headers["grpc-status"], "11");
    }

    #[tokio::test]
    async fn a_compressed_request_is_refused_with_unimplemented_as_tonic_refuses_it() {
        let (_writer, mut service) = service();
        let mut request = subscribe(0);
        request
            .headers_mut()
            .insert("grpc-encoding", http::HeaderValue::from_static("gzip"));
        let response = call(&mut service, request).await;
        let headers = refused(&response);
        assert_eq!(headers["grpc-status"], "12");
        assert_eq!(headers["grpc-accept-encoding"], "identity");
        let message = headers["grpc-message"].to_str().unwrap();
        assert!(message.contains("gzip"), "{message}");
    }

    #[tokio::test]
    async fn a_call_without_its_request_message_is_refused_with_internal() {
        let (_writer, mut service) = service();
        let response = call(&mut service, http::Request::new(Body::empty())).await;
        assert_eq!(refused(&response)["grpc-status"], "13");
    }

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
