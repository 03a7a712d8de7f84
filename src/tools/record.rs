//! `kvgate record`: keep a gateway's stream in a recording file
//! (`docs/recording-format.md`), and `kvgate record --stats` to summarise
//! one (`kvgate tail --file` prints one).
//!
//! Invariant: the recorder is one well-behaved router. It admits batches by
//! the router's rules with the upstream source's [`Cursors`], so a
//! reconnect resumes from its cursor and writes no batch twice and skips
//! none; a refused cursor (`OUT_OF_RANGE`, `DATA_LOSS`) writes a `resync`
//! record and starts over from a snapshot. A signal closes the file cleanly;
//! a kill loses at most the frame being gathered.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use prost::Message as _;
use tonic::{Code, Status};
use tracing::warn;

use super::GatewayArgs;
use crate::cli_values::byte_size;
use crate::client::{RawBatches, Target, subscribe_requesting};
use crate::proto::common::{KvEventBatch, SubscribeKvEventsRequest, kv_cache_event::Data};
use crate::recording::{self, Entry, Header, Recording, Writer, WriterLimits, decode_batch};
use crate::router_rules::{Cursors, FIRST_BACKOFF, MAX_BACKOFF, Verdict};

/// How often the progress line is redrawn.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, clap::Args)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub struct RecordArgs {
    #[command(flatten)]
    #[allow(missing_docs)] // flattened or a subcommand: clap documents it
    pub gateway: GatewayArgs,
    /// The recording to write (it must not exist); parts FILE.1, FILE.2,
    /// ... follow at --rotate-bytes.
    #[arg(long, value_name = "FILE", required_unless_present = "stats")]
    pub out: Option<PathBuf>,
    /// Summarise a recording (events by kind, blocks, duration, gaps)
    /// instead of making one.
    #[arg(long, value_name = "FILE", conflicts_with = "out")]
    pub stats: Option<PathBuf>,
    /// Start after this rank-0 sequence number; 0 starts with a snapshot.
    #[arg(long, default_value_t = 0)]
    pub from: u64,
    /// Which service name to call SubscribeKvEvents on.
    #[arg(long, default_value = "kvgate.v1.KvGate")]
    pub service: String,
    /// The engine's data-parallel ranks, written in the header for whoever
    /// replays the recording.
    #[arg(long, env = "KVGATE_RECORD_DP_SIZE", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub dp_size: u32,
    /// Ask for load records before the first batch, so they are recorded
    /// too from the start.
    #[arg(long)]
    pub load_before_first_batch: bool,
    /// Size at which a part is closed and the next one (FILE.1, ...) opened.
    #[arg(long, env = "KVGATE_RECORD_ROTATE_BYTES", default_value = "1GiB", value_name = "SIZE",
          value_parser = byte_size((1 << 20)..=(1 << 40)))]
    pub rotate_bytes: u64,
    /// Records gathered before a compressed frame is written.
    #[arg(long, env = "KVGATE_RECORD_FRAME_BYTES", default_value = "256KiB", value_name = "SIZE",
          value_parser = byte_size(4096..=(32 << 20)))]
    pub frame_bytes: u64,
    /// Longest a received batch waits in memory before its frame is
    /// written (what a killed recorder can lose).
    #[arg(long, env = "KVGATE_RECORD_FLUSH_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub flush_ms: u64,
}

/// `kvgate record`: records until a signal (`shutdown`), or summarises a
/// recording with `--stats`.
pub async fn run(args: RecordArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    if let Some(file) = &args.stats {
        return print_stats(file);
    }
    let Some(out) = args.out.clone() else {
        anyhow::bail!("give --out FILE (where to record) or --stats FILE");
    };
    let target = args.gateway.connect()?.target;
    let header = Header {
        kvgate_version: env!("CARGO_PKG_VERSION").into(),
        source: args.gateway.addr.clone(),
        service: args.service.clone(),
        started_unix_ms: crate::clock::unix_micros_now() / 1000,
        dp_size: args.dp_size,
        part: 0,
    };
    let limits = WriterLimits {
        rotate_bytes: args.rotate_bytes,
        frame_bytes: usize::try_from(args.frame_bytes).unwrap_or(usize::MAX),
    };
    let writer = Writer::create(&out, header, limits).with_context(|| "--out")?;
    let mut recorder = Recorder {
        writer,
        cursors: Cursors::default(),
        progress: Progress::new(std::io::stderr().is_terminal()),
    };
    let outcome = tokio::select! {
        outcome = recorder.record(&target, &args) => outcome,
        () = shutdown => Ok(()),
    };
    let Recorder {
        writer, progress, ..
    } = recorder;
    let written = writer.written();
    // Even after a failure, what was received is closed into the file.
    let closed = writer.finish();
    progress.done(&out, written);
    outcome.and(closed)
}

/// Why one subscription ended.
enum Outcome {
    /// Resume from the cursor after a pause.
    Retry(String),
    /// The cursor is worthless: start over with a snapshot.
    Resync(String),
}

