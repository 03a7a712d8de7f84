//! Reading the state directory back at start: the newest checkpoint that
//! verifies, then the logged batches after it.
//!
//! Invariants: every byte read is untrusted; what does not verify is set
//! aside and never served. The state is rebuilt only from a checkpoint and
//! every batch after it with no position missing, else kvgate starts with
//! an empty state. The old numbering goes on only when the directory proves
//! it holds every batch the old process announced: the newest segment
//! verified to its end and either the announcement mark (`announced`: how
//! far the old process announced, raised before each announcement) names
//! no position past the log's end, or a `synced` record of a clean shutdown
//! ends exactly there. Otherwise the state is kept but numbered anew, and
//! old cursors are refused. A log cut short
//! before a checkpoint's or the last sync's position lacks announced
//! batches too; one cut after them cannot be told from a write cut short
//! by a killed process (so the directory should not be edited by hand).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::File;
use std::io::{self, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use prost::Message;
use serde::Serialize;
use tracing::warn;

use super::announced::MarkRecord;
use super::files::{self, Listed, Named};
use super::format::{Damage, FileKind, Next, RecordReader};
use super::records::{
    BatchRecord, CheckpointMeta, CycleRecord, Marks, SegmentHeader, SyncedRecord, kind,
};
use crate::hub::HistoryLimits;
use crate::proto::common::KvEventBatch;
use crate::state::LiveState;
use crate::wire::Batch;

/// The most of one cycle's batches held while reading it back (a cycle is
/// taken whole or not at all, so its batches wait for its end): beside the
/// history, the most a restore holds of the log is this and one record.
/// The drain's cycles (at most 256 engine messages) are normally far
/// smaller; a longer run of batches is set aside as malformed (and the
/// restart then renumbers, as after any damage at the log's end).
pub const MAX_CYCLE_BYTES: usize = 64 << 20;

/// How the directory's content was taken up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Nothing to restore: a new directory.
    Empty,
    /// State, history and numbering go on where the old process stopped.
    Continued,
    /// The state goes on under new numbers: the directory may lack batches
    /// the old process announced, so old cursors are refused.
    Renumbered,
    /// The state could not be rebuilt (a checkpoint or batches missing or
    /// damaged): kvgate starts as without a directory.
    Fresh,
}

/// What the restore found, for `/status` and the metrics.
#[derive(Clone, Debug, Serialize)]
pub struct RestoreReport {
    pub outcome: Outcome,
    /// The position of the checkpoint the state started from.
    pub checkpoint_position: Option<u64>,
    /// Blocks read from that checkpoint.
    pub checkpoint_blocks: u64,
    /// Logged batches applied to the state after the checkpoint.
    pub batches_replayed: u64,
    /// Logged batches put back into the history.
    pub history_batches: u64,
    /// Files set aside, with why.
    pub set_aside: Vec<String>,
}

/// Everything the drain, the hub and the source continue from.
pub struct Restored {
    pub report: RestoreReport,
    /// With `Continued`: the numbering's first number and each rank's last.
    pub numbering: Option<(u64, BTreeMap<u32, u64>)>,
    /// With `Continued`: the newest batches, for the history.
    pub history: Vec<Arc<Batch>>,
    /// The position the next published batch takes.
    pub next_position: u64,
    /// Past every position a file names: where a new numbering starts its
    /// log.
    past_every_position: u64,
    /// The highest sequence number or numbering seed any file names: a
    /// new numbering starts above it, whatever the clock says.
    pub highest_number: u64,
    pub state: LiveState,
    /// Each engine publisher's record as of the state.
    pub marks: Marks,
    /// Something restored lives only in files that a new checkpoint
    /// should replace (set aside, renumbered, or started fresh).
    pub needs_checkpoint: bool,
}

impl Restored {
    /// Gives up a continued numbering (this process cannot keep the mark
    /// that would vouch for what it announces): the state goes on under a
    /// new numbering, as after any unproven end.
    pub fn renumber(&mut self) {
        if self.report.outcome == Outcome::Continued {
            self.report.outcome = Outcome::Renumbered;
            self.numbering = None;
            self.history.clear();
            self.report.history_batches = 0;
            self.next_position = self.past_every_position;
            self.needs_checkpoint = true;
        }
    }
}

/// A checkpoint read back whole.
struct Base {
    meta: CheckpointMeta,
    state: LiveState,
    blocks: u64,
}

/// The history being refilled: the newest batches within the limits.
struct RestoredHistory {
    batches: VecDeque<Arc<Batch>>,
    bytes: usize,
    limits: HistoryLimits,
}

impl RestoredHistory {
    fn push(&mut self, batch: Arc<Batch>) {
        self.bytes += batch.retained_bytes();
        self.batches.push_back(batch);
        while self.batches.len() > 1
            && (self.batches.len() > self.limits.batches || self.bytes > self.limits.bytes)
        {
            let evicted = self.batches.pop_front().expect("more than one");
            self.bytes -= evicted.retained_bytes();
        }
    }

