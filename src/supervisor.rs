//! One supervised tree of the gateway's long-lived tasks.
//!
//! Invariant: every long-lived task is spawned here under its name, and none
//! of them may end while the gateway is meant to run. A task that ends before
//! shutdown began, returns an error or panics is a failure: it is logged with
//! the task's name and why, the lifecycle turns [`Lifecycle::Failed`] (health
//! then reports NOT_SERVING) and shutdown begins, so the process exits
//! non-zero and the orchestrator restarts it instead of keeping a gateway
//! that reports SERVING while nothing flows. Only the first failure is kept:
//! the tasks that end because of it are logged, not reported.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};

use futures::FutureExt as _;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, warn};

/// Every long-lived task of the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskName {
    /// The ZMQ SUB socket of one data-parallel rank.
    SourceRank(u32),
    /// The subscription to an upstream `SubscribeKvEvents` server.
    Upstream,
    /// A recording played as the source (`--replay-file`).
    RecordingReplay,
    /// A trace played through a simulated prefix cache (`--trace-file`).
    TraceReplay,
    Drain,
    GrpcServer,
    AdminServer,
    /// The simulated engine of `--demo`.
    DemoEngine,
    /// The engine's `GetLoads` poller.
    LoadPoller,
    /// The engine's load publisher socket of one data-parallel rank.
    LoadPush(u32),
    /// Re-reads certificates and tokens on SIGHUP (and when they change).
    CredentialReloader,
    /// Asks the engine where it publishes (`--engine-http`, `--engine-grpc`).
    EngineDiscovery,
    /// The engine's own prefix index's one writer (`--index`).
    IndexWriter,
    /// The engine's own prefix index's feed from the hub (`--index`).
    IndexFeed,
}

impl fmt::Display for TaskName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SourceRank(rank) => write!(f, "ZMQ source of rank {rank}"),
            Self::Upstream => f.write_str("upstream source"),
            Self::RecordingReplay => f.write_str("recording replay"),
            Self::TraceReplay => f.write_str("trace replay"),
            Self::Drain => f.write_str("drain"),
            Self::GrpcServer => f.write_str("gRPC server"),
            Self::AdminServer => f.write_str("admin HTTP server"),
            Self::DemoEngine => f.write_str("demo engine"),
            Self::LoadPoller => f.write_str("load poller"),
            Self::LoadPush(rank) => write!(f, "load publisher socket of rank {rank}"),
            Self::CredentialReloader => f.write_str("credential reloader"),
            Self::EngineDiscovery => f.write_str("engine discovery"),
            Self::IndexWriter => f.write_str("index writer"),
            Self::IndexFeed => f.write_str("index feed"),
        }
    }
}

/// How a task ended when it should not have.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UnexpectedEnd {
    #[error("ended while the gateway was running")]
    Returned,
    #[error("failed: {0}")]
    Failed(String),
    #[error("panicked: {0}")]
    Panicked(String),
}

/// The task that brought the gateway down, and how.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the {task} {end}")]
pub struct TaskFailure {
    pub task: TaskName,
    pub end: UnexpectedEnd,
}

/// Where the gateway is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    Running,
    /// Shutdown was asked for; tasks may end.
    Stopping,
    /// A task failed; every other task is stopping.
    Failed(Arc<TaskFailure>),
}

/// Spawns and watches the gateway's tasks; cheap to clone.
#[derive(Clone)]
pub struct Supervisor {
    tracker: TaskTracker,
    /// Cancelled once shutdown begins, asked for or after a failure.
    stopping: CancellationToken,
    lifecycle: watch::Sender<Lifecycle>,
    /// Names of the tasks not ended yet, for the record of a slow shutdown.
    running: Arc<Mutex<Vec<TaskName>>>,
    /// Debug builds only: a task name to make panic (see [`Self::inject_panic`]).
    #[cfg(debug_assertions)]
    fault: watch::Sender<Option<TaskName>>,
}

impl Default for Supervisor {
    fn default() -> Self {
        Self::new()
    }
}

impl Supervisor {
    pub fn new() -> Self {
        Self {
            tracker: TaskTracker::new(),
            stopping: CancellationToken::new(),
            lifecycle: watch::Sender::new(Lifecycle::Running),
            running: Arc::default(),
            #[cfg(debug_assertions)]
            fault: watch::Sender::new(None),
        }
    }

