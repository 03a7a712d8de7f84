//! A single-threaded tokio runtime on an OS thread of its own.
//!
//! The publisher and the subscribers each get one, so the CPU time of each
//! can be read apart (per thread, from `/proc`), neither delays the other's
//! timing, and together they never take more than two cores from kvgate.

use std::future::Future;
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::procfs;

pub struct Worker {
    handle: Handle,
    thread_id: u32,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    pub fn start(name: &str) -> anyhow::Result<Self> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let started = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(anyhow::Error::from)
                    .and_then(|runtime| Ok((runtime, procfs::current_thread_id()?)));
                match started {
                    Ok((runtime, thread_id)) => {
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
        let (handle, thread_id) = ready_rx
            .recv()
            .map_err(|_| anyhow::anyhow!("the {name} thread died while starting"))??;
        Ok(Self {
            handle,
            thread_id,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn spawn<F>(&self, future: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(future)
    }

    pub fn cpu_seconds(&self) -> std::io::Result<f64> {
        procfs::thread_cpu_seconds(self.thread_id)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
