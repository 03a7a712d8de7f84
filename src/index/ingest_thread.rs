//! The index's ingest (every worker's feed and the one writer) on a thread
//! of its own, below the queries' threads in the kernel's priority.
//!
//! Invariant: a query that becomes ready is run before ingest on a busy
//! core: the thread runs at nice [`INGEST_NICENESS`], so the kernel
//! preempts it for a query's thread, and tokio never queues a query behind
//! a feed or the writer (they are on another runtime). The writer's lock
//! stays bounded by one step: a query that finds it held sleeps, and the
//! ingest thread then has the core to finish the step.

use std::sync::mpsc;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// How much lower the ingest thread's priority is: a weight a tenth of a
/// query thread's.
pub const INGEST_NICENESS: i32 = 10;

/// The ingest thread; it stops when this is dropped.
pub struct IngestThread {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl IngestThread {
    /// Starts the thread and its runtime.
    pub fn start() -> std::io::Result<Self> {
        let (handle_tx, handle_rx) = mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kvgate-ingest".to_owned())
            .spawn(move || {
                lower_priority();
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(error) => {
                        let _ = handle_tx.send(Err(error));
                        return;
                    }
                };
                let _ = handle_tx.send(Ok(runtime.handle().clone()));
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        let handle = handle_rx
            .recv()
            .map_err(|_| std::io::Error::other("the ingest thread ended at start"))??;
        Ok(IngestThread {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Where ingest tasks are spawned.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }
}

impl Drop for IngestThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Lowers the calling thread's priority (on Linux, nice is a thread's).
fn lower_priority() {
    // SAFETY: setpriority and gettid take plain integers and touch no memory.
    let result = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::gettid() as libc::id_t,
            INGEST_NICENESS,
        )
    };
    if result != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "the index's ingest thread runs at the queries' priority"
        );
    }
}