    fn clear(&mut self) {
        self.batches.clear();
        self.bytes = 0;
    }
}

/// Whether the newest segment proves the log's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tail {
    /// Verified to its end (a torn last record is a write cut short,
    /// never announced).
    Verified,
    /// Damaged, or marked unfinished (by an earlier version, when a write
    /// failed while it went on announcing).
    Unproven,
}

/// Where the scan of the log is.
struct Scan {
    state: LiveState,
    /// The state includes every batch up to here.
    state_through: u64,
    state_broken: bool,
    batches_replayed: u64,
    /// The last committed position (a batch followed by its cycle's end),
    /// 0 before the first.
    end: u64,
    /// The highest position any file names.
    highest: u64,
    /// The highest sequence number or seed any file names.
    highest_number: u64,
    seed: Option<u64>,
    last_sequences: BTreeMap<u32, u64>,
    history: RestoredHistory,
    /// The newest cycle's marks and position.
    marks: Option<(u64, Marks)>,
    /// (tail, seed) of the newest segment that committed a batch, or that
    /// cannot prove it did not.
    newest: Option<(Tail, u64)>,
}

/// Reads `dir` back, with the announcement mark the last process left
/// (`mark`, already checked to be this directory's and this boot's);
/// `set_aside` is told of every damaged file (already renamed). Files are
/// never trusted: nothing here panics on their content.
pub fn restore(
    dir: &Path,
    mark: Option<MarkRecord>,
    limits: HistoryLimits,
    set_aside: &mut dyn FnMut(&Path, Damage),
) -> io::Result<Restored> {
    let mut damaged = Vec::new();
    let mut set_aside_names = Vec::new();
    let mut put_aside = |path: &Path, damage: Damage| {
        let kept = files::damaged_path(path, damage);
        match std::fs::rename(path, &kept) {
            Ok(()) => {
                warn!(file = %path.display(), kept = %kept.display(), kind = damage.as_str(), "state file does not verify: set aside")
            }
            Err(error) => {
                warn!(file = %path.display(), %error, kind = damage.as_str(), "state file does not verify and cannot be set aside; ignored")
            }
        }
        damaged.push(damage);
        set_aside_names.push(format!("{}: {}", path.display(), damage.as_str()));
        set_aside(path, damage);
    };
    let mut segments: Vec<(u64, bool, PathBuf)> = Vec::new();
    let mut checkpoints: Vec<(u64, PathBuf)> = Vec::new();
    let mut synced = None;
    for Listed {
        named,
        path,
        is_file,
        ..
    } in files::list(dir)?
    {
        if !is_file {
            put_aside(&path, Damage::NotAFile);
            continue;
        }
        match named {
            Named::Temporary => {
                let _ = std::fs::remove_file(&path);
            }
            Named::Segment {
                first_position,
                unfinished,
            } => segments.push((first_position, unfinished, path)),
            Named::Checkpoint { position } => checkpoints.push((position, path)),
            Named::Synced => match unreadable_is_damage(&path, read_synced(&path)) {
                Ok(record) => synced = record,
                Err(damage) => put_aside(&path, damage),
            },
        }
    }
    let found_anything = !segments.is_empty() || !checkpoints.is_empty();

    // A segment of a numbering this directory's history cannot hold
    // (another kvgate's, copied in) is set aside before anything is read.
    let numbered: Vec<(u64, Option<u64>)> = segments
        .iter()
        .map(|(first_position, _, path)| (*first_position, segment_seed(path)))
        .collect();
    let foreign = foreign_segments(&numbered, synced.as_ref().map(|synced| synced.seed));
    let mut own_segments = Vec::with_capacity(segments.len());
    for ((segment, (_, seed)), foreign) in segments.into_iter().zip(numbered).zip(foreign) {
        if foreign {
            put_aside(&segment.2, Damage::Foreign);
        } else {
            own_segments.push((segment, seed));
        }
    }
    // The numberings this directory's history used: every process records
    // its own in `synced` before anything else, and in each segment.
    let known_seeds: BTreeSet<u64> = synced
        .iter()
        .map(|synced| synced.seed)
        .chain(own_segments.iter().filter_map(|(_, seed)| *seed))
        .collect();
    let segments: Vec<(u64, bool, PathBuf)> = own_segments
        .into_iter()
        .map(|(segment, _)| segment)
        .collect();
    let mut base = None;
    for (position, path) in checkpoints.iter().rev() {
        match unreadable_is_damage(path, read_checkpoint(path, *position)) {
            Ok(read) if known_seeds.contains(&read.meta.seed) => {
                base = Some(read);
                break;
            }
            Ok(_) => put_aside(path, Damage::Foreign),
            Err(damage) => put_aside(path, damage),
        }
    }
    let checkpoint_position = base.as_ref().map(|base| base.meta.position);
    let checkpoint_blocks = base.as_ref().map_or(0, |base| base.blocks);
    let (state, state_through) = match base.as_ref() {
        Some(base) => (LiveState::default(), base.meta.position),
        None => (LiveState::default(), 0),
    };
    let (base_state, base_meta) = match base {
        Some(Base { meta, state, .. }) => (Some(state), Some(meta)),
        None => (None, None),
    };
    let mut scan = Scan {
        state: base_state.unwrap_or(state),
        state_through,
        state_broken: false,
        batches_replayed: 0,
        end: 0,
        highest: state_through,
        highest_number: base_meta.as_ref().map_or(0, |meta| {
            meta.last_sequences
                .values()
                .fold(meta.seed, |highest, &sequence| highest.max(sequence))
        }),
        seed: None,
        last_sequences: BTreeMap::new(),
        history: RestoredHistory {
            batches: VecDeque::new(),
            bytes: 0,
            limits,
        },
        marks: None,
        newest: None,
    };
    for (first_position, unfinished, path) in &segments {
        scan.highest = scan.highest.max(*first_position);
        if let Err(damage) =
            unreadable_is_damage(path, scan.segment(path, *first_position, *unfinished))
        {
            put_aside(path, damage);
        }
    }

    // With nothing logged after it, the checkpoint is where the log ends.
    let end = scan.end.max(state_through);
    // A log that ends before what a checkpoint or a sync saw was cut
    // short after the fact: it lacks batches that were announced.
    let log_reaches = |seed: u64| {
        scan.end >= state_through
            && synced
                .as_ref()
                .is_none_or(|synced| synced.seed != seed || synced.through <= scan.end)
    };
    // Nothing was announced past the log's end: the mark, raised before
    // every announcement, says so, or a clean shutdown recorded it.
    let end_proven = |seed: u64| {
        mark.is_some_and(|mark| !mark.owner_running && mark.seed == seed && mark.through <= end)
            || synced_clean_at(&synced, seed, end)
    };
    let numbering_proven = match (&scan.newest, &base_meta) {
        (Some((Tail::Verified, seed)), _) => log_reaches(*seed) && end_proven(*seed),
        (Some((Tail::Unproven, _)), _) => false,
        (None, Some(meta)) => end_proven(meta.seed),
        (None, None) => false,
    };
    let seed = scan
        .newest
        .as_ref()
        .map(|(_, seed)| *seed)
        .or(base_meta.as_ref().map(|meta| meta.seed));
    let outcome = if !found_anything {
        Outcome::Empty
    } else if scan.state_broken {
        Outcome::Fresh
    } else if numbering_proven {
        Outcome::Continued
    } else {
        Outcome::Renumbered
    };
    let marks = match (scan.marks.take(), base_meta.as_ref()) {
        (Some((position, _)), Some(meta)) if position < meta.position => meta.marks.clone(),
        (Some((_, marks)), _) => marks,
        (None, Some(meta)) => meta.marks.clone(),
        (None, None) => Marks::new(),
    };
    // Past every position a file names, so the new numbering's first
    // segment is never named like one left from the old. (Positions the
    // mark names past them name no file, and never reach a router: only
    // the mark's sequence numbers must not be used again.)
    let past_every_position = scan.highest + 1;
    let mut restored = Restored {
        report: RestoreReport {
            outcome,
            checkpoint_position,
            checkpoint_blocks,
            batches_replayed: scan.batches_replayed,
            history_batches: 0,
            set_aside: set_aside_names,
        },
        numbering: None,
        history: Vec::new(),
        next_position: end + 1,
        past_every_position,
        highest_number: scan
            .highest_number
            .max(synced.as_ref().map_or(0, |synced| synced.seed))
            .max(mark.map_or(0, |mark| mark.seed.max(mark.highest_sequence))),
        state: LiveState::default(),
        marks: Marks::new(),
        needs_checkpoint: !damaged.is_empty()
            || matches!(outcome, Outcome::Renumbered | Outcome::Fresh),
    };
    match outcome {
        Outcome::Empty => {}
        Outcome::Fresh => restored.next_position = past_every_position,
        Outcome::Renumbered => {
            restored.next_position = past_every_position;
            restored.state = scan.state;
            restored.marks = marks;
        }
        Outcome::Continued => {
            let seed = seed.expect("a numbering was proven");
            let mut last_sequences = scan.last_sequences;
            if let Some(meta) = base_meta.filter(|meta| meta.seed == seed) {
                for (rank, sequence) in meta.last_sequences {
                    let last = last_sequences.entry(rank).or_insert(sequence);
                    *last = (*last).max(sequence);
                }
            }
            restored.numbering = Some((seed, last_sequences));
            // The history ends where the log does (`log_reaches`), or is
            // not put back at all.
            if scan.history.batches.back().map(|batch| batch.position) == Some(end) {
                restored.history = scan.history.batches.into();
            }
            restored.report.history_batches = restored.history.len() as u64;
            restored.state = scan.state;
            restored.marks = marks;
        }
    }
    Ok(restored)
}

