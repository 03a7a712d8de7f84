//! `kvgate tail`: print a gateway's stream, one JSON object per event
//! (`--json`, proto3 JSON with lowerCamelCase names as grpcurl prints it, so
//! the two diff cleanly) or one line per batch. Load records show as a
//! compact line of their own (`--json`: a `load` object).

use std::io::Write;
use std::path::Path;

use serde_json::{Map, Value};

use super::GatewayArgs;
use crate::client::subscribe_requesting;
use crate::json::{FieldNames, to_json_with};
use crate::proto::common::{KvEventBatch, SubscribeKvEventsRequest, kv_cache_event::Data};
use crate::recording::{self, Entry, Recording, decode_batch};

#[derive(Debug, Clone, clap::Args)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub struct TailArgs {
    #[command(flatten)]
    #[allow(missing_docs)] // flattened or a subcommand: clap documents it
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
    /// Ask for load records before the first batch (load-only batches
    /// numbered 0 while the engine has sent no KV event yet).
    #[arg(long)]
    pub load_before_first_batch: bool,
    /// Stop after this many batches.
    #[arg(long)]
    pub limit: Option<u64>,
    /// Print a recording (`kvgate record --out FILE`, with its parts
    /// FILE.1, ...) instead of a gateway's stream.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["from", "load_before_first_batch"])]
    pub file: Option<std::path::PathBuf>,
}

/// `kvgate tail`: prints the stream until it ends, is interrupted, or its
/// reader goes away (`| head`: a quiet, successful end).
pub async fn run(args: TailArgs) -> anyhow::Result<()> {
    if let Some(file) = &args.file {
        return print_recording(file, args.json, args.limit);
    }
    let connected = args.gateway.connect()?;
    let request = SubscribeKvEventsRequest {
        start_sequence_number: args.from,
        load_records_before_first_batch: args.load_before_first_batch,
    };
    let codec = tonic_prost::ProstCodec::<SubscribeKvEventsRequest, KvEventBatch>::default();
    let subscribed =
        subscribe_requesting(connected.channel.clone(), &args.service, request, codec).await;
    let mut stream = match subscribed {
        Ok(stream) => stream,
        Err(status) if status.code() == tonic::Code::Unimplemented => {
            return Err(unknown_service(&connected, &args.service, &status).await);
        }
        Err(status) => return Err(connected.failed("SubscribeKvEvents refused", &status)),
    };
    let mut out = std::io::stdout().lock();
    let mut batches = 0;
    while args.limit.is_none_or(|limit| batches < limit) {
        let Some(batch) = stream
            .message()
            .await
            .map_err(|status| connected.failed("stream ended", &status))?
        else {
            break;
        };
        batches += 1;
        match write_batch(&mut out, &batch, args.json) {
            Err(error) if super::reader_gone(&error) => break,
            written => written?,
        }
    }
    Ok(())
}

/// One batch as `tail` prints it (its events as JSON lines, or its
/// summary), flushed.
fn write_batch(out: &mut impl Write, batch: &KvEventBatch, json: bool) -> std::io::Result<()> {
    if json {
        for line in event_lines(batch).into_iter().chain(load_line(batch)) {
            writeln!(out, "{line}")?;
        }
    } else if batch.load.as_ref().is_some_and(|load| load.load_only) {
        writeln!(out, "{}", load_summary(batch).unwrap_or_default())?;
    } else {
        writeln!(out, "{}", summary(batch))?;
    }
    out.flush()
}

/// `kvgate tail --file`: prints a recording as `tail` prints a stream; a
/// resync shows as a line of its own. Damage is reported after everything
/// intact was printed.
fn print_recording(file: &Path, json: bool, limit: Option<u64>) -> anyhow::Result<()> {
    let mut recording = Recording::open(&[file.to_owned()])?;
    let mut out = std::io::stdout().lock();
    let mut batches = 0;
    for record in recording.by_ref() {
        if limit.is_some_and(|limit| batches >= limit) {
            return Ok(());
        }
        let written = match record.entry {
            Entry::Batch(bytes) => {
                batches += 1;
                let batch = decode_batch(&bytes, batches)?;
                write_batch(&mut out, &batch, json)
            }
            Entry::Resync(reason) if json => {
                writeln!(out, "{}", serde_json::json!({ "resync": reason }))
            }
            Entry::Resync(reason) => writeln!(out, "resync (a new snapshot follows): {reason}"),
        };
        match written {
            Err(error) if super::reader_gone(&error) => return Ok(()),
            written => written?,
        }
    }
    out.flush()?;
    recording::ending_result(recording.ending())
}

