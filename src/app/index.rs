//! `kvgate index`: the registry, its one writer, the workers given by
//! flags, and the HTTP port, wired together and run until shutdown.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::cli::IndexArgs;
use crate::client::TlsFlags;
use crate::index::feed::sidecar::{self, SidecarSettings, SidecarTrust};
use crate::index::ingest_thread;
use crate::index::partition::PartitionKey;
use crate::index::registry::{FeedSettings, Registration, Registry, RegistryLimits};
use crate::index::writer;
use crate::runtime_thread::RuntimeThread;
use crate::server::admin_connection::AdminLimits;
use crate::server::index_http;

/// The flags a sidecar's credentials come from.
pub(super) const WORKER_FLAGS: TlsFlags = TlsFlags {
    uri: "endpoint",
    ca: "--worker-ca-file",
    cert: "--worker-tls-cert",
    key: "--worker-tls-key",
};

/// A running index: its address, until [`Index::run`] ends it.
pub struct Index {
    listener: TcpListener,
    registry: Arc<Registry>,
    writer: tokio::task::JoinHandle<()>,
    /// Runs the feeds and the writer; stopped last.
    ingest: RuntimeThread,
    limits: AdminLimits,
}

impl Index {
    /// Binds the port and registers the workers `args` names.
    pub async fn start(args: IndexArgs) -> anyhow::Result<Self> {
        let trust = SidecarTrust {
            ca_file: args.worker_ca_file.clone(),
            cert_file: args.worker_tls_cert.clone(),
            key_file: args.worker_tls_key.clone(),
            token_file: args.worker_token_file.clone(),
            flags: WORKER_FLAGS,
            token_flag: "--worker-token-file",
        };
        check_trust(&trust)?;
        let ingest = ingest_thread::start()?;
        let (queue, inputs) = writer::queue();
        let writer = ingest.handle().spawn(writer::run(inputs));
        let registry = Arc::new(Registry::new(
            queue,
            ingest.handle().clone(),
            FeedSettings {
                replay_timeout: Duration::from_millis(args.zmq_replay_timeout_ms),
                max_message_bytes: usize::try_from(args.zmq_max_message_bytes)
                    .unwrap_or(usize::MAX),
                sidecar: SidecarSettings {
                    trust,
                    service: args.worker_service.clone(),
                    max_ranks: args.index_max_sidecar_ranks,
                },
            },
            RegistryLimits {
                max_worker_ranks: usize::try_from(args.index_max_worker_ranks)
                    .unwrap_or(usize::MAX),
                max_partitions: usize::try_from(args.index_max_partitions).unwrap_or(usize::MAX),
            },
        ));
        if let (Some(workers), Some(model_name), Some(block_size)) =
            (&args.workers, &args.model_name, args.block_size)
        {
            for worker in &workers.0 {
                registry
                    .register(Registration {
                        instance_id: worker.instance_id,
                        dp_rank: worker.dp_rank,
                        partition: PartitionKey {
                            model_name: model_name.clone(),
                            routing_group: args.routing_group.clone(),
                        },
                        block_size,
                        endpoint: worker.endpoint.clone(),
                        replay_endpoint: None,
                    })
                    .map_err(|refused| {
                        crate::usage_error::UsageError(format!("--workers: {refused}"))
                    })?;
            }
        }
        let listener = TcpListener::bind(args.listen)
            .await
            .map_err(|error| anyhow::anyhow!("cannot listen on {}: {error}", args.listen))?;
        Ok(Index {
            listener,
            registry,
            writer,
            ingest,
            limits: AdminLimits {
                max_connections: args.http_max_connections,
                header_timeout: Duration::from_millis(args.http_header_timeout_ms),
                idle_timeout: Duration::from_millis(args.http_idle_timeout_ms),
            },
        })
    }

    /// Where the HTTP port listens.
    pub fn address(&self) -> std::io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown`, then stops every feed.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
        let registry = Arc::clone(&self.registry);
        index_http::serve(self.listener, registry, self.limits, shutdown).await;
        self.registry.stop_all();
        drop(self.registry);
        self.writer.abort();
        drop(self.ingest);
        Ok(())
    }
}

/// Fails at start, naming the flag, when a sidecar credential cannot be
/// read: every registration would be refused for it.
fn check_trust(trust: &SidecarTrust) -> anyhow::Result<()> {
    let scheme = if trust.ca_file.is_some() || trust.cert_file.is_some() {
        "grpcs"
    } else if trust.token_file.is_some() {
        "grpc"
    } else {
        return Ok(());
    };
    sidecar::target(&format!("{scheme}://localhost:1"), trust)
        .map(drop)
        .map_err(|error| crate::usage_error::UsageError(error).into())
}

/// Runs `kvgate index` until `shutdown`.
pub async fn run(
    args: IndexArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let index = Index::start(args).await?;
    crate::logging::announce(&format!(
        "kvgate: index answering Dynamo's API on http://{}",
        index.address()?
    ));
    index.run(shutdown).await
}
