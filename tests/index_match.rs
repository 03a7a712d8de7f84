//! `kvgate.v1.KvIndex/Match` on `kvgate index`'s port: the real binary, real
//! ZMQ publishers, a real tonic client over HTTP/2 on the same port as
//! Dynamo's HTTP API, and reflection.

mod common;

use std::net::SocketAddr;

use common::index::{Stored, get, post, publish_until, publisher};
use common::{DEADLINE, IndexProcess, Polling};
use kvgate::index::block_hash::HashSeed;
use kvgate::proto::kvgate::v1::kv_index_client::KvIndexClient;
use kvgate::proto::kvgate::v1::match_request::Query;
use kvgate::proto::kvgate::v1::{BlockHashes, MatchRequest, MatchResponse, RankMatch, TokenIds};
use kvgate_sim::EnginePublisher;
use serde_json::{Value, json};
use tonic::Code;
use tonic::transport::Channel;

async fn channel(address: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect_timeout(DEADLINE)
        .connect()
        .await
        .expect("connect to kvgate index's port over HTTP/2")
}

fn by_tokens(tokens: &[u32], lora_name: &str, cache_salt: &str) -> MatchRequest {
    MatchRequest {
        query: Some(Query::TokenIds(TokenIds {
            ids: tokens.to_vec(),
        })),
        model_name: "m".into(),
        lora_name: lora_name.into(),
        cache_salt: cache_salt.into(),
        ..Default::default()
    }
}

fn by_hashes(hashes: &[i64]) -> MatchRequest {
    MatchRequest {
        query: Some(Query::BlockHashes(BlockHashes {
            hashes: hashes.to_vec(),
        })),
        model_name: "m".into(),
        ..Default::default()
    }
}

/// `request`'s answer (the call must succeed).
async fn matched(client: &mut KvIndexClient<Channel>, request: MatchRequest) -> MatchResponse {
    client.r#match(request).await.unwrap().into_inner()
}

/// Dynamo's local hashes of `tokens` in blocks of 2, as `/query_by_hash` takes them.
fn local_hashes(tokens: &[u32], lora_name: Option<&str>, cache_salt: Option<&str>) -> Vec<i64> {
    HashSeed::new(lora_name, cache_salt)
        .blocks(tokens, 2)
        .into_iter()
        .map(|hash| hash as i64)
        .collect()
}

/// A `Match` answer in `/query`'s JSON terms: what both must agree on.
fn as_query_answer(answer: &MatchResponse) -> Value {
    let mut scores = serde_json::Map::new();
    let mut instances = serde_json::Map::new();
    for worker in &answer.workers {
        let ranks = |device_only: bool| -> serde_json::Map<String, Value> {
            worker
                .ranks
                .iter()
                .filter(|rank| !device_only || rank.device_blocks > 0)
                .map(|rank| (rank.dp_rank.to_string(), json!(rank.device_tokens)))
                .collect()
        };
        if !ranks(true).is_empty() {
            scores.insert(worker.worker_id.to_string(), Value::Object(ranks(true)));
        }
        instances.insert(
            worker.worker_id.to_string(),
            json!({
                "longest_matched": worker.longest_matched_tokens,
                "gpu": worker.device_tokens,
                "dp": ranks(false),
                "cpu": worker.host_tokens,
                "disk": worker.disk_tokens,
            }),
        );
    }
    json!({"scores": scores, "frequencies": [], "instances": instances})
}

async fn register(address: SocketAddr, instance_id: u64, rank: u32, publisher: &EnginePublisher) {
    let registration = json!({
        "instance_id": instance_id,
        "dp_rank": rank,
        "endpoint": publisher.endpoint(),
        "replay_endpoint": publisher.replay_endpoint(),
        "model_name": "m",
        "block_size": 2,
    });
    let (status, answer) = post(address, "/register", registration).await;
    assert_eq!(status, 201, "{answer}");
}

