//! `kvgate serve`: wires source → drain → hub → server and shuts them down in
//! that order, so every subscriber's stream ends cleanly before exit.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::cli::ServeArgs;
use crate::client::{TlsFlags, TlsPaths};
use crate::drain::Drain;
use crate::drain::batcher::BatchLimits;
use crate::drain::sequence::epoch_seed;
use crate::hub::{HistoryLimits, hub};
use crate::metrics::Metrics;
use crate::pem::FlagFile;
use crate::server::admin::{self, AdminState};
use crate::server::auth::Tokens;
use crate::server::passthrough::PassThrough;
use crate::server::reload::{self, Credentials};
use crate::server::tls::{ServerTlsFiles, TlsAcceptor};
use crate::server::{self, ServerParts};
use crate::sim::{DemoConfig, DemoEngine};
use crate::source::SourceEvent;
use crate::source::upstream::{self, UpstreamConfig};
use crate::source::zmq::{ZmqSource, ZmqSourceConfig};

/// Engine messages queued between the sockets and the drain. Beyond this the
/// socket tasks wait, and the engine's own PUB buffer takes over.
const SOURCE_QUEUE: usize = 4096;

/// Time allowed for streams to end and tasks to stop after a shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(4);

/// Runs the gateway until `shutdown` resolves.
pub async fn serve(args: ServeArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    let (stop, _) = watch::channel(false);

    let (source_config, demo) = choose_source(&args).await?;
    let source_description = source_config.to_string();

    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("--listen {}: cannot listen", args.listen))?;
    let address = listener.local_addr()?;
    let admin_listener = match args.metrics_listen {
        Some(address) => Some(admin::bind(address).await?),
        None => None,
    };
    let engine_tls = TlsPaths {
        ca: args.engine_tls_ca.clone(),
        cert: args.engine_tls_cert.clone(),
        key: args.engine_tls_key.clone(),
    };
    let pass_through = args
        .engine_grpc
        .as_deref()
        .map(|target| PassThrough::new(target, &engine_tls, metrics.clone()))
        .transpose()?;
    let credentials = server_credentials(&args, &metrics)?;

    let (hub_writer, hub_reader) = hub(
        args.live_buffer_batches as usize,
        HistoryLimits {
            batches: args.history_batches as usize,
            bytes: usize::try_from(args.history_bytes).unwrap_or(usize::MAX),
        },
    );
    let limits = BatchLimits {
        max_events: args.max_batch_events as usize,
        max_bytes: args.max_batch_bytes as usize,
    };
    let (events_tx, events_rx) = mpsc::channel(SOURCE_QUEUE);
    let (ready_tx, ready_rx) = watch::channel(false);
    let source =
        RunningSource::start(source_config, events_tx, metrics.clone(), ready_tx, &stop).await?;
    let drain = Drain::new(limits, epoch_seed(), hub_writer, metrics.clone());
    let drain_task = tokio::spawn(drain.run(events_rx));

    let admin_task = admin_listener.map(|listener| {
        let state = AdminState {
            metrics: metrics.clone(),
            hub: hub_reader.clone(),
            source_ready: ready_rx.clone(),
            source: source_description.clone().into(),
            started: Instant::now(),
        };
        let address = listener.local_addr().ok();
        if let Some(address) = address {
            println!("kvgate: metrics, /healthz and /status on http://{address}");
        }
        let mut admin_stop = stop.subscribe();
        tokio::spawn(admin::serve(listener, state, async move {
            let _ = admin_stop.wait_for(|stopped| *stopped).await;
        }))
    });
    let mut server_stop = stop.subscribe();
    let mut server_task = tokio::spawn(server::serve(
        listener,
        ServerParts {
            hub: hub_reader,
            metrics: metrics.clone(),
            source_ready: ready_rx,
            pass_through,
            tls: credentials.tls.clone(),
            tokens: credentials.tokens.clone(),
        },
        async move {
            let _ = server_stop.wait_for(|stopped| *stopped).await;
        },
    ));
    let mut reload_stop = stop.subscribe();
    let check_every = Some(Duration::from_secs(args.credentials_check_seconds))
        .filter(|period| !period.is_zero());
    let reload_task = tokio::spawn(reload::reload_task(
        credentials,
        metrics.clone(),
        check_every,
        async move {
            let _ = reload_stop.wait_for(|stopped| *stopped).await;
        },
    )?);
    let demo_task = demo.map(|demo| {
        let mut demo_stop = stop.subscribe();
        tokio::spawn(demo.run(async move {
            let _ = demo_stop.wait_for(|stopped| *stopped).await;
        }))
    });

    println!("kvgate: serving gRPC on {address}, events from {source_description}");
    if args.demo {
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
        let credentials = flags.join(" ");
        println!(
            "kvgate: watch the demo stream with\n  grpcurl {credentials} -d '{{}}' {} kvgate.v1.KvGate/SubscribeKvEvents",
            display_address(address)
        );
    }

    tokio::select! {
        () = shutdown => info!("shutting down"),
        // The server only stops on its own when it failed.
        joined = &mut server_task => {
            joined??;
            anyhow::bail!("the gRPC server stopped unexpectedly");
        }
    }
    stop.send_replace(true);
    let stopped = tokio::time::timeout(SHUTDOWN_GRACE, async {
        // Closing the sockets ends the drain, which closes the hub, which
        // ends every subscriber stream, which lets the server finish.
        source.shutdown().await;
        let _ = drain_task.await;
        if let Some(demo) = demo_task {
            let _ = demo.await;
        }
        if let Some(admin) = admin_task {
            let _ = admin.await;
        }
        let _ = reload_task.await;
        server_task.await
    })
    .await;
    match stopped {
        Ok(joined) => joined?,
        Err(_) => {
            warn!("streams did not end within {SHUTDOWN_GRACE:?}; exiting anyway");
            Ok(())
        }
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

const UPSTREAM_FLAGS: TlsFlags = TlsFlags {
    uri: "--upstream-grpc",
    ca: "--upstream-tls-ca",
    cert: "--upstream-tls-cert",
    key: "--upstream-tls-key",
};

/// TLS on the gRPC port and bearer tokens, read and checked now.
fn server_credentials(args: &ServeArgs, metrics: &Metrics) -> anyhow::Result<Credentials> {
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

/// Where events come from, as configured.
enum SourceConfig {
    Zmq(ZmqSourceConfig),
    Upstream(UpstreamConfig),
}

impl std::fmt::Display for SourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Zmq(config) => write!(f, "{} ({} rank(s))", config.endpoint, config.dp_size),
            Self::Upstream(config) => write!(f, "{} ({})", config.target.uri(), config.service),
        }
    }
}