/// `--service` names no service serving `SubscribeKvEvents`: the error says
/// which ones the gateway lists.
async fn unknown_service(
    connected: &super::Connected,
    service: &str,
    status: &tonic::Status,
) -> anyhow::Error {
    let listed = match connected.services().await {
        Ok(services) => {
            let subscribable: Vec<String> = services
                .into_iter()
                .filter(|name| !name.starts_with("grpc."))
                .collect();
            format!("the services it lists: {}", subscribable.join(", "))
        }
        Err(reflection) => format!(
            "its reflection did not answer ({})",
            crate::connect_error::describe_status(&reflection)
        ),
    };
    anyhow::anyhow!(
        "--service {service}: the gateway serves no {service}/SubscribeKvEvents ({}); {listed}",
        crate::connect_error::describe_status(status)
    )
}

/// Each event as proto3 JSON (lowerCamelCase names), with its batch's
/// number, rank and snapshot position alongside, named as grpcurl names
/// the batch's fields.
pub fn event_lines(batch: &KvEventBatch) -> Vec<Value> {
    batch
        .events
        .iter()
        .map(|event| {
            let mut line = Map::new();
            line.insert(
                "sequenceNumber".into(),
                Value::String(batch.sequence_number.to_string()),
            );
            line.insert("dpRank".into(), batch.dp_rank.unwrap_or(0).into());
            if let Some(snapshot) = &batch.snapshot {
                line.insert(
                    "snapshot".into(),
                    to_json_with(
                        snapshot,
                        "smg.grpc.common.KvSnapshotChunk",
                        FieldNames::Json,
                    ),
                );
            }
            if let Value::Object(event) =
                to_json_with(event, "smg.grpc.common.KvCacheEvent", FieldNames::Json)
            {
                line.extend(event);
            }
            Value::Object(line)
        })
        .collect()
}

/// The batch's load record as proto3 JSON (lowerCamelCase names, as
/// grpcurl prints it), with its number and rank named as the events' lines
/// name them.
pub fn load_line(batch: &KvEventBatch) -> Option<Value> {
    let load = batch.load.as_ref()?;
    let mut line = Map::new();
    line.insert(
        "sequenceNumber".into(),
        Value::String(batch.sequence_number.to_string()),
    );
    line.insert("dpRank".into(), batch.dp_rank.unwrap_or(0).into());
    line.insert(
        "load".into(),
        to_json_with(load, "smg.grpc.common.EngineLoad", FieldNames::Json),
    );
    Some(Value::Object(line))
}

/// The batch's load record as a compact human line.
pub fn load_summary(batch: &KvEventBatch) -> Option<String> {
    let load = batch.load.as_ref()?;
    let mut line = format!(
        "load rank {} sample {} age {}ms  running {} waiting {} usage {:.3} gen {:.1} tok/s",
        batch.dp_rank.unwrap_or(0),
        load.sample,
        load.age_ms,
        load.running_requests,
        load.waiting_requests,
        load.token_usage,
        load.gen_throughput,
    );
    if let Some(uncached) = load.waiting_uncached_tokens {
        line.push_str(&format!(" uncached {uncached}"));
    }
    if load.load_only {
        line.push_str("  [load only]");
    }
    Some(line)
}

/// One human line per batch (its load record, if any, on a second line).
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
    if let Some(load) = load_summary(batch) {
        line.push('\n');
        line.push_str(&load);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::EngineLoad;

    fn heartbeat() -> KvEventBatch {
        KvEventBatch {
            sequence_number: 41,
            dp_rank: Some(1),
            load: Some(EngineLoad {
                running_requests: 4,
                waiting_requests: 1,
                waiting_uncached_tokens: Some(256),
                token_usage: 0.5,
                gen_throughput: 812.0,
                sample: 12,
                age_ms: 3,
                load_only: true,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_load_record_shows_as_one_compact_line() {
        assert_eq!(
            load_summary(&heartbeat()).unwrap(),
            "load rank 1 sample 12 age 3ms  running 4 waiting 1 usage 0.500 gen 812.0 tok/s uncached 256  [load only]"
        );
        assert_eq!(load_summary(&KvEventBatch::default()), None);
    }

    #[test]
    fn json_output_includes_the_load_record_with_its_rank_and_number() {
        let line = load_line(&heartbeat()).unwrap();
        assert_eq!(line["dpRank"], 1);
        assert_eq!(line["sequenceNumber"], "41");
        assert_eq!(line["load"]["runningRequests"], 4);
        assert_eq!(line["load"]["waitingUncachedTokens"], 256);
        assert_eq!(line["load"]["ageMs"], 3);
        assert_eq!(line["load"]["loadOnly"], true);
        assert!(event_lines(&heartbeat()).is_empty(), "no events");
    }
}