#[tokio::test]
async fn match_answers_what_query_and_query_by_hash_answer_for_every_rank_tier_lora_and_salt() {
    let index = IndexProcess::start(&[]);
    let address = index.address;
    let (mut w1r0, mut w1r1, mut w2r0) = (publisher().await, publisher().await, publisher().await);
    register(address, 1, 0, &w1r0).await;
    register(address, 1, 1, &w1r1).await;
    register(address, 2, 0, &w2r0).await;

    let tokens: Vec<u32> = (0..8).collect();
    let store = |hashes, parent, range: std::ops::Range<usize>, medium, rank| Stored {
        hashes,
        parent,
        tokens: &tokens[range],
        block_size: 2,
        medium,
        rank,
        lora_name: None,
        cache_salt: None,
    };
    // Worker 1: rank 0 holds two blocks on the device and the third in host
    // memory; rank 1 the first on the device and the next two on disk.
    // Worker 2 holds all four in host memory only.
    for payload in [
        store(&[101, 102], None, 0..4, "GPU", 0).payload(),
        store(&[103], Some(102), 4..6, "CPU", 0).payload(),
        Stored {
            lora_name: Some("a"),
            cache_salt: Some("s"),
            ..store(&[151, 152, 153], None, 0..6, "GPU", 0)
        }
        .payload(),
    ] {
        w1r0.publish(payload).await.unwrap();
    }
    for payload in [
        store(&[111], None, 0..2, "GPU", 1).payload(),
        store(&[112, 113], Some(111), 2..6, "DISK", 1).payload(),
    ] {
        w1r1.publish(payload).await.unwrap();
    }
    w2r0.publish(store(&[201, 202, 203, 204], None, 0..8, "CPU", 0).payload())
        .await
        .unwrap();

    let plain = json!({
        "scores": {"1": {"0": 4, "1": 2}},
        "frequencies": [],
        "instances": {
            "1": {"longest_matched": 6, "gpu": 4, "dp": {"0": 4, "1": 2}, "cpu": 6, "disk": 6},
            "2": {"longest_matched": 8, "gpu": 0, "dp": {"0": 0}, "cpu": 8, "disk": 8},
        },
    });
    let adapted = json!({
        "scores": {"1": {"0": 6}},
        "frequencies": [],
        "instances": {
            "1": {"longest_matched": 6, "gpu": 6, "dp": {"0": 6}, "cpu": 6, "disk": 6},
        },
    });
    let adapted_query =
        json!({"token_ids": tokens, "model_name": "m", "lora_name": "a", "cache_salt": "s"});
    let publishers = &mut [&mut w1r0, &mut w1r1, &mut w2r0];
    let plain_query = json!({"token_ids": tokens, "model_name": "m"});
    publish_until(publishers, address, "/query", plain_query, &plain).await;
    publish_until(publishers, address, "/query", adapted_query, &adapted).await;

    let mut client = KvIndexClient::new(channel(address).await);
    let answer = matched(&mut client, by_tokens(&tokens, "", "")).await;
    assert_eq!(as_query_answer(&answer), plain);
    // What `/query` cannot say: each rank's depth per tier.
    assert_eq!(answer.block_size, 2);
    let depths: Vec<(u64, u32, [u32; 4], u32)> = answer
        .workers
        .iter()
        .flat_map(|worker| {
            worker.ranks.iter().map(|rank: &RankMatch| {
                let blocks = [
                    rank.device_blocks,
                    rank.host_blocks,
                    rank.disk_blocks,
                    rank.external_blocks,
                ];
                (worker.worker_id, rank.dp_rank, blocks, rank.matched_tokens)
            })
        })
        .collect();
    assert_eq!(
        depths,
        [
            (1, 0, [2, 1, 0, 0], 6),
            (1, 1, [1, 0, 2, 0], 6),
            (2, 0, [0, 4, 0, 0], 8)
        ]
    );

    let answer = matched(&mut client, by_tokens(&tokens, "a", "s")).await;
    assert_eq!(as_query_answer(&answer), adapted);

    for (lora_name, cache_salt, expected) in
        [(None, None, &plain), (Some("a"), Some("s"), &adapted)]
    {
        let hashes = local_hashes(&tokens, lora_name, cache_salt);
        let by_hash = json!({"block_hashes": hashes, "model_name": "m"});
        let (status, http_answer) = post(address, "/query_by_hash", by_hash).await;
        assert_eq!((status, &http_answer), (200, expected));
        let answer = matched(&mut client, by_hashes(&hashes)).await;
        assert_eq!(&as_query_answer(&answer), expected);
    }

    // Another routing group's question is not this partition's.
    let mut elsewhere = by_tokens(&tokens, "", "");
    elsewhere.routing_group = "default".into();
    let answer = matched(&mut client, elsewhere).await;
    assert_eq!(
        as_query_answer(&answer),
        plain,
        "empty and \"default\" are one group"
    );
    // The port still answers HTTP/1.1 beside HTTP/2.
    assert_eq!(get(address, "/health").await.0, 200);
}

