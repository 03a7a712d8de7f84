//! Engines that publish on `ipc://` (a Unix-domain socket on the same
//! host): `kvgate index` follows such a worker as it follows a `tcp://`
//! one, through restarts and bad peers, and `kvgate serve` reads such an
//! engine. Real zeromq publishers and replay ROUTERs bound on socket paths
//! under a directory of the test's own, the real binary, Dynamo's HTTP API
//! over raw sockets.

mod common;

use std::net::SocketAddr;
use std::path::Path;

use common::index::{
    await_listener, await_listener_saying, get, held, post, publish_until, stored_payload,
};
use common::socket_dir::SocketDir;
use common::{DEADLINE, IndexProcess, Polling};
use kvgate::proto::common::kv_cache_event::Data;
use kvgate_sim::{EnginePublisher, PublisherOptions};
use serde_json::json;

/// An engine rank publishing at `ipc://dir/rank0.sock`, its replay ROUTER at
/// `ipc://dir/replay0.sock`.
async fn ipc_publisher(dir: &SocketDir) -> EnginePublisher {
    let options = PublisherOptions {
        replay_endpoint: Some(dir.endpoint("replay0.sock")),
        ..PublisherOptions::default()
    };
    EnginePublisher::bind(&dir.endpoint("rank0.sock"), &options)
        .await
        .unwrap()
}

/// Waits until nothing is at `path`: a zeromq socket removes its file
/// once its listener has stopped, after the socket is dropped, and a new
/// one cannot bind the path before.
async fn await_removed(path: &Path) {
    let mut polling = Polling::within(DEADLINE);
    while path.exists() {
        polling
            .again(format_args!("{} was never removed", path.display()))
            .await;
    }
}

/// Publishes `store` (of `tokens`, on worker 1's rank 0) until `/query`
/// answers it held: with no replay endpoint, the first messages may go
/// before the subscription does; storing the same blocks again changes
/// nothing.
async fn store_until_held(
    publisher: &mut EnginePublisher,
    address: SocketAddr,
    store: bytes::Bytes,
    tokens: &[u32],
) {
    let query = json!({"token_ids": tokens, "model_name": "m"});
    let mut polling = Polling::within(DEADLINE);
    loop {
        publisher.publish(store.clone()).await.unwrap();
        let (_, answer) = post(address, "/query", query.clone()).await;
        if answer == held(tokens.len()) {
            return;
        }
        polling.again(format_args!("answered {answer}")).await;
    }
}

#[tokio::test]
async fn a_worker_publishing_on_ipc_is_answered_for_exactly_and_followed_through_its_restart() {
    let dir = SocketDir::new("follow");
    let index = IndexProcess::start(&[]);
    let mut publisher = ipc_publisher(&dir).await;
    // Published before the index joins: only the replay ROUTER, over its
    // own socket path, can bring it.
    let tokens: Vec<u32> = (0..6).collect();
    publisher
        .publish(stored_payload(&[11, 12, 13], None, &tokens, 2, "GPU", 0))
        .await
        .unwrap();
    let registration = json!({
        "instance_id": 1,
        "endpoint": dir.endpoint("rank0.sock"),
        "replay_endpoint": dir.endpoint("replay0.sock"),
        "model_name": "m",
        "block_size": 2,
    });
    let (status, answer) = post(index.address, "/register", registration).await;
    assert_eq!((status, answer), (201, json!({"status": "ok"})));
    let connected = await_listener(index.address, 1, "connected").await;
    assert_eq!(connected["status"], "active");
    assert_eq!(connected["endpoint"], dir.endpoint("rank0.sock"));
    let query = json!({"token_ids": tokens, "model_name": "m"});
    let (_, answer) = post(index.address, "/query", query.clone()).await;
    assert_eq!(answer, held(6), "primed from the ipc replay endpoint");

    // Live messages over the socket path, removals included.
    publisher
        .publish(common::removed_payload(&[13], 0))
        .await
        .unwrap();
    publish_until(
        &mut [&mut publisher],
        index.address,
        "/query",
        query.clone(),
        &held(4),
    )
    .await;

    // The engine goes away: its socket file with it. The listener says so.
    drop(publisher);
    await_removed(&dir.path("rank0.sock")).await;
    let gone = await_listener_saying(
        index.address,
        1,
        "disconnected",
        &format!("no socket at {}", dir.path("rank0.sock").display()),
    )
    .await;
    assert_eq!(gone["status"], "pending");

    // Restarted on the same path, its cache empty, it stores other blocks:
    // the old ones are gone, the new ones answered exactly.
    await_removed(&dir.path("replay0.sock")).await;
    let mut restarted = ipc_publisher(&dir).await;
    await_listener(index.address, 1, "connected").await;
    common::index::assert_a_restarted_engine_starts_empty(&mut restarted, index.address, query)
        .await;
}

