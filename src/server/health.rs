//! The gRPC health service follows the gateway's health.
//!
//! Invariant: every served name (the overall "" and each `SubscribeKvEvents`
//! service) reports SERVING exactly while [`Health::is_serving`] holds, from
//! before the first request is answered until the server ends.

use std::convert::Infallible;
use std::future::Future;

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use super::SUBSCRIBE_SERVICES;
use crate::health::{Health, HealthWatch};

/// Sets every service's status from `health` now; the returned future keeps
/// them following it for as long as it is polled.
pub(crate) async fn follow(
    reporter: HealthReporter,
    mut health: HealthWatch,
) -> impl Future<Output = Infallible> {
    let mut reported = status(&health.now());
    set_all(&reporter, reported).await;
    async move {
        loop {
            health.changed().await;
            let now = status(&health.now());
            if now != reported {
                set_all(&reporter, now).await;
                reported = now;
            }
        }
    }
}

fn status(health: &Health) -> ServingStatus {
    if health.is_serving() {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

async fn set_all(reporter: &HealthReporter, status: ServingStatus) {
    for name in std::iter::once("").chain(SUBSCRIBE_SERVICES) {
        reporter.set_service_status(name, status).await;
    }
}