#[tokio::test]
async fn match_refusals_carry_the_code_a_router_can_act_on_and_name_the_limit() {
    let index = IndexProcess::start(&[]);
    let publisher = publisher().await;
    register(index.address, 1, 0, &publisher).await;
    let mut client = KvIndexClient::new(channel(index.address).await);
    let refused = async |client: &mut KvIndexClient<Channel>, request| {
        client.r#match(request).await.unwrap_err()
    };

    let mut unknown = by_tokens(&[1, 2], "", "");
    unknown.model_name = "other".into();
    let status = refused(&mut client, unknown).await;
    assert_eq!(
        (status.code(), status.message()),
        (
            Code::NotFound,
            "no indexer for model=other routing_group=default"
        )
    );
    let mut other_group = by_tokens(&[1, 2], "", "");
    other_group.routing_group = "g".into();
    assert_eq!(
        refused(&mut client, other_group).await.code(),
        Code::NotFound
    );

    let mut nothing = by_tokens(&[], "", "");
    nothing.query = None;
    assert_eq!(
        refused(&mut client, nothing).await.code(),
        Code::InvalidArgument
    );
    let mut no_model = by_tokens(&[1, 2], "", "");
    no_model.model_name.clear();
    assert_eq!(
        refused(&mut client, no_model).await.code(),
        Code::InvalidArgument
    );
    let mut salted_hashes = by_hashes(&[1]);
    salted_hashes.cache_salt = "s".into();
    let status = refused(&mut client, salted_hashes).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("cache_salt"), "{status:?}");

    // Two million small token ids fit in 2 MB, yet are refused by count.
    let many: Vec<u32> = vec![1; 2_000_000];
    let status = refused(&mut client, by_tokens(&many, "", "")).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("1048576"), "{status:?}");
    // As many large ones take 10 MB: refused by size, before decoding.
    let large: Vec<u32> = vec![u32::MAX; 2_000_000];
    let status = refused(&mut client, by_tokens(&large, "", "")).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("8388608"), "{status:?}");
    // A million fit.
    let million: Vec<u32> = vec![1; 1_048_576];
    let answer = matched(&mut client, by_tokens(&million, "", "")).await;
    assert_eq!(answer.workers, []);
}

#[tokio::test]
async fn reflection_on_the_index_port_lists_and_describes_kv_index() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let index = IndexProcess::start(&[]);
    let mut client = ServerReflectionClient::new(channel(index.address).await);
    let ask = |request| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    };
    let requests = tokio_stream::iter([
        ask(MessageRequest::ListServices(String::new())),
        ask(MessageRequest::FileContainingSymbol(
            "kvgate.v1.KvIndex".into(),
        )),
    ]);
    let mut responses = client
        .server_reflection_info(requests)
        .await
        .unwrap()
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        responses.message().await.unwrap().unwrap().message_response
    else {
        panic!("expected a service list")
    };
    let mut names: Vec<String> = list
        .service
        .into_iter()
        .map(|service| service.name)
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
            "kvgate.v1.KvIndex"
        ]
    );
    let Some(MessageResponse::FileDescriptorResponse(files)) =
        responses.message().await.unwrap().unwrap().message_response
    else {
        panic!("expected the file of kvgate.v1.KvIndex")
    };
    let described = files
        .file_descriptor_proto
        .iter()
        .any(|file| String::from_utf8_lossy(file).contains("MatchRequest"));
    assert!(described, "KvIndex's file describes MatchRequest");
}