#[tokio::test]
async fn an_ipc_worker_is_told_at_registration_or_in_workers_what_is_wrong_with_its_path() {
    let dir = SocketDir::new("paths");
    let index = IndexProcess::start(&[]);
    let register = |instance_id: u64, endpoint: &str| json!({"instance_id": instance_id, "endpoint": endpoint, "model_name": "m", "block_size": 2});

    // A path no socket address holds (107 bytes at most) is refused.
    let too_long = format!("ipc:///{}", "p".repeat(120));
    let (status, answer) = post(index.address, "/register", register(1, &too_long)).await;
    assert_eq!(status, 400, "{answer}");
    let error = answer["error"].as_str().unwrap();
    assert!(
        error.starts_with(&format!("invalid ZMQ endpoint `{too_long}`: "))
            && error.contains("is 121 bytes"),
        "{error}"
    );
    let mut replay_too_long = register(1, &dir.endpoint("rank0.sock"));
    replay_too_long["replay_endpoint"] = json!(too_long);
    let (status, answer) = post(index.address, "/register", replay_too_long).await;
    assert_eq!(status, 400, "{answer}");
    let (status, answer) = post(index.address, "/register", register(1, "ipc://@kv")).await;
    assert_eq!(status, 400, "{answer}");

    // inproc:// is registered, as Dynamo does, and fails saying why.
    assert_eq!(
        post(index.address, "/register", register(2, "inproc://kv"))
            .await
            .0,
        201
    );
    let failed = await_listener(index.address, 2, "failed").await;
    assert_eq!(failed["status"], "failed");
    assert!(
        failed["last_error"]
            .as_str()
            .unwrap()
            .contains("only threads of the engine's own process can reach"),
        "{failed}"
    );

    // Nothing at the path yet: registered, dialled, and said so. A replay
    // endpoint nobody outside the engine can reach leaves the rank
    // followed without gap fills, not failed.
    let path = dir.path("rank0.sock");
    let mut unreachable_replay = register(1, &dir.endpoint("rank0.sock"));
    unreachable_replay["replay_endpoint"] = json!("inproc://replay");
    assert_eq!(
        post(index.address, "/register", unreachable_replay).await.0,
        201
    );
    let waiting = await_listener_saying(
        index.address,
        1,
        "connecting",
        &format!("no socket at {}", path.display()),
    )
    .await;
    assert_eq!(waiting["status"], "pending");
    // A file that is not a socket: said so too, and still dialled.
    std::fs::write(&path, b"not a socket").unwrap();
    await_listener_saying(
        index.address,
        1,
        "connecting",
        "is a regular file, not a socket",
    )
    .await;

    // The engine replaces it with its socket: followed, answered exactly.
    std::fs::remove_file(&path).unwrap();
    let mut publisher =
        EnginePublisher::bind(&dir.endpoint("rank0.sock"), &PublisherOptions::default())
            .await
            .unwrap();
    let connected = await_listener(index.address, 1, "connected").await;
    assert!(connected["kvgate"]["reason"].is_null(), "{connected}");
    let tokens: Vec<u32> = (0..4).collect();
    let store = stored_payload(&[41, 42], None, &tokens, 2, "GPU", 0);
    store_until_held(&mut publisher, index.address, store, &tokens).await;
}

/// Waits until kvgate closes `stream`, reading whatever it sends.
async fn closed_by_kvgate(mut stream: tokio::net::UnixStream) {
    use tokio::io::AsyncReadExt as _;
    let mut sink = [0u8; 4096];
    let closed = tokio::time::timeout(DEADLINE, async {
        while let Ok(read) = stream.read(&mut sink).await
            && read > 0
        {}
    });
    closed.await.expect("kvgate closed the connection");
}