/// A file that cannot be opened or read (permissions, an I/O error) is
/// damage like one that does not verify.
fn unreadable_is_damage<T>(path: &Path, read: io::Result<Result<T, Damage>>) -> Result<T, Damage> {
    read.unwrap_or_else(|error| {
        warn!(file = %path.display(), %error, "state file cannot be read");
        Err(Damage::Malformed)
    })
}

fn synced_clean_at(synced: &Option<SyncedRecord>, seed: u64, end: u64) -> bool {
    synced
        .as_ref()
        .is_some_and(|synced| synced.clean && synced.seed == seed && synced.through == end)
}

fn open_records(
    path: &Path,
    kind: FileKind,
) -> io::Result<Result<Option<RecordReader<BufReader<File>>>, Damage>> {
    let file = File::open(path)?;
    RecordReader::open(BufReader::with_capacity(1 << 20, file), kind)
}

/// Which segments (`(first position, the seed its header names)`, in log
/// order) are not this directory's history, given the newest numbering
/// (`synced`'s: every process writes it before it creates any file).
/// A new numbering starts above every number and past every position the
/// directory names, so along the log the seeds only go up, and the newest
/// numbering's segments come after every older one's: a segment of a seed
/// above the newest, of another seed after the newest's first segment, or
/// of a seed above a later segment's is another history's. Without a
/// `synced` record that reads nothing is judged (so that none of the
/// directory's own segments is set aside); a header that does not read is
/// left to the reading, which sets it aside as damage.
fn foreign_segments(numbered: &[(u64, Option<u64>)], newest: Option<u64>) -> Vec<bool> {
    let mut foreign = vec![false; numbered.len()];
    let Some(newest) = newest else {
        return foreign;
    };
    let newest_starts = numbered
        .iter()
        .filter(|(_, seed)| *seed == Some(newest))
        .map(|(first_position, _)| *first_position)
        .min();
    let mut later_seed = newest;
    for (index, (first_position, seed)) in numbered.iter().enumerate().rev() {
        let Some(seed) = *seed else { continue };
        if seed == newest || seed == later_seed {
            continue;
        }
        if seed < later_seed && newest_starts.is_none_or(|starts| *first_position < starts) {
            later_seed = seed;
        } else {
            foreign[index] = true;
        }
    }
    foreign
}