/// `kvgate serve` on the publisher at `endpoint` (its replay endpoint
/// `replay`) with the index on (model `m`, blocks of 2 tokens), then `extra`.
fn sidecar_with_index(endpoint: &str, replay: &str, extra: &[&str]) -> common::Gateway {
    let mut args = vec![
        "--zmq-endpoint",
        endpoint,
        "--zmq-replay-endpoint",
        replay,
        "--metrics-listen",
        "127.0.0.1:0",
        "--index",
        "--index-model-name",
        "m",
        "--index-block-size",
        "2",
    ];
    args.extend_from_slice(extra);
    common::Gateway::start(&args)
}

#[tokio::test]
async fn a_sidecar_with_index_answers_query_and_match_for_its_engine_through_a_restart() {
    let mut engine = publisher().await;
    let endpoint = engine.endpoint().to_owned();
    let replay = engine.replay_endpoint().unwrap().to_owned();
    let gateway = sidecar_with_index(&endpoint, &replay, &["--index-worker-id", "5"]);
    let admin = gateway.admin.unwrap();
    let tokens: Vec<u32> = (0..6).collect();
    let store = |hashes, parent, range: std::ops::Range<usize>, medium| Stored {
        hashes,
        parent,
        tokens: &tokens[range],
        block_size: 2,
        medium,
        rank: 0,
        lora_name: None,
        cache_salt: None,
    };
    engine
        .publish(store(&[11, 12], None, 0..4, "GPU").payload())
        .await
        .unwrap();
    engine
        .publish(store(&[13], Some(12), 4..6, "CPU").payload())
        .await
        .unwrap();
    let query = json!({"token_ids": tokens, "model_name": "m"});
    let held = json!({
        "scores": {"5": {"0": 4}},
        "frequencies": [],
        "instances": {"5": {"longest_matched": 6, "gpu": 4, "dp": {"0": 4}, "cpu": 6, "disk": 6}},
    });
    publish_until(&mut [&mut engine], admin, "/query", query.clone(), &held).await;
    let mut client = KvIndexClient::new(gateway.channel().await);
    let answer = matched(&mut client, by_tokens(&tokens, "", "")).await;
    assert_eq!(as_query_answer(&answer), held);
    let hashes = local_hashes(&tokens, None, None);
    let (_, by_hash) = post(
        admin,
        "/query_by_hash",
        json!({"block_hashes": hashes, "model_name": "m"}),
    )
    .await;
    assert_eq!(by_hash, held);
    // The admin port's `/status` shows the tree.
    let (_, status) = get(admin, "/status").await;
    let tree = &status["index"][0];
    assert_eq!(
        (&tree["model_name"], &tree["block_size"], &tree["blocks"]),
        (&json!("m"), &json!(2), &json!(3)),
        "{status}"
    );

    // The engine restarts (its counter from 0, its cache empty) and stores
    // other blocks: the sidecar's index forgets the old ones.
    engine.restart();
    let other: Vec<u32> = (100..104).collect();
    engine
        .publish(
            Stored {
                tokens: &other,
                ..store(&[31, 32], None, 0..4, "GPU")
            }
            .payload(),
        )
        .await
        .unwrap();
    let other_held = json!({
        "scores": {"5": {"0": 4}},
        "frequencies": [],
        "instances": {"5": {"longest_matched": 4, "gpu": 4, "dp": {"0": 4}, "cpu": 4, "disk": 4}},
    });
    let other_query = json!({"token_ids": other, "model_name": "m"});
    publish_until(
        &mut [&mut engine],
        admin,
        "/query",
        other_query,
        &other_held,
    )
    .await;
    let empty = json!({"scores": {}, "frequencies": [], "instances": {}});
    assert_eq!(post(admin, "/query", query).await, (200, empty.clone()));
    let answer = matched(&mut client, by_tokens(&tokens, "", "")).await;
    assert_eq!(as_query_answer(&answer), empty);
    let answer = matched(&mut client, by_tokens(&other, "", "")).await;
    assert_eq!(as_query_answer(&answer), other_held);

    // Another model is not this engine's.
    let mut unknown = by_tokens(&tokens, "", "");
    unknown.model_name = "other".into();
    let status = client.r#match(unknown).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
}

