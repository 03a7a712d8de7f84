//! `kvgate-bench index`: `kvgate index` and, with `--peer`, a peer index
//! (Dynamo's standalone indexer through `benchmarks/dynamo-index/peer.py
//! serve`) measured in turns on the same simulated fleet.
//!
//! Per run: the subject starts with no worker; the fleet ([`fleet`]) binds
//! one XPUB per rank, registers each over `POST /register` and waits for
//! the subscription; then it publishes every rank's chains, and the run
//! waits until every rank's last chain matches in full. From `/proc` of the
//! subject's process: CPU per ingested block over that ingest, memory per
//! live block (RSS after ingest minus RSS before the first registration).
//! Then closed-loop queries (whole stored chains of random ranks, bodies
//! built beforehand) over keep-alive connections on a thread of the tool's
//! own, whose CPU is reported too; then, if asked, the fleet-scale phase:
//! queries at a fixed rate (open loop) while every rank keeps storing and
//! evicting.
//!
//! [`fleet`]: super::fleet

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::fleet::{Fleet, FleetShape, Sent};
use super::gateway::Gateway;
use super::histogram::Histogram;
use super::http_client::Connection;
use super::index_report::{
    IndexConfig, IndexMemory, IndexPeerConfig, IndexReport, IndexRunReport, Ingest, Queries, Steady,
};
use super::procfs;
use super::report::Latency;
use super::subject::{IndexPeer, IndexSubject};
use super::worker::Worker;

/// The subject's resident memory is read this long after it starts.
const IDLE_SETTLE: Duration = Duration::from_millis(500);

/// And this long after its last block was applied: memory at rest, what it
/// keeps for the blocks once whatever the burst left is let go (kvgate
/// hands its free pages back 100 ms after its queue runs dry; a subject
/// that frees later, or never, is read as it is). Its CPU meanwhile counts
/// as ingest.
const AT_REST_SETTLE: Duration = Duration::from_secs(1);
/// How long the index may go without completing one more rank once the
/// fleet has published everything.
const INGEST_STALL: Duration = Duration::from_secs(60);
/// Between two asks whether a rank's last chain is in.
const APPLIED_POLL: Duration = Duration::from_millis(50);
/// Distinct query bodies, built before any query is timed.
const QUERY_BODIES: usize = 256;
/// Fixed, so every run asks the same queries.
const QUERY_SEED: u64 = 7;

/// Measures `kvgate index` (and a peer index, in turns) on a simulated
/// fleet: CPU per ingested block, memory per live block, CPU and latency
/// per query, and at fleet scale queries at a fixed rate while every rank
/// keeps storing.
#[derive(Debug, Clone, clap::Args)]
pub struct IndexArgs {
    /// Engine ranks in the fleet, one ZMQ publisher each.
    #[arg(long, default_value_t = 33, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    ranks: u32,

    /// Data-parallel ranks per worker (instance id).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1_024))]
    ranks_per_worker: u32,

    /// Blocks each rank holds once ingested (whole chains; the remainder of
    /// a chain is not stored).
    #[arg(long, default_value_t = 8_000, value_parser = clap::value_parser!(u32).range(1..))]
    blocks_per_rank: u32,

    /// Tokens per block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4_096))]
    block_size: u32,

    /// Blocks per request chain (one store event each).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4_096))]
    chain: u32,

    /// Share of each chain every rank holds alike (a system prompt), 0 to 1.
    #[arg(long, default_value_t = 0.5, value_parser = share)]
    shared: f64,

    /// Chains stored per batch while the fleet is ingested.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4_096))]
    chains_per_batch: u32,

    /// Closed-loop queries per run, after the ingest (0: none).
    #[arg(long, default_value_t = 20_000)]
    queries: u32,

    /// Keep-alive connections the queries are spread over.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1_024))]
    connections: u32,

