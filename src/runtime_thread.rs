//! A single-threaded tokio runtime on an OS thread of its own, at a
//! priority of its own: work that must neither be queued behind another
//! runtime's tasks nor queue them (the index's ingest; the load tool's
//! publisher and clients, whose CPU is read per thread).
//!
//! Invariant: the thread's runtime runs until the [`RuntimeThread`] is
//! dropped; dropping it stops the runtime (cancelling what is left) and
//! waits for the thread.

use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The thread and its runtime.
pub struct RuntimeThread {
    handle: Handle,
    /// The kernel's id of the thread (its `/proc/<pid>/task/<tid>`).
    thread_id: u32,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl RuntimeThread {
    /// Starts thread `name` at nice `niceness` (0: the process's own; a
    /// niceness the kernel refuses is warned about and the thread runs at
    /// the process's).
    pub fn start(name: &str, niceness: i32) -> std::io::Result<Self> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                // SAFETY: gettid takes nothing and touches no memory.
                let thread_id = unsafe { libc::gettid() } as u32;
                if niceness != 0 {
                    set_niceness(thread_id, niceness);
                }
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => {
                        let _ = ready_tx.send(Ok((runtime.handle().clone(), thread_id)));
                        // Spawned tasks run while this blocks; dropping the
                        // runtime afterwards cancels whatever is left.
                        runtime.block_on(async {
                            let _ = stopped.await;
                        });
                    }
                    Err(error) => {
                        let _ = ready_tx.send(Err(error));
                    }
                }
            })?;
        let (handle, thread_id) = ready_rx.recv().map_err(|_| {
            std::io::Error::other(format!("the {name} thread ended while starting"))
        })??;
        Ok(RuntimeThread {
            handle,
            thread_id,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Where tasks for the thread are spawned.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// The kernel's id of the thread.
    pub fn thread_id(&self) -> u32 {
        self.thread_id
    }
}

impl Drop for RuntimeThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Sets thread `thread_id`'s nice value (on Linux, nice is a thread's).
fn set_niceness(thread_id: u32, niceness: i32) {
    // SAFETY: setpriority takes plain integers and touches no memory.
    let result =
        unsafe { libc::setpriority(libc::PRIO_PROCESS, thread_id as libc::id_t, niceness) };
    if result != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            niceness,
            "a runtime thread runs at the process's priority"
        );
    }
}
