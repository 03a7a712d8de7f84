//! A recording (`kvgate record`) as the event source: its batches fed to
//! the drain at their recorded pace, as an upstream gateway would feed them.
//!
//! Invariant: the recorded batches go through the router's rules
//! ([`Cursors`]) and [`upstream::forwarded`], exactly as a live upstream's
//! do, so the drain sees the same resyncs and restarts a router saw when the
//! recording was made, and renumbers everything as its own. Each pass of
//! `--replay-loop` after the first starts with a resync (an ownerless clear
//! of every rank, as an engine restart); a pass that gave the drain nothing
//! ends the loop. Damage in the file ends the pass at the last intact
//! record, and a part that is no regular file (a FIFO, a device) is damage,
//! refused without waiting for it; when the last pass ends, the source stays
//! (serving the final state) until kvgate stops. Recorded load records go
//! to a [`LoadSink`] as they come due, so the drain stamps them as it
//! would an engine's.

use std::path::PathBuf;
use std::sync::Arc;

use prost::Message as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::pace::{self, Pacer, Pass, Played, Speed};
use super::upstream;
use super::{DrainGone, SourceEvent, send};
use crate::metrics::Metrics;
use crate::proto::common::{EngineLoad, KvEventBatch};
use crate::recording::{Ending, Entry, Header, OpenError, Record, Recording};
use crate::router_rules::{Cursors, Verdict};

/// The bad-message reason of a recorded batch that is not a `KvEventBatch`,
/// or is of a rank outside `0..dp_size`.
pub const UNDECODABLE: &str = "recording_undecodable";

/// Where recorded load records go, with their rank: `app` feeds them to
/// the drain's load records as readings.
pub type LoadSink = Box<dyn Fn(u32, &EngineLoad) + Send + Sync>;

/// Records read ahead of the pacer.
const READ_AHEAD: usize = 1024;

/// Bytes those records may hold, each counted with what holding it costs
/// (above the largest record, 16 MiB, so every record fits): what a paced
/// recording holds in memory beyond the frame being read, however its
/// records are sized.
const READ_AHEAD_BYTES: u32 = 64 << 20;

/// Which recording to play, and how.
#[derive(Clone, Debug)]
pub struct RecordedConfig {
    /// The recording's parts (see [`crate::recording::parts`]).
    pub files: Vec<PathBuf>,
    /// How fast.
    pub speed: Speed,
    /// Start over at the end, forever.
    pub looped: bool,
    /// The ranks served are `0..dp_size`; a recorded batch of another rank
    /// is counted as bad and skipped.
    pub dp_size: u32,
}

impl RecordedConfig {
    /// Opens the recording to check it can be played; returns its header.
    pub fn check(&self) -> Result<Header, OpenError> {
        Recording::open(&self.files).map(|recording| recording.header().clone())
    }
}

/// Plays the recording until `stop` is cancelled (or the drain is gone).
pub async fn run(
    config: RecordedConfig,
    events: mpsc::Sender<SourceEvent>,
    metrics: Metrics,
    ready: watch::Sender<bool>,
    loads: LoadSink,
    stop: CancellationToken,
) {
    let pass = RecordingPass {
        config: &config,
        events: &events,
        metrics: &metrics,
        loads: &loads,
    };
    pace::play_passes(config.speed, config.looped, &events, &ready, &stop, pass).await;
}

struct RecordingPass<'a> {
    config: &'a RecordedConfig,
    events: &'a mpsc::Sender<SourceEvent>,
    metrics: &'a Metrics,
    loads: &'a LoadSink,
}

impl Pass for RecordingPass<'_> {
    async fn play(&mut self, number: u64, pacer: &mut Pacer) -> Result<Played, DrainGone> {
        let (ending, played) =
            play(self.config, pacer, self.events, self.metrics, self.loads).await?;
        // One line a second at most: a short recording looped at max speed
        // plays thousands of passes a second.
        crate::logging::rate_limited("recording pass", || match ending {
            Ending::Closed => info!(pass = number, "recording played to its end"),
            ending => warn!(pass = number, %ending, "recording played to its last intact record"),
        });
        Ok(played)
    }
}

/// What a record read ahead costs against [`READ_AHEAD_BYTES`]: its bytes
/// and what holding it costs beside them, so a frame of millions of empty
/// records is bounded as its bytes would be.
fn read_ahead_cost(record: &Record) -> u32 {
    let bytes = record.size() + size_of::<Record>();
    u32::try_from(bytes).map_or(READ_AHEAD_BYTES, |bytes| bytes.min(READ_AHEAD_BYTES))
}

/// One pass over the recording: how it ended, and whether it gave the
/// drain anything.
async fn play(
    config: &RecordedConfig,
    pacer: &mut Pacer,
    events: &mpsc::Sender<SourceEvent>,
    metrics: &Metrics,
    loads: &LoadSink,
) -> Result<(Ending, Played), DrainGone> {
    let mut played = Played::Nothing;
    let (records, mut receive) = mpsc::channel::<(Record, OwnedSemaphorePermit)>(READ_AHEAD);
    // Each record read ahead holds permits for its bytes until it is played.
    let room = Arc::new(Semaphore::new(READ_AHEAD_BYTES as usize));
    let runtime = tokio::runtime::Handle::current();
    let files = config.files.clone();
    // File reads and decompression stay off the runtime's workers.
    let reader = tokio::task::spawn_blocking(move || {
        let mut recording = Recording::open(&files)?;
        for record in recording.by_ref() {
            let cost = read_ahead_cost(&record);
            let Ok(held) = runtime.block_on(Arc::clone(&room).acquire_many_owned(cost)) else {
                break;
            };
            if records.blocking_send((record, held)).is_err() {
                break;
            }
        }
        Ok::<_, OpenError>(recording.ending().cloned())
    });
    let mut cursors = Cursors::default();
    while let Some((record, _held)) = receive.recv().await {
        pacer.wait_for(record.received_unix_micros).await;
        let bytes = match record.entry {
            Entry::Batch(bytes) => bytes,
            // The snapshot that follows resyncs every rank.
            Entry::Resync(_) => {
                cursors.forget();
                continue;
            }
        };
        let batch = KvEventBatch::decode(bytes).ok();
        let Some((batch, rank)) = batch.and_then(|batch| {
            let rank = u32::try_from(batch.dp_rank.unwrap_or(0)).ok()?;
            (rank < config.dp_size).then_some((batch, rank))
        }) else {
            metrics.count_bad_message(UNDECODABLE);
            continue;
        };
        played = Played::Something;
        if let Some(load) = &batch.load {
            loads(rank, load);
        }
        let verdict = match cursors.admit(&batch) {
            // Not in a recorder's file, but a damaged part's successor
            // could show one: what the rank held is unknown, so it restarts.
            Verdict::Gap => {
                send(events, SourceEvent::PublisherRestarted { rank }).await?;
                cursors.forget();
                cursors.admit(&batch)
            }
            verdict => verdict,
        };
        for event in upstream::forwarded(verdict, batch, crate::clock::unix_now()) {
            send(events, event).await?;
        }
    }
    let ending = match reader.await {
        Ok(Ok(ending)) => ending.unwrap_or(Ending::Closed),
        Ok(Err(error)) => Ending::Cut {
            path: config.files[0].display().to_string(),
            offset: 0,
            what: error.to_string(),
        },
        Err(error) => Ending::Cut {
            path: config.files[0].display().to_string(),
            offset: 0,
            what: format!("the reader stopped: {error}"),
        },
    };
    Ok((ending, played))
}
