//! The index's ingest (every worker's feed and the one writer) on a thread
//! of its own, below the queries' threads in the kernel's priority.
//!
//! Invariant: a query that becomes ready is run before ingest on a busy
//! core: the thread runs at nice [`INGEST_NICENESS`], so the kernel
//! preempts it for a query's thread, and tokio never queues a query behind
//! a feed or the writer (they are on another runtime). The writer's lock
//! stays bounded by one step: a query that finds it held sleeps, and the
//! ingest thread then has the core to finish the step.

use crate::runtime_thread::RuntimeThread;

/// How much lower the ingest thread's priority is: a weight a tenth of a
/// query thread's.
pub const INGEST_NICENESS: i32 = 10;

/// Starts the ingest thread; it stops when dropped.
pub fn start() -> std::io::Result<RuntimeThread> {
    RuntimeThread::start("kvgate-ingest", INGEST_NICENESS)
}