    /// Seconds of the fleet-scale phase: queries at --query-rate while every
    /// rank stores --store-rate blocks a second (0: none).
    #[arg(long, default_value = "0", value_parser = super::seconds)]
    steady: Duration,

    /// Queries per second in the fleet-scale phase (open loop).
    #[arg(long, default_value_t = 5_000.0, value_parser = positive)]
    query_rate: f64,

    /// Blocks per second each rank stores (and evicts) in the fleet-scale
    /// phase.
    #[arg(long, default_value_t = 500.0, value_parser = positive)]
    store_rate: f64,

    /// Runs per subject; with --peer, kvgate and the peer take turns.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,

    /// The kvgate binary to measure (default: the `kvgate` beside this tool).
    #[arg(long, value_name = "PATH")]
    kvgate: Option<PathBuf>,

    /// A peer index to measure as well, alternating with kvgate: its command
    /// (words split on whitespace, no shell), where `{port}` (or
    /// `{address}`) is where it must answer Dynamo's HTTP API; it prints
    /// `{"pid": PID, "url": URL}` once it does, and PID is measured, e.g.
    /// `/work/dynamo-venv/bin/python benchmarks/dynamo-index/peer.py serve
    /// --port {port}`.
    #[arg(long, value_name = "COMMAND")]
    peer: Option<String>,

    /// The peer's name in the report.
    #[arg(long, value_name = "NAME", default_value = "dynamo")]
    peer_name: String,

    /// Write the report as JSON here.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
}

fn share(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|share| (0.0..=1.0).contains(share))
        .ok_or_else(|| format!("{text:?} is not a share between 0 and 1"))
}

fn positive(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|value| value.is_finite() && *value > 0.0)
        .ok_or_else(|| format!("{text:?} is not a positive number"))
}

impl IndexArgs {
    fn shape(&self) -> anyhow::Result<FleetShape> {
        let chain_blocks = self.chain as usize;
        let shape = FleetShape {
            ranks: self.ranks as usize,
            ranks_per_worker: self.ranks_per_worker as usize,
            blocks_per_rank: self.blocks_per_rank as usize,
            block_size: self.block_size,
            chain_blocks,
            shared_blocks: (chain_blocks as f64 * self.shared) as usize,
            chains_per_batch: self.chains_per_batch as usize,
        };
        anyhow::ensure!(
            shape.chains() > 0,
            "--blocks-per-rank {} holds no whole --chain of {} blocks",
            self.blocks_per_rank,
            self.chain
        );
        Ok(shape)
    }

    /// The chains every rank still holds at the end of the fleet-scale
    /// phase: queries ask for those, so eviction does not turn them into
    /// misses as the phase goes on.
    fn queried_chains(&self, shape: &FleetShape) -> anyhow::Result<std::ops::Range<usize>> {
        let evicted = (self.store_rate * self.steady.as_secs_f64() / shape.chain_blocks as f64)
            .ceil() as usize
            + 1;
        let chains = shape.chains();
        anyhow::ensure!(
            self.steady.is_zero() || evicted < chains,
            "--steady {:?} at --store-rate {} evicts all {chains} chains a rank holds: raise \
             --blocks-per-rank or shorten --steady",
            self.steady,
            self.store_rate
        );
        Ok(if self.steady.is_zero() {
            0..chains
        } else {
            evicted..chains
        })
    }
}

