//! `kvgate index` end to end: the real binary, real ZMQ publishers on
//! loopback, and Dynamo's HTTP API spoken over raw sockets.

mod common;

use std::net::SocketAddr;

use bytes::Bytes;
use common::index::{self, await_listener, get, post, publisher, request, stored_payload};
use common::{DEADLINE, IndexProcess, Polling};
use kvgate_sim::{EnginePublisher, PublisherOptions};
use serde_json::{Value, json};

/// Publishes until `/query` answers `expected` (see `common::index`).
async fn publish_until(
    publisher: &mut EnginePublisher,
    address: SocketAddr,
    query: Value,
    expected: &Value,
) {
    index::publish_until(&mut [publisher], address, "/query", query, expected).await;
}

fn register(instance_id: u64, publisher: &EnginePublisher, block_size: u32) -> Value {
    json!({
        "instance_id": instance_id,
        "endpoint": publisher.endpoint(),
        "replay_endpoint": publisher.replay_endpoint(),
        "model_name": "m",
        "block_size": block_size,
    })
}

#[tokio::test]
async fn a_registered_worker_is_answered_for_with_dynamos_scores_and_tiers() {
    let index = IndexProcess::start(&[]);
    let mut publisher = publisher().await;
    let (status, answer) = post(index.address, "/register", register(1, &publisher, 2)).await;
    assert_eq!((status, answer), (201, json!({"status": "ok"})));

    let tokens: Vec<u32> = (0..10).collect();
    publisher
        .publish(stored_payload(
            &[11, 12, 13],
            None,
            &tokens[..6],
            2,
            "GPU",
            0,
        ))
        .await
        .unwrap();
    publisher
        .publish(stored_payload(&[14], Some(13), &tokens[6..8], 2, "CPU", 0))
        .await
        .unwrap();
    let query = json!({"token_ids": tokens, "model_name": "m"});
    let expected = json!({
        "scores": {"1": {"0": 6}},
        "frequencies": [],
        "instances": {"1": {"longest_matched": 8, "gpu": 6, "dp": {"0": 6}, "cpu": 8, "disk": 8}},
    });
    publish_until(&mut publisher, index.address, query, &expected).await;

    let (status, workers) = get(index.address, "/workers").await;
    assert_eq!(status, 200);
    assert_eq!(workers[0]["instance_id"], 1);
    assert_eq!(workers[0]["status"], "active");
    assert_eq!(workers[0]["endpoints"]["0"], publisher.endpoint());
    assert_eq!(workers[0]["listeners"]["0"]["status"], "active");

    // Removed from the device: the host copy no longer continues anything.
    publisher
        .publish(common::removed_payload(&[12], 0))
        .await
        .unwrap();
    let expected = json!({
        "scores": {"1": {"0": 2}},
        "frequencies": [],
        "instances": {"1": {"longest_matched": 2, "gpu": 2, "dp": {"0": 2}, "cpu": 2, "disk": 2}},
    });
    publish_until(
        &mut publisher,
        index.address,
        json!({"token_ids": tokens, "model_name": "m"}),
        &expected,
    )
    .await;

    let (status, _) = post(
        index.address,
        "/unregister",
        json!({"instance_id": 1, "model_name": "m"}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, answer) = post(
        index.address,
        "/query",
        json!({"token_ids": tokens, "model_name": "m"}),
    )
    .await;
    assert_eq!(
        status, 404,
        "the partition goes with its last worker: {answer}"
    );
}

#[tokio::test]
async fn registrations_and_queries_get_dynamos_status_codes() {
    let index = IndexProcess::start(&["--index-max-worker-ranks", "2"]);
    let publisher = publisher().await;
    let address = index.address;
    assert_eq!(
        post(address, "/register", register(1, &publisher, 16))
            .await
            .0,
        201
    );
    let (status, answer) = post(address, "/register", register(1, &publisher, 16)).await;
    assert_eq!(
        (status, &answer["error"]),
        (409, &json!("instance 1 dp_rank 0 already registered"))
    );
    let (status, answer) = post(address, "/register", register(2, &publisher, 32)).await;
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .starts_with("block_size mismatch")
    );
    let mut rank_one = register(1, &publisher, 16);
    rank_one["dp_rank"] = json!(1);
    assert_eq!(post(address, "/register", rank_one).await.0, 201);
    let (status, answer) = post(address, "/register", register(3, &publisher, 16)).await;
    assert_eq!(status, 503);
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("--index-max-worker-ranks"),
        "{answer}"
    );

    let (status, _) = request(address, "POST", "/register", b"{not json").await;
    assert_eq!(status, 400);
    let (status, _) = post(
        address,
        "/register",
        json!({"instance_id": 4, "model_name": "m"}),
    )
    .await;
    assert_eq!(status, 422);
    let (status, _) = post(address, "/register", json!({"instance_id": "four", "endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": 16})).await;
    assert_eq!(status, 422);
    let (status, answer) = post(
        address,
        "/register",
        json!({"instance_id": 4, "endpoint": "http://127.0.0.1:1", "model_name": "m", "block_size": 16}),
    )
    .await;
    assert_eq!(
        (status, &answer["error"]),
        (
            400,
            &json!("invalid ZMQ endpoint `http://127.0.0.1:1`: unsupported scheme `http`")
        )
    );

    let (status, answer) = post(
        address,
        "/query",
        json!({"token_ids": [1, 2], "model_name": "other"}),
    )
    .await;
    assert_eq!(
        (status, &answer["error"]),
        (
            404,
            &json!("no indexer for model=other routing_group=default")
        )
    );
    let (status, answer) = post(
        address,
        "/query_by_hash",
        json!({"block_hashes": [1], "model_name": "m", "cache_salt": "s"}),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    let (status, answer) = post(
        address,
        "/query_by_hash",
        json!({"block_hashes": [1], "model_name": "m"}),
    )
    .await;
    assert_eq!(
        (status, answer),
        (
            200,
            json!({"scores": {}, "frequencies": [], "instances": {}})
        )
    );
    let (status, _) = post(
        address,
        "/unregister",
        json!({"instance_id": 9, "model_name": "m"}),
    )
    .await;
    assert_eq!(status, 404);
    let (status, _) = post(
        address,
        "/unregister",
        json!({"instance_id": 1, "model_name": "m", "routing_group": "default", "dp_rank": 5}),
    )
    .await;
    assert_eq!(status, 404);

    let oversized = format!(
        "{{\"token_ids\":[{}0],\"model_name\":\"m\"}}",
        "0,".repeat(4 * 1024 * 1024 + 1)
    );
    let (status, _) = request(address, "POST", "/query", oversized.as_bytes()).await;
    assert_eq!(status, 413);
    // A million tokens fit: answered, not refused.
    let million = format!(
        "{{\"token_ids\":[{}1],\"model_name\":\"m\"}}",
        "1,".repeat(999_999)
    );
    let (status, body) = request(address, "POST", "/query", million.as_bytes()).await;
    assert_eq!(
        (status, body.as_str()),
        (200, r#"{"scores":{},"frequencies":[],"instances":{}}"#)
    );
    assert_eq!(get(address, "/health").await.0, 200);
    let (status, metrics) = request(address, "GET", "/metrics", b"").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("kvgate_index_worker_ranks{status="),
        "{metrics}"
    );
}