    /// Runs `task` as `name` until shutdown; it should watch
    /// [`Self::stopping`] (or end when its input does).
    pub fn spawn<F>(&self, name: TaskName, task: F)
    where
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        #[cfg(debug_assertions)]
        let task = self.with_fault(name, task);
        let supervisor = self.clone();
        self.running_names().push(name);
        // A combinator, not an async block: a block would keep `task` as
        // its capture beside the copy it awaits, twice the task's size for
        // as long as it runs (a rank's socket task is kilobytes).
        let watched = AssertUnwindSafe(task).catch_unwind().map(move |ended| {
            let mut running = supervisor.running_names();
            if let Some(index) = running.iter().position(|running| *running == name) {
                running.swap_remove(index);
            }
            drop(running);
            let end = match ended {
                Ok(Ok(())) if supervisor.stopping.is_cancelled() => return,
                Ok(Ok(())) => UnexpectedEnd::Returned,
                Ok(Err(error)) => UnexpectedEnd::Failed(format!("{error:#}")),
                Err(panic) => UnexpectedEnd::Panicked(panic_message(panic.as_ref())),
            };
            supervisor.fail(TaskFailure { task: name, end });
        });
        self.tracker.spawn(watched);
    }

    /// Cancelled once shutdown begins.
    pub fn stopping(&self) -> CancellationToken {
        self.stopping.clone()
    }

    pub fn lifecycle(&self) -> watch::Receiver<Lifecycle> {
        self.lifecycle.subscribe()
    }

    /// Begins an orderly shutdown (a failure already began one).
    pub fn stop(&self) {
        self.lifecycle.send_if_modified(|lifecycle| {
            let running = *lifecycle == Lifecycle::Running;
            if running {
                *lifecycle = Lifecycle::Stopping;
            }
            running
        });
        self.stopping.cancel();
    }

    /// Resolves once a task has failed.
    pub async fn failed(&self) -> Arc<TaskFailure> {
        let mut lifecycle = self.lifecycle.subscribe();
        loop {
            if let Lifecycle::Failed(failure) = &*lifecycle.borrow_and_update() {
                return Arc::clone(failure);
            }
            // The sender lives in `self`, so this cannot be closed.
            let _ = lifecycle.changed().await;
        }
    }

    /// The failure that brought the gateway down, if any.
    pub fn failure(&self) -> Option<Arc<TaskFailure>> {
        match &*self.lifecycle.borrow() {
            Lifecycle::Failed(failure) => Some(Arc::clone(failure)),
            Lifecycle::Running | Lifecycle::Stopping => None,
        }
    }

    /// The tasks that have not ended yet.
    pub fn running(&self) -> Vec<TaskName> {
        self.running_names().clone()
    }

    fn running_names(&self) -> std::sync::MutexGuard<'_, Vec<TaskName>> {
        // Only pushes and removals happen under the lock: a panic elsewhere
        // cannot leave the list half-updated.
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until every task spawned so far has ended.
    pub async fn tasks_ended(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Records `failure` and stops the gateway. The first failure is the one
    /// reported, unless it is a task that merely ended: a task ends when its
    /// neighbour dies (the source when the drain's input is gone), and may
    /// notice before the neighbour's panic or error is recorded, so a later
    /// panic or error is the cause and replaces it.
    fn fail(&self, failure: TaskFailure) {
        let cause = self.lifecycle.send_if_modified(|lifecycle| {
            let cause = match lifecycle {
                Lifecycle::Failed(earlier) => {
                    earlier.end == UnexpectedEnd::Returned && failure.end != UnexpectedEnd::Returned
                }
                Lifecycle::Running | Lifecycle::Stopping => true,
            };
            if cause {
                *lifecycle = Lifecycle::Failed(Arc::new(failure.clone()));
            }
            cause
        });
        if cause {
            error!(task = %failure.task, reason = %failure.end, "a task failed; stopping the gateway");
        } else {
            warn!(task = %failure.task, reason = %failure.end, "a task failed after an earlier failure");
        }
        self.stopping.cancel();
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(message) = panic.downcast_ref::<&str>() {
        (*message).to_owned()
    } else if let Some(message) = panic.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// Fault injection for tests, compiled into debug builds only: the release
/// binary has neither the hook nor the extra `select!` per task.
#[cfg(debug_assertions)]
impl Supervisor {
    /// Makes the running task `name` panic where it stands, as a bug in it
    /// would: its future is dropped by the unwinding, with everything it owns.
    /// The end-to-end tests reach it through `KVGATE_DEBUG_PANIC_TASK=drain`.
    pub(crate) fn inject_panic(&self, name: TaskName) {
        self.fault.send_replace(Some(name));
    }

    fn with_fault<F>(
        &self,
        name: TaskName,
        task: F,
    ) -> impl Future<Output = anyhow::Result<()>> + Send + 'static
    where
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let mut fault = self.fault.subscribe();
        async move {
            tokio::select! {
                result = task => result,
                Ok(_) = fault.wait_for(|fault| *fault == Some(name)) => {
                    panic!("a fault injected by a test")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn failure_of(
        task: impl Future<Output = anyhow::Result<()>> + Send + 'static,
    ) -> TaskFailure {
        let supervisor = Supervisor::new();
        let stopping = supervisor.stopping();
        supervisor.spawn(TaskName::GrpcServer, async move {
            stopping.cancelled().await;
            Ok(())
        });
        supervisor.spawn(TaskName::Drain, task);
        let failure = supervisor.failed().await;
        assert!(
            supervisor.stopping().is_cancelled(),
            "a failure begins shutdown"
        );
        supervisor.tasks_ended().await;
        assert_eq!(supervisor.failure().as_deref(), Some(&*failure));
        Arc::unwrap_or_clone(failure)
    }

    #[tokio::test]
    async fn a_task_that_panics_fails_the_gateway_naming_the_task_and_the_panic() {
        let failure = failure_of(async {
            tokio::task::yield_now().await;
            panic!("index out of bounds")
        })
        .await;
        assert_eq!(failure.task, TaskName::Drain);
        assert_eq!(
            failure.end,
            UnexpectedEnd::Panicked("index out of bounds".into())
        );
        assert_eq!(
            failure.to_string(),
            "the drain panicked: index out of bounds"
        );
    }

    #[tokio::test]
    async fn a_task_that_returns_an_error_fails_the_gateway_with_the_whole_error_chain() {
        let failure = failure_of(async {
            Err(anyhow::anyhow!("connection reset").context("cannot read the engine socket"))
        })
        .await;
        assert_eq!(
            failure.end,
            UnexpectedEnd::Failed("cannot read the engine socket: connection reset".into())
        );
    }

    #[tokio::test]
    async fn a_task_that_ends_while_the_gateway_runs_fails_it() {
        let failure = failure_of(async { Ok(()) }).await;
        assert_eq!(failure.end, UnexpectedEnd::Returned);
    }

    #[tokio::test]
    async fn tasks_that_end_after_shutdown_began_are_no_failure() {
        let supervisor = Supervisor::new();
        for rank in 0..3 {
            let stopping = supervisor.stopping();
            supervisor.spawn(TaskName::SourceRank(rank), async move {
                stopping.cancelled().await;
                Ok(())
            });
        }
        assert_eq!(supervisor.running().len(), 3);
        supervisor.stop();
        supervisor.tasks_ended().await;
        assert_eq!(supervisor.running(), []);
        assert_eq!(*supervisor.lifecycle().borrow(), Lifecycle::Stopping);
        assert_eq!(supervisor.failure(), None);
    }

    #[tokio::test]
    async fn only_the_first_failure_is_reported() {
        let supervisor = Supervisor::new();
        supervisor.spawn(TaskName::SourceRank(0), async { anyhow::bail!("first") });
        supervisor.failed().await;
        supervisor.spawn(TaskName::Drain, async { anyhow::bail!("second") });
        supervisor.tasks_ended().await;
        let failure = supervisor.failure().expect("failed");
        assert_eq!(failure.task, TaskName::SourceRank(0));
    }

    #[tokio::test]
    async fn a_panic_after_a_task_merely_ended_is_reported_as_the_cause() {
        let supervisor = Supervisor::new();
        supervisor.spawn(TaskName::SourceRank(0), async { Ok(()) });
        supervisor.failed().await;
        supervisor.spawn(TaskName::Drain, async { panic!("the cause") });
        supervisor.tasks_ended().await;
        let failure = supervisor.failure().expect("failed");
        assert_eq!(failure.task, TaskName::Drain);
        assert_eq!(failure.end, UnexpectedEnd::Panicked("the cause".into()));
    }
}
