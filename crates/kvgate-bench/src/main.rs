//! `kvgate-bench`: a load run of the real thing on one machine, kept out of
//! the sidecar binary.
//!
//! Per subscriber count: a simulated engine (a real ZMQ PUB, vLLM's msgpack,
//! a steady mix of 16-token-block stores and one-hash removals) on its own
//! thread, `kvgate serve` as a child process, and N decode-light gRPC
//! subscribers on another thread, each on its own HTTP/2 connection. After
//! ZMQ's slow joiner and a warm-up, it measures for the duration: events
//! published and delivered per second, publish-to-receive latency (the
//! engine stamps each payload, kvgate passes the stamp on as the batch
//! timestamp), kvgate's CPU and memory from `/proc`, and the tool's own CPU
//! — where that approaches kvgate's, the run measures the tool.
//!
//! With `--peer`, a peer relay is measured the same way, alternating with
//! kvgate run by run, so both see the same machine at the same time.
//!
//! `kvgate-bench index` measures `kvgate index` instead, and with `--peer`
//! Dynamo's standalone indexer in turns ([`index_bench`]).

mod chart;
mod fleet;
mod floor;
mod floor_relay;
mod gateway;
mod histogram;
mod http_client;
mod index_bench;
mod index_floor;
mod index_report;
mod procfs;
mod publisher;
mod report;
mod subject;
mod subscriber;
mod worker;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use gateway::Gateway;
use histogram::Histogram;
use publisher::{Mode, Publisher};
use report::{Config, KvgateCost, Latency, PeerConfig, Report, RunReport, ToolCost};
use subject::{Peer, Subject};
use subscriber::{Delivery, Subscribers, Window};
use workload::Workload;

use clap::Parser;
use kvgate_sim::WorkloadShape;

/// kvgate's resident memory is read this long after it starts serving.
const IDLE_SETTLE: Duration = Duration::from_millis(500);
/// How long kvgate's SUB may take to join the publisher.
const JOIN_TIMEOUT: Duration = Duration::from_secs(20);
/// No event for this long: everything published has arrived.
const QUIET: Duration = Duration::from_millis(300);
/// After publishing stops, how long subscribers may go without progress
/// before the events they lack count as missing.
const DRAIN_STALL: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(10);

/// Measures a kvgate binary under N subscribers: throughput, latency, CPU
/// and memory, as tables, JSON and an SVG chart.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvgate-bench", version, args_conflicts_with_subcommands = true)]
struct LoadArgs {
    #[command(subcommand)]
    command: Option<Command>,

    /// Subscriber counts, one run each (a list is a sweep).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64",
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    subscribers: Vec<u32>,

    /// Events per second the simulated engine publishes; 0 publishes as fast
    /// as every subscriber receives (a bounded number of events in flight).
    #[arg(long, default_value_t = 20_000)]
    rate: u64,

    /// Seconds measured per run.
    #[arg(long, default_value = "10", value_parser = seconds)]
    duration: Duration,

    /// Seconds of load before measuring. The engine's cache fills within
    /// the default, kvgate's history only once it holds --history-batches
    /// batches (about 13 s at 20k events/s of 16-block stores); a run whose
    /// subject's RSS still grew is noted in the report, and a warm-up past
    /// that measures the steady state.
    #[arg(long, default_value = "2", value_parser = seconds)]
    warmup: Duration,

    /// 16-token blocks per stored event; once the engine's cache is full,
    /// each store comes with as many one-block removals.
    #[arg(long, default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    blocks_per_store: u32,

    /// Publish the traffic of a recording (`kvgate record`) or a Mooncake
    /// trace instead of the steady mix, in a loop, at --rate.
    #[arg(long, value_name = "FILE")]
    workload: Option<PathBuf>,

    /// Write the report as JSON here.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,

    /// Write an SVG chart (throughput and latency against subscribers) here.
    #[arg(long, value_name = "PATH")]
    svg: Option<PathBuf>,

    /// The kvgate binary to measure (default: the `kvgate` beside this tool,
    /// as `cargo build --release` leaves them).
    #[arg(long, value_name = "PATH")]
    kvgate: Option<PathBuf>,

