//! The log writer thread (`kvgate-log`) and the drain's handle on it: the
//! drain hands over each cycle (its batches, already encoded, and the
//! engine publishers' marks) and goes on converting the next payloads
//! while the thread frames and writes it; the thread hands each cycle back
//! once it is in the page cache, and only then does the drain announce it.
//!
//! Invariants: cycles are written and handed back in the order they were
//! handed over, each exactly once, whether its write succeeded or paused
//! persistence (a failing disk never stops serving; a slow or hung write
//! holds the announcements back while it lasts). A writer thread that
//! dies (a panic) takes the drain down with it, through the supervisor,
//! rather than leaving it numbering cycles nobody will announce. At most
//! `LOG_QUEUE` cycles are out at once (`LogThread::is_full`): the drain
//! then takes no engine message until one comes back, so nothing grows
//! while the disk is behind. The batches' bytes are shared
//! (`FramedBatch`), never copied, and the buffers a cycle travels in go
//! back and forth with it.
//! While cycles come closer together than `SPIN` the thread spins for the
//! next one, so neither side makes a system call per cycle; further apart
//! it parks (an idle sidecar burns no CPU), and the drain unparks it only
//! when it has parked. Each hand-back notifies the drain (`Notify`): a
//! drain waiting for a cycle wakes, a busy one finds the cycle when it next
//! looks and its loop takes one extra turn for the permit left behind.
//!
//! A cycle that comes alone (none out, the last handed over more than
//! `SPIN` ago, so the thread is parked) is written by the drain itself,
//! under the writer's lock, when a segment is open: waking the thread and
//! being woken back would cost more CPU than the write and put two
//! cross-CPU wake-ups before its announcement (p99 at 8 × 20k events/s
//! rose 0.05–0.1 ms without this). Such a write opens no file, but it is
//! still a write into the page cache on the drain's thread: a disk that
//! hangs a write of an open segment holds the drain there, as before the
//! thread existed; opening segments (where a FIFO or a dead mount hangs)
//! and every cycle under load go to the thread. The checkpoint's cut is
//! handed over the same way, at a quiet point, so the thread never holds
//! the lock the drain may wait for.

use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::background::Shared;
use super::records::{Marks, RankMark};
use super::writer::StoreWriter;
use crate::hub::FramedBatch;
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
#[derive(Default)]
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
    Cycle(LogCycle, Instant),
    /// A clean stop: the last sync records it.
    Close,
}

/// The store's writer, used by the thread and, for a cycle that comes
/// alone, by the drain (`LogThread::hand_over`); `None` once closed.
type SharedWriter = Arc<Mutex<Option<StoreWriter>>>;

/// The writer, for one job.
///
/// # Panics
/// If a thread panicked holding it: the log's state is unknown, and the
/// drain must go down (through the supervisor) rather than go on.
fn lock(writer: &SharedWriter) -> std::sync::MutexGuard<'_, Option<StoreWriter>> {
    writer
        .lock()
        .expect("the log writer's lock, poisoned by a panic")
}

/// Appends `cycle` with `writer` (nothing once it is closed).
fn write_cycle(writer: &SharedWriter, cycle: &LogCycle) {
    let mut writer = lock(writer);
    if let Some(writer) = writer.as_mut() {
        writer.append_cycle(cycle.first_position, &cycle.batches, &cycle.marks);
        writer.publish_checkpoint_wanted();
    }
}

