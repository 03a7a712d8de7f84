//! `kvgate serve` as a [`Gateway`] handle: `start` binds every port and
//! spawns every long-lived task under one `Supervisor`, `run` waits for a
//! shutdown request or a task failure, `shutdown` stops the tasks.
//!
//! Invariants: shutdown follows the flow. Stopping the source drops the
//! drain's input, the drain then closes the hub, which ends every
//! subscriber's stream cleanly, which lets the server finish. A task that
//! ends or panics while the gateway runs turns health NOT_SERVING and makes
//! `run` return that failure, so the process exits non-zero.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::cli::ServeArgs;
use crate::client::{TlsFlags, TlsPaths};
use crate::clock::epoch_seed;
use crate::drain::Drain;
use crate::drain::batcher::BatchLimits;
use crate::health::HealthWatch;
use crate::hub::{HistoryLimits, HubWriter, hub};
use crate::load::BoardWriter;
use crate::load::engine::EngineLoads;
use crate::load::poller::{self, PollerConfig};
use crate::load::push::PushConfig;
use crate::load::records::LoadRecords;
use crate::metrics::Metrics;
use crate::pem::FlagFile;
use crate::server::admin::{self, AdminState};
use crate::server::admin_connection::AdminLimits;
use crate::server::auth::Tokens;
use crate::server::connection::ConnectionLimits;
use crate::server::passthrough::{PassThrough, PassThroughLimits};
use crate::server::reload::{self, Credentials};
use crate::server::tls::{ServerTlsFiles, TlsAcceptor};
use crate::server::{self, ServerParts};
use crate::source::SourceEvent;
use crate::store::{self, StoreConfig, StoreLimits};
use crate::supervisor::{Supervisor, TaskFailure, TaskName};
use crate::usage::UsageError;
use source::{choose_load_push, choose_source, start_source};

mod engine_index;
mod engine_sources;
pub mod index;
pub mod metric_labels;
mod source;
#[cfg(test)]
mod tests;

/// Engine messages queued between the sockets and the drain. Beyond this the
/// socket tasks wait, and the engine's own PUB buffer takes over.
const SOURCE_QUEUE: usize = 4096;

/// The flags of the engine's address and TLS files, for errors.
const ENGINE_FLAGS: TlsFlags = TlsFlags {
    uri: "--engine-grpc",
    ca: "--engine-tls-ca",
    cert: "--engine-tls-cert",
    key: "--engine-tls-key",
};

/// Time allowed for streams to end and tasks to stop after a shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(4);

/// Runs the gateway until `shutdown` resolves or one of its tasks fails,
/// announcing its addresses on stdout.
pub async fn serve(args: ServeArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let demo = args.demo;
    let grpcurl_credentials = grpcurl_credentials(&args);
    let mut shutdown = std::pin::pin!(shutdown);
    // A signal while starting (reading a state directory back, say) stops
    // it there: nothing is served yet, and what was started is abandoned.
    let gateway = tokio::select! {
        gateway = Gateway::start(args) => gateway?,
        () = &mut shutdown => {
            info!("shutting down before serving");
            return Ok(());
        }
    };
    if let Some(admin) = gateway.admin_address() {
        crate::logging::announce(&format!(
            "kvgate: metrics, /healthz and /status on http://{admin}"
        ));
    }
    let address = gateway.address();
    crate::logging::announce(&format!(
        "kvgate: serving gRPC on {address}, events from {}",
        gateway.source()
    ));
    if demo {
        crate::logging::announce(&format!(
            "kvgate: watch the demo stream with\n  grpcurl {grpcurl_credentials} -d '{{}}' {} kvgate.v1.KvGate/SubscribeKvEvents",
            display_address(address)
        ));
    }
    Ok(gateway.run(shutdown).await?)
}

/// The grpcurl flags a client of this gateway needs.
fn grpcurl_credentials(args: &ServeArgs) -> String {
    let mut flags = vec![if args.tls_cert.is_some() {
        "-cacert CA.pem"
    } else {
        "-plaintext"
    }];
    if args.tls_client_ca.is_some() {
        flags.push("-cert CLIENT.pem -key CLIENT.key");
    }
    if args.auth_token_file.is_some() {
        flags.push("-H 'authorization: Bearer TOKEN'");
    }
    flags.join(" ")
}