pub async fn run(args: IndexArgs) -> anyhow::Result<()> {
    let shape = args.shape()?;
    let queried = args.queried_chains(&shape)?;
    let binary = match &args.kvgate {
        Some(path) => path.clone(),
        None => super::sibling_kvgate()?,
    };
    let peer = args
        .peer
        .clone()
        .map(|command| IndexPeer::new(args.peer_name.clone(), command))
        .transpose()?;
    let mut subjects = vec![IndexSubject::Kvgate {
        binary: binary.clone(),
    }];
    subjects.extend(peer.clone().map(IndexSubject::Peer));
    let bodies = query_bodies(&shape, queried);
    let mut runs = Vec::new();
    for _ in 0..args.rounds {
        for subject in &subjects {
            let name = subject.name();
            eprintln!("kvgate-bench index: {name}...");
            let run = measure(&args, subject, shape, &bodies)
                .await
                .with_context(|| format!("the index run of {name}"))?;
            eprintln!(
                "kvgate-bench index: {name}: {:.2} µs CPU per ingested block, {:.1} B per live \
                 block{}",
                run.ingest.cpu_us_per_block,
                run.memory.bytes_per_live_block,
                run.queries
                    .as_ref()
                    .map_or(String::new(), |queries| format!(
                        ", {:.1} µs CPU per query, p99 {:.3} ms",
                        queries.cpu_us_per_query, queries.latency_ms.p99
                    ))
            );
            runs.push(run);
        }
    }
    let config = IndexConfig {
        ranks: shape.ranks,
        ranks_per_worker: shape.ranks_per_worker,
        blocks_per_rank: shape.blocks_per_rank,
        block_size: shape.block_size,
        chain_blocks: shape.chain_blocks,
        shared_blocks_per_chain: shape.shared_blocks,
        chains_per_batch: shape.chains_per_batch,
        live_blocks: shape.live_blocks(),
        queries: args.queries as usize,
        connections: args.connections as usize,
        steady_s: args.steady.as_secs_f64(),
        query_rate: args.query_rate,
        store_blocks_per_s_per_rank: args.store_rate,
        kvgate: binary.display().to_string(),
        peer: peer.map(|peer| IndexPeerConfig {
            name: peer.name,
            command: peer.command,
        }),
    };
    let report = IndexReport::new(procfs::machine(), config, runs);
    print!("{}", report.table());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("--json {}", path.display()))?;
    }
    Ok(())
}

/// Whole stored chains of random ranks: a full match on that rank, the
/// shared prefix on every other.
fn query_bodies(shape: &FleetShape, chains: std::ops::Range<usize>) -> Arc<Vec<Bytes>> {
    let mut rng = SmallRng::seed_from_u64(QUERY_SEED);
    Arc::new(
        (0..QUERY_BODIES)
            .map(|_| {
                let rank = rng.random_range(0..shape.ranks);
                shape.query_body(rank, rng.random_range(chains.clone()))
            })
            .collect(),
    )
}

/// The subject's clocks and the machine's, read together.
struct Clocks {
    at: Instant,
    subject_cpu: f64,
    tool_cpu: f64,
    system: procfs::SystemCpu,
}

impl Clocks {
    fn take(subject: &Gateway) -> anyhow::Result<Self> {
        Ok(Self {
            at: Instant::now(),
            subject_cpu: procfs::process_cpu_seconds(subject.pid())?,
            tool_cpu: procfs::process_cpu_seconds(std::process::id())?,
            system: procfs::system_cpu()?,
        })
    }

    fn seconds_since(&self, start: &Self) -> f64 {
        (self.at - start.at).as_secs_f64()
    }

    fn subject_cpu_since(&self, start: &Self) -> f64 {
        self.subject_cpu - start.subject_cpu
    }

    /// CPU everyone but the subject and the tool used meanwhile, as a share
    /// of all CPUs.
    fn others_busy_percent_since(&self, start: &Self) -> f64 {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from) as f64;
        let others = self.system.busy_s
            - start.system.busy_s
            - self.subject_cpu_since(start)
            - (self.tool_cpu - start.tool_cpu);
        100.0 * others.max(0.0) / (self.seconds_since(start) * cpus)
    }
}

