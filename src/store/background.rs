//! Two of the threads that keep the drain free of disk waits: one fsyncs the
//! log at a fixed interval and records how far it got, one writes
//! checkpoints and deletes what they make obsolete.
//!
//! Invariants: the log writer only hands them work through bounded
//! channels and atomics, never waits for them (but at shutdown, for the
//! last sync). A
//! `synced` record never claims more than was fsynced. A checkpoint is
//! complete on disk (temporary name, fsync, rename, directory fsync)
//! before anything it covers is deleted; a segment is deleted only once
//! every batch in it is covered by a checkpoint and older than the history.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{info, warn};

use super::files::{self, Named};
use super::format::{FileKind, file_header, put_record, record_head};
use super::lock::DirLock;
use super::records::{CheckpointMeta, SyncedRecord, encode_checkpoint_end, kind};
use crate::clock::unix_now;
use crate::metrics::Metrics;
use crate::state::snapshot::{SnapshotCut, SnapshotEncoder};

/// What the drain and the threads share.
#[derive(Debug, Default)]
pub struct Shared {
    /// The last position appended to the log (in the page cache), by the
    /// log writer thread; the drain announces no position above it.
    pub written_through: AtomicU64,
    /// The oldest position the hub's history holds: segments before it are
    /// not needed to refill the history at a restart.
    pub history_oldest: AtomicU64,
    /// The first position of the segment the log writer writes to, 0 while
    /// none is open: never deleted, whatever a checkpoint covers.
    pub open_segment: AtomicU64,
    /// A checkpoint is being written.
    pub checkpoint_busy: AtomicBool,
    /// The last checkpoint failed: the log writer asks for another soon.
    pub checkpoint_failed: AtomicBool,
    /// The log writer asks the drain for a cut to checkpoint, to be taken
    /// at its next quiet point (every cycle announced).
    pub checkpoint_wanted: AtomicBool,
    /// A background write failed since the log writer last looked: the log may
    /// lack what was announced, so the log writer pauses persistence.
    pub fault: AtomicBool,
    /// What the log writer is doing (an `Operation`), to name what did not
    /// complete in time.
    pub operation: AtomicU8,
    /// When the sync thread's running fsync began (Unix µs), 0 when none
    /// runs: `/status` shows one that takes long (a hung disk).
    pub sync_started: AtomicU64,
    /// What `/status` shows.
    pub status: Mutex<PersistStatus>,
}

/// What the log writer thread waits for the disk in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Operation {
    /// Waiting for the next cycle, or framing one.
    Idle = 0,
    /// Creating a segment and writing its header.
    Opening = 1,
    /// Appending a cycle.
    Writing = 2,
}

impl Operation {
    /// As a pause's reason names it.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Idle => "handing a cycle to the log writer",
            Self::Opening => "opening a log segment",
            Self::Writing => "writing the log",
        }
    }
}

/// Persistence as `/status` shows it.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PersistStatus {
    /// Why persistence is paused; `None` while it runs.
    pub paused: Option<String>,
    /// Bytes of kvgate's files in the directory.
    pub bytes_on_disk: u64,
    /// The newest checkpoint: its position, block count and Unix time.
    pub last_checkpoint: Option<CheckpointStatus>,
    /// The last position fsynced.
    pub synced_through: u64,
    /// How long the fsync under way has run, in ms (a disk that does not
    /// finish it: the log still goes to the page cache and is announced,
    /// but not made durable against a machine crash).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fsync_running_ms: Option<u64>,
}

/// The newest checkpoint written.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckpointStatus {
    pub position: u64,
    pub blocks: u64,
    pub unix_seconds: f64,
}

impl Shared {
    /// The log writer starts (or ends, with `Idle`) waiting for the disk.
    pub fn begin(&self, operation: Operation) {
        self.operation.store(operation as u8, Ordering::Release);
    }

    /// What the log writer waits for the disk in.
    pub fn operation(&self) -> Operation {
        match self.operation.load(Ordering::Acquire) {
            1 => Operation::Opening,
            2 => Operation::Writing,
            _ => Operation::Idle,
        }
    }

    /// Records a failed write: the log writer pauses at its next cycle.
    /// Logged once while the same error repeats, whichever thread meets it
    /// (a sync and a segment's open retried on a directory that was
    /// replaced say so once).
    pub fn fail(&self, what: &str, error: &std::io::Error) {
        let error_text = error.to_string();
        let mut status = self.status.lock().expect("status lock");
        let repeated = status
            .paused
            .as_ref()
            .is_some_and(|paused| paused.ends_with(&error_text));
        if !repeated {
            warn!(%error, "state directory: {what} failed; persistence pauses");
        }
        status.paused = Some(format!("{what}: {error_text}"));
        drop(status);
        self.fault.store(true, Ordering::Release);
    }
}

