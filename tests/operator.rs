//! What an operator relies on: health, server reflection for grpcurl, clear
//! start-up errors and a clean exit on SIGTERM.

mod common;

use std::process::Command;

use common::{Gateway, subscribe};
use kvgate::server::SUBSCRIBE_SERVICES;
use kvgate_sim::{EnginePublisher, PublisherOptions};
use tokio_stream::StreamExt;

async fn gateway_with_publisher() -> (Gateway, EnginePublisher) {
    let publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let gateway = Gateway::start(&["--zmq-endpoint", publisher.endpoint()]);
    (gateway, publisher)
}

#[tokio::test(flavor = "multi_thread")]
async fn health_reports_serving_once_the_engine_source_is_up() {
    let (gateway, _publisher) = gateway_with_publisher().await;
    for service in std::iter::once("").chain(SUBSCRIBE_SERVICES) {
        gateway.await_serving(service).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn reflection_v1_and_v1alpha_list_every_service_and_describe_the_messages() {
    let (gateway, _publisher) = gateway_with_publisher().await;
    let channel = gateway.channel().await;

    use tonic_reflection::pb::v1;
    let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel.clone());
    let requests = tokio_stream::iter([
        v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        },
        v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(
                v1::server_reflection_request::MessageRequest::FileContainingSymbol(
                    "smg.grpc.common.KvEventBatch".into(),
                ),
            ),
        },
    ]);
    let mut responses = client
        .server_reflection_info(requests)
        .await
        .unwrap()
        .into_inner();
    let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        responses.next().await.unwrap().unwrap().message_response
    else {
        panic!("expected a service list")
    };
    let names: Vec<String> = list
        .service
        .into_iter()
        .map(|service| service.name)
        .collect();
    for expected in SUBSCRIBE_SERVICES.iter().chain(&["grpc.health.v1.Health"]) {
        assert!(
            names.iter().any(|name| name == expected),
            "{expected} missing from {names:?}"
        );
    }
    let Some(v1::server_reflection_response::MessageResponse::FileDescriptorResponse(files)) =
        responses.next().await.unwrap().unwrap().message_response
    else {
        panic!("expected a file descriptor")
    };
    assert!(!files.file_descriptor_proto.is_empty());

    use tonic_reflection::pb::v1alpha;
    let mut client = v1alpha::server_reflection_client::ServerReflectionClient::new(channel);
    let requests = tokio_stream::iter([v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    }]);
    let mut responses = client
        .server_reflection_info(requests)
        .await
        .unwrap()
        .into_inner();
    let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        responses.next().await.unwrap().unwrap().message_response
    else {
        panic!("expected a service list")
    };
    assert!(
        list.service
            .iter()
            .any(|service| service.name == "kvgate.v1.KvGate")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn other_rpcs_answer_unimplemented_without_an_engine_to_pass_them_to() {
    let (gateway, _publisher) = gateway_with_publisher().await;
    let status = subscribe(
        gateway.channel().await,
        "vllm.grpc.engine.VllmEngine/Generate",
        0,
    )
    .await
    .expect_err("no such method here");
    assert_eq!(status.code(), tonic::Code::Unimplemented);
}

/// Runs `kvgate serve ARGS` with `env` set, expecting it to refuse to start
/// with the usage exit code; returns its stderr. It listens on an ephemeral
/// port unless ARGS say otherwise, so a gateway on the default port (a
/// `make run` elsewhere) changes nothing.
fn serve_fails_with_env(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    command.arg("serve").args(args).envs(env.iter().copied());
    if !args.contains(&"--listen") && !env.iter().any(|(name, _)| *name == "KVGATE_LISTEN") {
        command.args(["--listen", "127.0.0.1:0"]);
    }
    let output = command.output().expect("kvgate runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(2),
        "kvgate serve {args:?} should refuse to start as a usage error: {stderr}"
    );
    assert!(
        !stderr.contains('\u{1b}'),
        "no colours when stderr is not a terminal: {stderr:?}"
    );
    stderr
}

fn serve_fails(args: &[&str]) -> String {
    serve_fails_with_env(args, &[])
}

#[test]
fn serve_without_an_event_source_refuses_to_start_and_says_what_to_give() {
    let message = serve_fails(&[]);
    assert!(message.contains("--zmq-endpoint"), "{message}");
    assert!(message.contains("--demo"), "{message}");
}

#[test]
fn replay_and_pass_through_bounds_that_cannot_hold_fail_at_start_naming_their_flags() {
    let publisher = ["--zmq-endpoint", "tcp://*:5557"];
    let message = serve_fails(&[&publisher[..], &["--zmq-replay-max-bytes", "512MiB"]].concat());
    assert!(message.contains("--zmq-replay-max-bytes"), "{message}");
    assert!(message.contains("--history-bytes"), "{message}");
    let message = serve_fails(
        &[
            &publisher[..],
            &[
                "--pass-through-max-streams",
                "4096",
                "--pass-through-stream-window-bytes",
                "1MiB",
            ],
        ]
        .concat(),
    );
    assert!(message.contains("--pass-through-max-streams"), "{message}");
    assert!(
        message.contains("--pass-through-stream-window-bytes"),
        "{message}"
    );
    let message = serve_fails(&[&publisher[..], &["--zmq-replay-fetch-timeout-ms", "0"]].concat());
    assert!(
        message.contains("--zmq-replay-fetch-timeout-ms"),
        "{message}"
    );
    let message = serve_fails_with_env(&publisher, &[("KVGATE_ZMQ_REPLAY_MAX_MESSAGES", "0")]);
    assert!(
        message.contains("KVGATE_ZMQ_REPLAY_MAX_MESSAGES"),
        "{message}"
    );
}

#[test]
fn a_bad_value_fails_at_start_naming_its_flag() {
    for (args, flag) in [
        (vec!["--zmq-endpoint", "localhost:5557"], "--zmq-endpoint"),
        (
            vec!["--zmq-endpoint", "tcp://*:5557", "--dp-size", "0"],
            "--dp-size",
        ),
        (
            vec![
                "--zmq-endpoint",
                "tcp://*:5557",
                "--max-batch-events",
                "2000",
            ],
            "--max-batch-events",
        ),
        (
            vec!["--zmq-endpoint", "tcp://*:5557", "--listen", "nowhere"],
            "--listen",
        ),
        (
            vec!["--zmq-endpoint", "tcp://*:65535", "--dp-size", "2"],
            "--dp-size",
        ),
        (
            vec![
                "--zmq-endpoint",
                "tcp://*:5557",
                "--zmq-max-message-bytes",
                "1024",
            ],
            "--zmq-max-message-bytes",
        ),
        (
            vec![
                "--zmq-endpoint",
                "tcp://*:5557",
                "--max-batch-bytes",
                "5MiB",
            ],
            "--max-batch-bytes",
        ),
        (
            vec![
                "--zmq-endpoint",
                "tcp://*:5557",
                "--zmq-max-message-bytes",
                "2147483648",
            ],
            "--zmq-max-message-bytes",
        ),
        (
            vec![
                "--zmq-endpoint",
                "tcp://*:5557",
                "--history-bytes",
                "2 lightyears",
            ],
            "--history-bytes",
        ),
        (
            vec![
                "--zmq-endpoint",
                "tcp://*:5557",
                "--engine-grpc",
                "127.0.0.1:50051",
            ],
            "--engine-grpc",
        ),
        (
            vec!["--zmq-endpoint", "tcp://*:5557", "--worker-threads", "0"],
            "--worker-threads",
        ),
        (
            vec!["--upstream-grpc", "ftp://127.0.0.1:50051"],
            "--upstream-grpc",
        ),
        (
            vec!["--upstream-grpc", "http://upstream"],
            "--upstream-grpc",
        ),
        (
            vec![
                "--zmq-endpoint",
                "tcp://*:5557",
                "--zmq-replay-endpoint",
                "tcp://*:5558",
                "--dp-size",
                "2",
            ],
            "at least --dp-size apart",
        ),
    ] {
        let message = serve_fails(&args);
        assert!(message.contains(flag), "{args:?}: {message}");
    }
}

#[test]
fn a_bad_environment_variable_fails_at_start_naming_the_variable_and_its_value() {
    for (variable, value, flag) in [
        ("KVGATE_MAX_BATCH_EVENTS", "5000", "--max-batch-events"),
        ("KVGATE_HISTORY_BYTES", "lots", "--history-bytes"),
        ("KVGATE_LISTEN", "nowhere", "--listen"),
        ("KVGATE_ENGINE_GRPC", "engine:50051", "--engine-grpc"),
        ("KVGATE_WORKER_THREADS", "257", "--worker-threads"),
    ] {
        let message =
            serve_fails_with_env(&["--zmq-endpoint", "tcp://*:5557"], &[(variable, value)]);
        assert!(
            message.contains(&format!("{variable}={value}: ")) && message.contains(flag),
            "{variable}={value}: {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sizes_take_units_and_listen_takes_a_host_name() {
    let publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let gateway = Gateway::start_listening(
        "localhost:0",
        &[
            "--zmq-endpoint",
            publisher.endpoint(),
            "--max-batch-bytes",
            "2MiB",
            "--history-bytes",
            "64MiB",
        ],
    );
    assert!(gateway.address.ip().is_loopback(), "{}", gateway.address);
    let mut health = tonic_health::pb::health_client::HealthClient::new(gateway.channel().await);
    health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("the gateway answers on the resolved address");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_under_load_ends_subscriber_streams_cleanly_and_exits_with_zero() {
    let (mut gateway, mut publisher) = gateway_with_publisher().await;
    let mut streams = vec![
        subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
            .await
            .unwrap(),
    ];
    common::sync_streams(&mut publisher, 0, &mut streams).await;
    let mut stream = streams.pop().unwrap();
    // The engine keeps publishing while kvgate shuts down.
    let load = tokio::spawn(async move {
        let mut workload = kvgate_sim::SteadyState::new(kvgate_sim::WorkloadShape::default(), 9);
        for _ in 0..20_000 {
            if publisher
                .publish(workload.next_payload(1.0, 0).into())
                .await
                .is_err()
            {
                break;
            }
            tokio::task::yield_now().await;
        }
    });
    common::next_batch(&mut stream).await;
    // The subscriber reads on while kvgate stops, as a router does: a client
    // that stopped reading could never be handed the end of its stream
    // (HTTP/2 flow control holds the batches queued before it).
    let terminated = tokio::task::spawn_blocking(move || gateway.terminate());
    let end = loop {
        match tokio::time::timeout(common::DEADLINE, stream.message())
            .await
            .expect("the stream ends")
        {
            Ok(Some(_)) => continue,
            end => break end,
        }
    };
    let status = terminated.await.unwrap();
    assert!(status.success(), "exit status {status}");
    assert!(
        matches!(end, Ok(None)),
        "a clean end of stream, got {end:?}"
    );
    load.abort();
}

/// A gateway with the admin port, synced past the slow joiner, holding the
/// blocks of the `stored-int-root` fixture.
async fn gateway_holding_two_blocks() -> (Gateway, EnginePublisher) {
    let (gateway, mut publisher) = common::gateway_on_a_publisher(&[]).await;
    let mut streams = vec![
        subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
            .await
            .unwrap(),
    ];
    common::sync_streams(&mut publisher, 0, &mut streams).await;
    // Its third event is a clear: it goes before the blocks.
    let (malformed, _) = common::fixture("vllm-0.33.0/malformed-unknown-type");
    publisher.publish(malformed.into()).await.unwrap();
    let (payload, _) = common::fixture("vllm-0.33.0/stored-int-root");
    publisher.publish(payload.into()).await.unwrap();
    publisher
        .send_frames(vec![
            bytes::Bytes::new(),
            bytes::Bytes::from_static(&[0; 4]),
            bytes::Bytes::new(),
        ])
        .await
        .unwrap();
    publisher
        .publish(common::fence_payload(u64::MAX, 0))
        .await
        .unwrap();
    common::skip_past_fence(&mut streams[0], u64::MAX).await;
    (gateway, publisher)
}

fn kvgate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .output()
        .expect("kvgate runs")
}

#[tokio::test(flavor = "multi_thread")]
async fn tail_prints_one_json_object_per_event_with_signed_hashes() {
    let (gateway, _publisher) = gateway_holding_two_blocks().await;
    let address = gateway.address.to_string();
    let output = kvgate(&["tail", "--addr", &address, "--json", "--limit", "1"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON object per line"))
        .collect();
    // The snapshot: an ownerless clear, then the live blocks.
    assert!(lines[0]["cleared"].is_object());
    assert_eq!(lines[0]["snapshot"]["count"], 1);
    let (_, fixture) = common::fixture("vllm-0.33.0/stored-int-root");
    let expected: Vec<&serde_json::Value> = fixture["expected"]["events"][0]["stored"]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|block| &block["block_hash"])
        .collect();
    // grpcurl's spelling: lowerCamelCase field names.
    let printed: Vec<&serde_json::Value> = lines[1..]
        .iter()
        .flat_map(|line| line["stored"]["blocks"].as_array().unwrap())
        .map(|block| &block["blockHash"])
        .collect();
    assert_eq!(printed, expected);
    assert!(
        lines
            .iter()
            .all(|line| line["dpRank"] == 0 && line["sequenceNumber"].is_string())
    );
    assert!(lines.iter().all(|line| line.get("block_hash").is_none()));

    let output = kvgate(&["tail", "--addr", &address, "--limit", "1"]);
    let text = String::from_utf8(output.stdout).unwrap();
    assert!(
        text.contains("+2 stored") && text.contains("[snapshot 1/1, 2 blocks]"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tail_refused_shows_the_status_name_first() {
    let (gateway, _publisher) = gateway_holding_two_blocks().await;
    // A cursor from the future: the gateway refuses it with OUT_OF_RANGE.
    let output = kvgate(&[
        "tail",
        "--addr",
        &gateway.address.to_string(),
        "--from",
        &u64::MAX.to_string(),
        "--limit",
        "1",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(": OUT_OF_RANGE: "), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn status_summarises_health_services_and_blocks_per_rank() {
    let (gateway, _publisher) = gateway_holding_two_blocks().await;
    let output = kvgate(&["status", "--addr", &gateway.address.to_string(), "--json"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(status["health"]["kvgate.v1.KvGate"], "SERVING");
    assert_eq!(status["health"]["server"], "SERVING", "{status}");
    assert_eq!(status["ranks"]["0"]["blocks"], 2);
    assert!(
        status["services"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s == "vllm.grpc.engine.VllmEngine")
    );
}

/// The value of the sample `name{labels}` in a Prometheus text exposition.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_healthz_and_status_are_served_on_the_admin_port() {
    let (gateway, mut publisher) = gateway_holding_two_blocks().await;
    let admin = gateway.admin.expect("admin port reported");
    // A connected subscriber that has read everything: lag 0.
    let mut stream = subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
        .await
        .unwrap();
    publisher
        .publish(common::fence_payload(7, 0))
        .await
        .unwrap();
    common::skip_past_fence(&mut stream, 7).await;
    let (code, body) = common::http_get(admin, "/healthz").await;
    assert_eq!((code, body.trim()), (200, "ok"));

    let (code, text) = common::http_get(admin, "/metrics").await;
    assert_eq!(code, 200);
    assert!(
        common::metric_sample(&text, "kvgate_engine_messages_total{rank=\"0\"}").unwrap() >= 3.0,
        "{text}"
    );
    assert_eq!(
        common::metric_sample(
            &text,
            "kvgate_events_dropped_total{reason=\"unknown_type\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        common::metric_sample(
            &text,
            "kvgate_bad_messages_total{reason=\"bad_sequence_frame\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        common::metric_sample(&text, "kvgate_state_blocks{rank=\"0\",tier=\"device\"}"),
        Some(2.0),
        "{text}"
    );
    assert!(common::metric_sample(&text, "kvgate_batches_out_total").unwrap() >= 2.0);
    assert!(
        common::metric_sample(&text, "kvgate_events_out_total").unwrap() >= 3.0,
        "{text}"
    );
    assert_eq!(
        common::metric_sample(&text, "kvgate_subscribers"),
        Some(1.0),
        "{text}"
    );
    let lag = text
        .lines()
        .find(|line| line.starts_with("kvgate_subscriber_lag{subscriber="));
    assert!(lag.is_some_and(|line| line.ends_with(" 0")), "{text}");

    let (code, body) = common::http_get(admin, "/status").await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["source_ready"], true);
    assert_eq!(status["worker_threads"], 1);
    assert_eq!(status["engine"]["messages_lost"], 0);
    assert_eq!(status["ranks"][0]["blocks"]["device"], 2);
    assert_eq!(status["ranks"][0]["blocks"]["external"], 0);
    assert!(status["history"]["batches"].as_u64().unwrap() >= 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn kvgate_worker_threads_sizes_the_runtime_that_serves_the_subscribers() {
    let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let gateway = Gateway::start_with_env(
        &[
            "--zmq-endpoint",
            publisher.endpoint(),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        &[("KVGATE_WORKER_THREADS", "3")],
    );
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(
            subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
                .await
                .unwrap(),
        );
    }
    common::sync_streams(&mut publisher, 0, &mut streams).await;
    let admin = gateway.admin.expect("admin port reported");
    let (code, body) = common::http_get(admin, "/status").await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["worker_threads"], 3, "{body}");
}

#[test]
fn a_file_a_flag_names_that_will_not_do_is_a_usage_error_before_anything_binds() {
    let files = common::pki::Files::new();
    let empty = files
        .write("empty-tokens", "# no token yet\n")
        .display()
        .to_string();
    let ca = files
        .write("ca.pem", &common::pki::Authority::new("engine CA").pem())
        .display()
        .to_string();
    let missing = files.path("missing.pem").display().to_string();
    for (args, flag) in [
        (
            vec!["--tls-cert", &missing, "--tls-key", &missing],
            "--tls-cert",
        ),
        (vec!["--auth-token-file", &empty], "--auth-token-file"),
        (
            vec![
                "--engine-grpc",
                "http://127.0.0.1:1",
                "--engine-tls-ca",
                &ca,
            ],
            "--engine-tls-ca",
        ),
    ] {
        let mut args = args;
        args.push("--demo");
        let stderr = serve_fails_with_env(&args, &[("RUST_LOG", "info")]);
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("bound") && !stderr.contains("serving"),
            "{args:?}: something started before the check: {stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_listen_takes_a_host_name_booleans_take_1_and_sizes_take_any_case() {
    let gateway = Gateway::start_with_env(
        &[
            "--metrics-listen",
            "localhost:0",
            "--max-batch-bytes",
            "1mb",
            "--history-bytes",
            "64mi",
        ],
        &[("KVGATE_DEMO", "1"), ("KVGATE_ZMQ_BIND", "no")],
    );
    let admin = gateway.admin.expect("the admin port is announced");
    assert!(admin.ip().is_loopback(), "{admin}");
    let (code, _) = common::http_get(admin, "/metrics").await;
    assert_eq!(code, 200);
}

#[test]
fn tail_whose_reader_goes_away_ends_quietly_with_exit_code_0() {
    use std::io::BufRead;
    let gateway = Gateway::start(&["--demo"]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["tail", "--addr", &gateway.address.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kvgate runs");
    // `| head -1`: one line read, then the pipe closed.
    let stdout = child.stdout.take().unwrap();
    let mut first = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("seq "), "{first}");
    let output = common::output_within_deadline(child);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn status_exits_non_zero_while_the_gateway_is_not_serving() {
    // An engine that is not up: kvgate serves, NOT_SERVING meanwhile.
    let port = common::free_ports(1);
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let gateway = Gateway::start(&["--zmq-endpoint", &endpoint]);
    let output = kvgate(&["status", "--addr", &gateway.address.to_string(), "--json"]);
    assert_eq!(output.status.code(), Some(1));
    let status: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(status["health"]["server"], "NOT_SERVING", "{status}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("NOT_SERVING"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn tail_of_a_service_the_gateway_lacks_names_the_services_it_has() {
    let gateway = Gateway::start(&["--demo"]);
    let output = kvgate(&[
        "tail",
        "--addr",
        &gateway.address.to_string(),
        "--service",
        "foo.Bar",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("foo.Bar") && stderr.contains("kvgate.v1.KvGate"),
        "{stderr}"
    );
}

#[test]
fn a_state_dir_beside_a_played_file_fails_at_start_naming_both_flags() {
    // A played recording or trace starts over at every start, so a state
    // directory could only restore a state the file is about to rebuild.
    let dir = std::env::temp_dir().join(format!("kvgate-state-beside-file-{}", std::process::id()));
    let dir = dir.to_str().expect("a UTF-8 temp dir");
    for (flag, file) in [
        ("--replay-file", "tests/fixtures/no-such-recording"),
        ("--trace-file", "tests/fixtures/no-such-trace"),
    ] {
        let stderr = serve_fails(&["--state-dir", dir, flag, file]);
        assert!(
            stderr.contains("--state-dir") && stderr.contains(flag),
            "{stderr}"
        );
    }
    assert!(
        !std::path::Path::new(dir).exists(),
        "nothing is created before the flags are checked"
    );
}