/// A started gateway: every port bound, every task running.
pub struct Gateway {
    supervisor: Supervisor,
    health: HealthWatch,
    address: SocketAddr,
    admin_address: Option<SocketAddr>,
    source: Arc<str>,
}

impl Gateway {
    /// Binds the ports and starts every task. On an error, whatever was
    /// started is stopped again.
    pub async fn start(args: ServeArgs) -> anyhow::Result<Self> {
        let supervisor = Supervisor::new();
        match start_tasks(&supervisor, args).await {
            Ok(gateway) => {
                #[cfg(debug_assertions)]
                if std::env::var_os("KVGATE_DEBUG_PANIC_TASK").is_some_and(|task| task == "drain") {
                    supervisor.inject_panic(TaskName::Drain);
                }
                Ok(gateway)
            }
            Err(error) => {
                supervisor.stop();
                let _ = tokio::time::timeout(SHUTDOWN_GRACE, supervisor.tasks_ended()).await;
                Err(error)
            }
        }
    }

    /// The gRPC address.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The admin HTTP address, with `--metrics-listen`.
    pub fn admin_address(&self) -> Option<SocketAddr> {
        self.admin_address
    }

    /// Where events come from, as configured.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the gateway is serving, as gRPC health and `/healthz` report it.
    pub fn health(&self) -> HealthWatch {
        self.health.clone()
    }

    /// Serves until `shutdown` resolves or a task fails, then shuts down.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), Arc<TaskFailure>> {
        tokio::select! {
            () = shutdown => info!("shutting down"),
            _ = self.supervisor.failed() => {}
        }
        self.shutdown().await
    }

    /// Stops every task, giving streams `SHUTDOWN_GRACE` to end; returns
    /// the task failure that brought the gateway down, if one did.
    pub async fn shutdown(self) -> Result<(), Arc<TaskFailure>> {
        self.supervisor.stop();
        if tokio::time::timeout(SHUTDOWN_GRACE, self.supervisor.tasks_ended())
            .await
            .is_err()
        {
            let running = self.supervisor.running();
            let running: Vec<String> = running.iter().map(ToString::to_string).collect();
            warn!(
                still_running = running.join(", "),
                "streams did not end within {SHUTDOWN_GRACE:?}; exiting anyway"
            );
        }
        match self.supervisor.failure() {
            Some(failure) => Err(failure),
            None => Ok(()),
        }
    }

    #[cfg(all(test, debug_assertions))]
    fn supervisor(&self) -> &Supervisor {
        &self.supervisor
    }
}

/// The pass-through's limits; checked even without `--engine-grpc`, so a
/// combination that cannot work fails before the flag is first used.
fn pass_through_limits(args: &ServeArgs) -> anyhow::Result<PassThroughLimits> {
    let limits = PassThroughLimits {
        max_path_bytes: args.pass_through_max_path_bytes as usize,
        max_streams: args.pass_through_max_streams,
        stream_window: u32::try_from(args.pass_through_stream_window_bytes)
            .expect("the flag's range fits a u32"),
    };
    limits.connection_window().map_err(|error| {
        UsageError(format!(
            "--pass-through-max-streams {} with --pass-through-stream-window-bytes {}: {error}",
            args.pass_through_max_streams, args.pass_through_stream_window_bytes
        ))
    })?;
    Ok(limits)
}