/// Work for the sync thread.
pub enum SyncJob {
    /// The log writer opened a new segment: fsync it from now on.
    Segment(File),
    /// Final sync at a clean shutdown: nothing more is published.
    Stop,
}

/// Fsyncs the log every `interval` and writes the `synced` record.
pub struct Syncer {
    pub dir: Arc<DirLock>,
    pub boot_id: Vec<u8>,
    pub seed: u64,
    pub interval: Duration,
    pub shared: Arc<Shared>,
    pub metrics: Metrics,
}

impl Syncer {
    pub fn run(self, jobs: Receiver<SyncJob>) {
        let mut segments: Vec<File> = Vec::new();
        let mut synced_through = 0;
        loop {
            let stop = match jobs.recv_timeout(self.interval) {
                Ok(SyncJob::Segment(file)) => {
                    segments.push(file);
                    continue;
                }
                Ok(SyncJob::Stop) => Some(()),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            // Loaded before the fsyncs, and after every segment announced
            // before it was written: the files synced hold it all.
            let through = self.shared.written_through.load(Ordering::Acquire);
            while let Ok(job) = jobs.try_recv() {
                if let SyncJob::Segment(file) = job {
                    segments.push(file);
                }
            }
            if through != synced_through || stop.is_some() {
                match self.sync(&segments, through, stop.is_some()) {
                    Ok(()) => {
                        synced_through = through;
                        // Only the newest can still be written to.
                        let keep = segments.len().saturating_sub(1);
                        segments.drain(..keep);
                    }
                    Err(error) => self.shared.fail("fsync of the log", &error),
                }
            }
            let bytes = files::bytes_on_disk(self.dir.held());
            self.metrics.state_disk_bytes.set(bytes as i64);
            {
                let mut status = self.shared.status.lock().expect("status lock");
                status.bytes_on_disk = bytes;
                status.synced_through = synced_through;
            }
            if stop.is_some() {
                return;
            }
        }
    }

    fn sync(&self, segments: &[File], through: u64, clean: bool) -> std::io::Result<()> {
        self.shared
            .sync_started
            .store(crate::clock::unix_micros_now(), Ordering::Release);
        let synced = self.sync_and_record(segments, through, clean);
        self.shared.sync_started.store(0, Ordering::Release);
        synced
    }

    fn sync_and_record(&self, segments: &[File], through: u64, clean: bool) -> std::io::Result<()> {
        for segment in segments {
            segment.sync_data()?;
        }
        write_synced(
            self.dir.checked()?,
            SyncedRecord {
                boot_id: self.boot_id.clone(),
                seed: self.seed,
                through,
                clean,
            },
        )
    }
}

/// Replaces the `synced` record (fsynced, atomically).
pub fn write_synced(dir: &Path, record: SyncedRecord) -> std::io::Result<()> {
    let mut out = file_header(FileKind::Synced).to_vec();
    put_record(&mut out, kind::SYNCED, &[&record.encode()]);
    files::replace(dir, files::SYNCED_FILE, &out)
}

/// A checkpoint to write: the cut and what goes with it.
pub struct CheckpointJob {
    pub cut: Arc<SnapshotCut>,
    pub meta: CheckpointMeta,
}

/// Writes checkpoints of the cuts the drain takes (handed over through the
/// log writer thread, which keeps count of what was logged since).
pub struct Checkpointer {
    pub dir: Arc<DirLock>,
    pub shared: Arc<Shared>,
    pub metrics: Metrics,
}

impl Checkpointer {
    pub fn run(self, jobs: Receiver<CheckpointJob>) {
        for job in jobs {
            let position = job.meta.position;
            match self.write(&job) {
                Ok(blocks) => {
                    if let Err(error) = self.delete_covered(position) {
                        warn!(%error, "state directory: cannot delete what a checkpoint covers");
                    }
                    self.metrics.state_checkpoints.inc();
                    self.metrics.state_checkpoint_blocks.set(blocks as i64);
                    let now = unix_now();
                    self.metrics.state_checkpoint_timestamp_seconds.set(now);
                    self.shared
                        .status
                        .lock()
                        .expect("status lock")
                        .last_checkpoint = Some(CheckpointStatus {
                        position,
                        blocks,
                        unix_seconds: now,
                    });
                    info!(position, blocks, "state checkpoint written");
                }
                Err(error) => {
                    self.shared.checkpoint_failed.store(true, Ordering::Release);
                    self.metrics.state_write_failures.inc();
                    warn!(%error, position, "state checkpoint failed; the log keeps everything until one succeeds");
                    let _ = std::fs::remove_file(temporary(self.dir.held(), position));
                }
            }
            self.shared.checkpoint_busy.store(false, Ordering::Release);
        }
    }

