//! The file side of the log: appends each cycle's batches to a segment,
//! rotates segments, pauses and resumes persistence, and hands checkpoints
//! and fsyncs to the background threads. It runs on the log writer thread
//! (`log_thread`), which the drain hands its cycles to.
//!
//! Invariants: a cycle is reported written (`Shared::written_through`, and
//! the cycle handed back to the drain by `log_thread`) only after its
//! records and its cycle's end were handed to the kernel (a write into the
//! page cache, no fsync), so every batch the drain announces survives a
//! killed process. The batches' own bytes are written (`writev`), never
//! copied into a record buffer first. When a write fails (or the drain
//! found one that did not complete in time), persistence pauses: the open
//! segment is closed as it is, and serving goes on. Nothing is written to
//! mark the log incomplete (a failing disk may accept nothing): the
//! announcement mark, raised before each announcement, already names
//! positions the log lacks. Every `PAUSE_RETRY` a new segment is tried;
//! once one opens, a checkpoint is asked for at once, so the log is whole
//! again from there. Every segment is created in the held directory, once
//! it is checked to be the one taken (`DirLock::checked`).

use std::fs::File;
use std::io::{IoSlice, Write};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::time::{Duration, Instant};

use tracing::info;

use super::background::{CheckpointJob, Operation, Shared, SyncJob};
use super::files;
use super::format::{Fields, FileKind, RECORD_HEADER_BYTES, file_header, put_record, record_head};
use super::lock::DirLock;
use super::records::{
    BatchRecord, CheckpointMeta, CycleRecord, Marks, RankMark, SegmentHeader, kind,
};
use crate::hub::FramedBatch;
use crate::metrics::Metrics;
use crate::state::snapshot::SnapshotCut;

/// How often a paused log tries a new segment, and a failed checkpoint
/// is tried again.
const PAUSE_RETRY: Duration = Duration::from_secs(1);

/// A checkpoint is also taken this long after the last one when anything
/// was logged since, so an idle engine's state is never far behind.
const CHECKPOINT_MAX_AGE: Duration = Duration::from_secs(60);