/// Binds every port, then starts the source, drain, admin and gRPC servers
/// and the demo engine under `supervisor`.
async fn start_tasks(supervisor: &Supervisor, mut args: ServeArgs) -> anyhow::Result<Gateway> {
    let metrics = Metrics::new(metric_labels::closed_labels());
    // Every flag and every file a flag names is checked before anything
    // binds or starts (the demo engine included): a bad one fails alone.
    let pass_through_limits = pass_through_limits(&args)?;
    let index_flags = engine_index::flags(&args)?;
    let engine_tls = TlsPaths {
        ca: args.engine_tls_ca.clone(),
        cert: args.engine_tls_cert.clone(),
        key: args.engine_tls_key.clone(),
    };
    let pass_through = args
        .engine_grpc
        .as_deref()
        .map(|target| {
            PassThrough::new(
                target,
                &engine_tls,
                ENGINE_FLAGS,
                pass_through_limits,
                metrics.clone(),
            )
        })
        .transpose()?;
    // Before anything counts ranks: the engine may be the one to say how many.
    let engine_sources = engine_sources::learn(&mut args, pass_through.as_ref()).await?;
    let credentials = server_credentials(&args, &metrics)?;
    let admin_connections = args
        .metrics_listen
        .as_ref()
        .map_or(0, |_| args.metrics_max_connections);
    server::fd_limit::ensure_room_for(args.max_connections, admin_connections, args.dp_size)
        .with_context(|| match args.metrics_listen {
            Some(_) => format!(
                "--max-connections {} with --metrics-max-connections {}",
                args.max_connections, args.metrics_max_connections
            ),
            None => format!("--max-connections {}", args.max_connections),
        })?;
    // Before anything binds: a second kvgate on the same directory fails
    // naming it and its holder, not a port the first one holds.
    let history_limits = HistoryLimits {
        batches: args.history_batches as usize,
        bytes: usize::try_from(args.history_bytes).unwrap_or(usize::MAX),
    };
    let store = match &args.state_dir {
        Some(dir) => Some(open_store(&args, dir, history_limits, &metrics).await?),
        None => None,
    };
    let (mut source_config, demo) = choose_source(&args).await?;
    if let Some(opened) = &store {
        source_config.resume(opened.resume_points());
    }
    let load_push = choose_load_push(&args, demo.as_ref())?;
    let (moves, learned) = engine_sources::start(engine_sources, &args, supervisor);
    source_config.follow(moves);
    let learned = learned.or_else(|| {
        source_config
            .learned()
            .map(|discovered| watch::channel(discovered.clone()).1)
    });
    let source: Arc<str> = match (&learned, source_config.learned()) {
        (Some(learned), None) => format!(
            "{source_config}, learned from {}",
            learned.borrow().learned_from
        )
        .into(),
        _ => source_config.to_string().into(),
    };
    let engine_ranks = source_config.dp_size();

    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("--listen {}: cannot listen", args.listen))?;
    let address = listener.local_addr()?;
    let admin_listener = match args.metrics_listen {
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .with_context(|| format!("--metrics-listen {address}: cannot listen"))?,
        ),
        None => None,
    };
    let load_engine = pass_through
        .as_ref()
        .filter(|_| args.load_poll_ms > 0)
        .map(|pass_through| {
            let (transport, origin) = pass_through.engine_transport();
            EngineLoads::new(
                transport,
                origin,
                Duration::from_millis(args.load_poll_timeout_ms),
            )
        });

    let (hub_writer, hub_reader) = hub(args.live_buffer_batches as usize, history_limits);
    let store_status = store.as_ref().map(store::Opened::status);
    let (events_tx, events_rx) = mpsc::channel(SOURCE_QUEUE);
    let (ready_tx, ready_rx) = watch::channel(false);
    let health = HealthWatch::new(supervisor.lifecycle(), ready_rx);
    let replayed_loads = start_source(
        source_config,
        events_tx,
        metrics.clone(),
        ready_tx,
        supervisor,
    )
    .await?;
    // The engine's own load, when it is reachable, or else what the
    // recording played carries.
    let heartbeat = Duration::from_millis(args.load_heartbeat_ms);
    let load_records = start_load(supervisor, &args, load_push, load_engine, &metrics)
        .await?
        .or_else(|| replayed_loads.map(|feed| LoadRecords::new(feed, heartbeat)));
    let drain = drain(
        &args,
        engine_ranks,
        hub_writer,
        store,
        load_records,
        metrics.clone(),
    );
    spawn_drain(supervisor, drain, events_rx);
    let engine_index = index_flags.map(|flags| engine_index::start(flags, &hub_reader, supervisor));
    let admin_address = admin_listener
        .map(|listener| {
            let state = AdminState {
                metrics: metrics.clone(),
                hub: hub_reader.clone(),
                health: health.clone(),
                source: Arc::clone(&source),
                started: Instant::now(),
                store: store_status,
                engine_sources: learned.clone(),
                index: engine_index.clone(),
            };
            spawn_admin(supervisor, listener, state, admin_limits(&args))
        })
        .transpose()?;
    let parts = ServerParts {
        hub: hub_reader,
        metrics: metrics.clone(),
        health: health.clone(),
        pass_through,
        limits: connection_limits(&args),
        tls: credentials.tls.clone(),
        tokens: credentials.tokens.clone(),
        index: engine_index,
        subscribe_limits: server::subscribe::SubscribeLimits {
            subscribers: args.max_subscribers as usize,
            snapshot_encodes: args.max_snapshot_encodes as usize,
        },
    };
    let check_every = Some(Duration::from_secs(args.credentials_check_seconds))
        .filter(|period| !period.is_zero());
    let reloads = reload::reload_task(
        credentials,
        metrics.clone(),
        check_every,
        supervisor.stopping().cancelled_owned(),
    )?;
    supervisor.spawn(TaskName::CredentialReloader, async move {
        reloads.await;
        Ok(())
    });
    let stop = supervisor.stopping();
    supervisor.spawn(
        TaskName::GrpcServer,
        server::serve(listener, parts, stop.clone().cancelled_owned()),
    );
    if let Some(demo) = demo {
        supervisor.spawn(TaskName::DemoEngine, async move {
            Ok(demo.run(stop.cancelled_owned()).await?)
        });
    }
    Ok(Gateway {
        supervisor: supervisor.clone(),
        health,
        address,
        admin_address,
        source,
    })
}

