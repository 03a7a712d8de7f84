//! The state directory (`--state-dir`): the stage below the drain that
//! lets a restarted kvgate continue the old process (contract section 8).
//!
//! The log is the history's own bytes: every published batch, appended to
//! a segment before its position is announced, and a cycle's end after
//! each drain cycle with the engine publishers' counters. A checkpoint is a
//! snapshot's chunks taken from a copy-on-write cut of the state, written
//! by a thread of its own; restore = the newest checkpoint that verifies,
//! then the logged batches after it. `docs/state-dir.md` has the format.
//!
//! Invariants: one process per directory, checked by identity before every
//! file it creates (`lock`); the drain never waits for the disk longer
//! than `--state-io-timeout-ms` (appends go to the page cache from the log
//! writer thread, `log_thread`, and the drain announces a cycle once it is
//! written or once its time is up, persistence then paused; fsyncs and
//! checkpoints run on their own threads); nothing read from the directory
//! is trusted (`format`, `restore`); a number is never given to different
//! content: the old numbering goes on only when the directory proves it
//! holds every batch the old process announced, as the announcement mark
//! (`announced`, raised before every announcement) or a clean shutdown's
//! record says.

mod announced;
mod background;
mod files;
pub(crate) mod format;
mod lock;
mod log_thread;
pub(crate) mod records;
pub(crate) mod restore;
mod writer;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::sync_channel;
use std::time::Duration;

use serde::Serialize;
use tracing::{info, warn};

use std::collections::BTreeMap;

pub use announced::mark_of;
use announced::{AnnouncedMark, MarkRecord};
use background::PersistStatus;
pub(crate) use format::Damage;
use lock::DirLock;
pub use lock::LockError;
pub(crate) use log_thread::{LogCycle, LogThread};
pub(crate) use records::RankMark;
use restore::{RestoreReport, Restored};
pub use writer::StoreLimits;
use writer::StoreWriter;

use crate::source::continuity::ResumePoint;

use crate::hub::HistoryLimits;
use crate::metrics::Metrics;
use background::{Checkpointer, Shared, Syncer};

/// Checkpoints handed over and not yet taken up (one at a time is written;
/// the drain asks for no other while one is under way).
const CHECKPOINT_QUEUE: usize = 1;

/// Segments announced to the sync thread and not yet taken up.
const SYNC_QUEUE: usize = 64;

/// How the directory is used, as the flags set it.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The directory (`--state-dir`), created if missing.
    pub dir: PathBuf,
    /// How often the log is fsynced (`--state-sync-ms`).
    pub sync_interval: Duration,
    /// How long the drain waits for a write or an open of the log
    /// (`--state-io-timeout-ms`) before it pauses persistence.
    pub io_timeout: Duration,
    /// Segment and checkpoint sizes.
    pub limits: StoreLimits,
    /// The history's bounds: how much of the log a restart puts back.
    pub history: HistoryLimits,
}

/// Why the directory cannot be used at all.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Another process holds it, or its lock file cannot be locked.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The directory cannot be created or listed.
    #[error("cannot read or create {dir}: {error}")]
    Io {
        /// The directory.
        dir: PathBuf,
        /// What the system said (in the message, so not the `source`: as
        /// both, `{:#}` printed it twice).
        error: std::io::Error,
    },
}

/// What the directory gave back, and the log writer thread that continues
/// it: handed to the drain (`Drain::with_state_dir`).
pub struct Opened {
    pub(crate) restored: Restored,
    /// The first number of the numbering this process continues or starts.
    pub(crate) seed: u64,
    pub(crate) log: LogThread,
    pub(crate) status: StoreStatus,
}

impl Opened {
    /// The first number of every rank's numbering: the old process's when
    /// it goes on, else the seed `open` was given.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Where each engine publisher's record ended.
    pub(crate) fn resume_points(&self) -> BTreeMap<u32, ResumePoint> {
        self.restored
            .marks
            .iter()
            .map(|(&rank, mark)| (rank, mark.resume))
            .collect()
    }

    /// What `/status` shows of the directory from now on.
    pub fn status(&self) -> StoreStatus {
        self.status.clone()
    }
}

/// What `/status` shows of the directory.
#[derive(Clone)]
pub struct StoreStatus {
    dir: PathBuf,
    restored: Arc<RestoreReport>,
    shared: Arc<Shared>,
}

/// The `/status` section.
#[derive(Serialize)]
pub(crate) struct StoreStatusView {
    dir: PathBuf,
    restored: RestoreReport,
    #[serde(flatten)]
    persist: PersistStatus,
}

impl StoreStatus {
    pub(crate) fn view(&self) -> StoreStatusView {
        let mut persist = self.shared.status.lock().expect("status lock").clone();
        let started = self.shared.sync_started.load(Ordering::Acquire);
        persist.fsync_running_ms =
            (started != 0).then(|| crate::clock::unix_micros_now().saturating_sub(started) / 1000);
        StoreStatusView {
            dir: self.dir.clone(),
            restored: (*self.restored).clone(),
            persist,
        }
    }
}