    /// A peer relay to measure as well, alternating with kvgate: its command
    /// (words split on whitespace, no shell), where `{port}` (or `{address}`,
    /// `127.0.0.1:PORT`) is where it must serve gRPC and `{zmq}` the
    /// engine's ZMQ endpoint, e.g. `python benchmarks/smg-peer.py {port} {zmq}`.
    #[arg(long, value_name = "COMMAND")]
    peer: Option<String>,

    /// The peer's `SubscribeKvEvents` method path.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents"
    )]
    peer_method: String,

    /// The peer's name in the report.
    #[arg(long, value_name = "NAME", default_value = "peer")]
    peer_name: String,

    /// Runs per subscriber count and subject; with `--peer`, kvgate and the
    /// peer take turns.
    #[arg(long, default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,

    /// Instead of a load run, be `benchmarks/floor.py`'s receivers: connect
    /// --floor-count of them to `zmq:ENDPOINT` (SUB sockets),
    /// `grpc:HOST:PORT` (kvgate's streams) or `tcp:IP:PORT` (the floor
    /// relay's connections), all on one thread, and answer
    /// floor.py's `ready?` and `count` on stdin.
    #[arg(long, value_name = "TARGET", requires = "floor_count")]
    floor_receivers: Option<floor::FloorTarget>,

    /// Instead of a load run, be `benchmarks/floor.py`'s floor relay: a
    /// relay that does nothing but relay, from the engine's ZMQ PUB at
    /// ENDPOINT to every `--floor-receivers tcp:ADDRESS` that connects (it
    /// prints its address first).
    #[arg(long, value_name = "ENDPOINT", conflicts_with = "floor_receivers")]
    floor_relay: Option<String>,

    /// How many receivers --floor-receivers connects.
    #[arg(long, value_name = "N", requires = "floor_receivers",
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    floor_count: Option<u32>,

    /// Extra `kvgate serve` flags, after `--` (e.g. `-- --max-batch-events 256`).
    #[arg(last = true, value_name = "SERVE_ARGS")]
    serve_args: Vec<String>,
}

#[derive(Debug, Clone, clap::Subcommand)]
enum Command {
    /// Measure `kvgate index` on a simulated fleet of engine ranks (and a
    /// peer index, e.g. Dynamo's, in turns): CPU per ingested block, memory
    /// per live block, CPU and latency per query, and queries at a fixed
    /// rate while every rank keeps storing.
    Index(index_bench::IndexArgs),
    /// Be an index that indexes nothing, the floor under any index's query
    /// latency: it follows every rank registered with it (each message
    /// read and dropped) and answers every query with one stored answer
    /// naming them all; `kvgate-bench index --peer "kvgate-bench
    /// index-floor --port {port}"` measures it beside kvgate.
    IndexFloor(index_floor::IndexFloorArgs),
}

fn seconds(text: &str) -> Result<Duration, String> {
    text.parse::<f64>()
        .ok()
        .filter(|secs| *secs >= 0.0)
        .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
        .ok_or_else(|| format!("{text:?} is not a number of seconds"))
}

fn main() -> anyhow::Result<()> {
    let args = LoadArgs::parse();
    match args.command {
        Some(Command::Index(index)) => {
            return tokio::runtime::Runtime::new()
                .context("cannot start the async runtime")?
                .block_on(index_bench::run(index));
        }
        // One thread answers, as `kvgate index`'s one query thread.
        Some(Command::IndexFloor(floor)) => {
            return tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start the async runtime")?
                .block_on(index_floor::serve(floor));
        }
        None => {}
    }
    if let (Some(target), Some(count)) = (args.floor_receivers.clone(), args.floor_count) {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?
            .block_on(floor::serve(target, count as usize));
    }
    if let Some(endpoint) = args.floor_relay.clone() {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?
            .block_on(floor_relay::serve(endpoint));
    }
    tokio::runtime::Runtime::new()
        .context("cannot start the async runtime")?
        .block_on(run(args))
}

