//! `kvgate tail`: print a gateway's stream, one JSON object per event
//! (`--json`, proto3 JSON as grpcurl shows it) or one line per batch.

use std::io::Write;

use serde_json::{Map, Value};

use super::{GatewayArgs, subscribe};
use crate::proto::common::{KvEventBatch, kv_cache_event::Data};

#[derive(Debug, Clone, clap::Args)]
pub struct TailArgs {
    #[command(flatten)]
    pub gateway: GatewayArgs,
    /// Resume after this rank-0 sequence number; 0 starts with a snapshot.
    #[arg(long, default_value_t = 0)]
    pub from: u64,
    /// Which service name to call SubscribeKvEvents on.
    #[arg(long, default_value = "kvgate.v1.KvGate")]
    pub service: String,
    /// One JSON object per event instead of a line per batch.
    #[arg(long)]
    pub json: bool,
    /// Stop after this many batches.
    #[arg(long)]
    pub limit: Option<u64>,
}

pub async fn run(args: TailArgs) -> anyhow::Result<()> {
    let channel = args.gateway.connect().await?;
    let mut stream = subscribe(channel, &args.service, args.from)
        .await
        .map_err(|status| anyhow::anyhow!("SubscribeKvEvents refused: {status}"))?;
    let mut out = std::io::stdout().lock();
    let mut batches = 0;
    while args.limit.is_none_or(|limit| batches < limit) {
        let Some(batch) = stream
            .message()
            .await
            .map_err(|status| anyhow::anyhow!("stream ended: {status}"))?
        else {
            break;
        };
        batches += 1;
        if args.json {
            for line in event_lines(&batch) {
                writeln!(out, "{line}")?;
            }
        } else {
            writeln!(out, "{}", summary(&batch))?;
        }
        out.flush()?;
    }
    Ok(())
}

/// Each event as proto3 JSON, with its batch's number, rank and snapshot
/// position alongside.
pub fn event_lines(batch: &KvEventBatch) -> Vec<Value> {
    batch
        .events
        .iter()
        .map(|event| {
            let mut line = Map::new();
            line.insert(
                "sequence_number".into(),
                Value::String(batch.sequence_number.to_string()),
            );
            line.insert("dp_rank".into(), batch.dp_rank.unwrap_or(0).into());
            if let Some(snapshot) = &batch.snapshot {
                line.insert(
                    "snapshot".into(),
                    crate::json::to_json(snapshot, "smg.grpc.common.KvSnapshotChunk"),
                );
            }
            if let Value::Object(event) =
                crate::json::to_json(event, "smg.grpc.common.KvCacheEvent")
            {
                line.extend(event);
            }
            Value::Object(line)
        })
        .collect()
}

/// One human line per batch.
pub fn summary(batch: &KvEventBatch) -> String {
    let (mut stored, mut removed, mut cleared) = (0, 0, 0);
    for event in &batch.events {
        match &event.data {
            Some(Data::Stored(store)) => stored += store.blocks.len(),
            Some(Data::Removed(removal)) => removed += removal.block_hashes.len(),
            Some(Data::Cleared(_)) => cleared += 1,
            None => {}
        }
    }
    let mut line = format!(
        "seq {} rank {} events {:>4}  +{stored} stored  -{removed} removed",
        batch.sequence_number,
        batch.dp_rank.unwrap_or(0),
        batch.events.len(),
    );
    if cleared > 0 {
        line.push_str(&format!("  {cleared} cleared"));
    }
    if let Some(snapshot) = &batch.snapshot {
        line.push_str(&format!(
            "  [snapshot {}/{}, {} blocks]",
            snapshot.index + 1,
            snapshot.count,
            snapshot.blocks
        ));
    }
    line
}