/// One run; everything it started is stopped however it ends.
async fn measure(
    args: &IndexArgs,
    subject: &IndexSubject,
    shape: FleetShape,
    bodies: &Arc<Vec<Bytes>>,
) -> anyhow::Result<IndexRunReport> {
    let index = subject.start().await?;
    let address = index.address().to_owned();
    tokio::time::sleep(IDLE_SETTLE).await;
    let before = procfs::memory(index.pid())?;
    let publisher = Worker::start("bench-fleet")?;
    let registering = address.clone();
    let mut fleet = publisher
        .spawn(async move {
            let mut fleet = Fleet::bind(shape).await?;
            fleet.register(&registering).await?;
            anyhow::Ok(fleet)
        })
        .await??;
    tokio::time::sleep(IDLE_SETTLE).await;
    let registered = procfs::memory(index.pid())?;

    let publisher_before = publisher.cpu_seconds()?;
    let start = Clocks::take(&index)?;
    let (returned, sent) = publisher
        .spawn(async move {
            let sent = fleet.ingest().await;
            (fleet, sent)
        })
        .await?;
    fleet = returned;
    let sent = sent?;
    let mut connection = Connection::open(&address).await?;
    wait_applied(&mut connection, &shape).await?;
    let applied = Clocks::take(&index)?;
    tokio::time::sleep(AT_REST_SETTLE).await;
    let ingested = Clocks::take(&index)?;
    let after = procfs::memory(index.pid())?;
    let publisher_cpu_s = publisher.cpu_seconds()? - publisher_before;
    let metrics = connection.get("/metrics").await?;
    let metrics = String::from_utf8_lossy(&metrics.body);
    let ingest_cpu = ingested.subject_cpu_since(&start);
    let ingest = Ingest {
        blocks: sent.stored_blocks,
        stores: sent.stored_blocks / shape.chain_blocks as u64,
        seconds: applied.seconds_since(&start),
        cpu_s: ingest_cpu,
        cpu_us_per_block: 1e6 * ingest_cpu / sent.stored_blocks.max(1) as f64,
        held_blocks_reported: metric_sum(&metrics, "kvgate_index_blocks{"),
        stores_applied_reported: metric_sum(
            &metrics,
            "dynamo_kvrouter_kv_cache_events_applied{event_type=\"stored\",status=\"ok\"}",
        ),
        publisher_cpu_s,
    };
    let memory = IndexMemory {
        rss_before_mb: before.rss_mb,
        rss_registered_mb: registered.rss_mb,
        rss_after_ingest_mb: after.rss_mb,
        bytes_per_live_block: (after.rss_mb - before.rss_mb) * 1e6 / shape.live_blocks() as f64,
        bytes_per_live_block_beyond_registration: (after.rss_mb - registered.rss_mb) * 1e6
            / shape.live_blocks() as f64,
    };
    drop(connection);

    let client = Worker::start("bench-queries")?;
    let queries = if args.queries > 0 {
        Some(closed_loop(&client, &index, args, bodies).await?)
    } else {
        None
    };
    let steady = if args.steady.is_zero() {
        None
    } else {
        Some(fleet_scale(&client, &publisher, fleet, &index, args, &shape, bodies).await?)
    };
    index.stop_noting(subject.name()).await?;
    Ok(IndexRunReport {
        subject: subject.name().to_owned(),
        ingest,
        memory,
        queries,
        steady,
    })
}

/// Waits until every rank's last chain matches in full on that rank: a
/// rank's stores are applied in its order, so all of them are.
async fn wait_applied(connection: &mut Connection, shape: &FleetShape) -> anyhow::Result<()> {
    let last = shape.chains() - 1;
    for rank in 0..shape.ranks {
        let deadline = Instant::now() + INGEST_STALL;
        let body = shape.query_body(rank, last);
        loop {
            let answer = connection.post("/query", body.clone()).await?;
            anyhow::ensure!(
                answer.status == 200,
                "/query answered {}: {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            );
            if rank_score(&answer.body, shape, rank) == Some(shape.full_score()) {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "rank {rank}'s stores were not all applied {INGEST_STALL:?} after the previous rank's"
            );
            tokio::time::sleep(APPLIED_POLL).await;
        }
    }
    Ok(())
}

/// `scores[instance][dp_rank]` of a `/query` answer.
fn rank_score(answer: &[u8], shape: &FleetShape, rank: usize) -> Option<u64> {
    let answer: serde_json::Value = serde_json::from_slice(answer).ok()?;
    answer["scores"][shape.instance_id(rank).to_string()][shape.dp_rank(rank).to_string()].as_u64()
}

/// The sum of a Prometheus text's samples whose line starts with `series`.
fn metric_sum(text: &str, series: &str) -> Option<u64> {
    text.lines()
        .filter(|line| line.starts_with(series))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|value| value as u64)
        .reduce(|sum, value| sum + value)
}