/// The drain's side of the log writer thread.
pub struct LogThread {
    writer: SharedWriter,
    /// When the last cycle was handed over: cycles further apart than
    /// `SPIN` find the writer parked.
    last_hand_over: Option<Instant>,
    /// A cycle the drain wrote itself, to be collected as written.
    written_inline: Option<LogCycle>,
    /// `None` once closed.
    jobs: Option<SyncSender<Job>>,
    /// The writer is parked (or about to): a job needs an unpark.
    parked: Arc<AtomicBool>,
    written: Receiver<LogCycle>,
    notify: Arc<Notify>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Cycles handed over and not handed back.
    out: usize,
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
        next_position: u64,
    ) -> std::io::Result<Self> {
        // Room for every job that can be queued at once: the cycles out
        // and the close, so a send never finds the queue full.
        let (jobs, receiver) = sync_channel(LOG_QUEUE + 1);
        let writer = Arc::new(Mutex::new(Some(writer)));
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
                let writer = Arc::clone(&writer);
                move || run(&writer, &receiver, &parked, &back)
            })?;
        Ok(Self {
            writer,
            last_hand_over: None,
            written_inline: None,
            jobs: Some(jobs),
            parked,
            written,
            notify,
            shared,
            thread: Some(thread),
            out: 0,
            next_position,
            spare: None,
        })
    }

    /// Hands a cycle to the writer: `batches` (emptied; their buffer comes
    /// back with a spare one) take the next positions, and `marks` fills
    /// its marks. Never waits: the drain hands over no cycle while
    /// `is_full` (it settles, or `run` stops taking engine messages).
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
        let now = Instant::now();
        let alone = self
            .last_hand_over
            .is_none_or(|last| now.duration_since(last) >= SPIN);
        self.last_hand_over = Some(now);
        self.out += 1;
        // A cycle that comes alone finds the writer parked: waking it, and
        // being woken back, costs more CPU than the write and puts two
        // cross-CPU wake-ups before the announcement. With none out and a
        // segment open (no open that could wait), the drain writes it.
        if alone && self.out == 1 && self.appends_to_an_open_segment() {
            write_cycle(&self.writer, &cycle);
            self.written_inline = Some(cycle);
        } else {
            self.send(Job::Cycle(cycle, now));
        }
    }

    fn appends_to_an_open_segment(&self) -> bool {
        lock(&self.writer)
            .as_ref()
            .is_some_and(StoreWriter::appends_to_an_open_segment)
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

    /// The next cycle the writer has handed back, if any (never waits).
    ///
    /// # Panics
    /// If the writer thread is gone with cycles out, which would otherwise
    /// hold every announcement back for good while health says SERVING.
    pub fn try_written(&mut self) -> Option<LogCycle> {
        let cycle = match self.written_inline.take() {
            Some(cycle) => cycle,
            None => match self.written.try_recv() {
                Ok(cycle) => cycle,
                Err(TryRecvError::Disconnected) if self.out > 0 => panic!("{WRITER_GONE}"),
                Err(_) => return None,
            },
        };
        self.out -= 1;
        Some(cycle)
    }

    /// The next cycle back from the writer, waiting for it (the calling
    /// thread polls, then blocks: not for the async workers). `None` when
    /// none is out.
    pub fn wait_written(&mut self) -> Option<LogCycle> {
        if self.out == 0 {
            return None;
        }
        if let Some(cycle) = self.try_written() {
            return Some(cycle);
        }
        let spinning = Instant::now();
        let cycle = loop {
            match self.written.try_recv() {
                Ok(cycle) => break cycle,
                // Yielding, not spinning: on two cores busy with the drain
                // and a checkpoint, the writer may need this very core.
                Err(TryRecvError::Empty) if spinning.elapsed() < WAIT_SPIN => {
                    std::thread::yield_now();
                }
                Err(TryRecvError::Empty) => match self.written.recv() {
                    Ok(cycle) => break cycle,
                    Err(_) => panic!("{WRITER_GONE}"),
                },
                Err(TryRecvError::Disconnected) => panic!("{WRITER_GONE}"),
            }
        };
        self.out -= 1;
        Some(cycle)
    }

    /// Keeps a handed-back cycle's buffers for the next one.
    pub fn recycle(&mut self, mut cycle: LogCycle) {
        cycle.batches.clear();
        self.spare = Some(cycle);
    }

    /// Cycles handed over and not yet handed back.
    pub fn out(&self) -> usize {
        self.out
    }

    /// `LOG_QUEUE` cycles are out: the disk is behind.
    pub fn is_full(&self) -> bool {
        self.out >= LOG_QUEUE
    }

    /// Notified when the writer hands a cycle back (a permit is kept if
    /// nobody waits, so a wait begun after the hand-back returns at once).
    pub fn written_signal(&self) -> Arc<Notify> {
        Arc::clone(&self.notify)
    }

    /// The writer asks for a checkpoint's cut at the next quiet point.
    pub fn wants_checkpoint(&self) -> bool {
        self.shared.checkpoint_wanted.load(Ordering::Acquire)
    }

    /// Hands a cut taken with no cycle out to the checkpoint thread, with
    /// the writer's bookkeeping of what was logged since. Done here, not by
    /// the thread: with none out the thread holds no lock, and a thread
    /// preempted while holding the writer's would hold the drain's next
    /// cycle for a whole time slice.
    pub fn checkpoint(&mut self, cut: SnapshotCut, marks: Marks) {
        debug_assert_eq!(self.out, 0, "a cut names only written positions");
        self.shared
            .checkpoint_wanted
            .store(false, Ordering::Release);
        if let Some(writer) = lock(&self.writer).as_mut() {
            writer.checkpoint(cut, marks);
        }
    }

    /// The oldest position the history still holds.
    pub fn history_oldest(&self, position: u64) {
        self.shared
            .history_oldest
            .store(position, Ordering::Release);
    }

    /// A clean shutdown: the writer finishes the cycles it has, then the
    /// last sync runs (`StoreWriter::close`). Blocks until it is done.
    pub fn close(mut self) {
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
    /// joined, so the directory holds every cycle handed over; inside one
    /// (a drain dropped by a panic) it is left to finish on its own, since
    /// joining would hold an async worker, and every connection it
    /// serves, on the disk.
    fn drop(&mut self) {
        self.disconnect();
        if tokio::runtime::Handle::try_current().is_err()
            && let Some(thread) = self.thread.take()
        {
            let _ = thread.join();
        }
    }
}

/// The thread: writes each cycle and hands it back, until the drain's
/// handle is gone (no last sync) or closes it (the last sync).
/// The writer's way back to the drain. Dropped however the thread ends (a
/// panic too): the channel closes, then the drain is woken, so a drain
/// waiting for a cycle finds the writer gone instead of waiting for good.
struct WayBack {
    /// `None` only while it is dropped.
    written: Option<SyncSender<LogCycle>>,
    notify: Arc<Notify>,
}

impl WayBack {
    /// Hands a written cycle back; false once the drain is gone.
    fn hand_back(&self, cycle: LogCycle) -> bool {
        let Some(written) = &self.written else {
            return false;
        };
        // Never full: the drain has at most LOG_QUEUE cycles out.
        if written.send(cycle).is_err() {
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

fn run(writer: &SharedWriter, jobs: &Receiver<Job>, parked: &AtomicBool, back: &WayBack) {
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
                write_cycle(writer, &cycle);
                if !back.hand_back(cycle) {
                    return;
                }
            }
            Job::Close => {
                let closing = lock(writer).take();
                if let Some(writer) = closing {
                    writer.close();
                }
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
