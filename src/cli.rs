//! Command line: every flag of `kvgate serve` can also come from a
//! `KVGATE_…` environment variable (handy in a Kubernetes sidecar manifest).
//! Values are checked here, so a bad one fails at start naming its flag.
//! A boolean flag's variable takes what Kubernetes users write: `1`/`0`,
//! `true`/`false`, `yes`/`no`, `on`/`off` (any case).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::builder::BoolishValueParser;
use clap::{Args, Parser, Subcommand};

use crate::cli_values::{byte_size, parse_grpc_uri, parse_http_url, parse_listen_address};
use crate::logging::LogFormat;
use kvgate_endpoint::ZmqEndpoint;

#[derive(Debug, Parser)]
#[command(
    name = "kvgate",
    // The version and the commit it was built from (build.rs), so a
    // running binary names its exact source.
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("KVGATE_GIT_COMMIT"), ")"),
    about = "gRPC streaming gateway for LLM KV-cache events"
)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub struct Cli {
    /// Log format on stderr (filter with RUST_LOG, e.g. RUST_LOG=kvgate=debug).
    #[arg(
        long,
        env = "KVGATE_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,

    #[command(subcommand)]
    #[allow(missing_docs)] // flattened or a subcommand: clap documents it
    pub command: Command,
}

#[derive(Debug, Subcommand)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub enum Command {
    /// Drain an engine's KV events and serve them to any number of routers.
    Serve(Box<ServeArgs>),
    /// Follow many engines' KV events and answer prefix-overlap queries:
    /// Dynamo's standalone indexer API over HTTP.
    Index(Box<IndexArgs>),
    /// Print a gateway's event stream (or a recording's, with --file).
    Tail(crate::tools::tail::TailArgs),
    /// Record a gateway's event stream to a file, to replay it later
    /// (`serve --replay-file`); --stats summarises a recording.
    Record(Box<crate::tools::record::RecordArgs>),
    /// Summarise a running gateway: health, services, blocks per rank.
    Status(crate::tools::status::StatusArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(crate::tools::shell::CompletionsArgs),
    /// Print a man page (roff), e.g. `kvgate man serve | man -l -`, or write
    /// every page with --dir.
    Man(crate::tools::shell::ManArgs),
}