#[tokio::test]
async fn a_sidecar_without_index_neither_serves_nor_lists_match() {
    let (gateway, _engine) = common::gateway_on_a_publisher(&[]).await;
    let mut client = KvIndexClient::new(gateway.channel().await);
    let status = client
        .r#match(by_tokens(&[1, 2], "", ""))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    let (code, _) = post(
        gateway.admin.unwrap(),
        "/query",
        json!({"token_ids": [1, 2], "model_name": "m"}),
    )
    .await;
    assert_eq!(code, 404);
}

#[tokio::test]
async fn a_sidecar_with_index_restarted_on_its_state_dir_answers_from_the_restored_state() {
    /// The state directory, removed with its announcement mark when dropped.
    struct StateDir(std::path::PathBuf);
    impl Drop for StateDir {
        fn drop(&mut self) {
            common::remove_state_dir(&self.0);
        }
    }
    let dir = StateDir(std::env::temp_dir().join(format!(
        "engine-index-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    )));
    let mut engine = publisher().await;
    let endpoint = engine.endpoint().to_owned();
    let replay = engine.replay_endpoint().unwrap().to_owned();
    let state_dir = dir.0.to_str().unwrap().to_owned();
    let args = ["--state-dir", &state_dir];
    let mut gateway = sidecar_with_index(&endpoint, &replay, &args);
    let tokens: Vec<u32> = (0..4).collect();
    let stored = Stored {
        hashes: &[61, 62],
        parent: None,
        tokens: &tokens,
        block_size: 2,
        medium: "GPU",
        rank: 0,
        lora_name: None,
        cache_salt: None,
    };
    engine.publish(stored.payload()).await.unwrap();
    let query = json!({"token_ids": tokens, "model_name": "m"});
    let held = json!({
        "scores": {"0": {"0": 4}},
        "frequencies": [],
        "instances": {"0": {"longest_matched": 4, "gpu": 4, "dp": {"0": 4}, "cpu": 4, "disk": 4}},
    });
    publish_until(
        &mut [&mut engine],
        gateway.admin.unwrap(),
        "/query",
        query.clone(),
        &held,
    )
    .await;
    gateway.terminate();

    // The engine is gone: only the state directory can tell the blocks,
    // through the snapshot the index's feed takes first.
    drop(engine);
    let gateway = sidecar_with_index(&endpoint, &replay, &args);
    let admin = gateway.admin.unwrap();
    let mut polling = Polling::within(DEADLINE);
    loop {
        let (status, answer) = post(admin, "/query", query.clone()).await;
        if status == 200 && answer == held {
            break;
        }
        polling
            .again(format_args!(
                "the restored state never reached the index: {status} {answer}"
            ))
            .await;
    }
}

#[tokio::test]
async fn a_peer_stalling_in_its_first_bytes_is_closed_at_the_header_timeout_not_the_idle_one() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let index = IndexProcess::start(&[
        "--http-header-timeout-ms",
        "200",
        "--http-idle-timeout-ms",
        "600000",
    ]);
    // "P" could begin HTTP/2's preface or an HTTP/1.1 POST: the protocol is
    // not known yet.
    for first in [&b""[..], b"P"] {
        let mut stream = tokio::net::TcpStream::connect(index.address).await.unwrap();
        stream.write_all(first).await.unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(DEADLINE, stream.read_to_end(&mut rest)).await;
        assert!(
            closed.is_ok(),
            "a peer that sent {first:?} was held past the header timeout"
        );
    }
    // A client that sends its request is answered as before.
    assert_eq!(get(index.address, "/health").await.0, 200);
}

#[test]
fn a_bad_combination_of_index_flags_fails_at_start_naming_the_flag() {
    for (args, named) in [
        (
            &["--index", "--index-block-size", "16"][..],
            "--index-model-name",
        ),
        (
            &["--index", "--index-model-name", "m"][..],
            "--index-block-size",
        ),
        (&["--index-model-name", "m"][..], "--index"),
    ] {
        let mut command = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--zmq-endpoint",
            "tcp://127.0.0.1:1",
        ];
        command.extend_from_slice(args);
        let (code, stderr) = common::exit_of(&command);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(named),
            "{args:?} does not name {named}: {stderr}"
        );
    }
}