/// The numbering a segment's header names, if it reads.
fn segment_seed(path: &Path) -> Option<u64> {
    let mut reader = open_records(path, FileKind::Segment).ok()?.ok()??;
    match reader.next().ok()? {
        Next::Record(kind::SEGMENT_HEADER, payload) => SegmentHeader::decode(&payload)
            .ok()
            .map(|header| header.seed),
        _ => None,
    }
}

fn read_synced(path: &Path) -> io::Result<Result<Option<SyncedRecord>, Damage>> {
    let mut reader = match open_records(path, FileKind::Synced)? {
        Ok(Some(reader)) => reader,
        Ok(None) => return Ok(Err(Damage::Malformed)),
        Err(damage) => return Ok(Err(damage)),
    };
    Ok(match reader.next()? {
        Next::Record(kind::SYNCED, payload) => SyncedRecord::decode(&payload).map(Some),
        Next::Damaged(damage) => Err(damage),
        _ => Err(Damage::Malformed),
    })
}

/// A checkpoint read and applied to a state of its own, or why not. Only a
/// checkpoint complete to its last record counts: it was renamed into
/// place after an fsync, so a torn one is damage.
fn read_checkpoint(path: &Path, position: u64) -> io::Result<Result<Base, Damage>> {
    let mut reader = match open_records(path, FileKind::Checkpoint)? {
        Ok(Some(reader)) => reader,
        Ok(None) => return Ok(Err(Damage::Malformed)),
        Err(damage) => return Ok(Err(damage)),
    };
    let meta = match reader.next()? {
        Next::Record(kind::CHECKPOINT_META, payload) => match CheckpointMeta::decode(&payload) {
            Ok(meta) if meta.position == position => meta,
            Ok(_) => return Ok(Err(Damage::Malformed)),
            Err(damage) => return Ok(Err(damage)),
        },
        Next::Damaged(damage) => return Ok(Err(damage)),
        _ => return Ok(Err(Damage::Malformed)),
    };
    let mut state = LiveState::default();
    let mut chunks = 0u64;
    loop {
        match reader.next()? {
            Next::Record(kind::CHUNK, payload) => {
                if apply_batch(&mut state, &payload, None).is_err() {
                    return Ok(Err(Damage::Malformed));
                }
                chunks += 1;
            }
            Next::Record(kind::CHECKPOINT_END, payload) => {
                return Ok(match super::records::decode_checkpoint_end(&payload) {
                    Ok((count, blocks)) if count == chunks => Ok(Base {
                        meta,
                        state,
                        blocks,
                    }),
                    Ok(_) => Err(Damage::Malformed),
                    Err(damage) => Err(damage),
                });
            }
            Next::Damaged(damage) => return Ok(Err(damage)),
            _ => return Ok(Err(Damage::Malformed)),
        }
    }
}