/// What the query connections measured.
#[derive(Default)]
struct Asked {
    latency: Histogram,
    answered: u64,
    failed: u64,
    /// When the last answer arrived.
    last: Option<Instant>,
}

impl Asked {
    fn merge(&mut self, other: Asked) {
        self.latency.merge(&other.latency);
        self.answered += other.answered;
        self.failed += other.failed;
        self.last = self.last.max(other.last);
    }
}

fn latency_ms(histogram: &Histogram) -> Latency {
    let millis = |quantile| histogram.quantile(quantile).unwrap_or(0) as f64 / 1e3;
    Latency {
        p50: millis(0.5),
        p99: millis(0.99),
        max: millis(1.0),
        samples: histogram.count(),
    }
}

/// When each query of a connection goes out.
#[derive(Clone, Copy)]
enum Schedule {
    /// As soon as the previous one is answered.
    ClosedLoop,
    /// Query `n` of all connections at `start + n / rate`.
    Rate { start: Instant, rate: f64 },
}

/// A connection's queries at a fixed rate, each timed as if the client
/// were punctual: its round trip, plus the wait behind its predecessor on
/// the connection that the subject's answers would have caused had every
/// query gone out at its time.
///
/// Why not the time from a query's intended send: the client wakes on a
/// timer of millisecond grain, so with a connection's queries less than a
/// millisecond apart a sleep that overshot left the next query late
/// through no fault of the subject. Timed from its intended send, an index
/// that answers from a stored buffer had a p99 of 1.15–1.71 ms at 4
/// connections and 0.17 ms at 16 (BENCHMARKS.md, "The fleet index").
/// What a slow answer costs those behind it is still counted, so a
/// subject that falls behind is not flattered (coordinated omission).
#[derive(Default)]
struct PunctualClock {
    /// When the previous query's answer would have come had it gone out at
    /// its time.
    answered_if_punctual: Option<Instant>,
}

impl PunctualClock {
    /// The time charged to a query meant for `intended` whose round trip
    /// took `round_trip`.
    fn charge(&mut self, intended: Instant, round_trip: Duration) -> Duration {
        let behind = self
            .answered_if_punctual
            .map_or(Duration::ZERO, |answered| {
                answered.saturating_duration_since(intended)
            });
        let charged = round_trip + behind;
        self.answered_if_punctual = Some(intended + charged);
        charged
    }
}

/// `count` queries on each of `connections.len()` connections, all on the
/// client's thread; connection `k` asks bodies `k * 7919 + i` in turn.
async fn ask(
    client: &Worker,
    connections: Vec<Connection>,
    bodies: &Arc<Vec<Bytes>>,
    count: usize,
    schedule: Schedule,
) -> anyhow::Result<Asked> {
    let total = connections.len();
    let tasks: Vec<_> = connections
        .into_iter()
        .enumerate()
        .map(|(k, mut connection)| {
            let bodies = Arc::clone(bodies);
            client.spawn(async move {
                let mut asked = Asked::default();
                let mut clock = PunctualClock::default();
                for i in 0..count {
                    let body = bodies[(k * 7_919 + i) % bodies.len()].clone();
                    let intended = match schedule {
                        Schedule::ClosedLoop => None,
                        Schedule::Rate { start, rate } => {
                            let intended =
                                start + Duration::from_secs_f64((i * total + k) as f64 / rate);
                            tokio::time::sleep_until(intended.into()).await;
                            Some(intended)
                        }
                    };
                    let sent = Instant::now();
                    let answer = connection.post("/query", body).await?;
                    let done = Instant::now();
                    let round_trip = done - sent;
                    let charged =
                        intended.map_or(round_trip, |intended| clock.charge(intended, round_trip));
                    asked.latency.record(charged.as_micros() as u64);
                    if answer.status == 200 {
                        asked.answered += 1;
                    } else {
                        asked.failed += 1;
                    }
                    asked.last = Some(done);
                }
                anyhow::Ok(asked)
            })
        })
        .collect();
    let mut asked = Asked::default();
    for task in tasks {
        asked.merge(task.await??);
    }
    Ok(asked)
}

