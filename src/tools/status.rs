//! `kvgate status`: what a running gateway serves and holds, over gRPC only:
//! health per service, the services reflection lists, and a summary of a
//! fresh snapshot (live blocks and last sequence number per rank).

use std::collections::BTreeMap;

use serde::Serialize;
use tokio_stream::StreamExt;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

use super::GatewayArgs;
use crate::client::subscribe;
use crate::proto::common::kv_cache_event::Data;
use crate::server::SUBSCRIBE_SERVICES;

#[derive(Debug, Clone, clap::Args)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub struct StatusArgs {
    #[command(flatten)]
    #[allow(missing_docs)] // flattened or a subcommand: clap documents it
    pub gateway: GatewayArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
/// What `kvgate status` learned of a gateway.
pub struct GatewayStatus {
    /// The address asked.
    pub address: String,
    /// Health per service ("" is the server as a whole).
    pub health: BTreeMap<String, String>,
    /// The gRPC services it serves.
    pub services: Vec<String>,
    /// What its snapshot said of each rank.
    pub ranks: BTreeMap<i32, RankStatus>,
    /// Engine messages before kvgate's record that it never saw.
    pub unknown_before: u64,
}

#[derive(Debug, Default, Serialize)]
/// One rank, as the snapshot showed it.
pub struct RankStatus {
    /// The rank's last sequence number.
    pub last_sequence: u64,
    /// Live blocks in the snapshot.
    pub blocks: u64,
}

/// `kvgate status`: collects and prints.
pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let status = collect(&args.gateway).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render(&status));
    }
    Ok(())
}

/// Asks the gateway for its health, services and a snapshot.
pub async fn collect(gateway: &GatewayArgs) -> anyhow::Result<GatewayStatus> {
    let channel = gateway.connect().await?;
    let mut health = BTreeMap::new();
    let mut client = HealthClient::new(channel.clone());
    for service in std::iter::once("").chain(SUBSCRIBE_SERVICES) {
        let verdict = match client
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
        {
            Ok(response) => response.into_inner().status().as_str_name().to_owned(),
            Err(status) => format!("{:?}", status.code()),
        };
        health.insert(service.to_owned(), verdict);
    }

    let mut reflection = ServerReflectionClient::new(channel.clone());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await?
        .into_inner();
    let services = match responses
        .next()
        .await
        .transpose()?
        .and_then(|r| r.message_response)
    {
        Some(MessageResponse::ListServicesResponse(list)) => list
            .service
            .into_iter()
            .map(|service| service.name)
            .collect(),
        _ => Vec::new(),
    };

    let mut ranks: BTreeMap<i32, RankStatus> = BTreeMap::new();
    let mut unknown_before = 0;
    let mut stream = subscribe(channel, "kvgate.v1.KvGate", 0).await?;
    // The snapshot comes first; a gateway that has seen nothing sends none.
    let first = tokio::time::timeout(std::time::Duration::from_secs(2), stream.message()).await;
    let mut next = match first {
        Ok(message) => message?,
        Err(_) => None,
    };
    while let Some(batch) = next.take() {
        let Some(chunk) = batch.snapshot else { break };
        unknown_before = chunk.unknown_before;
        let rank = ranks.entry(batch.dp_rank.unwrap_or(0)).or_default();
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
    Ok(GatewayStatus {
        address: gateway.addr.clone(),
        health,
        services,
        ranks,
        unknown_before,
    })
}

/// The status as `kvgate status` prints it.
pub fn render(status: &GatewayStatus) -> String {
    let mut out = format!("kvgate at {}\n", status.address);
    out.push_str("health:\n");
    for (service, verdict) in &status.health {
        let name = if service.is_empty() {
            "(server)"
        } else {
            service
        };
        out.push_str(&format!("  {name:<48} {verdict}\n"));
    }
    out.push_str(&format!("services: {}\n", status.services.join(", ")));
    if status.ranks.is_empty() {
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
    out
}
