//! Engines that publish on `ipc://` (a Unix-domain socket on the same
//! host): `kvgate index` follows such a worker as it follows a `tcp://`
//! one, through restarts and bad peers, and `kvgate serve` reads such an
//! engine. Real zeromq publishers and replay ROUTERs bound on socket paths
//! under a directory of the test's own, the real binary, Dynamo's HTTP API
//! over raw sockets.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use common::index::{get, post, publish_until, stored_payload};
use common::{DEADLINE, IndexProcess, Polling};
use kvgate_sim::{EnginePublisher, PublisherOptions};
use serde_json::{Value, json};

/// A directory for one test's socket files, removed with what is in it.
struct SocketDir(PathBuf);

impl SocketDir {
    fn new(test: &str) -> Self {
        // Short: a socket path must fit in 107 bytes.
        let dir = std::env::temp_dir().join(format!("kvg-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        SocketDir(dir)
    }

    /// `ipc://` at `name` in the directory.
    fn endpoint(&self, name: &str) -> String {
        format!("ipc://{}", self.0.join(name).display())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

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

/// Polls `/workers` until worker `id`'s rank 0 listener is in `state`.
async fn await_listener(address: SocketAddr, id: u64, state: &str) -> Value {
    await_listener_saying(address, id, state, "").await
}

/// Polls `/workers` until worker `id`'s rank 0 listener is in `state` for
/// a reason that contains `why`.
async fn await_listener_saying(address: SocketAddr, id: u64, state: &str, why: &str) -> Value {
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

fn held(tokens: usize) -> Value {
    json!({
        "scores": {"1": {"0": tokens}},
        "frequencies": [],
        "instances": {"1": {"longest_matched": tokens, "gpu": tokens, "dp": {"0": tokens}, "cpu": tokens, "disk": tokens}},
    })
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
    let other: Vec<u32> = (100..104).collect();
    restarted
        .publish(stored_payload(&[31, 32], None, &other, 2, "GPU", 0))
        .await
        .unwrap();
    publish_until(
        &mut [&mut restarted],
        index.address,
        "/query",
        json!({"token_ids": other, "model_name": "m"}),
        &held(4),
    )
    .await;
    let (_, answer) = post(index.address, "/query", query).await;
    assert_eq!(
        answer["scores"],
        json!({}),
        "the restarted engine's old blocks are gone"
    );
}