#[tokio::test]
async fn workers_tell_when_a_publisher_went_away_and_a_restarted_engine_starts_empty() {
    let index = IndexProcess::start(&[]);
    let mut publisher = publisher().await;
    let endpoint = publisher.endpoint().to_owned();
    let replay = publisher.replay_endpoint().unwrap().to_owned();
    assert_eq!(
        post(index.address, "/register", register(1, &publisher, 2))
            .await
            .0,
        201
    );
    let before = await_listener(index.address, 1, "connected").await;
    assert_eq!(before["status"], "active");

    let tokens: Vec<u32> = (0..4).collect();
    publisher
        .publish(stored_payload(&[21, 22], None, &tokens, 2, "GPU", 0))
        .await
        .unwrap();
    let query = json!({"token_ids": tokens, "model_name": "m"});
    let held = index::held(4);
    publish_until(&mut publisher, index.address, query.clone(), &held).await;

    // The engine goes away: the listener says so, and since when.
    drop(publisher);
    let gone = await_listener(index.address, 1, "disconnected").await;
    assert_eq!(gone["status"], "pending");
    assert!(
        gone["kvgate"]["since"].as_f64().unwrap() >= before["kvgate"]["since"].as_f64().unwrap()
    );
    assert!(gone["kvgate"]["reason"].as_str().is_some(), "{gone}");

    // It comes back restarted (its counter from 0, its cache empty) and
    // stores other blocks: the old ones are gone, the new ones answered.
    let options = PublisherOptions {
        replay_endpoint: Some(replay),
        ..PublisherOptions::default()
    };
    let mut restarted = EnginePublisher::bind(&endpoint, &options).await.unwrap();
    await_listener(index.address, 1, "connected").await;
    index::assert_a_restarted_engine_starts_empty(&mut restarted, index.address, query).await;
}

