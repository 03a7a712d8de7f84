//! The history's memory follows its flags, measured on the real binary: its
//! resident bytes stay within the formula of docs/guarantees.md, and flags that would
//! make it allocate more than it ever fills are refused at start.

mod common;

use std::time::Duration;

use common::{DEADLINE, Gateway, fence_payload, http_get};
use kvgate_sim::{EnginePublisher, PublisherOptions, SimEvent, encode_batch};

/// A metric's value on the gateway's `/metrics` (0 for a labelled series
/// not counted yet).
async fn metric(gateway: &Gateway, name: &str) -> f64 {
    let (status, body) = http_get(gateway.admin.expect("admin port"), "/metrics").await;
    assert_eq!(status, 200);
    body.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .map_or(0.0, |value| value.parse().unwrap())
}

/// Stores kvgate has converted (and so batched and held).
const STORES: &str = "kvgate_engine_events_total{rank=\"0\",type=\"stored\"}";

/// Waits (bounded) until kvgate has batched at least `stores` stores.
async fn wait_for_stores(gateway: &Gateway, stores: u64) {
    let admin = gateway.admin.expect("admin port");
    let wanted = format!(">= {stores}");
    common::await_metric_where(admin, STORES, &wanted, |now| now >= stores as f64).await;
}

fn resident_bytes(pid: u32) -> u64 {
    common::live_rss_kib(pid) * 1024
}

/// One engine message that kvgate turns into one ~100 KB batch: 96 blocks
/// of 1024 one-byte tokens, stored and removed again (so the live state
/// stays empty and only the history grows).
fn hundred_kb_message(n: u64) -> Vec<u8> {
    let hashes: Vec<u64> = (0..96).map(|i| (n << 8) + i + 1).collect();
    let events = [
        SimEvent::Stored {
            hashes: hashes.clone(),
            parent: None,
            tokens: (0..96 * 1024).map(|i| (i % 100) as u32).collect(),
            block_size: 1024,
        },
        SimEvent::Removed { hashes },
    ];
    let mut payload = Vec::new();
    encode_batch(1.0, &events, Some(0), &mut payload);
    payload
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_history_of_100_kb_batches_stays_resident_within_its_formula() {
    const HISTORY_BYTES: u64 = 16 << 20;
    const MESSAGES: u64 = 400;
    const STEP: u64 = 50;
    let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .expect("publisher binds");
    let history_bytes = HISTORY_BYTES.to_string();
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--metrics-listen",
        "127.0.0.1:0",
        "--max-batch-bytes",
        "102400",
        "--history-bytes",
        &history_bytes,
    ]);
    // Past ZMQ's slow joiner, with every buffer of the path warmed by a
    // first 100 KB batch.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut fence = 0;
    while metric(&gateway, "kvgate_batches_out_total").await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "kvgate never forwarded a message"
        );
        fence += 1;
        publisher.publish(fence_payload(fence, 0)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    publisher
        .publish(hundred_kb_message(0).into())
        .await
        .unwrap();
    wait_for_stores(&gateway, 1).await;
    let before = resident_bytes(gateway.pid());

    for step in 0..MESSAGES / STEP {
        for n in 0..STEP {
            let payload = hundred_kb_message(1 + step * STEP + n);
            publisher.publish(payload.into()).await.unwrap();
        }
        wait_for_stores(&gateway, 1 + (step + 1) * STEP).await;
    }
    let held = metric(&gateway, "kvgate_history_bytes").await as u64;
    let after = resident_bytes(gateway.pid());
    let grown = after.saturating_sub(before);
    eprintln!(
        "history holds {held} bytes of {HISTORY_BYTES}; RSS {before} -> {after} (+{grown}, {:.2}x --history-bytes)",
        grown as f64 / HISTORY_BYTES as f64
    );
    assert!(
        held > HISTORY_BYTES * 9 / 10,
        "the history is full ({held} bytes)"
    );
    // The formula: --history-bytes, plus 24 bytes of slots per batch held
    // (a few KB here); the margin is the allocator's and the runtime's.
    assert!(
        grown <= HISTORY_BYTES * 5 / 4 + (8 << 20),
        "RSS grew by {grown} bytes for a {HISTORY_BYTES}-byte history"
    );
}

/// `kvgate serve <args>` must fail at start with a message naming `flag`.
fn refused_at_start(args: &[&str], flag: &str) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--demo"])
        .args(args)
        .output()
        .expect("kvgate runs");
    assert!(!output.status.success(), "{args:?} was accepted");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(flag), "{args:?}: {stderr}");
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("serving gRPC"),
        "{args:?} bound the port first"
    );
}

#[test]
fn history_limits_beyond_their_range_are_refused_at_start_naming_the_flag() {
    refused_at_start(&["--history-batches", "4000000000"], "--history-batches");
    refused_at_start(&["--history-batches", "10000001"], "--history-batches");
    refused_at_start(&["--history-batches", "0"], "--history-batches");
    refused_at_start(&["--history-bytes", "100"], "--history-bytes");
    refused_at_start(&["--history-bytes", "1000000000000000"], "--history-bytes");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_largest_history_batches_allocates_no_slots_up_front_and_exits_0_on_sigterm() {
    let mut gateway = Gateway::start(&[
        "--demo",
        "--history-batches",
        "10000000",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let resident = resident_bytes(gateway.pid());
    assert!(
        resident < 64 << 20,
        "{resident} bytes resident with no batch held"
    );
    let exit = gateway.terminate();
    assert!(exit.success(), "kvgate exited with {exit}");
}
