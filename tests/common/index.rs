//! What the tests of the prefix index share: Dynamo's HTTP API spoken as
//! JSON over raw HTTP/1.0, vLLM-shaped stores, and publishers with a replay
//! endpoint.

use std::net::SocketAddr;

use bytes::Bytes;
use kvgate_sim::{EnginePublisher, PublisherOptions};
use serde_json::Value;

use super::{DEADLINE, Polling, http_exchange, removed_payload};

/// `/query`'s answer when rank 0 of worker 1 alone holds all `tokens`
/// tokens asked for.
pub fn held(tokens: usize) -> Value {
    serde_json::json!({
        "scores": {"1": {"0": tokens}},
        "frequencies": [],
        "instances": {"1": {"longest_matched": tokens, "gpu": tokens, "dp": {"0": tokens}, "cpu": tokens, "disk": tokens}},
    })
}

/// One HTTP/1.0 request of a JSON body: (status, body).
pub async fn request(address: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    http_exchange(address, method, path, Some(body), Some("application/json")).await
}

/// A JSON POST: (status, the answer as JSON, or as a string if it is not).
pub async fn post(address: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, body) = request(address, "POST", path, body.to_string().as_bytes()).await;
    (
        status,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    )
}

/// A GET: (status, the answer as JSON, or as a string if it is not).
pub async fn get(address: SocketAddr, path: &str) -> (u16, Value) {
    let (status, body) = request(address, "GET", path, b"").await;
    (
        status,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    )
}

/// One vLLM `BlockStored` event, published alone as `[ts, [event], rank]`.
#[derive(Clone, Copy, Debug)]
pub struct Stored<'a> {
    pub hashes: &'a [i64],
    pub parent: Option<i64>,
    pub tokens: &'a [u32],
    pub block_size: u32,
    pub medium: &'a str,
    pub rank: u32,
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
}

impl Stored<'_> {
    /// The payload (map form).
    pub fn payload(&self) -> Bytes {
        use rmp::encode::*;
        let mut out = Vec::new();
        write_array_len(&mut out, 3).unwrap();
        write_f64(&mut out, 1.0).unwrap();
        write_array_len(&mut out, 1).unwrap();
        let named = u32::from(self.lora_name.is_some()) + u32::from(self.cache_salt.is_some());
        write_map_len(&mut out, 7 + named).unwrap();
        write_str(&mut out, "type").unwrap();
        write_str(&mut out, "BlockStored").unwrap();
        write_str(&mut out, "block_hashes").unwrap();
        write_array_len(&mut out, self.hashes.len() as u32).unwrap();
        for &hash in self.hashes {
            write_sint(&mut out, hash).unwrap();
        }
        write_str(&mut out, "parent_block_hash").unwrap();
        match self.parent {
            Some(parent) => write_sint(&mut out, parent).map(|_| ()).unwrap(),
            None => write_nil(&mut out).unwrap(),
        }
        write_str(&mut out, "token_ids").unwrap();
        write_array_len(&mut out, self.tokens.len() as u32).unwrap();
        for &token in self.tokens {
            write_uint(&mut out, token.into()).unwrap();
        }
        write_str(&mut out, "block_size").unwrap();
        write_uint(&mut out, self.block_size.into()).unwrap();
        write_str(&mut out, "lora_id").unwrap();
        write_nil(&mut out).unwrap();
        write_str(&mut out, "medium").unwrap();
        write_str(&mut out, self.medium).unwrap();
        for (key, value) in [
            ("lora_name", self.lora_name),
            ("cache_salt", self.cache_salt),
        ] {
            if let Some(value) = value {
                write_str(&mut out, key).unwrap();
                write_str(&mut out, value).unwrap();
            }
        }
        write_uint(&mut out, self.rank.into()).unwrap();
        out.into()
    }
}

/// A vLLM `BlockStored` payload (map form) in `medium`, on `rank`.
pub fn stored_payload(
    hashes: &[i64],
    parent: Option<i64>,
    tokens: &[u32],
    block_size: u32,
    medium: &str,
    rank: u32,
) -> Bytes {
    Stored {
        hashes,
        parent,
        tokens,
        block_size,
        medium,
        rank,
        lora_name: None,
        cache_salt: None,
    }
    .payload()
}

/// A publisher on an ephemeral port, with a replay endpoint.
pub async fn publisher() -> EnginePublisher {
    let options = PublisherOptions {
        replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
        ..PublisherOptions::default()
    };
    EnginePublisher::bind("tcp://127.0.0.1:0", &options)
        .await
        .unwrap()
}

/// After worker 1's engine (rank 0, block size 2) restarted: it stores
/// blocks 31 and 32 (tokens 100..104), answered once they arrive, while the
/// blocks it held before (`old_query`) are answered for nobody.
pub async fn assert_a_restarted_engine_starts_empty(
    restarted: &mut EnginePublisher,
    address: SocketAddr,
    old_query: Value,
) {
    let other: Vec<u32> = (100..104).collect();
    restarted
        .publish(stored_payload(&[31, 32], None, &other, 2, "GPU", 0))
        .await
        .unwrap();
    let other_held = held(other.len());
    publish_until(
        &mut [restarted],
        address,
        "/query",
        serde_json::json!({"token_ids": other, "model_name": "m"}),
        &other_held,
    )
    .await;
    let (_, answer) = post(address, "/query", old_query).await;
    assert_eq!(
        answer["scores"],
        serde_json::json!({}),
        "the restarted engine's old blocks are gone"
    );
}

/// Publishes a harmless removal on every one of `publishers` until `path`
/// answers `query` with `expected` (ZMQ's late joiner may miss the first
/// messages; the replay endpoint fills the hole once a later message shows
/// it).
pub async fn publish_until(
    publishers: &mut [&mut EnginePublisher],
    address: SocketAddr,
    path: &str,
    query: Value,
    expected: &Value,
) {
    let mut polling = Polling::within(DEADLINE);
    loop {
        let (status, answer) = post(address, path, query.clone()).await;
        if status == 200 && &answer == expected {
            return;
        }
        for publisher in publishers.iter_mut() {
            publisher
                .publish(removed_payload(&[-12345], 0))
                .await
                .unwrap();
        }
        polling
            .again(format_args!(
                "{path} answered {status} {answer}, not {expected}"
            ))
            .await;
    }
}

/// Polls `/workers` until worker `id`'s rank 0 listener is in `state`.
pub async fn await_listener(address: SocketAddr, id: u64, state: &str) -> Value {
    await_listener_saying(address, id, state, "").await
}

/// Polls `/workers` until worker `id`'s rank 0 listener is in `state` for
/// a reason that contains `why`.
pub async fn await_listener_saying(address: SocketAddr, id: u64, state: &str, why: &str) -> Value {
    let mut polling = Polling::within(DEADLINE);
    loop {
        let (_, workers) = get(address, "/workers").await;
        let listener = workers
            .as_array()
            .into_iter()
            .flatten()
            .find(|worker| worker["instance_id"] == id)
            .map(|worker| worker["listeners"]["0"].clone())
            .unwrap_or_default();
        let reason = listener["kvgate"]["reason"].as_str().unwrap_or_default();
        if listener["kvgate"]["state"] == state && reason.contains(why) {
            return listener;
        }
        polling
            .again(format_args!(
                "worker {id}'s listener stayed {listener}, never {state} saying {why:?}"
            ))
            .await;
    }
}