/// Opens the query connections on the client's thread, where they are used.
async fn connect(client: &Worker, address: &str, count: u32) -> anyhow::Result<Vec<Connection>> {
    let address = address.to_owned();
    client
        .spawn(async move {
            let mut connections = Vec::new();
            for _ in 0..count {
                connections.push(Connection::open(&address).await?);
            }
            anyhow::Ok(connections)
        })
        .await?
}

async fn closed_loop(
    client: &Worker,
    index: &Gateway,
    args: &IndexArgs,
    bodies: &Arc<Vec<Bytes>>,
) -> anyhow::Result<Queries> {
    let connections = connect(client, index.address(), args.connections).await?;
    let per_connection = (args.queries / args.connections) as usize;
    let client_before = client.cpu_seconds()?;
    let start = Clocks::take(index)?;
    let asked = ask(
        client,
        connections,
        bodies,
        per_connection,
        Schedule::ClosedLoop,
    )
    .await?;
    let end = Clocks::take(index)?;
    let client_cpu_s = client.cpu_seconds()? - client_before;
    let queries = asked.answered + asked.failed;
    let seconds = end.seconds_since(&start);
    let cpu_s = end.subject_cpu_since(&start);
    Ok(Queries {
        queries,
        answered: asked.answered,
        failed: asked.failed,
        connections: args.connections as usize,
        seconds,
        queries_per_s: queries as f64 / seconds,
        cpu_s,
        cpu_us_per_query: 1e6 * cpu_s / queries.max(1) as f64,
        latency_ms: latency_ms(&asked.latency),
        client_cpu_s,
        client_cpu_us_per_query: 1e6 * client_cpu_s / queries.max(1) as f64,
        others_busy_percent: end.others_busy_percent_since(&start),
    })
}

