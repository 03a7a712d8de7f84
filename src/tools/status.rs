//! `kvgate status`: what a running gateway serves and holds, over gRPC only
//! (`--index` shows a `kvgate index` instead, see `index_status`):
//! health per service, the services reflection lists, and a summary of a
//! fresh snapshot (live blocks and last sequence number per rank).
//!
//! Invariant: health and reflection need no token, so a gateway that wants
//! one still shows them; the snapshot part then says the token is missing.
//! The exit code is 0 only when the gateway as a whole is `SERVING`, so a
//! script or probe can rely on it, and a call that cannot reach the gateway
//! stops at once (one failed TLS handshake, not one per call).

use std::collections::BTreeMap;

use serde::Serialize;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use super::{Connected, GatewayArgs};
use crate::client::subscribe;
use crate::proto::common::kv_cache_event::Data;
use crate::server::SUBSCRIBE_SERVICES;

/// The key of the gateway's own health (gRPC health's empty service name)
/// in [`GatewayStatus::health`].
pub const SERVER_HEALTH: &str = "server";

#[derive(Debug, Clone, clap::Args)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub struct StatusArgs {
    #[command(flatten)]
    #[allow(missing_docs)] // flattened or a subcommand: clap documents it
    pub gateway: GatewayArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// The gateway's admin address (its --metrics-listen, HOST:PORT): adds
    /// where each rank's events come from and how kvgate learned it.
    #[arg(long, env = "KVGATE_ADMIN_ADDR", value_name = "ADDR")]
    pub admin: Option<String>,
    /// Show a `kvgate index` instead (its --listen, http://HOST:PORT):
    /// partitions, workers and each rank's source; exits 1 unless every
    /// rank is connected.
    #[arg(
        long,
        env = "KVGATE_INDEX_URL",
        value_name = "URL",
        conflicts_with = "admin"
    )]
    pub index: Option<String>,
}

#[derive(Debug, Serialize)]
/// What `kvgate status` learned of a gateway.
pub struct GatewayStatus {
    /// The address asked.
    pub address: String,
    /// Health per service; the gateway as a whole is [`SERVER_HEALTH`].
    pub health: BTreeMap<String, String>,
    /// The gRPC services it serves.
    pub services: Vec<String>,
    /// What its snapshot said of each rank.
    pub ranks: BTreeMap<i32, RankStatus>,
    /// Engine messages before kvgate's record that it never saw.
    pub unknown_before: u64,
    /// Why no snapshot was read (a token the gateway requires, most
    /// likely), when none was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_refused: Option<String>,
    /// Where events come from, as the admin port's `/status` says (with
    /// `--admin`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub events_from: Option<EventsFrom>,
}

/// The gateway's source, from its `/status`.
#[derive(Debug, Default, Serialize, serde::Deserialize)]
pub struct EventsFrom {
    /// The source as configured.
    pub source: String,
    /// Each rank's publisher, when the engine named it.
    #[serde(default)]
    pub sources: Vec<RankSource>,
}

/// One rank's publisher and how kvgate learned it.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct RankSource {
    /// The rank.
    pub rank: u32,
    /// Its publisher.
    pub endpoint: String,
    /// Its replay endpoint, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    /// Its topic.
    #[serde(default)]
    pub topic: String,
    /// The question the engine answered.
    pub learned_from: String,
}

/// The most bytes of a `/status` read.
const MAX_STATUS_BYTES: usize = 4 << 20;

/// `/status` of the admin port at `admin` (HOST:PORT or http://HOST:PORT).
async fn events_from(admin: &str) -> anyhow::Result<EventsFrom> {
    let url: http::Uri = if admin.starts_with("http://") {
        admin.parse()
    } else {
        format!("http://{admin}").parse()
    }
    .map_err(|error| anyhow::anyhow!("--admin {admin}: {error}"))?;
    let body = crate::http_get::get(
        &url,
        "/status",
        MAX_STATUS_BYTES,
        std::time::Duration::from_secs(5),
    )
    .await
    .map_err(|why| anyhow::anyhow!("--admin {admin}: GET /status: {why}"))?;
    serde_json::from_slice(&body)
        .map_err(|error| anyhow::anyhow!("--admin {admin}: /status is not kvgate's: {error}"))
}

#[derive(Debug, Default, Serialize)]
/// One rank, as the snapshot showed it.
pub struct RankStatus {
    /// The rank's last sequence number.
    pub last_sequence: u64,
    /// Live blocks in the snapshot.
    pub blocks: u64,
}

impl GatewayStatus {
    /// The gateway's own health verdict.
    pub fn server_health(&self) -> &str {
        self.health
            .get(SERVER_HEALTH)
            .map_or("UNKNOWN", String::as_str)
    }
}

