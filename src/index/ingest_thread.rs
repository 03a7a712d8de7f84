//! The index's ingest (every worker's feed and the one writer) on a thread
//! of its own, below the queries' threads in the kernel's priority.
//!
//! Invariant: tokio never queues a query behind a feed or the writer (they
//! are on another runtime), and on a busy core the kernel gives ingest a
//! tenth of a query thread's share (nice [`INGEST_NICENESS`]). The kernel
//! does not preempt it at once: a query woken on its core may wait out the
//! rest of ingest's slice (up to 0.6 ms seen at fleet scale, BENCHMARKS.md,
//! "The fleet index"). The writer's lock stays bounded by one step: a query
//! that finds it held sleeps, and the ingest thread then has the core to
//! finish the step.

use crate::runtime_thread::RuntimeThread;

/// How much lower the ingest thread's priority is: a weight a tenth of a
/// query thread's.
pub const INGEST_NICENESS: i32 = 10;

/// Starts the ingest thread; it stops when dropped.
pub fn start() -> std::io::Result<RuntimeThread> {
    RuntimeThread::start("kvgate-ingest", INGEST_NICENESS)
}