/// Starts the engine's load sources, pushed first and polled as fallback;
/// `None` when there is neither.
async fn start_load(
    supervisor: &Supervisor,
    args: &ServeArgs,
    push: Option<PushConfig>,
    poll: Option<EngineLoads>,
    metrics: &Metrics,
) -> anyhow::Result<Option<LoadRecords>> {
    if push.is_none() && poll.is_none() {
        return Ok(None);
    }
    let stale = push
        .as_ref()
        .map(|_| Duration::from_millis(args.load_push_stale_ms));
    let (board, feed) = BoardWriter::new(args.dp_size, stale);
    if let Some(push) = push {
        let flags = if args.demo {
            "the demo engine's load publisher".to_owned()
        } else {
            format!(
                "--zmq-load-endpoint {} with --dp-size {}",
                push.endpoint, args.dp_size
            )
        };
        push.start(board.clone(), metrics, supervisor)
            .await
            .context(flags)?;
    }
    if let Some(engine) = poll {
        let config = PollerConfig {
            interval: Duration::from_millis(args.load_poll_ms),
            kind: args.engine_kind,
        };
        let (stop, metrics) = (supervisor.stopping(), metrics.clone());
        supervisor.spawn(TaskName::LoadPoller, async move {
            poller::run(config, engine, board, metrics, stop).await;
            Ok(())
        });
    }
    let heartbeat = Duration::from_millis(args.load_heartbeat_ms);
    Ok(Some(LoadRecords::new(feed, heartbeat)))
}

/// The bounds of every gRPC connection, as the flags set them.
fn connection_limits(args: &ServeArgs) -> ConnectionLimits {
    ConnectionLimits {
        max_connections: args.max_connections,
        handshake_timeout: Duration::from_millis(args.handshake_timeout_ms),
        idle_timeout: Duration::from_millis(args.idle_timeout_ms),
        max_concurrent_streams: args.http2_max_concurrent_streams,
        max_header_list_bytes: args.http2_max_header_list_bytes,
        keepalive_interval: Duration::from_millis(args.http2_keepalive_interval_ms),
        keepalive_timeout: Duration::from_millis(args.http2_keepalive_timeout_ms),
        max_pending_accept_reset_streams: args.http2_max_pending_accept_reset_streams,
    }
}