struct Recorder {
    writer: Writer,
    cursors: Cursors,
    progress: Progress,
}

impl Recorder {
    /// Subscribes again and again; returns only on an error that retrying
    /// cannot mend (the file, the credentials).
    async fn record(&mut self, target: &Target, args: &RecordArgs) -> anyhow::Result<()> {
        let mut backoff = FIRST_BACKOFF;
        let mut first = true;
        let mut from = args.from;
        loop {
            let outcome = self.follow(target, args, from, first).await?;
            first = false;
            // Only the first subscription starts from --from.
            from = 0;
            self.writer.flush()?;
            match outcome {
                Outcome::Resync(reason) => {
                    warn!(%reason, "the gateway refused the cursor; recording a new snapshot");
                    self.writer
                        .resync(crate::clock::unix_micros_now(), &reason)?;
                    self.cursors.forget();
                    backoff = FIRST_BACKOFF;
                }
                Outcome::Retry(reason) => {
                    warn!(%reason, ?backoff, "stream lost; resuming");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// One subscription. The first connection's failure is an error (a
    /// wrong address or credentials), later ones are retried.
    async fn follow(
        &mut self,
        target: &Target,
        args: &RecordArgs,
        from: u64,
        first: bool,
    ) -> anyhow::Result<Outcome> {
        let channel = match target.connect().await {
            Ok(channel) => channel,
            Err(error) if first => return Err(error),
            Err(error) => return Ok(Outcome::Retry(format!("{error:#}"))),
        };
        let request = SubscribeKvEventsRequest {
            start_sequence_number: from.max(self.cursors.resume_from()),
            load_records_before_first_batch: args.load_before_first_batch,
        };
        let mut stream =
            match subscribe_requesting(channel, &args.service, request, RawBatches).await {
                Ok(stream) => stream,
                Err(status) => return refused(status, first),
            };
        self.cursors.connected();
        let mut flush = tokio::time::interval(Duration::from_millis(args.flush_ms));
        loop {
            let received = tokio::select! {
                received = stream.message() => received,
                _ = flush.tick() => {
                    self.writer.flush()?;
                    self.progress.tick(self.writer.written());
                    continue;
                }
            };
            let bytes = match received {
                Ok(Some(bytes)) => bytes,
                Ok(None) => return Ok(Outcome::Retry("the gateway ended the stream".into())),
                Err(status) => return refused(status, false),
            };
            // The bytes go to the file as they came; the cursors need the
            // batch's numbers.
            let batch = match KvEventBatch::decode(bytes.clone()) {
                Ok(batch) => batch,
                Err(error) => {
                    let status = Status::internal(format!("undecodable batch: {error}"));
                    return refused(status, false);
                }
            };
            match self.cursors.admit(&batch) {
                Verdict::Stale => continue,
                Verdict::Gap => return Ok(Outcome::Retry("a gap in the numbers".into())),
                Verdict::Next | Verdict::Restart | Verdict::Snapshot { .. } | Verdict::LoadOnly => {
                }
            }
            self.writer.batch(crate::clock::unix_micros_now(), &bytes)?;
            self.progress.batch(batch.events.len());
        }
    }
}

/// What a refusal means for the recorder: a cursor refusal starts over, a
/// credential or usage refusal ends it, anything else is retried.
fn refused(status: Status, fatal_if_unknown: bool) -> anyhow::Result<Outcome> {
    let described = crate::connect_error::describe_status(&status);
    match status.code() {
        Code::OutOfRange | Code::DataLoss => Ok(Outcome::Resync(described)),
        Code::Unauthenticated
        | Code::PermissionDenied
        | Code::Unimplemented
        | Code::InvalidArgument => anyhow::bail!("SubscribeKvEvents refused: {described}"),
        _ if fatal_if_unknown && status.code() != Code::Unavailable => {
            anyhow::bail!("SubscribeKvEvents refused: {described}")
        }
        _ => Ok(Outcome::Retry(described)),
    }
}

/// The progress line on a terminal's stderr.
struct Progress {
    terminal: bool,
    started: Instant,
    last_shown: Instant,
    batches: u64,
    events: u64,
}

impl Progress {
    fn new(terminal: bool) -> Self {
        let now = Instant::now();
        Self {
            terminal,
            started: now,
            last_shown: now,
            batches: 0,
            events: 0,
        }
    }

    fn batch(&mut self, events: usize) {
        self.batches += 1;
        self.events += events as u64;
    }

    fn line(&self, written: u64) -> String {
        let seconds = self.started.elapsed().as_secs_f64().max(1e-3);
        let written = if written < 1 << 20 {
            format!("{:.1} KiB", written as f64 / 1024.0)
        } else {
            format!("{:.1} MiB", written as f64 / f64::from(1 << 20))
        };
        format!(
            "{} batches, {} events, {written} written, {:.0} events/s",
            self.batches,
            self.events,
            self.events as f64 / seconds
        )
    }

    fn tick(&mut self, written: u64) {
        if self.terminal && self.last_shown.elapsed() >= PROGRESS_EVERY {
            self.last_shown = Instant::now();
            eprint!("\r\x1b[Kkvgate record: {}", self.line(written));
        }
    }

    fn done(&self, out: &Path, written: u64) {
        if self.terminal {
            eprintln!();
        }
        eprintln!(
            "kvgate record: {}: {}, closed",
            out.display(),
            self.line(written)
        );
    }
}

/// What `kvgate record --stats` counts.
#[derive(Debug, Default)]
pub struct Stats {
    /// Batches in the file.
    pub batches: u64,
    /// Of which snapshot chunks.
    pub snapshot_batches: u64,
    /// Of which `load_only` batches.
    pub load_only_batches: u64,
    /// Store events, and the blocks they carry.
    pub stored: (u64, u64),
    /// Removal events, and the hashes they carry.
    pub removed: (u64, u64),
    /// Clear events.
    pub cleared: u64,
    /// Batches per rank.
    pub ranks: BTreeMap<i32, u64>,
    /// Cursor refusals the recorder started over after.
    pub resyncs: u64,
    /// Batches a router would take as a restart of their rank.
    pub restarts: u64,
    /// Skipped numbers a router would see (none in a good recording).
    pub gaps: u64,
    /// First and last receive time, Unix microseconds.
    pub span: Option<(u64, u64)>,
}

impl Stats {
    /// Counts a whole recording; [`Recording::ending`] then says how it
    /// ended.
    pub fn of(recording: &mut Recording) -> anyhow::Result<Self> {
        let mut stats = Self::default();
        let mut cursors = Cursors::default();
        for record in recording.by_ref() {
            let at = record.received_unix_micros;
            stats.span = Some(stats.span.map_or((at, at), |(first, _)| (first, at)));
            let bytes = match record.entry {
                Entry::Batch(bytes) => bytes,
                Entry::Resync(_) => {
                    stats.resyncs += 1;
                    cursors.forget();
                    continue;
                }
            };
            stats.batches += 1;
            let batch = decode_batch(&bytes, stats.batches)?;
            stats.count(&batch);
            match cursors.admit(&batch) {
                Verdict::Restart => stats.restarts += 1,
                Verdict::Gap => {
                    stats.gaps += 1;
                    // Counted once; the batch after it follows this one.
                    cursors.forget();
                    cursors.admit(&batch);
                }
                _ => {}
            }
        }
        Ok(stats)
    }

    fn count(&mut self, batch: &KvEventBatch) {
        *self.ranks.entry(batch.dp_rank.unwrap_or(0)).or_default() += 1;
        self.snapshot_batches += u64::from(batch.snapshot.is_some());
        self.load_only_batches += u64::from(batch.load.as_ref().is_some_and(|l| l.load_only));
        for event in &batch.events {
            match &event.data {
                Some(Data::Stored(stored)) => {
                    self.stored.0 += 1;
                    self.stored.1 += stored.blocks.len() as u64;
                }
                Some(Data::Removed(removed)) => {
                    self.removed.0 += 1;
                    self.removed.1 += removed.block_hashes.len() as u64;
                }
                Some(Data::Cleared(_)) => self.cleared += 1,
                None => {}
            }
        }
    }
}

/// `kvgate record --stats FILE`.
fn print_stats(file: &Path) -> anyhow::Result<()> {
    let mut recording = Recording::open(&[file.to_owned()])?;
    let header = recording.header().clone();
    let stats = Stats::of(&mut recording)?;
    let seconds = stats
        .span
        .map_or(0.0, |(first, last)| (last - first) as f64 / 1e6);
    let ranks: Vec<String> = stats
        .ranks
        .iter()
        .map(|(rank, batches)| format!("{rank} ({batches} batches)"))
        .collect();
    let ending = recording
        .ending()
        .map_or_else(String::new, ToString::to_string);
    println!(
        "recording   {}\nsource      {} ({}), kvgate {}, dp size {}, started at unix ms {}\n\
         duration    {seconds:.3} s\n\
         batches     {} ({} snapshot, {} load only)\n\
         stored      {} events, {} blocks\n\
         removed     {} events, {} blocks\n\
         cleared     {}\n\
         ranks       {}\n\
         resyncs     {}\n\
         restarts    {}\n\
         gaps        {}\n\
         ending      {ending}",
        file.display(),
        header.source,
        header.service,
        header.kvgate_version,
        header.dp_size,
        header.started_unix_ms,
        stats.batches,
        stats.snapshot_batches,
        stats.load_only_batches,
        stats.stored.0,
        stats.stored.1,
        stats.removed.0,
        stats.removed.1,
        stats.cleared,
        ranks.join(", "),
        stats.resyncs,
        stats.restarts,
        stats.gaps,
    );
    recording::ending_result(recording.ending())
}