    /// Writes the checkpoint and returns its block count.
    fn write(&self, job: &CheckpointJob) -> std::io::Result<u64> {
        let position = job.meta.position;
        let dir = self.dir.checked()?;
        let temporary = temporary(dir, position);
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&temporary)?);
        let mut record = file_header(FileKind::Checkpoint).to_vec();
        put_record(&mut record, kind::CHECKPOINT_META, &[&job.meta.encode()]);
        out.write_all(&record)?;
        let mut chunks = 0u64;
        let blocks = job
            .cut
            .state
            .values()
            .map(|blocks| blocks.counts().total())
            .sum();
        // A chunk (about 1 MiB) goes out as it is, behind its record's
        // head: copying it into a record buffer first cost a second large
        // allocation per chunk, and the allocator's locks are shared with
        // the drain.
        for chunk in SnapshotEncoder::plan(Arc::clone(&job.cut), unix_now()) {
            out.write_all(&record_head(kind::CHUNK, &[&chunk]))?;
            out.write_all(&chunk)?;
            chunks += 1;
        }
        record.clear();
        put_record(
            &mut record,
            kind::CHECKPOINT_END,
            &[&encode_checkpoint_end(chunks, blocks)],
        );
        out.write_all(&record)?;
        let file = out.into_inner().map_err(|error| error.into_error())?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&temporary, dir.join(files::checkpoint_name(position)))?;
        files::sync_dir(dir)?;
        Ok(blocks)
    }

    /// Deletes older checkpoints, and segments whose batches are all
    /// covered by the checkpoint at `position` and older than the history.
    fn delete_covered(&self, position: u64) -> std::io::Result<()> {
        let history_oldest = self.shared.history_oldest.load(Ordering::Acquire);
        let needed_from = (position + 1).min(history_oldest.max(1));
        let dir = self.dir.checked()?;
        let listed = files::list(dir)?;
        let open = self.shared.open_segment.load(Ordering::Acquire);
        let segments: Vec<(u64, bool, &Path)> = listed
            .iter()
            .filter_map(|file| match file.named {
                Named::Segment {
                    first_position,
                    unfinished,
                } if file.is_file => Some((first_position, unfinished, file.path.as_path())),
                _ => None,
            })
            .collect();
        // A segment's batches end where the next one's begin; the newest
        // is still being written, and so is the open one whatever sorts
        // after it.
        let mut obsolete: Vec<&Path> = segments
            .windows(2)
            .filter(|pair| {
                let ((first, unfinished, _), (next_first, ..)) = (pair[0], pair[1]);
                next_first <= needed_from && (unfinished || first != open)
            })
            .map(|pair| pair[0].2)
            .collect();
        obsolete.extend(listed.iter().filter_map(|file| match file.named {
            Named::Checkpoint { position: older } if older < position && file.is_file => {
                Some(file.path.as_path())
            }
            _ => None,
        }));
        // One file that cannot go must not keep the others.
        for path in obsolete {
            if let Err(error) = std::fs::remove_file(path) {
                warn!(%error, file = %path.display(), "state directory: cannot delete an obsolete file");
            }
        }
        files::sync_dir(dir)
    }
}

/// Where a checkpoint at `position` is written before it is renamed.
fn temporary(dir: &Path, position: u64) -> PathBuf {
    dir.join(format!("{}.tmp", files::checkpoint_name(position)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::ClosedLabels;

    #[test]
    fn a_checkpoint_never_deletes_the_segment_being_written() {
        let dir = std::env::temp_dir().join(format!("continuity-delete-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let names = [
            files::segment_name(1),
            files::unfinished_name(6),
            files::segment_name(6),
        ];
        for name in &names {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let shared = Arc::new(Shared::default());
        shared.open_segment.store(6, Ordering::Release);
        shared.history_oldest.store(100, Ordering::Release);
        let checkpointer = Checkpointer {
            dir: Arc::new(DirLock::take(&dir).unwrap()),
            shared,
            metrics: Metrics::new(ClosedLabels::default()),
        };
        checkpointer.delete_covered(20).unwrap();
        let left: Vec<bool> = names.iter().map(|name| dir.join(name).exists()).collect();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(left, [false, true, true], "{names:?}");
    }
}