#[derive(Debug, Clone, Args)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub struct IndexArgs {
    /// HTTP address the index answers on (Dynamo's API): IP:PORT or
    /// HOST:PORT.
    #[arg(long, env = "KVGATE_INDEX_LISTEN", value_name = "ADDR",
          value_parser = parse_listen_address)]
    pub listen: SocketAddr,

    /// Workers to follow from the start, as Dynamo's indexer takes them:
    /// `id[:dp_rank]=tcp://HOST:PORT,...` or `id[:dp_rank]=ipc://PATH`, or
    /// a kvgate sidecar for every rank of an engine, `id=grpc://HOST:PORT`
    /// (`grpcs://` for TLS); more can register over HTTP.
    #[arg(long, env = "KVGATE_INDEX_WORKERS", value_name = "LIST",
          value_parser = parse_index_workers, requires_all = ["model_name", "block_size"])]
    pub workers: Option<IndexWorkers>,

    /// The model the --workers serve.
    #[arg(long, env = "KVGATE_INDEX_MODEL_NAME", value_name = "NAME")]
    pub model_name: Option<String>,

    /// The routing group the --workers are in.
    #[arg(long, env = "KVGATE_INDEX_ROUTING_GROUP", value_name = "NAME",
          default_value = crate::index::registry::DEFAULT_ROUTING_GROUP)]
    pub routing_group: String,

    /// Tokens per KV block of the --workers' engines.
    #[arg(long, env = "KVGATE_INDEX_BLOCK_SIZE", value_name = "TOKENS",
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub block_size: Option<u32>,

    /// Most registrations at once: worker ranks (each one socket) and
    /// sidecars (each one connection); one more is answered 503 naming this
    /// flag.
    #[arg(long, env = "KVGATE_INDEX_MAX_WORKER_RANKS", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub index_max_worker_ranks: u64,

    /// Most (model, routing group) partitions at once; one more is answered
    /// 503 naming this flag.
    #[arg(long, env = "KVGATE_INDEX_MAX_PARTITIONS", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub index_max_partitions: u64,

    /// Ranks a grpc:// worker may have: its batches for rank
    /// 0..this are indexed, any other is dropped and counted.
    #[arg(long, env = "KVGATE_INDEX_MAX_SIDECAR_RANKS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub index_max_sidecar_ranks: u32,

    /// The CA that signed grpcs:// workers' certificates (PEM).
    #[arg(long, env = "KVGATE_WORKER_CA_FILE", value_name = "FILE")]
    pub worker_ca_file: Option<PathBuf>,

    /// A client certificate (PEM) presented to grpcs:// workers that
    /// require one (their --tls-client-ca).
    #[arg(
        long,
        env = "KVGATE_WORKER_TLS_CERT",
        value_name = "FILE",
        requires = "worker_tls_key"
    )]
    pub worker_tls_cert: Option<PathBuf>,

    /// The private key (PEM) of --worker-tls-cert.
    #[arg(
        long,
        env = "KVGATE_WORKER_TLS_KEY",
        value_name = "FILE",
        requires = "worker_tls_cert"
    )]
    pub worker_tls_key: Option<PathBuf>,

    /// A file whose first token is sent to every grpc:// and grpcs://
    /// worker as a bearer token (their --auth-token-file).
    #[arg(long, env = "KVGATE_WORKER_TOKEN_FILE", value_name = "FILE")]
    pub worker_token_file: Option<PathBuf>,

    /// The service name grpc:// workers are called on (SubscribeKvEvents).
    #[arg(
        long,
        env = "KVGATE_WORKER_SERVICE",
        default_value = "kvgate.v1.KvGate",
        value_name = "NAME"
    )]
    pub worker_service: String,

    /// Threads that answer queries (every feed and the writer run on a
    /// thread of their own). One answers each query on the thread that read
    /// it, with no wake-up of another: 23-24 µs of CPU per query against
    /// 28.5-31.5 with two on 33 ranks, at the same rate and p99
    /// (BENCHMARKS.md, "The fleet index"). It caps the index at one core's
    /// queries (about 40,000 a second over 33 ranks, 16,000 over 256): more
    /// threads for more.
    #[arg(long, env = "KVGATE_INDEX_WORKER_THREADS", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub worker_threads: u32,

    /// Most milliseconds one replay request to a worker's replay endpoint
    /// may take.
    #[arg(long, env = "KVGATE_ZMQ_REPLAY_TIMEOUT_MS",
          default_value_t = crate::source::replay::DEFAULT_TIMEOUT.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub zmq_replay_timeout_ms: u64,

    /// Largest ZMQ message accepted from a worker's publisher or replay
    /// endpoint, e.g. 64MiB.
    #[arg(long, env = "KVGATE_ZMQ_MAX_MESSAGE_BYTES", default_value = "64MiB", value_name = "SIZE",
          value_parser = byte_size(crate::source::peer::MAX_MESSAGE_BYTES_RANGE))]
    pub zmq_max_message_bytes: u64,

    /// Most connections open on the HTTP port; one more is answered 503 and
    /// closed at once.
    #[arg(long, env = "KVGATE_INDEX_MAX_CONNECTIONS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub http_max_connections: u32,

    /// Most milliseconds a client may take to send a request's headers.
    #[arg(long, env = "KVGATE_INDEX_HEADER_TIMEOUT_MS", default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(10..=600_000))]
    pub http_header_timeout_ms: u64,

    /// A connection that moves no byte either way for this many
    /// milliseconds is closed.
    #[arg(long, env = "KVGATE_INDEX_IDLE_TIMEOUT_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(10..=86_400_000))]
    pub http_idle_timeout_ms: u64,
}

/// `--workers`: each rank's publisher, as Dynamo's indexer takes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexWorkers(pub Vec<IndexWorker>);

/// One entry of `--workers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexWorker {
    /// The worker instance.
    pub instance_id: u64,
    /// Its rank, if given.
    pub dp_rank: Option<u32>,
    /// The rank's publisher (`tcp://`, `ipc://`), or the engine's sidecar
    /// (`grpc://`, `grpcs://`), checked when it is registered.
    pub endpoint: String,
}

/// Parses `id[:dp_rank]=ENDPOINT,...`: `tcp://HOST:PORT`, `ipc://PATH` (or
/// `id=grpc://HOST:PORT`).
pub fn parse_index_workers(text: &str) -> Result<IndexWorkers, String> {
    text.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let (worker, endpoint) = entry
                .split_once('=')
                .ok_or_else(|| format!("expected id[:dp_rank]=tcp://HOST:PORT, id[:dp_rank]=ipc://PATH or id=grpc://HOST:PORT, got {entry:?}"))?;
            let (instance_id, dp_rank) = match worker.split_once(':') {
                Some((id, rank)) => (id, Some(rank)),
                None => (worker, None),
            };
            Ok(IndexWorker {
                instance_id: instance_id
                    .parse()
                    .map_err(|_| format!("bad instance id {instance_id:?} in {entry:?}"))?,
                dp_rank: dp_rank
                    .map(|rank| {
                        rank.parse()
                            .map_err(|_| format!("bad dp_rank {rank:?} in {entry:?}"))
                    })
                    .transpose()?,
                endpoint: endpoint.to_owned(),
            })
        })
        .collect::<Result<Vec<_>, String>>()
        .and_then(|workers| {
            if workers.is_empty() {
                Err("no worker given".to_owned())
            } else {
                Ok(IndexWorkers(workers))
            }
        })
}