/// The bounds of every admin port connection, as the flags set them.
fn admin_limits(args: &ServeArgs) -> AdminLimits {
    AdminLimits {
        max_connections: args.metrics_max_connections,
        header_timeout: Duration::from_millis(args.metrics_header_timeout_ms),
        idle_timeout: Duration::from_millis(args.metrics_idle_timeout_ms),
    }
}

/// A wildcard listen address is reached on loopback.
fn display_address(address: std::net::SocketAddr) -> String {
    if address.ip().is_unspecified() {
        format!("localhost:{}", address.port())
    } else {
        address.to_string()
    }
}

/// TLS on the gRPC port and bearer tokens, read and checked now: a file
/// that will not do is a usage error naming its flag.
fn server_credentials(args: &ServeArgs, metrics: &Metrics) -> anyhow::Result<Credentials> {
    read_server_credentials(args, metrics).map_err(|error| UsageError::from_error(&error).into())
}

fn read_server_credentials(args: &ServeArgs, metrics: &Metrics) -> anyhow::Result<Credentials> {
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let files = ServerTlsFiles {
                cert: FlagFile::new("--tls-cert", cert),
                key: FlagFile::new("--tls-key", key),
                client_ca: args
                    .tls_client_ca
                    .as_ref()
                    .map(|ca| FlagFile::new("--tls-client-ca", ca)),
            };
            Some(TlsAcceptor::new(files, metrics.clone())?)
        }
        // clap makes --tls-cert and --tls-key go together.
        _ => None,
    };
    let tokens = args
        .auth_token_file
        .as_ref()
        .map(|path| Tokens::load(FlagFile::new("--auth-token-file", path)))
        .transpose()?;
    Ok(Credentials { tls, tokens })
}

/// Takes `--state-dir` and reads it back (blocking work, off the runtime).
async fn open_store(
    args: &ServeArgs,
    dir: &std::path::Path,
    history: HistoryLimits,
    metrics: &Metrics,
) -> anyhow::Result<store::Opened> {
    let config = StoreConfig {
        dir: dir.to_owned(),
        sync_interval: Duration::from_millis(args.state_sync_ms),
        io_timeout: Duration::from_millis(args.state_io_timeout_ms),
        limits: StoreLimits {
            segment_bytes: args.state_segment_bytes,
            checkpoint_bytes: args.state_checkpoint_bytes,
        },
        history,
    };
    let metrics = metrics.clone();
    tokio::task::spawn_blocking(move || store::open(config, &metrics, epoch_seed()))
        .await?
        .with_context(|| format!("--state-dir {}", dir.display()))
}

/// The drain of an engine of `engine_ranks` ranks, as the flags set it.
fn drain(
    args: &ServeArgs,
    engine_ranks: u32,
    hub: HubWriter,
    store: Option<store::Opened>,
    load_records: Option<LoadRecords>,
    metrics: Metrics,
) -> Drain {
    let limits = BatchLimits {
        max_events: args.max_batch_events as usize,
        max_bytes: args.max_batch_bytes as usize,
    };
    let seed = store.as_ref().map_or_else(epoch_seed, store::Opened::seed);
    let mut drain = Drain::new(limits, seed, hub, metrics).with_engine_ranks(engine_ranks);
    if let Some(opened) = store {
        drain = drain.with_state_dir(opened);
    }
    if let Some(records) = load_records {
        drain = drain.with_load_records(records);
    }
    drain
}

fn spawn_drain(supervisor: &Supervisor, drain: Drain, events: mpsc::Receiver<SourceEvent>) {
    let stop = supervisor.stopping();
    supervisor.spawn(TaskName::Drain, async move {
        drain.run(events, stop).await;
        Ok(())
    });
}

/// Serves the admin port until shutdown; returns its address.
fn spawn_admin(
    supervisor: &Supervisor,
    listener: TcpListener,
    state: AdminState,
    limits: AdminLimits,
) -> std::io::Result<SocketAddr> {
    let address = listener.local_addr()?;
    let stop = supervisor.stopping().cancelled_owned();
    supervisor.spawn(TaskName::AdminServer, async move {
        admin::serve(listener, state, limits, stop).await;
        Ok(())
    });
    Ok(address)
}