/// Applies the events of one encoded batch (a logged batch of `rank`, or a
/// snapshot chunk naming its own rank) to `state`.
fn apply_batch(state: &mut LiveState, encoded: &[u8], rank: Option<u32>) -> Result<(), Damage> {
    let batch = KvEventBatch::decode(encoded).map_err(|_| Damage::Malformed)?;
    let rank = match rank {
        Some(rank) => rank,
        None => u32::try_from(batch.dp_rank.unwrap_or(0)).map_err(|_| Damage::Malformed)?,
    };
    for event in &batch.events {
        state.record(rank, event);
    }
    Ok(())
}

impl Scan {
    /// Reads one segment, committing each cycle's batches; the damage that
    /// ended it early, if any (what came before it is used).
    fn segment(
        &mut self,
        path: &Path,
        first_position: u64,
        unfinished: bool,
    ) -> io::Result<Result<(), Damage>> {
        let mut reader = match open_records(path, FileKind::Segment)? {
            Ok(Some(reader)) => reader,
            Ok(None) => {
                self.segment_ended(unfinished, false, None);
                return Ok(Ok(()));
            }
            Err(damage) => {
                self.segment_ended(true, false, None);
                return Ok(Err(damage));
            }
        };
        let header = match reader.next()? {
            Next::Record(kind::SEGMENT_HEADER, payload) => match SegmentHeader::decode(&payload) {
                Ok(header) if header.first_position == first_position => header,
                Ok(_) => {
                    self.segment_ended(true, false, None);
                    return Ok(Err(Damage::Malformed));
                }
                Err(damage) => {
                    self.segment_ended(true, false, None);
                    return Ok(Err(damage));
                }
            },
            Next::End | Next::Torn => {
                self.segment_ended(unfinished, false, None);
                return Ok(Ok(()));
            }
            Next::Damaged(damage) => {
                self.segment_ended(true, false, None);
                return Ok(Err(damage));
            }
            Next::Record(..) => {
                self.segment_ended(true, false, None);
                return Ok(Err(Damage::Malformed));
            }
        };
        self.highest_number = self.highest_number.max(header.seed);
        if self.seed != Some(header.seed) {
            // Another numbering: the history and cursors of the old one
            // mean nothing in it.
            self.seed = Some(header.seed);
            self.history.clear();
            self.last_sequences.clear();
        }
        let mut pending = Vec::new();
        let mut pending_bytes = 0;
        let mut committed = false;
        let outcome = loop {
            match reader.next()? {
                Next::Record(kind::BATCH, payload) => match BatchRecord::decode(payload) {
                    Ok(record) => {
                        self.highest = self.highest.max(record.position);
                        self.highest_number = self.highest_number.max(record.sequence);
                        pending_bytes += record.encoded.len();
                        if pending_bytes > MAX_CYCLE_BYTES {
                            break Err(Damage::Malformed);
                        }
                        pending.push(record);
                    }
                    Err(damage) => break Err(damage),
                },
                Next::Record(kind::CYCLE, payload) => match CycleRecord::decode(&payload) {
                    Ok(cycle) => {
                        committed |= !pending.is_empty();
                        pending_bytes = 0;
                        if let Err(damage) = self.commit(std::mem::take(&mut pending)) {
                            break Err(damage);
                        }
                        self.marks = Some((cycle.position, cycle.marks));
                    }
                    Err(damage) => break Err(damage),
                },
                Next::End | Next::Torn => break Ok(()),
                Next::Damaged(damage) => break Err(damage),
                Next::Record(..) => break Err(Damage::Malformed),
            }
        };
        let verified = outcome.is_ok() && !unfinished;
        self.segment_ended(!verified, committed, Some(header));
        Ok(outcome)
    }

    /// Records what this segment says of the log's end: a segment that
    /// committed nothing and proves it (verified, not unfinished) says
    /// nothing.
    fn segment_ended(&mut self, unproven: bool, committed: bool, header: Option<SegmentHeader>) {
        let seed = header.map_or(self.seed.unwrap_or(0), |header| header.seed);
        if unproven {
            self.newest = Some((Tail::Unproven, seed));
        } else if committed {
            self.newest = Some((Tail::Verified, seed));
        }
    }