/// Queries at `--query-rate` for `--steady` while every rank stores
/// `--store-rate` blocks a second.
async fn fleet_scale(
    client: &Worker,
    publisher: &Worker,
    mut fleet: Fleet,
    index: &Gateway,
    args: &IndexArgs,
    shape: &FleetShape,
    bodies: &Arc<Vec<Bytes>>,
) -> anyhow::Result<Steady> {
    let connections = connect(client, index.address(), args.connections).await?;
    let per_connection =
        (args.query_rate * args.steady.as_secs_f64() / f64::from(args.connections)).ceil() as usize;
    let stop = Arc::new(AtomicBool::new(false));
    let client_before = client.cpu_seconds()?;
    let publisher_before = publisher.cpu_seconds()?;
    let start = Clocks::take(index)?;
    let store_rate = args.store_rate;
    let churning = {
        let stop = Arc::clone(&stop);
        publisher.spawn(async move { fleet.churn(store_rate, stop).await })
    };
    // The ranks store for the phase's length, not for as long as a subject
    // that fell behind takes to answer: its late queries are still timed,
    // and no query asks for a chain evicted meanwhile.
    let phase_over = {
        let stop = Arc::clone(&stop);
        let steady = args.steady;
        tokio::spawn(async move {
            tokio::time::sleep(steady).await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        })
    };
    let schedule = Schedule::Rate {
        start: start.at,
        rate: args.query_rate,
    };
    let asked = ask(client, connections, bodies, per_connection, schedule).await;
    let end = Clocks::take(index)?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    phase_over.abort();
    let churned: Sent = churning.await??;
    let asked = asked?;
    let memory = procfs::memory(index.pid())?;
    let seconds = end.seconds_since(&start);
    let cpu_s = end.subject_cpu_since(&start);
    let queries = asked.answered + asked.failed;
    // Until the last answer, or the schedule's end if all came in time.
    let answering_s = asked.last.map_or(seconds, |last| {
        (last - start.at)
            .as_secs_f64()
            .max(queries as f64 / args.query_rate)
    });
    Ok(Steady {
        seconds,
        query_rate: args.query_rate,
        queries,
        answered: asked.answered,
        failed: asked.failed,
        answered_per_s: asked.answered as f64 / answering_s,
        latency_ms: latency_ms(&asked.latency),
        stored_blocks: churned.stored_blocks,
        removed_blocks: churned.removed_blocks,
        stored_blocks_per_s_per_rank: churned.stored_blocks as f64
            / seconds.min(args.steady.as_secs_f64())
            / shape.ranks as f64,
        cpu_s,
        cpu_percent_of_one_core: 100.0 * cpu_s / seconds,
        rss_end_mb: memory.rss_mb,
        peak_rss_mb: memory.peak_rss_mb,
        client_cpu_s: client.cpu_seconds()? - client_before,
        publisher_cpu_s: publisher.cpu_seconds()? - publisher_before,
        others_busy_percent: end.others_busy_percent_since(&start),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_send_is_not_charged_but_a_slow_answer_delays_those_behind_it() {
        let mut clock = PunctualClock::default();
        let start = Instant::now();
        let ms = Duration::from_millis;
        // Sent late by the client's timer, answered in 0.1 ms: 0.1 ms.
        assert_eq!(clock.charge(start, ms(1) / 10), ms(1) / 10);
        assert_eq!(clock.charge(start + ms(1), ms(1) / 10), ms(1) / 10);
        // An answer 3 ms late holds the next two queries behind it.
        assert_eq!(clock.charge(start + ms(2), ms(3)), ms(3));
        assert_eq!(clock.charge(start + ms(3), ms(1) / 10), ms(2) + ms(1) / 10);
        assert_eq!(clock.charge(start + ms(4), ms(1) / 10), ms(1) + ms(2) / 10);
        assert_eq!(clock.charge(start + ms(6), ms(1) / 10), ms(1) / 10);
    }

    #[test]
    fn metric_samples_are_summed_over_their_labels() {
        let text = "# HELP kvgate_index_blocks x\n\
                    kvgate_index_blocks{model_name=\"m\",routing_group=\"a\"} 10\n\
                    kvgate_index_blocks{model_name=\"m\",routing_group=\"b\"} 5\n\
                    kvgate_index_nodes{model_name=\"m\"} 7\n";
        assert_eq!(metric_sum(text, "kvgate_index_blocks{"), Some(15));
        assert_eq!(metric_sum(text, "dynamo_kvrouter"), None);
    }

    #[test]
    fn a_rank_score_is_read_by_instance_and_dp_rank() {
        let shape = FleetShape {
            ranks: 6,
            ranks_per_worker: 4,
            blocks_per_rank: 64,
            block_size: 16,
            chain_blocks: 32,
            shared_blocks: 16,
            chains_per_batch: 1,
        };
        let answer = br#"{"scores":{"1":{"0":512,"3":256},"2":{"1":512}}}"#;
        assert_eq!(rank_score(answer, &shape, 0), Some(512));
        assert_eq!(rank_score(answer, &shape, 3), Some(256));
        assert_eq!(rank_score(answer, &shape, 5), Some(512));
        assert_eq!(rank_score(answer, &shape, 4), None);
    }
}
