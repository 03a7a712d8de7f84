//! `kvgate status --index URL`: what a running `kvgate index` holds, read
//! from its `/status` (kvgate's own route beside Dynamo's API): each
//! partition's block size, blocks and dropped events, and each worker with
//! the state of every rank's source.
//!
//! Invariant: the exit code is 0 when the index answered and every rank it
//! follows is connected, so a probe can rely on it; a rank connecting,
//! disconnected or failed is printed with since when and why, and makes
//! the exit code 1. A worker's fields are read as `/workers` writes them,
//! and a field this command does not know is left out, not an error.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::index::partition::PartitionStatus;

/// The most bytes of an index's `/status` (its workers are bounded by
/// `--index-max-worker-ranks`).
const MAX_STATUS_BYTES: usize = 16 << 20;

/// How long the index has to answer.
const TIMEOUT: Duration = Duration::from_secs(5);

/// What `kvgate status --index` learned of an index.
#[derive(Debug, Serialize, Deserialize)]
pub struct IndexStatus {
    /// The address asked.
    #[serde(default)]
    pub address: String,
    /// Every (model, routing group) it holds.
    pub partitions: Vec<PartitionStatus>,
    /// Every worker, as `/workers` lists it.
    pub workers: Vec<Value>,
}

impl IndexStatus {
    /// Each rank's source that is not connected: (worker, rank, state).
    pub fn ranks_not_connected(&self) -> Vec<(String, String, String)> {
        self.workers
            .iter()
            .flat_map(|worker| {
                let id = worker["instance_id"].to_string();
                listeners(worker)
                    .filter(|(_, listener)| state(listener) != "connected")
                    .map(move |(rank, listener)| (id.clone(), rank.clone(), state(listener)))
            })
            .collect()
    }
}

fn listeners(worker: &Value) -> impl Iterator<Item = (&String, &Value)> {
    worker["listeners"].as_object().into_iter().flatten()
}

/// kvgate's own name for a listener's state, or Dynamo's when it has none.
fn state(listener: &Value) -> String {
    listener["kvgate"]["state"]
        .as_str()
        .or(listener["status"].as_str())
        .unwrap_or("unknown")
        .to_owned()
}

/// Reads the index at `url` (`http://HOST:PORT` or `HOST:PORT`).
pub async fn collect(url: &str) -> anyhow::Result<IndexStatus> {
    let parsed: http::Uri = if url.contains("://") {
        url.parse()
    } else {
        format!("http://{url}").parse()
    }
    .map_err(|error| anyhow::anyhow!("--index {url}: {error}"))?;
    let body = crate::http_get::get(&parsed, "/status", MAX_STATUS_BYTES, TIMEOUT)
        .await
        .map_err(|why| anyhow::anyhow!("--index {url}: GET /status: {why}"))?;
    let mut status: IndexStatus = serde_json::from_slice(&body).map_err(|error| {
        anyhow::anyhow!("--index {url}: /status is not a kvgate index's: {error}")
    })?;
    status.address = url.to_owned();
    Ok(status)
}

/// `kvgate status --index`: collects and prints; fails unless every rank
/// is connected.
pub async fn run(url: &str, json: bool) -> anyhow::Result<()> {
    let status = collect(url).await?;
    if json {
        super::print(&format!("{}\n", serde_json::to_string_pretty(&status)?))?;
    } else {
        super::print(&render(&status, SystemTime::now()))?;
    }
    let waiting = status.ranks_not_connected();
    if waiting.is_empty() {
        return Ok(());
    }
    let named: Vec<String> = waiting
        .iter()
        .map(|(worker, rank, state)| format!("worker {worker} rank {rank} is {state}"))
        .collect();
    anyhow::bail!("the index at {url}: {}", named.join(", "))
}

/// The status as `kvgate status --index` prints it, ages counted to `now`.
pub fn render(status: &IndexStatus, now: SystemTime) -> String {
    let now = now
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64());
    let mut out = format!("kvgate index at {}\n", status.address);
    if status.partitions.is_empty() {
        out.push_str("no partitions: no worker is registered\n");
    }
    for partition in &status.partitions {
        let dropped: Vec<String> = partition
            .dropped
            .iter()
            .map(|(reason, count)| format!("{reason} {count}"))
            .collect();
        out.push_str(&format!(
            "partition model={} routing_group={}: block size {}, {} blocks held ({} distinct), {} events; dropped: {}\n",
            partition.model_name,
            partition.routing_group,
            partition.block_size,
            partition.blocks,
            partition.nodes,
            partition.events,
            dropped.join(", ")
        ));
    }
    for worker in &status.workers {
        out.push_str(&format!(
            "worker {} (model={} routing_group={}, block size {}): {}\n",
            worker["instance_id"],
            text(&worker["model_name"]),
            text(&worker["routing_group"]),
            worker["block_size"],
            text(&worker["status"]),
        ));
        for (rank, listener) in listeners(worker) {
            out.push_str(&rank_line(rank, listener, now));
        }
    }
    out
}

fn text(value: &Value) -> String {
    value
        .as_str()
        .map_or_else(|| value.to_string(), str::to_owned)
}

/// One rank's source: its state and for how long, where, why, and what it
/// brought.
fn rank_line(rank: &str, listener: &Value, now: f64) -> String {
    let detail = &listener["kvgate"];
    let mut line = format!("  rank {rank}: {}", state(listener));
    if let Some(since) = detail["since"].as_f64() {
        line.push_str(&format!(" for {:.0}s", (now - since).max(0.0)));
    }
    line.push_str(&format!(", {}", text(&listener["endpoint"])));
    if let Some(replay) = detail["replay_endpoint"].as_str() {
        line.push_str(&format!(" (replay {replay})"));
    }
    if let Some(reason) = detail["reason"].as_str() {
        line.push_str(&format!(": {reason}"));
    }
    let counted: Vec<String> = [
        ("payloads", "payloads"),
        ("bad_payloads", "bad"),
        ("publisher_restarts", "publisher restarts"),
    ]
    .into_iter()
    .filter_map(|(key, name)| detail[key].as_u64().map(|count| format!("{count} {name}")))
    .collect();
    if !counted.is_empty() {
        line.push_str(&format!("; {}", counted.join(", ")));
    }
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_not_connected_is_printed_with_its_age_and_reason_and_named_as_waiting() {
        let status: IndexStatus = serde_json::from_value(serde_json::json!({
            "partitions": [{
                "model_name": "m", "routing_group": "default", "block_size": 16,
                "blocks": 5, "nodes": 4, "events": 9,
                "dropped": {"unknown_parent": 1},
            }],
            "workers": [{
                "instance_id": 7, "model_name": "m", "routing_group": "default",
                "block_size": 16, "status": "pending",
                "listeners": {"0": {
                    "endpoint": "tcp://10.0.0.1:5557", "status": "pending",
                    "kvgate": {"state": "disconnected", "since": 100.0,
                               "reason": "the publisher closed the connection",
                               "payloads": 3, "bad_payloads": 0, "publisher_restarts": 1},
                }},
            }],
        }))
        .unwrap();
        let text = render(&status, UNIX_EPOCH + Duration::from_secs(130));
        assert!(
            text.contains(
                "block size 16, 5 blocks held (4 distinct), 9 events; dropped: unknown_parent 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("rank 0: disconnected for 30s, tcp://10.0.0.1:5557: the publisher closed the connection; 3 payloads, 0 bad, 1 publisher restarts"),
            "{text}"
        );
        assert_eq!(
            status.ranks_not_connected(),
            [("7".to_owned(), "0".to_owned(), "disconnected".to_owned())]
        );
    }
}
