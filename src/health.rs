//! What the gateway reports to probes: gRPC health and the admin `/healthz`.
//!
//! Invariant: health is SERVING only while every task runs, no shutdown has
//! begun and the event source is up. It is computed from the supervisor's
//! lifecycle and the source's readiness each time it is read, so no task of
//! its own can die and leave a stale SERVING behind.

use std::fmt;
use std::sync::Arc;

use tokio::sync::watch;

use crate::supervisor::{Lifecycle, TaskFailure};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Running, but the event source is not connected (yet, or any more).
    WaitingForSource,
    Serving,
    /// Shutting down as asked.
    Stopping,
    /// A task failed: nothing flows and the process is about to exit.
    Failed(Arc<TaskFailure>),
}

impl Health {
    pub fn is_serving(&self) -> bool {
        *self == Self::Serving
    }

    /// Shutting down or failed: health will not change again.
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Stopping | Self::Failed(_))
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WaitingForSource => f.write_str("waiting for the event source"),
            Self::Serving => f.write_str("ok"),
            Self::Stopping => f.write_str("shutting down"),
            Self::Failed(failure) => write!(f, "failed: {failure}"),
        }
    }
}

/// A view of the gateway's health; cheap to clone.
#[derive(Clone)]
pub struct HealthWatch {
    lifecycle: watch::Receiver<Lifecycle>,
    source_ready: watch::Receiver<bool>,
}

impl HealthWatch {
    pub fn new(lifecycle: watch::Receiver<Lifecycle>, source_ready: watch::Receiver<bool>) -> Self {
        Self {
            lifecycle,
            source_ready,
        }
    }

    pub fn now(&self) -> Health {
        match &*self.lifecycle.borrow() {
            Lifecycle::Failed(failure) => Health::Failed(Arc::clone(failure)),
            Lifecycle::Stopping => Health::Stopping,
            Lifecycle::Running if *self.source_ready.borrow() => Health::Serving,
            Lifecycle::Running => Health::WaitingForSource,
        }
    }

    pub fn source_ready(&self) -> bool {
        *self.source_ready.borrow()
    }

    /// Waits until health may have changed; pending forever once nothing
    /// can change it any more.
    pub async fn changed(&mut self) {
        tokio::select! {
            Ok(()) = self.lifecycle.changed() => {}
            Ok(()) = self.source_ready.changed() => {}
            else => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::{Supervisor, TaskName};

    #[tokio::test]
    async fn health_is_serving_only_while_every_task_runs_and_the_source_is_up() {
        let supervisor = Supervisor::new();
        let (ready, source_ready) = watch::channel(false);
        let mut health = HealthWatch::new(supervisor.lifecycle(), source_ready);
        assert_eq!(health.now(), Health::WaitingForSource);

        ready.send_replace(true);
        health.changed().await;
        assert_eq!(health.now(), Health::Serving);

        ready.send_replace(false);
        health.changed().await;
        assert_eq!(
            health.now(),
            Health::WaitingForSource,
            "the source went away"
        );

        ready.send_replace(true);
        supervisor.spawn(TaskName::Drain, async { Ok(()) });
        let failure = supervisor.failed().await;
        assert_eq!(health.now(), Health::Failed(failure));
        assert!(!health.now().is_serving());
        drop(ready);
        assert!(!health.now().is_serving(), "a failure is final");
    }
}