/// Exactly one of `--zmq-endpoint`, `--demo` (a simulated engine started
/// here) and `--upstream-grpc`.
async fn choose_source(args: &ServeArgs) -> anyhow::Result<(SourceConfig, Option<DemoEngine>)> {
    let zmq = |endpoint, replay_endpoint| {
        SourceConfig::Zmq(ZmqSourceConfig {
            endpoint,
            replay_endpoint,
            replay_timeout: Duration::from_millis(args.zmq_replay_timeout_ms),
            dp_size: args.dp_size,
            topic: args.zmq_topic.clone(),
            bind: args.zmq_bind,
        })
    };
    if args.demo {
        // With a replay endpoint, like a well-configured engine: kvgate
        // primes from it, so the first steps lost to ZMQ's slow joiner are not.
        let mut config = DemoConfig::new(args.dp_size);
        config.publisher.replay_endpoint = Some("tcp://127.0.0.1:0".into());
        let demo = DemoEngine::bind(config).await?;
        let endpoint = demo.endpoint().parse()?;
        let replay = demo
            .endpoints()
            .first()
            .and_then(|rank0| rank0.replay_endpoint.as_deref()?.parse().ok());
        return Ok((zmq(endpoint, replay), Some(demo)));
    }
    if let Some(uri) = &args.upstream_grpc {
        let tls = TlsPaths {
            ca: args.upstream_tls_ca.clone(),
            cert: args.upstream_tls_cert.clone(),
            key: args.upstream_tls_key.clone(),
        };
        let token = args
            .upstream_token_file
            .as_ref()
            .map(|path| FlagFile::new("--upstream-token-file", path));
        let config = UpstreamConfig {
            target: crate::client::Target::new(uri, &tls, UPSTREAM_FLAGS, token)?,
            service: args.upstream_service.clone(),
        };
        return Ok((SourceConfig::Upstream(config), None));
    }
    let endpoint = args.zmq_endpoint.clone().context(
        "no event source: give --zmq-endpoint tcp://HOST:PORT (the engine's KV-event publisher), \
         --upstream-grpc URI (another SubscribeKvEvents server) or --demo",
    )?;
    Ok((zmq(endpoint, args.zmq_replay_endpoint.clone()), None))
}

/// The running source, stopped before the drain so the drain ends cleanly.
enum RunningSource {
    Zmq(ZmqSource),
    Upstream(tokio::task::JoinHandle<()>),
}

impl RunningSource {
    async fn start(
        config: SourceConfig,
        events: mpsc::Sender<SourceEvent>,
        metrics: Metrics,
        ready: watch::Sender<bool>,
        stop: &watch::Sender<bool>,
    ) -> anyhow::Result<Self> {
        Ok(match config {
            SourceConfig::Zmq(config) => {
                Self::Zmq(ZmqSource::start(config, events, metrics, ready).await?)
            }
            SourceConfig::Upstream(config) => Self::Upstream(tokio::spawn(upstream::run(
                config,
                events,
                metrics,
                ready,
                stop.subscribe(),
            ))),
        })
    }

    async fn shutdown(self) {
        match self {
            Self::Zmq(source) => source.shutdown().await,
            // It watches the stop signal, already sent.
            Self::Upstream(task) => {
                let _ = task.await;
            }
        }
    }
}