/// `kvgate status`: collects and prints; fails unless the gateway is
/// `SERVING`.
pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    if let Some(index) = &args.index {
        return super::index_status::run(index, args.json).await;
    }
    let mut status = collect(&args.gateway).await?;
    if let Some(admin) = &args.admin {
        status.events_from = Some(events_from(admin).await?);
    }
    if args.json {
        super::print(&format!("{}\n", serde_json::to_string_pretty(&status)?))?;
    } else {
        super::print(&render(&status))?;
    }
    match status.server_health() {
        "SERVING" => Ok(()),
        verdict => anyhow::bail!("the gateway at {} is {verdict}", status.address),
    }
}

/// Asks the gateway for its health, services and a snapshot.
pub async fn collect(gateway: &GatewayArgs) -> anyhow::Result<GatewayStatus> {
    let connected = gateway.connect()?;
    let mut health = BTreeMap::new();
    let mut client = HealthClient::new(connected.channel.clone());
    for service in std::iter::once("").chain(SUBSCRIBE_SERVICES) {
        let request = HealthCheckRequest {
            service: service.into(),
        };
        let verdict = match client.check(request).await {
            Ok(response) => response.into_inner().status().as_str_name().to_owned(),
            Err(status) if is_transport(&status) => {
                return Err(connected.failed("health check", &status));
            }
            Err(status) => crate::connect_error::describe_status(&status),
        };
        let key = if service.is_empty() {
            SERVER_HEALTH
        } else {
            service
        };
        health.insert(key.to_owned(), verdict);
    }
    let services = connected
        .services()
        .await
        .map_err(|status| connected.failed("reflection", &status))?;
    let mut status = GatewayStatus {
        address: gateway.addr.clone(),
        health,
        services,
        ranks: BTreeMap::new(),
        unknown_before: 0,
        snapshot_refused: None,
        events_from: None,
    };
    if let Err(refused) = read_snapshot(&connected, &mut status).await {
        if is_transport(&refused) {
            return Err(connected.failed("SubscribeKvEvents", &refused));
        }
        status.snapshot_refused = Some(crate::connect_error::describe_status(&refused));
    }
    Ok(status)
}

/// Whether the call failed on the way rather than being answered.
fn is_transport(status: &tonic::Status) -> bool {
    crate::connect_error::transport_failure(status).is_some()
}

/// Reads a fresh snapshot into `status`'s ranks.
async fn read_snapshot(
    connected: &Connected,
    status: &mut GatewayStatus,
) -> Result<(), tonic::Status> {
    let mut stream = subscribe(connected.channel.clone(), "kvgate.v1.KvGate", 0).await?;
    // The snapshot comes first; a gateway that has seen nothing sends none.
    let first = tokio::time::timeout(std::time::Duration::from_secs(2), stream.message()).await;
    let mut next = match first {
        Ok(message) => message?,
        Err(_) => None,
    };
    while let Some(batch) = next.take() {
        let Some(chunk) = batch.snapshot else { break };
        status.unknown_before = chunk.unknown_before;
        let rank = status.ranks.entry(batch.dp_rank.unwrap_or(0)).or_default();
        rank.last_sequence = batch.sequence_number;
        for event in &batch.events {
            if let Some(Data::Stored(stored)) = &event.data {
                rank.blocks += stored.blocks.len() as u64;
            }
        }
        if chunk.index + 1 < chunk.count {
            next = stream.message().await?;
        }
    }
    Ok(())
}

/// The status as `kvgate status` prints it.
pub fn render(status: &GatewayStatus) -> String {
    let mut out = format!("kvgate at {}\n", status.address);
    out.push_str("health:\n");
    // The gateway as a whole first, then each service.
    let mut health: Vec<(&String, &String)> = status.health.iter().collect();
    health.sort_by_key(|(service, _)| service.as_str() != SERVER_HEALTH);
    for (service, verdict) in health {
        out.push_str(&format!("  {service:<48} {verdict}\n"));
    }
    out.push_str(&format!("services: {}\n", status.services.join(", ")));
    if let Some(refused) = &status.snapshot_refused {
        out.push_str(&format!(
            "events: no snapshot: {refused} (a gateway with --auth-token-file needs --token-file)\n"
        ));
    } else if status.ranks.is_empty() {
        out.push_str("no events seen yet\n");
    }
    for (rank, figures) in &status.ranks {
        out.push_str(&format!(
            "rank {rank}: {} live blocks, last sequence {}\n",
            figures.blocks, figures.last_sequence
        ));
    }
    if status.unknown_before > 0 {
        out.push_str(&format!(
            "{} engine messages came before kvgate's record\n",
            status.unknown_before
        ));
    }
    if let Some(events_from) = &status.events_from {
        out.push_str(&format!("events from: {}\n", events_from.source));
        for source in &events_from.sources {
            let replay = source
                .replay_endpoint
                .as_deref()
                .map_or_else(String::new, |replay| format!(", replay {replay}"));
            out.push_str(&format!(
                "rank {}: {}{replay}, topic {:?}, learned from {}\n",
                source.rank, source.endpoint, source.topic, source.learned_from
            ));
        }
    }
    out
}