#[tokio::test]
async fn workers_named_by_flags_are_followed_and_garbage_from_them_is_counted_not_fatal() {
    let mut publisher = publisher().await;
    let workers = format!("7:1={}", publisher.endpoint());
    let index = IndexProcess::start(&[
        "--workers",
        &workers,
        "--model-name",
        "m",
        "--routing-group",
        "g",
        "--block-size",
        "2",
    ]);
    let (status, workers) = get(index.address, "/workers?routing_group=g").await;
    assert_eq!(status, 200);
    assert_eq!(workers[0]["instance_id"], 7);
    assert_eq!(workers[0]["block_size"], 2);
    assert_eq!(workers[0]["endpoints"]["1"], publisher.endpoint());
    await_rank_one_connected(index.address).await;

    let tokens: Vec<u32> = (0..2).collect();
    // The payload names no rank: the registered rank 1 holds it.
    let mut stored = stored_payload(&[5], None, &tokens, 2, "GPU", 1).to_vec();
    *stored.last_mut().unwrap() = 0xc0;
    let query = json!({"token_ids": tokens, "model_name": "m", "routing_group": "g"});
    let expected = json!({
        "scores": {"7": {"1": 2}},
        "frequencies": [],
        "instances": {"7": {"longest_matched": 2, "gpu": 2, "dp": {"1": 2}, "cpu": 2, "disk": 2}},
    });
    // Published until it arrives (no replay endpoint here: the first
    // messages may go before the subscription does).
    let mut polling = Polling::within(DEADLINE);
    loop {
        publisher
            .publish(Bytes::from(stored.clone()))
            .await
            .unwrap();
        let (_, answer) = post(index.address, "/query", query.clone()).await;
        if answer == expected {
            break;
        }
        polling.again(format_args!("answered {answer}")).await;
    }
    // Not msgpack, then a batch that is not [ts, events, rank]: counted, and
    // the rank goes on.
    publisher
        .publish(Bytes::from_static(b"\xc1garbage"))
        .await
        .unwrap();
    publisher
        .publish(Bytes::from_static(b"\x93\xa1x\x90\x00"))
        .await
        .unwrap();
    let mut polling = Polling::within(DEADLINE);
    loop {
        let (_, workers) = get(index.address, "/workers").await;
        let listener = &workers[0]["listeners"]["1"];
        if listener["kvgate"]["bad_payloads"] == 2 {
            assert_eq!(listener["status"], "active");
            break;
        }
        polling.again(format_args!("not counted: {listener}")).await;
    }
    let (_, answer) = post(index.address, "/query", query).await;
    assert_eq!(answer, expected);
}

async fn await_rank_one_connected(address: SocketAddr) {
    let mut polling = Polling::within(DEADLINE);
    loop {
        let (_, workers) = get(address, "/workers").await;
        if workers[0]["listeners"]["1"]["kvgate"]["state"] == "connected" {
            return;
        }
        polling
            .again(format_args!("never connected: {workers}"))
            .await;
    }
}

#[tokio::test]
async fn a_worker_priming_from_a_slow_replay_endpoint_is_reported_catching_up_then_connected() {
    use zeromq::Socket as _;
    // A replay ROUTER that takes requests and never answers: priming waits
    // out the replay timeout.
    let mut silent_replay = zeromq::RouterSocket::new();
    let replay = silent_replay
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let index = IndexProcess::start(&["--zmq-replay-timeout-ms", "3000"]);
    let publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let mut registration = register(1, &publisher, 2);
    registration["replay_endpoint"] = json!(replay);
    assert_eq!(post(index.address, "/register", registration).await.0, 201);
    let catching_up = await_listener(index.address, 1, "catching_up").await;
    assert_eq!(catching_up["status"], "active", "Dynamo's status of it");
    let connected = await_listener(index.address, 1, "connected").await;
    assert!(
        connected["kvgate"]["since"].as_f64() > catching_up["kvgate"]["since"].as_f64(),
        "{catching_up} then {connected}"
    );
    drop(silent_replay);
}

