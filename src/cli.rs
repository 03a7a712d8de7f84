//! Command line: every flag of `kvgate serve` can also come from a
//! `KVGATE_…` environment variable (handy in a Kubernetes sidecar manifest).
//! Values are checked here, so a bad one fails at start naming its flag.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::logging::LogFormat;
use crate::source::endpoint::TcpEndpoint;

#[derive(Debug, Parser)]
#[command(
    name = "kvgate",
    version,
    about = "gRPC streaming gateway for LLM KV-cache events"
)]
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
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Drain an engine's KV events and serve them to any number of routers.
    Serve(Box<ServeArgs>),
    /// Print a gateway's event stream.
    Tail(crate::tools::tail::TailArgs),
    /// Summarise a running gateway: health, services, blocks per rank.
    Status(crate::tools::status::StatusArgs),
    /// Load-test kvgate: a simulated engine, N gRPC subscribers and a kvgate
    /// child process; reports throughput, latency, CPU and memory.
    Bench(crate::tools::load::LoadArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// gRPC address routers connect to.
    #[arg(long, env = "KVGATE_LISTEN", default_value = "0.0.0.0:50061")]
    pub listen: SocketAddr,

    /// The engine's KV-event publisher for rank 0, as configured on the engine
    /// (e.g. tcp://*:5557); rank r is at port + r.
    #[arg(
        long,
        env = "KVGATE_ZMQ_ENDPOINT",
        value_name = "URI",
        conflicts_with = "demo"
    )]
    pub zmq_endpoint: Option<TcpEndpoint>,

    /// Another SubscribeKvEvents server to re-serve instead of a ZMQ engine
    /// (TensorRT-LLM's gRPC server, or another kvgate), e.g. http://127.0.0.1:50051.
    #[arg(long, env = "KVGATE_UPSTREAM_GRPC", value_name = "URI", conflicts_with_all = ["zmq_endpoint", "demo"])]
    pub upstream_grpc: Option<String>,

    /// The upstream service name to call SubscribeKvEvents on.
    #[arg(
        long,
        env = "KVGATE_UPSTREAM_SERVICE",
        default_value = "kvgate.v1.KvGate",
        value_name = "NAME"
    )]
    pub upstream_service: String,

    /// Number of data-parallel ranks, each with its own publisher.
    #[arg(long, env = "KVGATE_DP_SIZE", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub dp_size: u32,

    /// The engine's replay ROUTER for rank 0 (e.g. tcp://*:5558; rank r at
    /// port + r): fills lost messages and primes the state at start.
    #[arg(long, env = "KVGATE_ZMQ_REPLAY_ENDPOINT", value_name = "URI")]
    pub zmq_replay_endpoint: Option<TcpEndpoint>,

    /// Most milliseconds one replay request may take (engines answer within
    /// ~100 ms when idle).
    #[arg(long, env = "KVGATE_ZMQ_REPLAY_TIMEOUT_MS",
          default_value_t = crate::source::replay::DEFAULT_TIMEOUT.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub zmq_replay_timeout_ms: u64,

    /// Topic the engine publishes under (empty by default, as in the engines).
    #[arg(long, env = "KVGATE_ZMQ_TOPIC", default_value = "")]
    pub zmq_topic: String,

    /// Bind the endpoint and let the engine connect (when the engine was given
    /// a concrete host rather than a wildcard, it connects out).
    #[arg(long, env = "KVGATE_ZMQ_BIND")]
    pub zmq_bind: bool,

    /// Most events in one outgoing batch.
    #[arg(long, env = "KVGATE_MAX_BATCH_EVENTS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_batch_events: u32,

    /// Most encoded bytes of events in one outgoing batch (the router refuses
    /// messages over 4 MiB).
    #[arg(long, env = "KVGATE_MAX_BATCH_BYTES", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u32).range(4096..=(3 << 20)))]
    pub max_batch_bytes: u32,

    /// Batches kept for resuming and lagging subscribers.
    #[arg(long, env = "KVGATE_HISTORY_BATCHES", default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub history_batches: u32,

    /// Encoded bytes kept for resuming and lagging subscribers.
    #[arg(long, env = "KVGATE_HISTORY_BYTES", default_value_t = 256 << 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub history_bytes: u64,

    /// Batches buffered per subscriber before a slow one is refilled from
    /// the history instead.
    #[arg(long, env = "KVGATE_LIVE_BUFFER_BATCHES", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub live_buffer_batches: u32,

    /// The engine's own gRPC server: every RPC but SubscribeKvEvents is
    /// passed through to it unchanged (e.g. http://127.0.0.1:50051).
    #[arg(long, env = "KVGATE_ENGINE_GRPC", value_name = "URI")]
    pub engine_grpc: Option<String>,

    /// Where to serve Prometheus /metrics, /healthz and /status over HTTP.
    #[arg(long, env = "KVGATE_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,

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

    /// Bearer tokens, one a line (# comments): every RPC but health then
    /// needs `authorization: Bearer <token>`; re-read on SIGHUP.
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

    /// Run a built-in simulated engine (vLLM format, real ZMQ) instead of a
    /// real one: live events with no GPU.
    #[arg(long, env = "KVGATE_DEMO")]
    pub demo: bool,
}