/// Where `cargo build` puts the gateway: beside this tool.
fn sibling_kvgate() -> anyhow::Result<PathBuf> {
    let tool = std::env::current_exe().context("cannot find this tool's own path")?;
    let kvgate = tool.with_file_name("kvgate");
    anyhow::ensure!(
        kvgate.is_file(),
        "no kvgate binary at {}: build it (cargo build --release) or give --kvgate PATH",
        kvgate.display()
    );
    Ok(kvgate)
}

async fn run(args: LoadArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.duration.is_zero(), "--duration must be positive");
    let binary = match &args.kvgate {
        Some(path) => path.clone(),
        None => sibling_kvgate()?,
    };
    let peer = args
        .peer
        .clone()
        .map(|command| Peer::new(args.peer_name.clone(), command, &args.peer_method))
        .transpose()?;
    let mut subjects = vec![Subject::Kvgate {
        binary: binary.clone(),
        serve_args: args.serve_args.clone(),
    }];
    subjects.extend(peer.clone().map(Subject::Peer));
    let shape = WorkloadShape {
        blocks_per_store: args.blocks_per_store as usize,
        ..WorkloadShape::default()
    };
    let mut runs = Vec::new();
    for &subscribers in &args.subscribers {
        let subscribers = subscribers as usize;
        for _ in 0..args.rounds {
            for subject in &subjects {
                let name = subject.name();
                eprintln!("kvgate-bench: {name}, {subscribers} subscriber(s)...");
                let run = measure(&args, subject, shape, subscribers)
                    .await
                    .with_context(|| {
                        format!("the run of {name} with {subscribers} subscriber(s)")
                    })?;
                eprintln!(
                    "kvgate-bench: {name}, {subscribers} subscriber(s): {:.0} events/s delivered per subscriber, p99 {:.2} ms, {:.2} µs CPU per event delivered",
                    run.delivered_events_per_s_mean,
                    run.latency_ms.p99,
                    run.kvgate.cpu_us_per_event_delivered
                );
                runs.push(run);
            }
        }
    }
    let config = Config {
        rate_events_per_s: args.rate,
        duration_s: args.duration.as_secs_f64(),
        warmup_s: args.warmup.as_secs_f64(),
        blocks_per_store: shape.blocks_per_store,
        block_size: shape.block_size,
        live_blocks: shape.live_blocks,
        workload: args
            .workload
            .as_ref()
            .map(|file| file.display().to_string()),
        kvgate: binary.display().to_string(),
        serve_args: args.serve_args.clone(),
        peer: peer.map(|peer| PeerConfig {
            name: peer.name,
            command: peer.command,
            method: args.peer_method.clone(),
        }),
    };
    let report = Report::new(procfs::machine(), config, runs);
    print!("{}", report.table());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("--json {}", path.display()))?;
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, chart::render(&report))
            .with_context(|| format!("--svg {}", path.display()))?;
    }
    Ok(())
}

/// The clocks read at either end of the measurement window.
struct Reading {
    at: Instant,
    published: u64,
    kvgate_cpu: f64,
    publisher_cpu: f64,
    subscribers_cpu: f64,
    /// This whole process: publisher, subscribers and orchestration.
    tool_cpu: f64,
    system: procfs::SystemCpu,
    /// Tells a subject still filling its buffers from one in its steady
    /// state.
    kvgate_rss_mb: f64,
}

impl Reading {
    fn take(
        gateway: &Gateway,
        publisher: &Publisher,
        subscribers: &Subscribers,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            at: Instant::now(),
            published: publisher.published_events(),
            kvgate_cpu: procfs::process_cpu_seconds(gateway.pid())?,
            publisher_cpu: publisher.cpu_seconds()?,
            subscribers_cpu: subscribers.cpu_seconds()?,
            tool_cpu: procfs::process_cpu_seconds(std::process::id())?,
            system: procfs::system_cpu()?,
            kvgate_rss_mb: procfs::memory(gateway.pid())?.rss_mb,
        })
    }
}