#[derive(Debug, Clone, Args)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub struct ServeArgs {
    /// gRPC address routers connect to: IP:PORT or HOST:PORT (resolved at
    /// start, e.g. localhost:50061).
    #[arg(long, env = "KVGATE_LISTEN", default_value = "0.0.0.0:50061",
          value_name = "ADDR", value_parser = parse_listen_address)]
    pub listen: SocketAddr,

    /// The engine's KV-event publisher for rank 0, as configured on the engine
    /// (e.g. tcp://*:5557); rank r is at port + r. With ranks on several
    /// hosts, give it once per rank in rank order (the env var takes a
    /// comma-separated list); the count must equal --dp-size. An engine on
    /// this host may publish on a Unix socket, ipc://PATH: a path has no
    /// port to offset, so with --dp-size over 1 give one per rank.
    #[arg(
        long,
        env = "KVGATE_ZMQ_ENDPOINT",
        value_name = "URI",
        value_delimiter = ',',
        conflicts_with = "demo"
    )]
    pub zmq_endpoint: Vec<ZmqEndpoint>,

    /// Another SubscribeKvEvents server to re-serve instead of a ZMQ engine
    /// (TensorRT-LLM's gRPC server, or another kvgate), e.g. http://127.0.0.1:50051.
    #[arg(long, env = "KVGATE_UPSTREAM_GRPC", value_name = "URI",
          value_parser = parse_grpc_uri, conflicts_with_all = ["zmq_endpoint", "demo"])]
    pub upstream_grpc: Option<String>,

    /// The upstream service name to call SubscribeKvEvents on.
    #[arg(
        long,
        env = "KVGATE_UPSTREAM_SERVICE",
        default_value = "kvgate.v1.KvGate",
        value_name = "NAME"
    )]
    pub upstream_service: String,

    /// Number of data-parallel ranks, each with its own publisher (with
    /// --upstream-grpc, the ranks taken from the upstream: a batch for any
    /// other is dropped and counted).
    #[arg(long, env = "KVGATE_DP_SIZE", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub dp_size: u32,

    /// The engine's replay ROUTER for rank 0 (e.g. tcp://*:5567; rank r at
    /// port + r): fills lost messages and primes the state at start. Keep
    /// the publisher and replay bases at least --dp-size apart. Like
    /// --zmq-endpoint, it may be given once per rank instead.
    #[arg(
        long,
        env = "KVGATE_ZMQ_REPLAY_ENDPOINT",
        value_name = "URI",
        value_delimiter = ','
    )]
    pub zmq_replay_endpoint: Vec<ZmqEndpoint>,

    /// Most milliseconds one replay request may take (engines answer within
    /// ~100 ms when idle).
    #[arg(long, env = "KVGATE_ZMQ_REPLAY_TIMEOUT_MS",
          default_value_t = crate::source::replay::DEFAULT_TIMEOUT.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub zmq_replay_timeout_ms: u64,

    /// Most milliseconds one replay fetch (priming, or filling one gap) may
    /// take in all, over every request it needs; the rank's live messages
    /// wait meanwhile.
    #[arg(long, env = "KVGATE_ZMQ_REPLAY_FETCH_TIMEOUT_MS",
          default_value_t = crate::source::replay::DEFAULT_FETCH_TIMEOUT.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub zmq_replay_fetch_timeout_ms: u64,

    /// Most messages one replay fetch forwards; the rest counts as lost.
    #[arg(long, env = "KVGATE_ZMQ_REPLAY_MAX_MESSAGES",
          default_value_t = crate::source::replay::DEFAULT_MAX_MESSAGES,
          value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub zmq_replay_max_messages: u64,

    /// Most payload bytes one replay fetch forwards, e.g. 64MiB; at most
    /// --history-bytes (the default is the smaller of 64MiB and that).
    #[arg(long, env = "KVGATE_ZMQ_REPLAY_MAX_BYTES", value_name = "SIZE",
          value_parser = byte_size(4096..=(64 << 30)))]
    pub zmq_replay_max_bytes: Option<u64>,

    /// Largest ZMQ message (all frames) accepted from the engine's publisher
    /// or replay endpoint, e.g. 64MiB; a peer announcing more is disconnected
    /// before anything is allocated for it. The default is several times the
    /// largest engine message seen in practice (a few MiB for a batch of
    /// thousands of events).
    #[arg(long, env = "KVGATE_ZMQ_MAX_MESSAGE_BYTES", default_value = "64MiB", value_name = "SIZE",
          value_parser = byte_size(crate::source::peer::MAX_MESSAGE_BYTES_RANGE))]
    pub zmq_max_message_bytes: u64,

    /// Topic the engine publishes under (empty by default, as in the engines).
    #[arg(long, env = "KVGATE_ZMQ_TOPIC", default_value = "")]
    pub zmq_topic: String,

    /// Bind the endpoint and let the engine connect (when the engine was given
    /// a concrete host rather than a wildcard, it connects out).
    #[arg(long, env = "KVGATE_ZMQ_BIND", value_parser = BoolishValueParser::new())]
    pub zmq_bind: bool,

    /// Most events in one outgoing batch.
    #[arg(long, env = "KVGATE_MAX_BATCH_EVENTS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_batch_events: u32,

    /// Most encoded bytes of events in one outgoing batch, e.g. 1MiB (the
    /// router refuses messages over 4 MiB).
    #[arg(long, env = "KVGATE_MAX_BATCH_BYTES", default_value = "1MiB", value_name = "SIZE",
          value_parser = byte_size(4096..=(3 << 20)))]
    pub max_batch_bytes: u64,

    /// Batches kept for resuming and lagging subscribers (slots are
    /// allocated as batches arrive, 24 bytes per batch held).
    #[arg(long, env = "KVGATE_HISTORY_BATCHES", default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub history_batches: u32,

    /// Bytes of batches kept for resuming and lagging subscribers, e.g.
    /// 256MiB (encoded bytes plus 256 per batch); the newest batch is always
    /// kept.
    #[arg(long, env = "KVGATE_HISTORY_BYTES", default_value = "256MiB", value_name = "SIZE",
          value_parser = byte_size(4096..=(64 << 30)))]
    pub history_bytes: u64,

    /// Keep the history, the live state and the numbering in DIR, so a
    /// restarted kvgate continues where the old process stopped: routers'
    /// cursors resume, snapshots hold what the old process knew (contract
    /// section 8). Off by default. One kvgate per DIR. Not with
    /// --replay-file or --trace-file: a played file starts over anyway.
    #[arg(long, env = "KVGATE_STATE_DIR", value_name = "DIR",
          conflicts_with_all = ["replay_file", "trace_file"])]
    pub state_dir: Option<PathBuf>,

    /// Milliseconds between fsyncs of the --state-dir log: after a machine
    /// crash (not a killed process) only what was synced counts.
    #[arg(long, env = "KVGATE_STATE_SYNC_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub state_sync_ms: u64,

    /// Milliseconds the drain waits for a write or an open of the
    /// --state-dir log (a frozen or hung file system) before it pauses
    /// persistence and announces without the log: delivery goes on, and a
    /// restart after an unclean stop numbers anew. Above the kernel's
    /// longest pause of a writer for dirty pages (200 ms).
    #[arg(long, env = "KVGATE_STATE_IO_TIMEOUT_MS", default_value_t = 500,
          value_parser = clap::value_parser!(u64).range(10..=10_000))]
    pub state_io_timeout_ms: u64,

    /// Size at which a --state-dir log segment is closed and a new one
    /// opened, e.g. 64MiB (segments are deleted whole).
    #[arg(long, env = "KVGATE_STATE_SEGMENT_BYTES", default_value = "64MiB", value_name = "SIZE",
          value_parser = byte_size((1 << 20)..=(1 << 30)))]
    pub state_segment_bytes: u64,

    /// Log bytes after which the live state is checkpointed to --state-dir
    /// (in the background), e.g. 256MiB; also a minute after the last
    /// checkpoint when anything was logged since. Bounds the log a restart
    /// replays.
    #[arg(long, env = "KVGATE_STATE_CHECKPOINT_BYTES", default_value = "256MiB", value_name = "SIZE",
          value_parser = byte_size((64 << 10)..=(64 << 30)))]
    pub state_checkpoint_bytes: u64,

    /// Batch announcements (positions, not batches) buffered per subscriber
    /// before a slow one is refilled from the history instead.
    #[arg(long, env = "KVGATE_LIVE_BUFFER_BATCHES", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub live_buffer_batches: u32,

    /// Most SubscribeKvEvents streams open at once; the next one is refused
    /// with RESOURCE_EXHAUSTED.
    #[arg(long, env = "KVGATE_MAX_SUBSCRIBERS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_subscribers: u32,

    /// Most snapshot chunks encoded at once (one blocking thread each);
    /// other snapshots wait their turn.
    #[arg(long, env = "KVGATE_MAX_SNAPSHOT_ENCODES", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_snapshot_encodes: u32,

    /// Threads that run kvgate's tasks (ingest, connections, streams). One
    /// keeps each delivery on one thread, with no wake-up of another: the
    /// least CPU per event, and as much throughput from 8 subscribers on;
    /// two let ingest and the writes run in parallel, for a single
    /// subscriber fed at full speed. Snapshot encodes and the state
    /// directory have threads of their own.
    #[arg(long, env = "KVGATE_WORKER_THREADS", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub worker_threads: u32,

    /// The engine's own gRPC server: every RPC but SubscribeKvEvents is
    /// passed through to it unchanged (e.g. http://127.0.0.1:50051).
    #[arg(long, env = "KVGATE_ENGINE_GRPC", value_name = "URI", value_parser = parse_grpc_uri)]
    pub engine_grpc: Option<String>,

    /// The engine's HTTP server (vLLM's API server, e.g.
    /// http://127.0.0.1:8000): kvgate asks its GET /kv_event_sources where
    /// every rank publishes, so no --zmq-endpoint is needed. Without it and
    /// without --zmq-endpoint, --engine-grpc is asked instead (OpenEngine's
    /// GetKvEventSources, SGLang's GetServerInfo).
    #[arg(long, env = "KVGATE_ENGINE_HTTP", value_name = "URL", value_parser = parse_http_url)]
    pub engine_http: Option<String>,

    /// How often kvgate asks the engine again where it publishes (with
    /// --engine-http or --engine-grpc), so an engine restarted on other
    /// ports is followed.
    #[arg(long, env = "KVGATE_ENGINE_DISCOVERY_MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub engine_discovery_ms: u64,

    /// How often to poll the engine's GetLoads (with --engine-grpc) for
    /// every rank whose load is not pushed (--zmq-load-endpoint), to put it
    /// on every subscriber's stream; 0 turns polling off.
    #[arg(long, env = "KVGATE_LOAD_POLL_MS", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub load_poll_ms: u64,

    /// Most milliseconds one GetLoads call may take before it counts as a
    /// timeout.
    #[arg(long, env = "KVGATE_LOAD_POLL_TIMEOUT_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub load_poll_timeout_ms: u64,

    /// The engine's load publisher for rank 0 (SGLang's
    /// --load-publish-endpoint, e.g. tcp://127.0.0.1:5558); rank r is at
    /// port + r, or give it once per rank like --zmq-endpoint. Each pushed
    /// stat reaches the stream at once; GetLoads is polled only for ranks
    /// whose pushes go silent.
    #[arg(
        long,
        env = "KVGATE_ZMQ_LOAD_ENDPOINT",
        value_name = "URI",
        value_delimiter = ',',
        conflicts_with_all = ["demo", "upstream_grpc"]
    )]
    pub zmq_load_endpoint: Vec<ZmqEndpoint>,

    /// Milliseconds a rank's load push may be silent before kvgate polls
    /// that rank's GetLoads instead (with --engine-grpc), until pushes
    /// return. The engine re-sends an unchanged stat every second.
    #[arg(long, env = "KVGATE_LOAD_PUSH_STALE_MS", default_value_t = 3000,
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub load_push_stale_ms: u64,

    /// Milliseconds between two load_only batches repeating a rank's
    /// unchanged record; keep it at or below the router's
    /// --load-monitor-interval, or the router polls the engine itself.
    #[arg(long, env = "KVGATE_LOAD_HEARTBEAT_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub load_heartbeat_ms: u64,

    /// Which engine serves --engine-grpc, for GetLoads (detected by trying
    /// each engine's service when not given; trtllm has no GetLoads).
    #[arg(long, env = "KVGATE_ENGINE_KIND", value_enum, value_name = "KIND")]
    pub engine_kind: Option<crate::load::engine::EngineKind>,

    /// Where to serve Prometheus /metrics, /healthz and /status over HTTP:
    /// IP:PORT or HOST:PORT, as --listen.
    #[arg(long, env = "KVGATE_METRICS_LISTEN", value_name = "ADDR",
          value_parser = parse_listen_address)]
    pub metrics_listen: Option<SocketAddr>,

    /// Most connections open on the metrics port; one more is answered 503
    /// and closed at once.
    #[arg(long, env = "KVGATE_METRICS_MAX_CONNECTIONS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub metrics_max_connections: u32,

    /// Most milliseconds a metrics-port client may take to send a request's
    /// headers (counted from the connection's start, or from the previous
    /// response: an idle keep-alive connection is closed after it too).
    #[arg(long, env = "KVGATE_METRICS_HEADER_TIMEOUT_MS", default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(10..=600_000))]
    pub metrics_header_timeout_ms: u64,

    /// A metrics-port connection that moves no byte either way for this many
    /// milliseconds (a client that stopped reading) is closed.
    #[arg(long, env = "KVGATE_METRICS_IDLE_TIMEOUT_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(10..=86_400_000))]
    pub metrics_idle_timeout_ms: u64,

    /// Serve gRPC over TLS with this certificate chain (PEM); re-read on
    /// SIGHUP.
    #[arg(
        long,
        env = "KVGATE_TLS_CERT",
        value_name = "PEM",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,

    /// The private key of --tls-cert (PEM).
    #[arg(
        long,
        env = "KVGATE_TLS_KEY",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,

    /// Require every client to present a certificate signed by this CA
    /// (PEM): mutual TLS.
    #[arg(
        long,
        env = "KVGATE_TLS_CLIENT_CA",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,

    /// Bearer tokens, one a line (# comments): every RPC but health and
    /// reflection then needs `authorization: Bearer <token>`; re-read on
    /// SIGHUP.
    #[arg(long, env = "KVGATE_AUTH_TOKEN_FILE", value_name = "PATH")]
    pub auth_token_file: Option<PathBuf>,

    /// Seconds between checks of the certificate and token files for a
    /// change (reloaded as on SIGHUP); 0 reloads on SIGHUP only.
    #[arg(long, env = "KVGATE_CREDENTIALS_CHECK_SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub credentials_check_seconds: u64,

    /// The CA that signed the engine's certificate, for an https:// --engine-grpc.
    #[arg(long, env = "KVGATE_ENGINE_TLS_CA", value_name = "PEM")]
    pub engine_tls_ca: Option<PathBuf>,

    /// kvgate's client certificate towards the engine (PEM), if it requires one.
    #[arg(long, env = "KVGATE_ENGINE_TLS_CERT", value_name = "PEM")]
    pub engine_tls_cert: Option<PathBuf>,

    /// The private key of --engine-tls-cert (PEM).
    #[arg(long, env = "KVGATE_ENGINE_TLS_KEY", value_name = "PEM")]
    pub engine_tls_key: Option<PathBuf>,

    /// The CA that signed the upstream's certificate, for an https:// --upstream-grpc.
    #[arg(long, env = "KVGATE_UPSTREAM_TLS_CA", value_name = "PEM")]
    pub upstream_tls_ca: Option<PathBuf>,

    /// kvgate's client certificate towards the upstream (PEM), if it requires one.
    #[arg(long, env = "KVGATE_UPSTREAM_TLS_CERT", value_name = "PEM")]
    pub upstream_tls_cert: Option<PathBuf>,

    /// The private key of --upstream-tls-cert (PEM).
    #[arg(long, env = "KVGATE_UPSTREAM_TLS_KEY", value_name = "PEM")]
    pub upstream_tls_key: Option<PathBuf>,

    /// A file whose first token kvgate sends to the upstream as
    /// `authorization: Bearer <token>`.
    #[arg(long, env = "KVGATE_UPSTREAM_TOKEN_FILE", value_name = "PATH")]
    pub upstream_token_file: Option<PathBuf>,

    /// Run a built-in simulated engine (vLLM's or TensorRT-LLM's layout,
    /// --demo-layout; real ZMQ) instead of a real one: live events with no
    /// GPU. kvgate finds its publishers by asking it, as it asks vLLM.
    #[arg(long, env = "KVGATE_DEMO", value_parser = BoolishValueParser::new())]
    pub demo: bool,

    /// Whose payload layout the --demo engine publishes: vLLM 0.33's, or
    /// TensorRT-LLM's native stream (with stand-in images as multimodal
    /// keys).
    #[arg(long, env = "KVGATE_DEMO_LAYOUT", value_enum, default_value = "vllm")]
    pub demo_layout: DemoLayout,

    /// Play a recording (`kvgate record --out FILE`) as the engine: one
    /// file and its parts FILE.1, ..., or the parts listed in order.
    #[arg(long, env = "KVGATE_REPLAY_FILE", value_name = "FILE", value_delimiter = ',',
          conflicts_with_all = ["zmq_endpoint", "demo", "upstream_grpc", "trace_file"])]
    pub replay_file: Vec<PathBuf>,

    /// Play a Mooncake trace (JSON lines: timestamp, input_length,
    /// output_length, hash_ids) through a simulated prefix cache as the
    /// engine.
    #[arg(long, env = "KVGATE_TRACE_FILE", value_name = "FILE",
          conflicts_with_all = ["zmq_endpoint", "demo", "upstream_grpc"])]
    pub trace_file: Option<PathBuf>,

    /// How fast --replay-file or --trace-file plays: a factor of recorded
    /// time (1 as recorded, 10 ten times faster, 0.001 to 1000000) or max.
    #[arg(long, env = "KVGATE_REPLAY_SPEED", default_value = "1.0", value_name = "SPEED",
          value_parser = crate::cli::parse_speed)]
    pub replay_speed: crate::source::pace::Speed,

    /// Play --replay-file or --trace-file again and again, each pass after
    /// an ownerless clear (as after an engine restart).
    #[arg(long, env = "KVGATE_REPLAY_LOOP", value_parser = BoolishValueParser::new())]
    pub replay_loop: bool,

    /// Blocks each rank's simulated prefix cache holds (--trace-file); the
    /// least recently used are evicted beyond it.
    #[arg(long, env = "KVGATE_TRACE_CACHE_BLOCKS", default_value_t = 16_384,
          value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub trace_cache_blocks: u64,

    /// Tokens per simulated block (--trace-file): 512 (the trace's own) or
    /// a divisor of it, each trace block then counting as several.
    #[arg(long, env = "KVGATE_TRACE_BLOCK_TOKENS", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..=512))]
    pub trace_block_tokens: u32,

    /// Longest trace line read (--trace-file); a longer one is counted as
    /// malformed and skipped.
    #[arg(long, env = "KVGATE_TRACE_MAX_LINE_BYTES", default_value = "1MiB", value_name = "SIZE",
          value_parser = byte_size(4096..=(64 << 20)))]
    pub trace_max_line_bytes: u64,

    /// Keep the prefix index's tree for this engine, fed from kvgate's own
    /// stream as a router is fed, and answer `/query`, `/query_by_hash` (on
    /// --metrics-listen) and `kvgate.v1.KvIndex/Match` (on --listen).
    #[arg(long, env = "KVGATE_INDEX", value_parser = BoolishValueParser::new())]
    pub index: bool,

    /// The model the engine serves, as --index's queries name it (required
    /// with --index).
    #[arg(
        long,
        env = "KVGATE_INDEX_MODEL_NAME",
        value_name = "NAME",
        requires = "index"
    )]
    pub index_model_name: Option<String>,

    /// Tokens per KV block of the engine (required with --index); a store
    /// of other blocks is counted and set aside.
    #[arg(long, env = "KVGATE_INDEX_BLOCK_SIZE", value_name = "TOKENS", requires = "index",
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub index_block_size: Option<u32>,

    /// The routing group --index's queries name.
    #[arg(long, env = "KVGATE_INDEX_ROUTING_GROUP", value_name = "NAME", requires = "index",
          default_value = crate::index::registry::DEFAULT_ROUTING_GROUP)]
    pub index_routing_group: String,

    /// The worker id --index's answers give the engine.
    #[arg(
        long,
        env = "KVGATE_INDEX_WORKER_ID",
        value_name = "ID",
        requires = "index",
        default_value_t = 0
    )]
    pub index_worker_id: u64,

    /// Most connections open on the gRPC port; one more is accepted and
    /// closed at once.
    #[arg(long, env = "KVGATE_MAX_CONNECTIONS", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections: u32,

    /// Most milliseconds from accepting a connection to its HTTP/2 preface
    /// (TLS handshake included).
    #[arg(long, env = "KVGATE_HANDSHAKE_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(10..=600_000))]
    pub handshake_timeout_ms: u64,

    /// Which of the flags the engine can also answer were set by the user
    /// (command line or environment), not defaulted.
    #[arg(skip)]
    pub given: GivenFlags,

    /// A connection with no open stream for this many milliseconds is closed
    /// (with GOAWAY; clients reconnect when they next call).
    #[arg(long, env = "KVGATE_IDLE_TIMEOUT_MS", default_value_t = 300_000,
          value_parser = clap::value_parser!(u64).range(10..=86_400_000))]
    pub idle_timeout_ms: u64,

    /// Most concurrent HTTP/2 streams (calls) per connection; clients queue
    /// beyond it, and a stream over it is refused with REFUSED_STREAM.
    #[arg(long, env = "KVGATE_HTTP2_MAX_CONCURRENT_STREAMS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub http2_max_concurrent_streams: u32,

    /// Most bytes of request headers (metadata) per call.
    #[arg(long, env = "KVGATE_HTTP2_MAX_HEADER_LIST_BYTES", default_value_t = 16 << 10,
          value_parser = clap::value_parser!(u32).range(1024..=(1 << 20)))]
    pub http2_max_header_list_bytes: u32,

    /// Milliseconds without a frame from a client before kvgate sends it a
    /// keepalive PING.
    #[arg(long, env = "KVGATE_HTTP2_KEEPALIVE_INTERVAL_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(10..=86_400_000))]
    pub http2_keepalive_interval_ms: u64,

    /// Milliseconds a client has to answer a keepalive PING before its
    /// connection is closed (a client that stopped reading never answers).
    #[arg(long, env = "KVGATE_HTTP2_KEEPALIVE_TIMEOUT_MS", default_value_t = 20_000,
          value_parser = clap::value_parser!(u64).range(10..=600_000))]
    pub http2_keepalive_timeout_ms: u64,

    /// Streams a client may open and reset before kvgate accepts them, per
    /// connection (a bound against rapid-reset floods).
    #[arg(long, env = "KVGATE_HTTP2_MAX_PENDING_ACCEPT_RESET_STREAMS", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub http2_max_pending_accept_reset_streams: u32,

    /// Longest method path passed through to the engine; longer ones get
    /// RESOURCE_EXHAUSTED and never reach it.
    #[arg(long, env = "KVGATE_PASS_THROUGH_MAX_PATH_BYTES", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(64..=16_384))]
    pub pass_through_max_path_bytes: u32,

    /// Most calls passed through to the engine at once; one more gets
    /// RESOURCE_EXHAUSTED. Times --pass-through-stream-window-bytes, it is
    /// the engine connection's window and the most that unread responses
    /// hold (at most 2 GiB - 1).
    #[arg(long, env = "KVGATE_PASS_THROUGH_MAX_STREAMS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub pass_through_max_streams: u32,

    /// Response bytes one passed-through call holds from the engine while
    /// its client does not read, e.g. 1MiB (its HTTP/2 receive window;
    /// smaller ones can slow big streamed messages to a crawl).
    #[arg(long, env = "KVGATE_PASS_THROUGH_STREAM_WINDOW_BYTES", default_value = "256KiB",
          value_name = "SIZE", value_parser = byte_size((256 << 10)..=(16 << 20)))]
    pub pass_through_stream_window_bytes: u64,
}