/// `kvgate status --index URL [--json]`, run to its end: (exit code, stdout, stderr).
fn status_of(address: SocketAddr, json: bool) -> (i32, String, String) {
    let url = format!("http://{address}");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"));
    command.args(["status", "--index", &url]);
    if json {
        command.arg("--json");
    }
    let child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let output = common::output_within_deadline(child);
    (
        output.status.code().unwrap(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn status_shows_partitions_and_each_ranks_source_and_fails_while_one_is_not_connected() {
    let index = IndexProcess::start(&[]);
    let address = index.address;
    let mut publisher = publisher().await;
    assert_eq!(
        post(address, "/register", register(1, &publisher, 2))
            .await
            .0,
        201
    );
    // Rank 1's publisher is not there: the rank stays connecting.
    let nobody = format!("tcp://127.0.0.1:{}", common::free_ports(1));
    let mut absent = register(1, &publisher, 2);
    absent["dp_rank"] = json!(1);
    absent["endpoint"] = json!(nobody);
    absent.as_object_mut().unwrap().remove("replay_endpoint");
    assert_eq!(post(address, "/register", absent).await.0, 201);

    let tokens: Vec<u32> = (0..4).collect();
    publisher
        .publish(stored_payload(&[41, 42], None, &tokens, 2, "GPU", 0))
        .await
        .unwrap();
    // A store of blocks of 3 tokens: set aside, and counted.
    publisher
        .publish(stored_payload(&[43], Some(42), &[7, 8, 9], 3, "GPU", 0))
        .await
        .unwrap();
    let held = index::held(4);
    publish_until(
        &mut publisher,
        address,
        json!({"token_ids": tokens, "model_name": "m"}),
        &held,
    )
    .await;
    await_listener(address, 1, "connected").await;

    let (code, text, stderr) = status_of(address, false);
    assert_eq!(code, 1, "a rank is not connected: {text}{stderr}");
    assert!(stderr.contains("worker 1 rank 1 is connecting"), "{stderr}");
    assert!(
        text.contains(
            "partition model=m routing_group=default: block size 2, 2 blocks held (2 distinct)"
        ),
        "{text}"
    );
    assert!(text.contains("block_size_mismatch 1"), "{text}");
    assert!(
        text.contains("worker 1 (model=m routing_group=default, block size 2)"),
        "{text}"
    );
    assert!(
        text.contains("  rank 0: connected for ") && text.contains(publisher.endpoint()),
        "{text}"
    );
    assert!(text.contains("  rank 1: connecting for "), "{text}");
    assert!(text.contains(&nobody), "{text}");

    let (_, json_text, _) = status_of(address, true);
    let status: Value = serde_json::from_str(&json_text).unwrap();
    assert_eq!(status["partitions"][0]["blocks"], 2);
    assert_eq!(status["partitions"][0]["dropped"]["block_size_mismatch"], 1);
    assert_eq!(
        status["workers"][0]["listeners"]["0"]["kvgate"]["state"],
        "connected"
    );
    assert_eq!(
        status["workers"][0]["listeners"]["1"]["kvgate"]["state"],
        "connecting"
    );

    // Without the absent rank, every source is connected: exit code 0.
    let (code, _) = post(
        address,
        "/unregister",
        json!({"instance_id": 1, "model_name": "m", "routing_group": "default", "dp_rank": 1}),
    )
    .await;
    assert_eq!(code, 200);
    let (code, text, stderr) = status_of(address, false);
    assert_eq!(code, 0, "{text}{stderr}");
}

/// `(thread name, nice)` of every thread of process `pid`, from `/proc`.
fn thread_priorities(pid: u32) -> Vec<(String, i64)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| {
            let task = task.ok()?.path();
            let name = std::fs::read_to_string(task.join("comm")).ok()?;
            let stat = std::fs::read_to_string(task.join("stat")).ok()?;
            // Past the name in parentheses, nice is the 17th field.
            let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
            Some((name.trim().to_owned(), fields.get(16)?.parse().ok()?))
        })
        .collect()
}

#[tokio::test]
async fn feeds_and_the_writer_run_on_a_thread_of_their_own_below_the_queries_priority() {
    let index = IndexProcess::start(&[]);
    let threads = thread_priorities(index.pid());
    let ingest: Vec<i64> = threads
        .iter()
        .filter(|(name, _)| name == "kvgate-ingest")
        .map(|&(_, nice)| nice)
        .collect();
    assert_eq!(ingest, [10], "{threads:?}");
    assert!(
        threads
            .iter()
            .any(|(name, nice)| name.starts_with("tokio-rt") && *nice == 0),
        "{threads:?}"
    );
}
