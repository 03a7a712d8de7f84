//! The gRPC health service follows the gateway's health.
//!
//! Invariant: every served name (the overall "" and each `SubscribeKvEvents`
//! service) reports SERVING exactly while [`Health::is_serving`] holds, from
//! before the first request is answered until the server ends. Once health
//! is final (shutting down or failed), open `Watch` streams get NOT_SERVING
//! and then end, so a health watcher never holds a shutdown up.

use std::convert::Infallible;
use std::future::Future;

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use super::SUBSCRIBE_SERVICES;
use crate::health::{Health, HealthWatch};

/// Sets every service's status from `health` now; the returned future keeps
/// them following it for as long as it is polled.
pub(crate) async fn follow(
    mut reporter: HealthReporter,
    mut health: HealthWatch,
) -> impl Future<Output = Infallible> {
    let mut reported = status(&health.now());
    set_all(&reporter, reported).await;
    async move {
        loop {
            let now = health.now();
            if status(&now) != reported {
                reported = status(&now);
                set_all(&reporter, reported).await;
            }
            if now.is_final() {
                // Watchers still get the last status before their stream ends.
                for name in served_names() {
                    reporter.clear_service_status(name).await;
                }
                return std::future::pending().await;
            }
            health.changed().await;
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

fn served_names() -> impl Iterator<Item = &'static str> {
    std::iter::once("").chain(SUBSCRIBE_SERVICES)
}

async fn set_all(reporter: &HealthReporter, status: ServingStatus) {
    for name in served_names() {
        reporter.set_service_status(name, status).await;
    }
}
