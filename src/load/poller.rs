//! The one `GetLoads` poller: every `--load-poll-ms`, whatever the number of
//! subscribers, and only while some rank's load is not pushed.
//!
//! Invariants: no call while every rank's push is fresh (the board says
//! which ranks are due, and takes an answer only for those); one call in
//! flight at a time; a call that fails or times out
//! is counted and the next comes after a growing pause (up to
//! [`MAX_BACKOFF`]), while the readings already published keep their poll
//! time, so every record stamped from them shows its true, growing age; an
//! engine without `GetLoads` (UNIMPLEMENTED on every service) turns records
//! off for good with one log line.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};
use tracing::{info, warn};

use super::BoardWriter;
use super::answer::{self, Faults};
use super::engine::{EngineKind, EngineLoads, LoadService};
use crate::metrics::Metrics;

/// Longest pause between two polls of an engine that keeps failing.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How one poll ended (the `outcome` label of `kvgate_load_polls_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollOutcome {
    Ok,
    Timeout,
    /// The engine's server could not be reached (or said UNAVAILABLE).
    Unavailable,
    /// The engine serves no `GetLoads`.
    Unimplemented,
    /// Any other error status.
    Error,
}

impl PollOutcome {
    pub const ALL: [Self; 5] = [
        Self::Ok,
        Self::Timeout,
        Self::Unavailable,
        Self::Unimplemented,
        Self::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Timeout => "timeout",
            Self::Unavailable => "unavailable",
            Self::Unimplemented => "unimplemented",
            Self::Error => "error",
        }
    }

    fn of(status: &Status) -> Self {
        match status.code() {
            Code::DeadlineExceeded => Self::Timeout,
            Code::Unavailable => Self::Unavailable,
            // The client's own transport failure (connection refused or
            // reset) comes as UNKNOWN with its cause attached.
            Code::Unknown if std::error::Error::source(status).is_some() => Self::Unavailable,
            Code::Unimplemented => Self::Unimplemented,
            _ => Self::Error,
        }
    }
}

/// What the poller was configured with.
#[derive(Clone, Copy, Debug)]
pub struct PollerConfig {
    pub interval: Duration,
    /// `None`: detect the service by trying each one.
    pub kind: Option<EngineKind>,
}

/// Which service the engine answers `GetLoads` on.
#[derive(Clone, Copy, Debug)]
enum Target {
    Detect,
    Known(LoadService),
}

/// Polls until `stop` is cancelled, writing each answer on `board` for the
/// ranks due for a poll (once polling is off, it only waits for `stop`).
pub async fn run(
    config: PollerConfig,
    engine: EngineLoads,
    board: BoardWriter,
    metrics: Metrics,
    stop: CancellationToken,
) {
    let mut target = match config.kind.map(EngineKind::load_service) {
        None => Target::Detect,
        Some(Some(service)) => Target::Known(service),
        Some(None) => {
            info!("TensorRT-LLM's gRPC service has no GetLoads; not polling it");
            return idle_until(stop).await;
        }
    };
    let mut last_answer: Option<Instant> = None;
    let mut failures: u32 = 0;
    let mut next_poll = Instant::now();
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(next_poll) => {}
            () = stop.cancelled() => return,
        }
        let polled_at = Instant::now();
        if !board.any_due_for_poll(polled_at) {
            next_poll = polled_at + config.interval;
            continue;
        }
        let mut faults = Faults::default();
        let answered = tokio::select! {
            answered = poll(&engine, &mut target, &mut faults) => answered,
            () = stop.cancelled() => return,
        };
        let outcome = answered
            .as_ref()
            .map_or_else(PollOutcome::of, |_| PollOutcome::Ok);
        metrics.count_load_poll(outcome.as_str());
        match answered {
            Ok(loads) => {
                failures = 0;
                last_answer = Some(polled_at);
                let placed = answer::by_rank(loads, board.ranks(), &mut faults);
                board.polled(placed, polled_at);
            }
            Err(status) if outcome == PollOutcome::Unimplemented => {
                let status = crate::connect_error::describe_status(&status);
                warn!(%status, "the engine serves no GetLoads; polling off (without pushed load, routers poll the engine themselves)");
                board.polling_off();
                return idle_until(stop).await;
            }
            Err(status) => {
                failures = failures.saturating_add(1);
                crate::logging::rate_limited("load_poll_failed", || {
                    let status = crate::connect_error::describe_status(&status);
                    warn!(%status, failures, "GetLoads failed; records age until it answers again");
                });
            }
        }
        for fault in faults.iter() {
            metrics.count_load_fault(fault.as_str());
        }
        if !faults.is_empty() {
            crate::logging::rate_limited("load_answer_faults", || {
                warn!(faults = ?faults, "GetLoads answer repaired or partly dropped");
            });
        }
        if let Some(at) = last_answer {
            metrics
                .load_poll_age_seconds
                .set(at.elapsed().as_secs_f64());
        }
        next_poll = polled_at + backoff(config.interval, failures);
    }
}

/// Polling off: the task stays until kvgate stops, like every other task
/// (a supervisor takes a task that ends early for a failure).
async fn idle_until(stop: CancellationToken) {
    stop.cancelled().await;
}

/// The pause before the next poll after `failures` failures in a row.
fn backoff(interval: Duration, failures: u32) -> Duration {
    interval
        .saturating_mul(1 << failures.min(16))
        .min(MAX_BACKOFF.max(interval))
}

/// One poll of the known service, or detection: the services in turn until
/// one answers anything but UNIMPLEMENTED (then it is the engine's).
async fn poll(
    engine: &EngineLoads,
    target: &mut Target,
    faults: &mut Faults,
) -> Result<Vec<answer::RankLoad>, Status> {
    if let Target::Known(service) = *target {
        return engine.get_loads(service, faults).await;
    }
    let mut last = Status::unimplemented("no engine service answered GetLoads");
    for service in LoadService::ALL {
        match engine.get_loads(service, faults).await {
            Err(status) if status.code() == Code::Unimplemented => last = status,
            Err(status) => return Err(status),
            Ok(loads) => {
                info!(
                    service = service.name(),
                    "the engine answers GetLoads; polling it for load records"
                );
                *target = Target::Known(service);
                return Ok(loads);
            }
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_that_cannot_be_reached_counts_as_unavailable_and_its_own_errors_as_errors() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            PollOutcome::of(&Status::from_error(Box::new(refused))),
            PollOutcome::Unavailable
        );
        assert_eq!(
            PollOutcome::of(&Status::unknown("engine bug")),
            PollOutcome::Error
        );
        assert_eq!(
            PollOutcome::of(&Status::internal("engine bug")),
            PollOutcome::Error
        );
        assert_eq!(
            PollOutcome::of(&Status::deadline_exceeded("slow")),
            PollOutcome::Timeout
        );
    }

    #[test]
    fn a_failing_engine_is_polled_less_and_less_often_down_to_the_cap() {
        let interval = Duration::from_millis(100);
        assert_eq!(backoff(interval, 0), interval);
        assert_eq!(backoff(interval, 1), Duration::from_millis(200));
        assert_eq!(backoff(interval, 3), Duration::from_millis(800));
        assert_eq!(backoff(interval, 10), MAX_BACKOFF);
        assert_eq!(backoff(interval, u32::MAX), MAX_BACKOFF);
        let slow = Duration::from_secs(30);
        assert_eq!(backoff(slow, 4), slow, "never faster than the interval");
    }
}
