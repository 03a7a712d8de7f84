//! The log writer thread (`kvgate-log`) and the drain's handle on it: the
//! drain hands over each cycle (its batches, already encoded, and the
//! engine publishers' marks) and goes on converting the next payloads
//! while the thread frames and writes it; the thread hands each cycle back
//! once it is in the page cache, and only then does the drain announce it.
//!
//! Invariants: cycles are announced in the order they were handed over,
//! each exactly once. The drain never waits for the disk longer than
//! `--state-io-timeout-ms`: a cycle the writer has not handed back by then
//! (a write, an open that hangs: a frozen file system, a dead network
//! mount, a FIFO where a segment belongs) pauses persistence, and the drain
//! announces that cycle and every later one itself, until the writer has
//! handed back everything it was given (it then resumes with a new segment
//! and a checkpoint). A write that fails pauses persistence too, and the
//! cycle is handed back all the same: a failing or hung disk never stops
//! serving. Whatever is announced is first marked announced
//! (`announced`), so a restart never continues a numbering past a log
//! that lacks it. A writer thread that dies (a panic) takes the drain down
//! with it, through the supervisor, rather than leaving it numbering
//! cycles nobody will announce. At most `LOG_QUEUE` cycles are out at once
//! (`LogThread::is_full`): the drain then takes no engine message until
//! one comes back, so nothing grows while the disk is behind. The batches'
//! bytes are shared (`FramedBatch`), never copied, and a cycle's buffers
//! are reused once the writer is done with it.
//! While cycles come closer together than `SPIN` the thread spins for the
//! next one, so neither side makes a system call per cycle; further apart
//! it parks (an idle sidecar burns no CPU), and the drain unparks it only
//! when it has parked. Each hand-back notifies the drain (`Notify`): a
//! drain waiting for a cycle wakes, a busy one finds the cycle when it next
//! looks and its loop takes one extra turn for the permit left behind.
//! Everything the drain does here returns at once: the checkpoint's cut
//! is queued to the thread like a cycle, and no lock is shared with it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::mpsc::{
    Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError, sync_channel,
};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::announced::AnnouncedMark;
use super::background::Shared;
use super::records::{Marks, RankMark};
use super::writer::StoreWriter;
use crate::hub::FramedBatch;
use crate::metrics::Metrics;
use crate::state::snapshot::SnapshotCut;

/// Cycles handed to the writer and not yet handed back. A write that waits
/// for the ext4 journal (a few ms while an fsync commits) lets the drain
/// convert this many cycles meanwhile; more would only hold announcements
/// back longer, and each cycle out keeps its batches' buffers.
pub const LOG_QUEUE: usize = 16;

/// How long the writer spins for the next cycle before it parks, when the
/// last one came sooner than this. A drain cycle under sustained load is
/// tens of µs and a futex wake-up costs the drain 1–3 µs on a VM; cycles
/// further apart than this park the thread at once.
const SPIN: Duration = Duration::from_micros(50);

/// How long `LogThread::wait_written` polls (yielding its core) before it
/// blocks: a cycle's write into the page cache takes a few µs, less than a
/// futex sleep and wake-up.
const WAIT_SPIN: Duration = Duration::from_micros(200);

/// What the drain says when the writer thread is gone under it.
const WRITER_GONE: &str = "the state directory's log writer thread ended (it panicked)";

/// One drain cycle on its way to the log and back.
#[derive(Clone, Default)]
pub struct LogCycle {
    /// The position the first batch takes.
    pub first_position: u64,
    /// (rank, sequence, framed batch), in position order.
    pub batches: Vec<(u32, u64, FramedBatch)>,
    /// Each engine publisher's mark as of the cycle's end, by rank.
    pub marks: Vec<(u32, RankMark)>,
}

enum Job {
    /// A cycle, and when the drain handed it over.
    Cycle(Arc<LogCycle>, Instant),
    /// A checkpoint's cut, taken with no cycle out.
    Checkpoint(SnapshotCut, Marks),
    /// A clean stop: the last sync records it.
    Close,
}