#[tokio::test]
async fn garbage_over_a_unix_socket_costs_the_connection_never_the_feed() {
    use tokio::io::AsyncWriteExt as _;
    let dir = SocketDir::new("garbage");
    let path = dir.path("rank0.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let index = IndexProcess::start(&[]);
    let registration = json!({
        "instance_id": 1, "endpoint": dir.endpoint("rank0.sock"), "model_name": "m", "block_size": 2,
    });
    assert_eq!(post(index.address, "/register", registration).await.0, 201);

    // Not ZMTP at all: a whole greeting's length of something else.
    let (mut stream, _) = tokio::time::timeout(DEADLINE, listener.accept())
        .await
        .expect("kvgate dials the path")
        .unwrap();
    let mut garbage = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
    garbage.resize(64, b'x');
    stream.write_all(&garbage).await.unwrap();
    closed_by_kvgate(stream).await;
    // A handshake, then a frame announced at 1 TiB.
    let (mut stream, _) = tokio::time::timeout(DEADLINE, listener.accept())
        .await
        .expect("kvgate dials the path again")
        .unwrap();
    common::zmtp::send_greeting(&mut stream).await;
    common::zmtp::send_ready(&mut stream, "PUB").await;
    common::zmtp::announce(&mut stream, common::zmtp::LONG, 1 << 40).await;
    closed_by_kvgate(stream).await;

    let mut polling = Polling::within(DEADLINE);
    loop {
        let (_, workers) = get(index.address, "/workers").await;
        let listener = &workers[0]["listeners"]["0"];
        if listener["kvgate"]["peers_dropped"] == 2 {
            assert_ne!(listener["status"], "failed", "{listener}");
            break;
        }
        polling.again(format_args!("not counted: {listener}")).await;
    }
    let (_, metrics) = get(index.address, "/metrics").await;
    let metrics = metrics.as_str().unwrap();
    assert!(
        metrics.contains("kvgate_index_zmq_peers_dropped_total{instance_id=\"1\"} 2"),
        "{metrics}"
    );

    // A peer that accepts and never says a word, holding the connection
    // open while the engine takes the path over: kvgate gives up on the
    // handshake (peer::HANDSHAKE_TIMEOUT) and dials again.
    let (_silent, _) = tokio::time::timeout(DEADLINE, listener.accept())
        .await
        .expect("kvgate dials the path once more")
        .unwrap();
    drop(listener);
    std::fs::remove_file(&path).unwrap();

    // The engine binds the path: followed, answered exactly.
    let mut publisher =
        EnginePublisher::bind(&dir.endpoint("rank0.sock"), &PublisherOptions::default())
            .await
            .unwrap();
    await_listener(index.address, 1, "connected").await;
    let tokens: Vec<u32> = (0..2).collect();
    let store = stored_payload(&[51], None, &tokens, 2, "GPU", 0);
    store_until_held(&mut publisher, index.address, store, &tokens).await;
}

#[tokio::test]
async fn workers_named_by_flags_may_publish_on_ipc_and_a_path_too_long_fails_the_start_naming_the_flag()
 {
    let dir = SocketDir::new("flags");
    let mut publisher =
        EnginePublisher::bind(&dir.endpoint("rank1.sock"), &PublisherOptions::default())
            .await
            .unwrap();
    let workers = format!("1:1={}", dir.endpoint("rank1.sock"));
    let index = IndexProcess::start(&[
        "--workers",
        &workers,
        "--model-name",
        "m",
        "--block-size",
        "2",
    ]);
    let (_, listed) = get(index.address, "/workers").await;
    assert_eq!(listed[0]["endpoints"]["1"], dir.endpoint("rank1.sock"));
    let tokens: Vec<u32> = (0..2).collect();
    let query = json!({"token_ids": tokens, "model_name": "m"});
    let expected = json!({
        "scores": {"1": {"1": 2}},
        "frequencies": [],
        "instances": {"1": {"longest_matched": 2, "gpu": 2, "dp": {"1": 2}, "cpu": 2, "disk": 2}},
    });
    let store = stored_payload(&[61], None, &tokens, 2, "GPU", 1);
    let mut polling = Polling::within(DEADLINE);
    loop {
        publisher.publish(store.clone()).await.unwrap();
        let (_, answer) = post(index.address, "/query", query.clone()).await;
        if answer == expected {
            break;
        }
        polling.again(format_args!("answered {answer}")).await;
    }

    let too_long = format!("1=ipc:///{}", "p".repeat(120));
    let (code, stderr) = common::exit_of(&[
        "index",
        "--listen",
        "127.0.0.1:0",
        "--model-name",
        "m",
        "--block-size",
        "2",
        "--workers",
        &too_long,
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--workers") && stderr.contains("is 121 bytes"),
        "{stderr}"
    );
}

const SERVICE: &str = "kvgate.v1.KvGate";

#[tokio::test(flavor = "multi_thread")]
async fn kvgate_serve_follows_an_engine_publishing_on_ipc_primed_from_its_ipc_replay_endpoint() {
    let dir = SocketDir::new("serve");
    let mut publisher = ipc_publisher(&dir).await;
    // Stored before kvgate starts: only the replay ROUTER can bring it.
    let tokens: Vec<u32> = (0..2).collect();
    publisher
        .publish(stored_payload(&[777], None, &tokens, 2, "GPU", 0))
        .await
        .unwrap();
    let gateway = common::Gateway::start(&[
        "--zmq-endpoint",
        &dir.endpoint("rank0.sock"),
        "--zmq-replay-endpoint",
        &dir.endpoint("replay0.sock"),
    ]);
    let mut stream = common::subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let batch = tokio::time::timeout_at(deadline, common::next_batch(&mut stream))
            .await
            .expect("the block stored before kvgate started, in the snapshot or primed");
        let stores = batch.events.iter().filter_map(|event| match &event.data {
            Some(Data::Stored(stored)) => Some(stored),
            _ => None,
        });
        if stores
            .flat_map(|stored| &stored.blocks)
            .any(|block| block.block_hash == 777)
        {
            break;
        }
    }
    // And live, over the socket path.
    common::sync_streams(&mut publisher, 0, std::slice::from_mut(&mut stream)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kvgate_serve_binds_an_ipc_endpoint_for_an_engine_that_connects_out() {
    let dir = SocketDir::new("bind");
    let endpoint = dir.endpoint("kvgate.sock");
    let mut gateway = common::Gateway::start(&["--zmq-endpoint", &endpoint, "--zmq-bind"]);
    assert!(dir.path("kvgate.sock").exists(), "bound before serving");
    let mut publisher = EnginePublisher::connect(&endpoint, &PublisherOptions::default())
        .await
        .unwrap();
    let mut stream = common::subscribe(gateway.channel().await, SERVICE, 0)
        .await
        .unwrap();
    common::sync_streams(&mut publisher, 0, std::slice::from_mut(&mut stream)).await;
    assert!(gateway.terminate().success());
    await_removed(&dir.path("kvgate.sock")).await;
}

/// `kvgate serve <args>` fails at start with exit status `code`, naming
/// `flag` and saying `why`.
fn serve_refused(code: i32, args: &[&str], flag: &str, why: &str) {
    let mut command = vec!["serve", "--listen", "127.0.0.1:0"];
    command.extend_from_slice(args);
    let (exit, stderr) = common::exit_of(&command);
    assert_eq!(exit, Some(code), "{args:?}: {stderr}");
    assert!(
        stderr.contains(flag) && stderr.contains(why),
        "{args:?}: {stderr}"
    );
}

#[test]
fn a_file_left_at_an_ipc_path_kvgate_is_to_bind_fails_the_start_and_stays() {
    let dir = SocketDir::new("stale");
    std::fs::write(dir.path("kv.sock"), b"left here").unwrap();
    let endpoint = dir.endpoint("kv.sock");
    serve_refused(
        1,
        &["--zmq-endpoint", &endpoint, "--zmq-bind"],
        &format!("--zmq-endpoint {endpoint} --zmq-bind: cannot bind {endpoint}"),
        "Address already in use",
    );
    assert_eq!(std::fs::read(dir.path("kv.sock")).unwrap(), b"left here");
}

#[test]
fn an_ipc_endpoint_given_once_for_several_ranks_or_too_long_fails_the_start_naming_the_flag() {
    serve_refused(
        2,
        &["--zmq-endpoint", "ipc:///tmp/kv.sock", "--dp-size", "2"],
        "--zmq-endpoint ipc:///tmp/kv.sock is given once but --dp-size is 2",
        "give one endpoint per rank",
    );
    let too_long = format!("ipc:///{}", "p".repeat(120));
    serve_refused(
        2,
        &["--zmq-endpoint", &too_long],
        "--zmq-endpoint",
        "is 121 bytes",
    );
    serve_refused(
        2,
        &[
            "--zmq-endpoint",
            "tcp://127.0.0.1:5557",
            "--zmq-replay-endpoint",
            "inproc://kv",
        ],
        "--zmq-replay-endpoint",
        "only threads of the engine's own process can reach",
    );
}