    /// Takes one cycle's batches into the history and, past the
    /// checkpoint, the state.
    fn commit(&mut self, records: Vec<BatchRecord>) -> Result<(), Damage> {
        for record in records {
            let position = record.position;
            if position <= self.end {
                // A newer process started over from an earlier end.
                continue;
            }
            if position > self.end + 1 {
                self.history.clear();
                if position > self.state_through + 1 {
                    self.state_broken = true;
                }
            }
            if position > self.state_through && !self.state_broken {
                if let Err(damage) =
                    apply_batch(&mut self.state, &record.encoded, Some(record.rank))
                {
                    self.state_broken = true;
                    return Err(damage);
                }
                self.state_through = position;
                self.batches_replayed += 1;
            }
            self.last_sequences.insert(record.rank, record.sequence);
            self.history.push(Arc::new(Batch {
                position,
                rank: record.rank,
                sequence: record.sequence,
                encoded: record.encoded,
            }));
            self.end = position;
        }
        Ok(())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::store::format::{MAX_RECORD_BYTES, file_header, put_record};
    use crate::store::records::{BatchRecord, SyncedRecord};
    use crate::wire::OpenBatch;

    pub(in crate::store) const LIMITS: HistoryLimits = HistoryLimits {
        batches: 100,
        bytes: 1 << 20,
    };

    /// A scratch directory for the store's tests, removed when dropped.
    pub(in crate::store) struct Dir(pub(in crate::store) PathBuf);

    impl Dir {
        pub(in crate::store) fn new(name: &str) -> Self {
            let path = std::env::temp_dir()
                .join(format!("continuity-restore-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }

        /// A segment from `first` holding `count` rank-0 batches numbered
        /// from `seed`, each followed by its cycle's end.
        pub(in crate::store) fn segment(&self, boot_id: &[u8], seed: u64, first: u64, count: u64) {
            let mut out = file_header(FileKind::Segment).to_vec();
            let header = SegmentHeader {
                boot_id: boot_id.to_vec(),
                seed,
                first_position: first,
            };
            put_record(&mut out, kind::SEGMENT_HEADER, &[&header.encode()]);
            for position in first..first + count {
                let encoded = OpenBatch::with_timestamp(1.0).encode(0, seed + position - 1, None);
                let header = BatchRecord::header(position, 0, seed + position - 1);
                put_record(&mut out, kind::BATCH, &[&header, &encoded]);
                let cycle = CycleRecord {
                    position,
                    marks: Marks::new(),
                };
                put_record(&mut out, kind::CYCLE, &[&cycle.encode()]);
            }
            std::fs::write(self.0.join(files::segment_name(first)), out).unwrap();
        }

        /// As a process does when a write to the segment at `first` fails.
        pub(in crate::store) fn mark_unfinished(&self, first: u64) {
            std::fs::rename(
                self.0.join(files::segment_name(first)),
                self.0.join(files::unfinished_name(first)),
            )
            .unwrap();
        }

        /// A checkpoint at `position` of numbering `seed`, holding nothing.
        fn checkpoint(&self, seed: u64, position: u64) {
            let mut out = file_header(FileKind::Checkpoint).to_vec();
            let meta = CheckpointMeta {
                position,
                seed,
                last_sequences: BTreeMap::from([(0, seed + position - 1)]),
                marks: Marks::new(),
            };
            put_record(&mut out, kind::CHECKPOINT_META, &[&meta.encode()]);
            let end = crate::store::records::encode_checkpoint_end(0, 0);
            put_record(&mut out, kind::CHECKPOINT_END, &[&end]);
            std::fs::write(self.0.join(files::checkpoint_name(position)), out).unwrap();
        }

        pub(in crate::store) fn synced(&self, seed: u64, through: u64, clean: bool) {
            let mut out = file_header(FileKind::Synced).to_vec();
            let record = SyncedRecord {
                boot_id: b"old".to_vec(),
                seed,
                through,
                clean,
            };
            put_record(&mut out, kind::SYNCED, &[&record.encode()]);
            std::fs::write(self.0.join(files::SYNCED_FILE), out).unwrap();
        }

        pub(in crate::store) fn restore(&self, mark: Option<MarkRecord>) -> Restored {
            restore(&self.0, mark, LIMITS, &mut |_, _| {}).unwrap()
        }
    }

    /// The mark a process numbering from `seed` leaves having announced
    /// through `through` (one rank, numbered from `seed` at position 1).
    pub(in crate::store) fn mark(seed: u64, through: u64) -> Option<MarkRecord> {
        Some(MarkRecord {
            seed,
            through,
            highest_sequence: seed + through - 1,
            owner_running: false,
        })
    }

    impl Dir {}

    impl Drop for Dir {
        fn drop(&mut self) {
            if let Ok(metadata) = std::fs::metadata(&self.0) {
                use std::os::unix::fs::MetadataExt;
                crate::store::announced::remove(crate::store::announced::DirIdentity {
                    dev: metadata.dev(),
                    ino: metadata.ino(),
                });
            }
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_mark_within_the_log_continues_the_numbering_where_the_log_ends() {
        let dir = Dir::new("same-boot");
        dir.segment(b"boot", 1000, 1, 5);
        let restored = dir.restore(mark(1000, 5));
        assert_eq!(restored.report.outcome, Outcome::Continued);
        assert_eq!(restored.next_position, 6);
        assert_eq!(
            restored.numbering,
            Some((1000, BTreeMap::from([(0, 1004)])))
        );
        assert_eq!(restored.history.len(), 5);
    }

    #[test]
    fn a_mark_past_the_logs_end_renumbers_above_every_announced_number() {
        // The disk took nothing after position 3; the process announced
        // through 9 and was killed.
        let dir = Dir::new("mark-past-end");
        dir.segment(b"boot", 1000, 1, 3);
        let restored = dir.restore(mark(1000, 9));
        assert_eq!(restored.report.outcome, Outcome::Renumbered);
        assert_eq!(restored.next_position, 4);
        assert!(restored.highest_number >= 1008);
        assert!(restored.history.is_empty());
        // A mark of another numbering proves nothing either.
        assert_eq!(
            dir.restore(mark(2000, 3)).report.outcome,
            Outcome::Renumbered
        );
        assert_eq!(
            dir.restore(mark(1000, 3)).report.outcome,
            Outcome::Continued
        );
    }

    #[test]
    fn without_a_mark_only_a_clean_sync_at_the_logs_end_continues_the_numbering() {
        let dir = Dir::new("reboot");
        dir.segment(b"old", 1000, 1, 5);
        assert_eq!(dir.restore(None).report.outcome, Outcome::Renumbered);
        dir.synced(1000, 4, false);
        assert_eq!(dir.restore(None).report.outcome, Outcome::Renumbered);
        dir.synced(1000, 5, false);
        assert_eq!(
            dir.restore(None).report.outcome,
            Outcome::Renumbered,
            "synced but not stopped: more may have been announced"
        );
        dir.synced(1000, 5, true);
        assert_eq!(dir.restore(None).report.outcome, Outcome::Continued);
    }

    #[test]
    fn an_unfinished_newest_segment_renumbers_and_a_hole_in_the_log_starts_fresh() {
        let dir = Dir::new("unfinished");
        dir.segment(b"boot", 1000, 1, 5);
        dir.mark_unfinished(1);
        let restored = dir.restore(mark(1000, 5));
        assert_eq!(restored.report.outcome, Outcome::Renumbered);
        assert!(restored.history.is_empty());
        assert!(restored.needs_checkpoint);

        dir.segment(b"boot", 1000, 9, 2);
        let restored = dir.restore(mark(1000, 5));
        assert_eq!(
            restored.report.outcome,
            Outcome::Fresh,
            "positions 6 to 8 are missing and no checkpoint covers them"
        );
        assert_eq!(restored.next_position, 11);
    }

    #[test]
    fn a_renumbered_log_goes_on_past_every_number_a_file_names() {
        let dir = Dir::new("renumber-past");
        dir.segment(b"boot", 1000, 1, 5);
        // The old process opened segment 6 and could not write to it.
        dir.segment(b"boot", 1000, 6, 0);
        dir.mark_unfinished(6);
        let restored = dir.restore(mark(1000, 5));
        assert_eq!(restored.report.outcome, Outcome::Renumbered);
        assert_eq!(restored.next_position, 7);
    }

    #[test]
    fn a_run_of_batches_longer_than_any_cycle_is_damage_and_not_held_whole() {
        let dir = Dir::new("endless-cycle");
        dir.segment(b"boot", 1000, 1, 3);
        let path = dir.0.join(files::segment_name(1));
        let mut bytes = std::fs::read(&path).unwrap();
        let filler = vec![0; MAX_RECORD_BYTES - 64];
        for position in 4..=4 + (MAX_CYCLE_BYTES / filler.len()) as u64 {
            let header = BatchRecord::header(position, 0, 999 + position);
            put_record(&mut bytes, kind::BATCH, &[&header, &filler]);
        }
        std::fs::write(&path, bytes).unwrap();
        let restored = dir.restore(mark(1000, 3));
        assert_eq!(restored.report.set_aside.len(), 1, "{:?}", restored.report);
        assert!(restored.report.set_aside[0].ends_with("malformed"));
        // What verified before the run is still used; the numbering is not.
        assert_eq!(restored.report.batches_replayed, 3);
        assert_eq!(restored.report.outcome, Outcome::Renumbered);
    }

    #[test]
    fn a_cycle_cut_short_is_not_restored() {
        let dir = Dir::new("cut-cycle");
        dir.segment(b"boot", 1000, 1, 3);
        let path = dir.0.join(files::segment_name(1));
        let mut bytes = std::fs::read(&path).unwrap();
        // The last cycle's end is gone: its batch was never announced.
        let cycle_len = RECORD_BYTES_OF_EMPTY_CYCLE;
        bytes.truncate(bytes.len() - cycle_len);
        std::fs::write(&path, bytes).unwrap();
        let restored = dir.restore(mark(1000, 2));
        assert_eq!(restored.report.outcome, Outcome::Continued);
        assert_eq!(restored.next_position, 3);
    }

    #[test]
    fn a_checkpoint_of_a_numbering_the_directory_never_used_is_set_aside() {
        let dir = Dir::new("foreign");
        dir.segment(b"boot", 1000, 1, 3);
        // Another kvgate's, far ahead of this log.
        dir.checkpoint(7777, 50);
        let restored = dir.restore(mark(1000, 3));
        assert_eq!(restored.report.set_aside.len(), 1, "{:?}", restored.report);
        assert!(restored.report.set_aside[0].ends_with("foreign"));
        assert_eq!(restored.report.checkpoint_position, None);
        assert_eq!(restored.report.outcome, Outcome::Continued);
        assert_eq!(restored.next_position, 4);
        // One of this directory's own numbering is the state's base.
        dir.checkpoint(1000, 2);
        let restored = dir.restore(mark(1000, 3));
        assert_eq!(restored.report.checkpoint_position, Some(2));
        assert_eq!(restored.report.outcome, Outcome::Continued);
    }

    #[test]
    fn a_segment_of_another_history_is_set_aside_and_never_served() {
        let dir = Dir::new("foreign-segment");
        dir.segment(b"boot", 1000, 1, 3);
        dir.synced(1000, 3, true);
        // Another kvgate's, named later than this log: a later numbering
        // than the newest this directory used, and an earlier one.
        dir.segment(b"boot", 7777, 50, 2);
        dir.segment(b"boot", 500, 60, 2);
        let restored = dir.restore(None);
        assert_eq!(restored.report.set_aside.len(), 2, "{:?}", restored.report);
        assert!(
            restored
                .report
                .set_aside
                .iter()
                .all(|set_aside| set_aside.ends_with("foreign"))
        );
        assert_eq!(restored.report.outcome, Outcome::Continued);
        assert_eq!(restored.next_position, 4);
        assert_eq!(
            restored.numbering,
            Some((1000, BTreeMap::from([(0, 1002)])))
        );
        // With its checkpoint, the checkpoint is no longer vouched for.
        dir.segment(b"boot", 7777, 50, 2);
        dir.checkpoint(7777, 51);
        let restored = dir.restore(None);
        assert_eq!(restored.report.set_aside.len(), 2, "{:?}", restored.report);
        assert_eq!(restored.report.checkpoint_position, None);
        assert_eq!(restored.report.outcome, Outcome::Continued);
    }

    #[test]
    fn every_numbering_of_the_directorys_own_history_is_read() {
        let dir = Dir::new("renumbered-history");
        // Renumbered twice: each numbering above every earlier number,
        // from past every earlier position.
        dir.segment(b"boot", 1000, 1, 3);
        dir.segment(b"boot", 1000, 4, 2);
        dir.segment(b"other-boot", 2000, 6, 2);
        dir.segment(b"boot", 3000, 8, 2);
        dir.synced(3000, 9, true);
        let restored = dir.restore(None);
        assert!(
            restored.report.set_aside.is_empty(),
            "{:?}",
            restored.report
        );
        assert_eq!(restored.report.outcome, Outcome::Continued);
        assert_eq!(restored.report.batches_replayed, 9);
        assert_eq!(restored.next_position, 10);
        // The newest process numbered anew and wrote nothing before it
        // stopped: its older numberings are still the history.
        dir.synced(4000, 9, false);
        let restored = dir.restore(None);
        assert!(
            restored.report.set_aside.is_empty(),
            "{:?}",
            restored.report
        );
        assert_eq!(restored.report.batches_replayed, 9);
        assert_eq!(restored.report.outcome, Outcome::Renumbered);
    }

    #[test]
    fn a_sparse_tail_of_any_size_is_skipped_as_a_torn_write() {
        let dir = Dir::new("sparse");
        dir.segment(b"boot", 1000, 1, 3);
        let path = dir.0.join(files::segment_name(1));
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        // A hole of 64 GiB after the records: read past it, not through.
        file.set_len(64 << 30).unwrap();
        let restored = dir.restore(mark(1000, 3));
        assert_eq!(
            restored.report.outcome,
            Outcome::Continued,
            "{:?}",
            restored.report
        );
        assert_eq!(restored.next_position, 4);
        assert!(restored.report.set_aside.is_empty());
    }

    #[test]
    fn a_run_of_zeros_on_disk_longer_than_any_write_is_damage() {
        let dir = Dir::new("zero-run");
        dir.segment(b"boot", 1000, 1, 3);
        let path = dir.0.join(files::segment_name(1));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.resize(
            bytes.len() + crate::store::format::MAX_ZERO_RUN_BYTES as usize + 4096,
            0,
        );
        std::fs::write(&path, bytes).unwrap();
        let restored = dir.restore(mark(1000, 3));
        assert_eq!(restored.report.set_aside.len(), 1, "{:?}", restored.report);
        // What verified before the run is used; the numbering is not.
        assert_eq!(restored.report.batches_replayed, 3);
        assert_eq!(restored.report.outcome, Outcome::Renumbered);
    }

    /// A cycle record with no marks: header, kind, position and count.
    const RECORD_BYTES_OF_EMPTY_CYCLE: usize = 12 + 1 + 8 + 4;
}