/// Takes the directory (creating it), reads it back and starts the
/// background threads. `fresh_seed` numbers a new numbering (raised above
/// every number the directory names). Blocking work.
pub fn open(config: StoreConfig, metrics: &Metrics, fresh_seed: u64) -> Result<Opened, OpenError> {
    let io = |error| OpenError::Io {
        dir: config.dir.clone(),
        error,
    };
    std::fs::create_dir_all(&config.dir).map_err(io)?;
    let dir = Arc::new(DirLock::take(&config.dir)?);
    // Held until the process ends, whoever still writes: the kernel
    // releases it then, however the process ends.
    std::mem::forget(Arc::clone(&dir));
    let boot_id = records::boot_id();
    let identity = dir.identity();
    let last_mark = announced::read(identity, &boot_id);
    let mut restored =
        restore::restore(&config.dir, last_mark, config.history, &mut |_, damage| {
            metrics.count_state_damage(damage.as_str());
        })
        .map_err(io)?;
    // A new numbering starts above every number DIR and the mark name, so
    // a clock that went back cannot put it inside one already used.
    let fresh = fresh_seed.max(restored.highest_number.saturating_add(1));
    let seed_of =
        |restored: &Restored| restored.numbering.as_ref().map_or(fresh, |(seed, _)| *seed);
    // This process's mark, before it announces anything. Without one, no
    // restart after an unclean stop may continue what it announces: it
    // numbers anew, and the old mark goes.
    let mark_for = |restored: &Restored| MarkRecord {
        seed: seed_of(restored),
        through: restored.next_position - 1,
        highest_sequence: restored.highest_number,
        owner_running: false,
    };
    let mark = match AnnouncedMark::create(identity, &boot_id, mark_for(&restored)) {
        Ok(mark) => Some(mark),
        Err(error) => {
            announced::remove(identity);
            restored.renumber();
            warn!(%error, "state directory: cannot keep the announcement mark in /dev/shm; a restart after an unclean stop will number anew");
            None
        }
    };
    let seed = seed_of(&restored);
    let report = &restored.report;
    info!(
        dir = %config.dir.display(),
        outcome = ?report.outcome,
        checkpoint = ?report.checkpoint_position,
        checkpoint_blocks = report.checkpoint_blocks,
        batches_replayed = report.batches_replayed,
        history_batches = report.history_batches,
        "state directory read back"
    );
    metrics
        .state_restored_blocks
        .set(report.checkpoint_blocks as i64);
    metrics
        .state_restored_batches
        .set(report.batches_replayed as i64);
    // Until this process's first sync, the old process's record must not
    // vouch for a log this one goes on writing: a crash before then would
    // read as its clean end and reuse the numbers announced since.
    background::write_synced(
        dir.checked().map_err(io)?,
        records::SyncedRecord {
            boot_id: boot_id.clone(),
            seed,
            through: restored.next_position - 1,
            clean: false,
        },
    )
    .map_err(io)?;
    let shared = Arc::new(Shared::default());
    let (sync_jobs, sync_receiver) = sync_channel(SYNC_QUEUE);
    let (checkpoint_jobs, checkpoint_receiver) = sync_channel(CHECKPOINT_QUEUE);
    let syncer = Syncer {
        dir: Arc::clone(&dir),
        boot_id: boot_id.clone(),
        seed,
        interval: config.sync_interval,
        shared: Arc::clone(&shared),
        metrics: metrics.clone(),
    };
    let sync_thread = std::thread::Builder::new()
        .name("kvgate-sync".into())
        .spawn(move || syncer.run(sync_receiver))
        .map_err(io)?;
    let checkpointer = Checkpointer {
        dir: Arc::clone(&dir),
        shared: Arc::clone(&shared),
        metrics: metrics.clone(),
    };
    std::thread::Builder::new()
        .name("kvgate-checkpoint".into())
        .spawn(move || checkpointer.run(checkpoint_receiver))
        .map_err(io)?;
    let status = StoreStatus {
        dir: config.dir.clone(),
        restored: Arc::new(restored.report.clone()),
        shared: Arc::clone(&shared),
    };
    let writer = StoreWriter::new(
        dir,
        boot_id,
        seed,
        config.limits,
        Arc::clone(&shared),
        metrics.clone(),
        sync_jobs,
        checkpoint_jobs,
        sync_thread,
        restored.needs_checkpoint,
    );
    let log = LogThread::start(
        writer,
        shared,
        metrics.clone(),
        mark,
        config.io_timeout,
        restored.next_position,
    )
    .map_err(io)?;
    Ok(Opened {
        restored,
        seed,
        log,
        status,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::FramedBatch;
    use crate::metrics::ClosedLabels;
    use crate::wire::OpenBatch;
    use restore::Outcome;
    use restore::tests::{Dir, LIMITS};
    use std::os::unix::fs::OpenOptionsExt;

    const SEED: u64 = 1000;

    fn open_store(dir: &Dir) -> Opened {
        open_store_waiting(dir, Duration::from_secs(10))
    }

    fn open_store_waiting(dir: &Dir, io_timeout: Duration) -> Opened {
        let config = StoreConfig {
            dir: dir.0.clone(),
            sync_interval: Duration::from_secs(3600),
            io_timeout,
            limits: StoreLimits {
                segment_bytes: 1 << 20,
                checkpoint_bytes: 1 << 20,
            },
            history: LIMITS,
        };
        open(config, &Metrics::new(ClosedLabels::default()), 1).unwrap()
    }

    #[test]
    fn a_disk_failing_before_the_first_segment_opens_leaves_the_numbering_unproven() {
        let boot_id = records::boot_id();
        let dir = Dir::new("first-segment-fails");
        dir.segment(&boot_id, SEED, 1, 3);
        let metadata = std::fs::metadata(&dir.0).unwrap();
        let identity = announced::DirIdentity {
            dev: std::os::unix::fs::MetadataExt::dev(&metadata),
            ino: std::os::unix::fs::MetadataExt::ino(&metadata),
        };
        // The old process announced what it logged, and was killed.
        drop(
            AnnouncedMark::create(identity, &boot_id, restore::tests::mark(SEED, 3).unwrap())
                .unwrap(),
        );
        let mut opened = open_store(&dir);
        assert_eq!(opened.restored.report.outcome, Outcome::Continued);
        assert_eq!(opened.restored.next_position, 4);
        // The first segment cannot be created: the batch is announced
        // unlogged.
        std::fs::create_dir(dir.0.join(files::segment_name(4))).unwrap();
        let framed = FramedBatch::new(&OpenBatch::with_timestamp(1.0).encode(0, SEED + 3, None));
        opened
            .log
            .hand_over(&mut vec![(0, SEED + 3, framed)], |_| {});
        let written = opened.log.wait_written().expect("handed back");
        assert_eq!(written.first_position, 4);
        assert_eq!(
            dir.restore(announced::read(identity, &boot_id))
                .report
                .outcome,
            Outcome::Renumbered,
            "position 4 was announced and is not in the log"
        );
        announced::remove(identity);
    }

    #[test]
    fn a_new_numbering_starts_above_every_number_the_directory_names_whatever_the_clock_says() {
        // Numbers from a clock far ahead of this one's, then a reboot with
        // no clean sync: the state goes on under a new numbering.
        let ahead = u64::MAX / 2;
        let dir = Dir::new("clock-went-back");
        dir.segment(b"old", ahead, 1, 3);
        let opened = open_store(&dir);
        assert_eq!(opened.restored.report.outcome, Outcome::Renumbered);
        assert!(
            opened.seed() > ahead + 2,
            "seed {} reuses the old numbering's {ahead}..={}",
            opened.seed(),
            ahead + 2
        );
    }

    #[test]
    fn a_crash_before_the_first_sync_does_not_continue_on_the_old_clean_shutdown() {
        let dir = Dir::new("old-clean-sync");
        dir.segment(b"old", SEED, 1, 3);
        dir.synced(SEED, 3, true);
        let opened = open_store(&dir);
        assert_eq!(opened.restored.report.outcome, Outcome::Continued);
        // Batches may have been announced since, in the page cache only:
        // the machine crashes before this process's first sync.
        drop(opened);
        assert_eq!(dir.restore(None).report.outcome, Outcome::Renumbered);
    }

    fn hand_over_one(log: &mut LogThread) {
        let framed = FramedBatch::new(&OpenBatch::with_timestamp(1.0).encode(0, SEED, None));
        log.hand_over(&mut vec![(0, SEED, framed)], |_| {});
    }

    #[test]
    fn a_writer_hung_in_an_open_holds_no_announcement_past_the_timeout_however_many_cycles_come() {
        let dir = Dir::new("hung-open");
        let mut opened = open_store_waiting(&dir, Duration::from_millis(50));
        // The first segment's open waits for a reader, as an open on a
        // dead network mount does.
        let fifo = dir.0.join(files::segment_name(1));
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        for _ in 0..log_thread::LOG_QUEUE {
            assert!(!opened.log.is_full());
            hand_over_one(&mut opened.log);
        }
        assert!(opened.log.is_full(), "the writer holds every cycle");
        let first = opened
            .log
            .wait_written()
            .expect("announced past the timeout");
        assert_eq!(first.first_position, 1);
        for position in 2..=log_thread::LOG_QUEUE as u64 {
            let cycle = opened
                .log
                .try_written()
                .expect("announced without the writer");
            assert_eq!(cycle.first_position, position);
        }
        // The writer still hangs: later cycles go out at once, and the
        // drain is never held back.
        for position in 17..200 {
            assert!(!opened.log.is_full());
            hand_over_one(&mut opened.log);
            let cycle = opened.log.try_written().expect("announced at once");
            assert_eq!(cycle.first_position, position);
        }
        let paused = opened.status().view().persist.paused.expect("paused");
        assert!(
            paused.contains("opening a log segment: did not complete within 50ms"),
            "{paused}"
        );
        // A reader lets the hung open finish, so the thread can end.
        let _reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
    }
}