/// The drain's side of the log writer thread.
pub struct LogThread {
    /// `None` once closed.
    jobs: Option<SyncSender<Job>>,
    /// The writer is parked (or about to): a job needs an unpark.
    parked: Arc<AtomicBool>,
    /// One message per cycle the writer is done with, in order.
    written: Receiver<()>,
    notify: Arc<Notify>,
    shared: Arc<Shared>,
    metrics: Metrics,
    thread: Option<JoinHandle<()>>,
    /// Raised before each announcement; `None` when it could not be made
    /// (then no unclean stop continues the numbering).
    mark: Option<AnnouncedMark>,
    /// How long a cycle may stay with the writer.
    io_timeout: Duration,
    /// Cycles handed over and not yet announced, oldest first, with when
    /// each was handed over.
    pending: VecDeque<(Arc<LogCycle>, Instant)>,
    /// Of `pending`, how many at its front the writer has handed back.
    confirmed: usize,
    /// Cycles the writer has been given and not handed back.
    with_writer: usize,
    /// Of `with_writer`, how many were announced without it.
    abandoned: usize,
    /// The writer missed its deadline: cycles are announced without it
    /// until it has handed back everything it was given.
    stalled: bool,
    /// The position the next cycle's first batch takes.
    next_position: u64,
    /// A cycle's buffers, back from the writer, for the next one.
    spare: Option<LogCycle>,
}

impl LogThread {
    /// Starts the thread writing with `writer`; the next batch takes
    /// `next_position`.
    pub(super) fn start(
        writer: StoreWriter,
        shared: Arc<Shared>,
        metrics: Metrics,
        mark: Option<AnnouncedMark>,
        io_timeout: Duration,
        next_position: u64,
    ) -> std::io::Result<Self> {
        // Room for every job that can be queued at once: the cycles out,
        // a checkpoint and the close, so a send never finds the queue full.
        let (jobs, receiver) = sync_channel(LOG_QUEUE + 2);
        let (written_sender, written) = sync_channel(LOG_QUEUE);
        let notify = Arc::new(Notify::new());
        let parked = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("kvgate-log".into())
            .spawn({
                let parked = Arc::clone(&parked);
                let back = WayBack {
                    written: Some(written_sender),
                    notify: Arc::clone(&notify),
                };
                move || run(writer, &receiver, &parked, &back)
            })?;
        Ok(Self {
            jobs: Some(jobs),
            parked,
            written,
            notify,
            shared,
            metrics,
            thread: Some(thread),
            mark,
            io_timeout,
            pending: VecDeque::new(),
            confirmed: 0,
            with_writer: 0,
            abandoned: 0,
            stalled: false,
            next_position,
            spare: None,
        })
    }

    /// Hands a cycle to the writer: `batches` (emptied; their buffer comes
    /// back with a spare one) take the next positions, and `marks` fills
    /// its marks. Never waits: the drain hands over no cycle while
    /// `is_full` (it settles, or `run` stops taking engine messages).
    /// While the writer is stalled, the cycle is only queued for its
    /// announcement.
    pub fn hand_over(
        &mut self,
        batches: &mut Vec<(u32, u64, FramedBatch)>,
        marks: impl FnOnce(&mut Vec<(u32, RankMark)>),
    ) {
        let mut cycle = self.spare.take().unwrap_or_default();
        cycle.first_position = self.next_position;
        self.next_position += batches.len() as u64;
        std::mem::swap(&mut cycle.batches, batches);
        cycle.marks.clear();
        marks(&mut cycle.marks);
        let cycle = Arc::new(cycle);
        let now = Instant::now();
        self.receive_hand_backs();
        if !self.stalled {
            self.send(Job::Cycle(Arc::clone(&cycle), now));
            self.with_writer += 1;
        }
        self.pending.push_back((cycle, now));
    }