/// One run; everything it started is stopped however it ends.
async fn measure(
    args: &LoadArgs,
    subject: &Subject,
    shape: WorkloadShape,
    count: usize,
) -> anyhow::Result<RunReport> {
    let delivery = Delivery::new(count);
    let workload = Workload::new(shape, publisher::SEED, args.workload.as_deref())?;
    let mut publisher = Publisher::start(workload, args.rate, Arc::clone(&delivery)).await?;
    let gateway = subject.start(publisher.endpoint()).await?;
    tokio::time::sleep(IDLE_SETTLE).await;
    let idle = procfs::memory(gateway.pid())?;
    let subscribers = Subscribers::connect(gateway.address(), subject.service(), &delivery).await?;

    // ZMQ's slow joiner: the PUB drops everything until kvgate's SUB has
    // joined, so publish slowly until every subscriber sees data, then let
    // the pipeline empty and count from there.
    publisher.set_mode(Mode::Prime);
    let joined = wait_until(JOIN_TIMEOUT, || {
        delivery.events().iter().all(|events| *events > 0)
    })
    .await;
    anyhow::ensure!(joined, "kvgate forwarded nothing within {JOIN_TIMEOUT:?}");
    publisher.set_mode(Mode::Quiet);
    settle(&delivery).await;
    let published_before = publisher.published_events();
    let received_before = delivery.events();

    publisher.set_mode(Mode::Run);
    tokio::time::sleep(args.warmup).await;
    let start = Reading::take(&gateway, &publisher, &subscribers)?;
    subscribers.record(true);
    tokio::time::sleep(args.duration).await;
    subscribers.record(false);
    let end = Reading::take(&gateway, &publisher, &subscribers)?;
    let published_total = publisher.stop().await?;

    let missing_events = drain(
        &delivery,
        &received_before,
        published_total - published_before,
    )
    .await;
    let ended_early = delivery.ended();
    let peak = procfs::memory(gateway.pid())?;
    // Everything has arrived or never will, so closing the engine's socket
    // loses nothing; stopping kvgate then ends every stream and so every
    // subscriber.
    drop(publisher);
    gateway.stop_noting(subject.name()).await?;
    let windows = subscribers.finish().await?;
    Ok(Measured {
        subject: subject.name().to_owned(),
        subscribers: count,
        start,
        end,
        idle,
        peak,
        missing_events,
        ended_early,
        windows,
    }
    .report())
}

/// A run's raw figures.
struct Measured {
    subject: String,
    subscribers: usize,
    start: Reading,
    end: Reading,
    idle: procfs::Memory,
    peak: procfs::Memory,
    missing_events: u64,
    /// Per subscriber: whether its stream ended before kvgate was stopped.
    ended_early: Vec<bool>,
    windows: Vec<Window>,
}

impl Measured {
    fn report(self) -> RunReport {
        let (start, end) = (&self.start, &self.end);
        let window_s = (end.at - start.at).as_secs_f64();
        let count = self.subscribers as f64;
        let mut latency = Histogram::default();
        for window in &self.windows {
            latency.merge(&window.latency);
        }
        let millis = |quantile| latency.quantile(quantile).unwrap_or(0) as f64 / 1e3;
        let delivered: Vec<f64> = self
            .windows
            .iter()
            .map(|window| window.events as f64 / window_s)
            .collect();
        let batches: u64 = self.windows.iter().map(|window| window.batches).sum();
        let events: u64 = self.windows.iter().map(|window| window.events).sum();
        let kvgate_cpu = end.kvgate_cpu - start.kvgate_cpu;
        let subscribers_cpu = end.subscribers_cpu - start.subscribers_cpu;
        let publisher_cpu = end.publisher_cpu - start.publisher_cpu;
        let tool_cpu = end.tool_cpu - start.tool_cpu;
        let cpus = std::thread::available_parallelism().map_or(1, usize::from) as f64;
        let of_machine = |cpu_s: f64| 100.0 * cpu_s / (window_s * cpus);
        RunReport {
            subject: self.subject,
            subscribers: self.subscribers,
            window_s,
            published_events_per_s: (end.published - start.published) as f64 / window_s,
            delivered_events_per_s_mean: delivered.iter().sum::<f64>() / count,
            delivered_events_per_s_min: delivered.iter().copied().fold(f64::INFINITY, f64::min),
            batches_per_s_per_subscriber: batches as f64 / count / window_s,
            latency_ms: Latency {
                p50: millis(0.5),
                p99: millis(0.99),
                max: millis(1.0),
                samples: latency.count(),
            },
            missing_events: self.missing_events,
            sequence_gaps: self.windows.iter().map(|window| window.sequence_gaps).sum(),
            streams_ended_early: self.ended_early.iter().filter(|early| **early).count(),
            first_stream_error: self
                .windows
                .iter()
                .zip(&self.ended_early)
                .find(|(_, early)| **early)
                .and_then(|(window, _)| window.error.clone()),
            kvgate: KvgateCost {
                cpu_s: kvgate_cpu,
                cpu_percent_of_one_core: 100.0 * kvgate_cpu / window_s,
                cpu_us_per_batch_delivered: 1e6 * kvgate_cpu / (batches as f64).max(1.0),
                cpu_us_per_event_delivered: 1e6 * kvgate_cpu / (events as f64).max(1.0),
                idle_rss_mb: self.idle.rss_mb,
                peak_rss_mb: self.peak.peak_rss_mb,
                window_rss_mb: [start.kvgate_rss_mb, end.kvgate_rss_mb],
            },
            tool: ToolCost {
                subscribers_cpu_s: subscribers_cpu,
                subscribers_cpu_percent_of_one_core: 100.0 * subscribers_cpu / window_s,
                publisher_cpu_s: publisher_cpu,
                subscribers_cheaper_than_kvgate: subscribers_cpu < kvgate_cpu,
            },
            machine_busy_percent: of_machine(kvgate_cpu + tool_cpu),
            others_busy_percent: of_machine(
                (end.system.busy_s - start.system.busy_s - kvgate_cpu - tool_cpu).max(0.0),
            ),
            steal_percent: of_machine(end.system.steal_s - start.system.steal_s),
        }
    }
}

async fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
    true
}

/// Waits until no subscriber has received anything for [`QUIET`].
async fn settle(delivery: &Delivery) {
    let mut last = delivery.events();
    let mut since = Instant::now();
    while since.elapsed() < QUIET {
        tokio::time::sleep(POLL).await;
        let now = delivery.events();
        if now != last {
            last = now;
            since = Instant::now();
        }
    }
}

/// Waits until every subscriber has the `published` events sent since it
/// had `before[i]`, or until they stop making progress; returns the events
/// still lacking, summed over subscribers.
async fn drain(delivery: &Delivery, before: &[u64], published: u64) -> u64 {
    let lacking = |received: &[u64]| -> u64 {
        received
            .iter()
            .zip(before)
            .map(|(now, before)| (before + published).saturating_sub(*now))
            .sum()
    };
    let mut last = delivery.events();
    let mut since = Instant::now();
    while lacking(&last) > 0 && since.elapsed() < DRAIN_STALL {
        tokio::time::sleep(POLL).await;
        let now = delivery.events();
        if now != last {
            last = now;
            since = Instant::now();
        }
    }
    lacking(&last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(at: Instant, kvgate_cpu: f64) -> Reading {
        Reading {
            at,
            published: 0,
            kvgate_cpu,
            publisher_cpu: 0.0,
            subscribers_cpu: 0.0,
            tool_cpu: 0.0,
            system: procfs::SystemCpu::default(),
            kvgate_rss_mb: 30.0,
        }
    }

    #[test]
    fn cpu_per_delivery_divides_kvgate_cpu_by_the_batches_and_events_of_every_subscriber() {
        let start = Instant::now();
        let memory = procfs::Memory {
            rss_mb: 10.0,
            peak_rss_mb: 20.0,
        };
        let window = |batches| Window {
            batches,
            events: 4 * batches,
            ..Window::default()
        };
        let measured = Measured {
            subject: "kvgate".to_owned(),
            subscribers: 2,
            start: reading(start, 1.0),
            end: reading(start + Duration::from_secs(10), 1.5),
            idle: memory,
            peak: memory,
            missing_events: 0,
            ended_early: vec![false, false],
            windows: vec![window(10_000), window(15_000)],
        };
        // 0.5 s of kvgate CPU over 25,000 deliveries.
        let report = measured.report();
        assert!((report.kvgate.cpu_us_per_batch_delivered - 20.0).abs() < 1e-9);
        assert!((report.kvgate.cpu_us_per_event_delivered - 5.0).abs() < 1e-9);
    }
}
