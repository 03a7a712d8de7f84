//! A single-threaded tokio runtime on an OS thread of its own
//! (`kvgate::runtime_thread`).
//!
//! The publisher and the subscribers each get one, so the CPU time of each
//! can be read apart (per thread, from `/proc`), neither delays the other's
//! timing, and together they never take more than two cores from kvgate.

use std::future::Future;

use kvgate::runtime_thread::RuntimeThread;

use super::procfs;

pub struct Worker(RuntimeThread);

impl Worker {
    pub fn start(name: &str) -> anyhow::Result<Self> {
        Ok(Self(RuntimeThread::start(name, 0)?))
    }

    pub fn spawn<F>(&self, future: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.0.handle().spawn(future)
    }

    pub fn cpu_seconds(&self) -> std::io::Result<f64> {
        procfs::thread_cpu_seconds(self.0.thread_id())
    }
}