    /// Queues `job` and unparks the writer if it parked. Never waits: the
    /// queue has room for every job that can be out at once.
    ///
    /// # Panics
    /// If the writer thread is gone (it panicked): the drain must not go
    /// on numbering cycles that will never be written or announced.
    fn send(&self, job: Job) {
        let Some(jobs) = &self.jobs else { return };
        match jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                unreachable!("the log queue holds every job that can be out at once")
            }
            Err(TrySendError::Disconnected(_)) => panic!("{WRITER_GONE}"),
        }
        // Pairs with the writer's fence between raising `parked` and
        // looking at the queue once more: it sees the job, or this sees
        // the flag.
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) {
            self.unpark();
        }
    }

    fn unpark(&self) {
        if let Some(thread) = &self.thread {
            thread.thread().unpark();
        }
    }

    /// Counts one cycle the writer is done with.
    fn handed_back(&mut self) {
        self.with_writer -= 1;
        if self.abandoned > 0 {
            self.abandoned -= 1;
        } else {
            self.confirmed += 1;
        }
    }

    /// Takes every hand-back waiting (never waits); a writer back from a
    /// stall with nothing left to announce gets cycles again.
    ///
    /// # Panics
    /// If the writer thread is gone with cycles out, which would otherwise
    /// hold every announcement back for good while health says SERVING.
    fn receive_hand_backs(&mut self) {
        loop {
            match self.written.try_recv() {
                Ok(()) => self.handed_back(),
                Err(TryRecvError::Disconnected) if self.with_writer > 0 => panic!("{WRITER_GONE}"),
                Err(_) => break,
            }
        }
        if self.stalled && self.with_writer == 0 && self.pending.is_empty() {
            self.stalled = false;
        }
    }

    /// When the oldest cycle with the writer is due back.
    pub fn deadline(&self) -> Option<Instant> {
        if self.stalled {
            return None;
        }
        self.pending
            .get(self.confirmed)
            .map(|(_, handed_at)| *handed_at + self.io_timeout)
    }

    /// Past the deadline, persistence pauses and every cycle out is
    /// announced without the writer.
    fn check_deadline(&mut self, now: Instant) {
        if self.deadline().is_none_or(|deadline| now < deadline) {
            return;
        }
        self.stalled = true;
        self.abandoned = self.with_writer;
        self.confirmed = 0;
        let what = self.shared.operation().describe();
        let error = std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("did not complete within {:?}", self.io_timeout),
        );
        // Counted as a failed write once the writer sees it.
        self.shared.fail(what, &error);
        self.metrics.state_paused.set(1);
    }

    /// The next cycle to announce, if any (never waits): one the writer
    /// has handed back, or, while it is stalled, the next one out. It is
    /// marked announced first.
    pub fn try_written(&mut self) -> Option<LogCycle> {
        self.receive_hand_backs();
        self.check_deadline(Instant::now());
        if !self.stalled && self.confirmed == 0 {
            return None;
        }
        let (cycle, _) = self.pending.pop_front()?;
        if !self.stalled {
            self.confirmed -= 1;
        }
        if let (Some(mark), Some((_, sequence, _))) = (&self.mark, cycle.batches.last()) {
            let highest = cycle
                .batches
                .iter()
                .map(|(_, sequence, _)| *sequence)
                .fold(*sequence, u64::max);
            mark.raise(
                cycle.first_position + cycle.batches.len() as u64 - 1,
                highest,
            );
        }
        Some(Arc::try_unwrap(cycle).unwrap_or_else(|shared| LogCycle::clone(&shared)))
    }

    /// The next cycle to announce, waiting for it at most until its
    /// deadline (the calling thread polls, then blocks: not for the async
    /// workers). `None` when none is out.
    pub fn wait_written(&mut self) -> Option<LogCycle> {
        let spinning = Instant::now();
        loop {
            if let Some(cycle) = self.try_written() {
                return Some(cycle);
            }
            let deadline = self.deadline()?;
            if spinning.elapsed() < WAIT_SPIN {
                // Yielding, not spinning: on two cores busy with the drain
                // and a checkpoint, the writer may need this very core.
                std::thread::yield_now();
                continue;
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.written.recv_timeout(wait) {
                Ok(()) => self.handed_back(),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => panic!("{WRITER_GONE}"),
            }
        }
    }

    /// Keeps a handed-back cycle's buffers for the next one.
    pub fn recycle(&mut self, mut cycle: LogCycle) {
        cycle.batches.clear();
        self.spare = Some(cycle);
    }

    /// Cycles handed over and not yet announced.
    pub fn out(&self) -> usize {
        self.pending.len()
    }

    /// `LOG_QUEUE` cycles are out: the disk is behind. (Cycles a stalled
    /// writer still holds do not count: nothing more is handed to it.)
    pub fn is_full(&self) -> bool {
        self.pending.len() >= LOG_QUEUE || (!self.stalled && self.with_writer >= LOG_QUEUE)
    }

    /// Notified when the writer hands a cycle back (a permit is kept if
    /// nobody waits, so a wait begun after the hand-back returns at once).
    pub fn written_signal(&self) -> Arc<Notify> {
        Arc::clone(&self.notify)
    }

    /// The writer asks for a checkpoint's cut at the next quiet point, and
    /// can take one now (it holds no cycle).
    pub fn wants_checkpoint(&self) -> bool {
        !self.stalled
            && self.with_writer == 0
            && self.shared.checkpoint_wanted.load(Ordering::Acquire)
    }

    /// Hands a cut taken with no cycle out to the writer, which passes it
    /// to the checkpoint thread with its bookkeeping of what was logged
    /// since.
    pub fn checkpoint(&mut self, cut: SnapshotCut, marks: Marks) {
        debug_assert_eq!(self.out(), 0, "a cut names only written positions");
        self.shared
            .checkpoint_wanted
            .store(false, Ordering::Release);
        self.send(Job::Checkpoint(cut, marks));
    }

    /// The oldest position the history still holds.
    pub fn history_oldest(&self, position: u64) {
        self.shared
            .history_oldest
            .store(position, Ordering::Release);
    }

    /// A clean shutdown: the writer finishes the cycles it has, then the
    /// last sync runs (`StoreWriter::close`). Blocks until it is done,
    /// unless the writer is stalled: then it is left behind, and the log,
    /// which lacks what was announced meanwhile, gets no clean record.
    pub fn close(mut self) {
        self.receive_hand_backs();
        if self.stalled {
            self.disconnect();
            self.thread = None;
            return;
        }
        self.send(Job::Close);
        self.disconnect();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Lets the writer end once it has written what it has.
    fn disconnect(&mut self) {
        // A parked writer sees the queue disconnected once unparked.
        self.jobs = None;
        self.unpark();
    }
}

impl Drop for LogThread {
    /// Without `close` (a drain dropped, as by a killed process): the
    /// writer finishes what it has, with no clean sync. Outside an async
    /// runtime (tests and benches that read the directory back) it is
    /// joined, so the directory holds every cycle handed over, unless it
    /// stalled; inside one (a drain dropped by a panic) it is left to
    /// finish on its own, since joining would hold an async worker, and
    /// every connection it serves, on the disk.
    fn drop(&mut self) {
        self.disconnect();
        if !self.stalled
            && tokio::runtime::Handle::try_current().is_err()
            && let Some(thread) = self.thread.take()
        {
            let _ = thread.join();
        }
    }
}

/// The writer's way back to the drain. Dropped however the thread ends (a
/// panic too): the channel closes, then the drain is woken, so a drain
/// waiting for a cycle finds the writer gone instead of waiting for good.
struct WayBack {
    /// `None` only while it is dropped.
    written: Option<SyncSender<()>>,
    notify: Arc<Notify>,
}

impl WayBack {
    /// Tells the drain a cycle is done; false once the drain is gone.
    fn hand_back(&self) -> bool {
        let Some(written) = &self.written else {
            return false;
        };
        // Never full: the drain has at most LOG_QUEUE cycles out.
        if written.send(()).is_err() {
            return false;
        }
        self.notify.notify_one();
        true
    }
}

impl Drop for WayBack {
    fn drop(&mut self) {
        drop(self.written.take());
        self.notify.notify_one();
    }
}

/// The thread: writes each cycle and hands it back, until the drain's
/// handle is gone (no last sync) or closes it (the last sync).
fn run(mut writer: StoreWriter, jobs: &Receiver<Job>, parked: &AtomicBool, back: &WayBack) {
    // Fault injection for the end-to-end tests, in debug builds only: the
    // thread panics at its first cycle, as a bug in it would.
    #[cfg(debug_assertions)]
    let injected_panic =
        std::env::var_os("KVGATE_DEBUG_PANIC_TASK").is_some_and(|task| task == "log-writer");
    let mut last_gap = Duration::MAX;
    let mut idle_since = Instant::now();
    loop {
        let Some(job) = next_job(jobs, parked, last_gap < SPIN) else {
            return;
        };
        match job {
            Job::Cycle(cycle, handed_at) => {
                #[cfg(debug_assertions)]
                assert!(!injected_panic, "injected fault in the log writer");
                // From the handing over, not from the wake-up: a parked
                // thread's wake-up is slower than the cycles it would miss.
                last_gap = handed_at.saturating_duration_since(idle_since);
                writer.append_cycle(cycle.first_position, &cycle.batches, &cycle.marks);
                writer.publish_checkpoint_wanted();
                // Dropped before the hand-back, so the drain's is the only
                // reference left and the cycle's buffers are reused.
                drop(cycle);
                if !back.hand_back() {
                    return;
                }
            }
            Job::Checkpoint(cut, marks) => writer.checkpoint(cut, marks),
            Job::Close => {
                writer.close();
                return;
            }
        }
        idle_since = Instant::now();
    }
}

/// The next job: spinning up to `SPIN` first if `spin` (sustained load),
/// then parked until the drain unparks it. `None` once the drain is gone.
fn next_job(jobs: &Receiver<Job>, parked: &AtomicBool, spin: bool) -> Option<Job> {
    let started = Instant::now();
    loop {
        match jobs.try_recv() {
            Ok(job) => return Some(job),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) if spin && started.elapsed() < SPIN => {
                std::hint::spin_loop();
                continue;
            }
            Err(TryRecvError::Empty) => {}
        }
        parked.store(true, Ordering::Relaxed);
        // Pairs with the drain's fence after it queues a job.
        fence(Ordering::SeqCst);
        match jobs.try_recv() {
            Ok(job) => {
                parked.store(false, Ordering::Relaxed);
                return Some(job);
            }
            Err(TryRecvError::Disconnected) => return None,
            // An unpark that came first makes this return at once.
            Err(TryRecvError::Empty) => std::thread::park(),
        }
        parked.store(false, Ordering::Relaxed);
    }
}