/// Writes every byte of `slices`, in as few `writev` calls as the kernel
/// takes (a cycle of more than about 500 batches needs several: a process
/// killed between them leaves a cycle without its end, never announced).
fn write_all_vectored(file: &mut File, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !slices.is_empty() {
        match file.write_vectored(slices) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut slices, written),
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// The bounds the flags set.
#[derive(Clone, Copy, Debug)]
pub struct StoreLimits {
    /// A segment is closed and a new one opened past this size.
    pub segment_bytes: u64,
    /// A checkpoint is taken once this much was logged since the last.
    pub checkpoint_bytes: u64,
}

/// A batch record's bytes before the batch's own: the record's header and
/// kind, then position, rank and sequence.
const BATCH_HEAD_BYTES: usize = RECORD_HEADER_BYTES + 1 + BatchRecord::HEADER_BYTES;

struct OpenSegment {
    file: File,
    bytes: u64,
}

/// Appends to the log; owned by the log writer thread.
pub struct StoreWriter {
    pub(super) dir: Arc<DirLock>,
    pub(super) boot_id: Vec<u8>,
    pub(super) seed: u64,
    pub(super) limits: StoreLimits,
    pub(super) shared: Arc<Shared>,
    pub(super) metrics: Metrics,
    pub(super) sync_jobs: SyncSender<SyncJob>,
    pub(super) checkpoint_jobs: SyncSender<CheckpointJob>,
    /// The sync thread, joined at a clean shutdown for its last sync (the
    /// checkpoint thread is left to finish or die with the process: a
    /// checkpoint cut short is only a temporary file).
    pub(super) sync_thread: Option<std::thread::JoinHandle<()>>,
    segment: Option<OpenSegment>,
    /// When persistence paused, and when to try again.
    paused: Option<Instant>,
    /// The next checkpoint should be taken at the first chance.
    checkpoint_due: bool,
    logged_since_checkpoint: u64,
    last_checkpoint: Instant,
    /// This cycle's batch record heads, each written before its batch.
    heads: Vec<[u8; BATCH_HEAD_BYTES]>,
    /// This cycle's end record.
    cycle_end: Vec<u8>,
    /// This cycle's end payload.
    cycle_fields: Fields,
}

impl StoreWriter {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        dir: Arc<DirLock>,
        boot_id: Vec<u8>,
        seed: u64,
        limits: StoreLimits,
        shared: Arc<Shared>,
        metrics: Metrics,
        sync_jobs: SyncSender<SyncJob>,
        checkpoint_jobs: SyncSender<CheckpointJob>,
        sync_thread: std::thread::JoinHandle<()>,
        checkpoint_due: bool,
    ) -> Self {
        Self {
            dir,
            boot_id,
            seed,
            limits,
            shared,
            metrics,
            sync_jobs,
            checkpoint_jobs,
            sync_thread: Some(sync_thread),
            segment: None,
            paused: None,
            checkpoint_due,
            logged_since_checkpoint: 0,
            last_checkpoint: Instant::now(),
            heads: Vec::new(),
            cycle_end: Vec::new(),
            cycle_fields: Fields::default(),
        }
    }

    /// Logs one drain cycle: `batches` (rank, sequence, bytes) take the
    /// positions from `first_position` on, then the cycle's end with
    /// `marks` (by rank). Returns once the kernel has it (or persistence
    /// paused).
    pub fn append_cycle(
        &mut self,
        first_position: u64,
        batches: &[(u32, u64, FramedBatch)],
        marks: &[(u32, RankMark)],
    ) {
        if self.shared.fault.swap(false, Ordering::AcqRel) {
            self.pause(None);
        }
        if let Some(since) = self.paused {
            if since.elapsed() < PAUSE_RETRY {
                return;
            }
            self.paused = None;
        }
        let full = self
            .segment
            .as_ref()
            .is_some_and(|segment| segment.bytes >= self.limits.segment_bytes);
        if self.segment.is_none() || full {
            self.shared.begin(Operation::Opening);
            let opened = self.open_segment(first_position);
            self.shared.begin(Operation::Idle);
            if let Err(error) = opened {
                self.pause(Some((Operation::Opening.describe(), error)));
                return;
            }
        }
        self.heads.clear();
        let mut position = first_position;
        for (rank, sequence, encoded) in batches {
            let header = BatchRecord::header(position, *rank, *sequence);
            let mut head = [0; BATCH_HEAD_BYTES];
            let (record, fields) = head.split_at_mut(RECORD_HEADER_BYTES + 1);
            record.copy_from_slice(&record_head(kind::BATCH, &[&header, encoded.message()]));
            fields.copy_from_slice(&header);
            self.heads.push(head);
            position += 1;
        }
        self.cycle_fields.0.clear();
        CycleRecord::encode_parts(
            &mut self.cycle_fields,
            position - 1,
            marks.iter().map(|(rank, mark)| (rank, mark)),
        );
        self.cycle_end.clear();
        put_record(&mut self.cycle_end, kind::CYCLE, &[&self.cycle_fields.0]);
        let mut slices: Vec<IoSlice> = Vec::with_capacity(2 * batches.len() + 1);
        for (head, (_, _, encoded)) in self.heads.iter().zip(batches) {
            slices.push(IoSlice::new(head));
            slices.push(IoSlice::new(encoded.message()));
        }
        slices.push(IoSlice::new(&self.cycle_end));
        let bytes: u64 = slices.iter().map(|slice| slice.len() as u64).sum();
        let segment = self.segment.as_mut().expect("opened above");
        self.shared.begin(Operation::Writing);
        let written = write_all_vectored(&mut segment.file, &mut slices);
        self.shared.begin(Operation::Idle);
        match written {
            Ok(()) => {
                segment.bytes += bytes;
                self.logged_since_checkpoint += bytes;
                self.metrics.state_log_bytes.inc_by(bytes);
                self.shared
                    .written_through
                    .store(position - 1, Ordering::Release);
            }
            Err(error) => self.pause(Some((Operation::Writing.describe(), error))),
        }
    }

    fn open_segment(&mut self, first_position: u64) -> std::io::Result<()> {
        let path = self
            .dir
            .checked()?
            .join(files::segment_name(first_position));
        let mut file = File::create(&path)?;
        let mut header = file_header(FileKind::Segment).to_vec();
        let segment_header = SegmentHeader {
            boot_id: self.boot_id.clone(),
            seed: self.seed,
            first_position,
        };
        put_record(
            &mut header,
            kind::SEGMENT_HEADER,
            &[&segment_header.encode()],
        );
        file.write_all(&header)?;
        let for_sync = file.try_clone()?;
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.sync_jobs.try_send(SyncJob::Segment(for_sync))
        {
            return Err(std::io::Error::other("the sync thread is not keeping up"));
        }
        let resumed = self.segment.is_none() && self.metrics.state_paused.get() == 1;
        self.shared
            .open_segment
            .store(first_position, Ordering::Release);
        self.segment = Some(OpenSegment {
            file,
            bytes: header.len() as u64,
        });
        if resumed {
            info!(
                first_position,
                "state directory writable again: persistence resumes"
            );
            self.metrics.state_paused.set(0);
            self.shared.status.lock().expect("status lock").paused = None;
            self.checkpoint_due = true;
        }
        Ok(())
    }

    /// Stops logging until `PAUSE_RETRY` has passed, closing the open
    /// segment: the next opens at the next cycle's position, after a gap.
    fn pause(&mut self, failed: Option<(&str, std::io::Error)>) {
        if let Some((what, error)) = failed {
            self.shared.fail(what, &error);
            self.shared.fault.store(false, Ordering::Release);
        }
        self.metrics.state_write_failures.inc();
        self.metrics.state_paused.set(1);
        self.paused = Some(Instant::now());
        self.segment = None;
        self.shared.open_segment.store(0, Ordering::Release);
    }

    /// Whether the drain should hand over a cut for a checkpoint now.
    fn wants_checkpoint(&self) -> bool {
        if self.segment.is_none() || self.shared.checkpoint_busy.load(Ordering::Acquire) {
            return false;
        }
        let retry = self.shared.checkpoint_failed.load(Ordering::Acquire)
            && self.last_checkpoint.elapsed() >= PAUSE_RETRY;
        self.checkpoint_due
            || retry
            || self.logged_since_checkpoint >= self.limits.checkpoint_bytes
            || (self.logged_since_checkpoint > 0
                && self.last_checkpoint.elapsed() >= CHECKPOINT_MAX_AGE)
    }

    /// Tells the drain whether it should hand over a cut for a checkpoint
    /// at its next quiet point (`Shared::checkpoint_wanted`).
    pub fn publish_checkpoint_wanted(&self) {
        self.shared
            .checkpoint_wanted
            .store(self.wants_checkpoint(), Ordering::Release);
    }

    /// Hands `cut` to the checkpoint thread (the drain's cut is copy on
    /// write, so it stays as it is while the drain goes on).
    pub fn checkpoint(&mut self, cut: SnapshotCut, marks: Marks) {
        let meta = CheckpointMeta {
            position: cut.position,
            seed: self.seed,
            last_sequences: cut.last_sequences.clone(),
            marks,
        };
        self.shared.checkpoint_busy.store(true, Ordering::Release);
        let job = CheckpointJob {
            cut: Arc::new(cut),
            meta,
        };
        if self.checkpoint_jobs.try_send(job).is_err() {
            self.shared.checkpoint_busy.store(false, Ordering::Release);
            return;
        }
        self.checkpoint_due = false;
        self.shared
            .checkpoint_failed
            .store(false, Ordering::Release);
        self.logged_since_checkpoint = 0;
        self.last_checkpoint = Instant::now();
    }

    /// A clean shutdown: the last sync records that nothing was published
    /// after what was written (unless persistence is paused: then the log
    /// cannot vouch for its end).
    pub fn close(mut self) {
        if self.segment.is_some()
            && self.paused.is_none()
            && !self.shared.fault.load(Ordering::Acquire)
        {
            let _ = self.sync_jobs.send(SyncJob::Stop);
        }
        drop(self.sync_jobs);
        if let Some(thread) = self.sync_thread.take() {
            let _ = thread.join();
        }
    }
}