/// `--replay-speed`: a factor or `max`.
fn parse_speed(text: &str) -> Result<crate::source::pace::Speed, String> {
    text.parse()
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// Every argument of every subcommand.
    fn arguments(command: &clap::Command) -> Vec<clap::Arg> {
        let mut found: Vec<clap::Arg> = command.get_arguments().cloned().collect();
        for sub in command.get_subcommands() {
            found.extend(arguments(sub));
        }
        found
    }

    #[test]
    fn every_boolean_flag_with_a_variable_takes_one_zero_yes_no_on_off() {
        let command = Cli::command();
        let flags: Vec<clap::Arg> = arguments(&command)
            .into_iter()
            .filter(|arg| {
                matches!(arg.get_action(), clap::ArgAction::SetTrue) && arg.get_env().is_some()
            })
            .collect();
        assert!(flags.len() >= 2, "--demo and --zmq-bind at least");
        for arg in flags {
            for (text, expected) in [
                ("1", true),
                ("yes", true),
                ("On", true),
                ("TRUE", true),
                ("0", false),
                ("no", false),
                ("off", false),
                ("false", false),
            ] {
                // A default goes through the same value parser as the
                // variable's value, without touching the environment.
                let id = arg.get_id().as_str();
                let parsed = clap::Command::new("kvgate")
                    .arg(arg.clone().env(None::<&str>).default_value(text))
                    .try_get_matches_from(["kvgate"])
                    .unwrap_or_else(|error| panic!("--{id} refuses {text}: {error}"));
                assert_eq!(parsed.get_flag(id), expected, "--{id} {text}");
            }
        }
    }
}

/// Flags whose default and an explicit value must be told apart: the
/// engine's answer fills what the user left unset, never what they set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GivenFlags {
    /// `--dp-size`.
    pub dp_size: bool,
    /// `--zmq-topic`.
    pub zmq_topic: bool,
}

/// `--demo-layout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoLayout {
    /// vLLM 0.33's map-tagged events.
    Vllm,
    /// TensorRT-LLM's native streaming publisher (KV-cache manager V2).
    TrtllmNative,
}
