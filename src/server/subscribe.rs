//! `SubscribeKvEvents`, served from the hub under every service name.
//!
//! The call is admitted or refused before any message: a cursor that cannot
//! be honoured fails with OUT_OF_RANGE. Afterwards the stream only ever
//! carries bytes the drain encoded, ends with DATA_LOSS if the subscriber fell
//! behind the history, and ends cleanly when kvgate shuts down.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tonic::body::Body;
use tonic::{Request, Response, Status};
use tracing::{debug, info};

use super::codec::PreEncodedCodec;
use crate::drain::unix_now;
use crate::hub::HubReader;
use crate::hub::snapshot::encode_snapshot;
use crate::hub::subscription::{Step, Subscription};
use crate::metrics::{Metrics, SubscriberLabel};
use crate::proto::common::SubscribeKvEventsRequest;

type BatchStream = BoxStream<'static, Result<Bytes, Status>>;

/// The HTTP-level service mounted at `/<service>/SubscribeKvEvents`.
#[derive(Clone)]
pub struct SubscribeService {
    hub: HubReader,
    metrics: Metrics,
}

impl SubscribeService {
    pub fn new(hub: HubReader, metrics: Metrics) -> Self {
        Self { hub, metrics }
    }

    async fn open(
        self,
        request: Request<SubscribeKvEventsRequest>,
    ) -> Result<Response<BatchStream>, Status> {
        let cursor = request.get_ref().start_sequence_number;
        let early_load_records = request.get_ref().load_records_before_first_batch;
        debug!(cursor, "subscriber joined");
        if cursor != 0 {
            let subscription = Subscription::resume(&self.hub, cursor)
                .map_err(|refusal| {
                    info!(cursor, ?refusal, "refused a resume cursor");
                    Status::out_of_range(refusal.describe(cursor))
                })?
                .with_early_load_records(early_load_records);
            return Ok(Response::new(stream(subscription, self.metrics)));
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
            return Ok(Response::new(stream(subscription, self.metrics)));
        }
        self.metrics.snapshots_served.inc();
        // Encoding happens once the response headers are out, off the
        // async workers (a large state takes a while).
        let chunks = futures::stream::once(async move {
            tokio::task::spawn_blocking(move || encode_snapshot(&cut, unix_now()))
                .await
                .unwrap_or_default()
        })
        .flat_map(|chunks| {
            futures::stream::iter(chunks.into_iter().map(|chunk| Ok(chunk.encoded)))
        });
        Ok(Response::new(
            chunks.chain(stream(subscription, self.metrics)).boxed(),
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
        Box::pin(async move {
            let handler = tower::service_fn(move |request| service.clone().open(request));
            let mut grpc =
                tonic::server::Grpc::new(PreEncodedCodec::<SubscribeKvEventsRequest>::default());
            Ok(grpc.server_streaming(handler, request).await)
        })
    }
}

/// Counts a subscriber, and shows its lag, for as long as its stream exists.
struct Connected {
    metrics: Metrics,
    /// Labels the subscriber's lag gauge.
    id: SubscriberLabel,
}

impl Connected {
    fn new(metrics: Metrics) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        metrics.subscribers.inc();
        let id = SubscriberLabel {
            subscriber: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        };
        Self { metrics, id }
    }

    fn lagging(&self, batches: u64) {
        self.metrics
            .subscriber_lag
            .get_or_create(&self.id)
            .set(i64::try_from(batches).unwrap_or(i64::MAX));
    }
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.metrics.subscribers.dec();
        self.metrics.subscriber_lag.remove(&self.id);
    }
}

fn stream(subscription: Subscription, metrics: Metrics) -> BatchStream {
    let connected = Connected::new(metrics);
    futures::stream::unfold(Some((subscription, connected)), |state| async move {
        let (mut subscription, connected) = state?;
        match subscription.next().await {
            Step::Batch(batch) => {
                connected.lagging(subscription.lag());
                Some((Ok(batch.encoded.clone()), Some((subscription, connected))))
            }
            Step::LoadOnly(record) => {
                Some((Ok(record.encoded.clone()), Some((subscription, connected))))
            }
            Step::Lost { position } => {
                connected.metrics.subscribers_lost.inc();
                info!(position, "subscriber fell behind the history");
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
