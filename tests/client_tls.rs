//! The client side of TLS and tokens, as an operator meets it with `kvgate
//! status` and `kvgate tail`: every mistake ends in one line naming the
//! cause and the flag to change, one failed `status` costs the server one
//! handshake, and a token-protected gateway still answers health and
//! reflection (grpcurl asks reflection first) without a token. The real
//! binary on both sides, real rustls with certificates made here.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Output, Stdio};

use common::Gateway;
use common::pki::{Authority, Files};
use kvgate_sim::{EnginePublisher, PublisherOptions};
use tokio_stream::StreamExt;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

/// Runs `kvgate ARGS` to its end (killed by pid past the deadline).
fn kvgate(args: &[&str]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate runs");
    common::output_within_deadline(child)
}

/// The one line a failed command printed on stderr.
fn one_line_error(output: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(code), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(
        !stderr.contains("Custom {") && !stderr.contains("transport error"),
        "no Debug chain: {stderr}"
    );
    stderr
}

/// An mTLS gateway and the files of a router it trusts.
struct Mtls {
    files: Files,
    gateway: Gateway,
    _publisher: EnginePublisher,
}

impl Mtls {
    async fn start() -> Self {
        let files = Files::new();
        let servers = Authority::new("server CA");
        let clients = Authority::new("client CA");
        let server = servers.server();
        let router = clients.client("router");
        let foreign = Authority::new("someone else's CA").client("router");
        for (name, pem) in [
            ("server.pem", &server.cert),
            ("server.key", &server.key),
            ("servers-ca.pem", &servers.pem()),
            ("clients-ca.pem", &clients.pem()),
            ("router.pem", &router.cert),
            ("router.key", &router.key),
            ("foreign.pem", &foreign.cert),
            ("foreign.key", &foreign.key),
        ] {
            files.write(name, pem);
        }
        let publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
            .await
            .unwrap();
        let path = |name| files.path(name).display().to_string();
        let gateway = Gateway::start(&[
            "--zmq-endpoint",
            publisher.endpoint(),
            "--metrics-listen",
            "127.0.0.1:0",
            "--tls-cert",
            &path("server.pem"),
            "--tls-key",
            &path("server.key"),
            "--tls-client-ca",
            &path("clients-ca.pem"),
        ]);
        Self {
            files,
            gateway,
            _publisher: publisher,
        }
    }

    fn path(&self, name: &str) -> String {
        self.files.path(name).display().to_string()
    }

    fn address(&self) -> String {
        self.gateway.address.to_string()
    }

    /// The handshake failures the gateway counted for `reason`, once it
    /// counted at least one.
    async fn handshake_failures(&self, reason: &str) -> f64 {
        let admin = self.gateway.admin.expect("started with --metrics-listen");
        let series = format!("kvgate_tls_handshake_failures_total{{reason=\"{reason}\"}}");
        common::await_metric_where(admin, &series, ">= 1", |now| now >= 1.0).await;
        let (_, metrics) = common::http_get(admin, "/metrics").await;
        common::metric_sample(&metrics, &series).unwrap()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn status_without_a_client_certificate_says_to_add_cert_and_key_and_costs_one_handshake() {
    let mtls = Mtls::start().await;
    let output = kvgate(&[
        "status",
        "--addr",
        &mtls.address(),
        "--ca",
        &mtls.path("servers-ca.pem"),
    ]);
    let stderr = one_line_error(&output, 1);
    assert!(
        stderr.contains("the server requires a client certificate: add --cert and --key"),
        "{stderr}"
    );
    assert_eq!(mtls.handshake_failures("no_client_certificate").await, 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_certificate_from_another_ca_is_named_as_untrusted() {
    let mtls = Mtls::start().await;
    for command in ["status", "tail"] {
        let output = kvgate(&[
            command,
            "--addr",
            &mtls.address(),
            "--ca",
            &mtls.path("servers-ca.pem"),
            "--cert",
            &mtls.path("foreign.pem"),
            "--key",
            &mtls.path("foreign.key"),
        ]);
        let stderr = one_line_error(&output, 1);
        assert!(
            stderr.contains("the server does not trust the client certificate (--cert)"),
            "{command}: {stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn plaintext_against_a_tls_gateway_says_to_add_ca() {
    let mtls = Mtls::start().await;
    for command in ["status", "tail"] {
        let output = kvgate(&[command, "--addr", &mtls.address()]);
        let stderr = one_line_error(&output, 1);
        assert!(
            stderr.contains("(it may require TLS): add --ca"),
            "{command}: {stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn ca_against_a_plaintext_gateway_says_to_drop_it() {
    let mtls = Mtls::start().await;
    let plaintext = Gateway::start(&["--demo"]);
    for command in ["status", "tail"] {
        let output = kvgate(&[
            command,
            "--addr",
            &plaintext.address.to_string(),
            "--ca",
            &mtls.path("servers-ca.pem"),
        ]);
        let stderr = one_line_error(&output, 1);
        assert!(
            stderr.contains("the server is not speaking TLS: drop --ca or use http://"),
            "{command}: {stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cert_without_key_or_without_ca_is_a_usage_error_naming_the_missing_flag() {
    let mtls = Mtls::start().await;
    let address = mtls.address();
    let cert = mtls.path("router.pem");
    let key = mtls.path("router.key");
    let ca = mtls.path("servers-ca.pem");
    for (args, says) in [
        (
            vec!["--cert", cert.as_str(), "--ca", ca.as_str()],
            "--cert needs --key",
        ),
        (vec!["--cert", cert.as_str()], "--cert needs --key"),
        (vec!["--key", key.as_str()], "--key needs --cert"),
        (
            vec!["--cert", cert.as_str(), "--key", key.as_str()],
            "add --ca",
        ),
    ] {
        let mut command = vec!["status", "--addr", address.as_str()];
        command.extend(args.iter().copied());
        let stderr = one_line_error(&kvgate(&command), 2);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // With every file, the same router is admitted.
    let output = kvgate(&[
        "status", "--addr", &address, "--ca", &ca, "--cert", &cert, "--key", &key,
    ]);
    assert!(
        output.status.code().is_some(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("health:"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A gateway that wants a bearer token for everything else.
fn token_gateway(files: &Files) -> Gateway {
    let tokens = files.write("tokens", "router-secret\n");
    Gateway::start(&["--demo", "--auth-token-file", &tokens.display().to_string()])
}

async fn reflection(address: SocketAddr, request: MessageRequest) -> MessageResponse {
    let channel = tonic::transport::Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    };
    ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection needs no token")
        .into_inner()
        .next()
        .await
        .expect("an answer")
        .expect("a good answer")
        .message_response
        .expect("a response")
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_token_reflection_and_health_answer_as_grpcurl_asks_them_and_events_do_not() {
    let files = Files::new();
    let gateway = token_gateway(&files);
    // grpcurl's `list`, then its lookup of the service it is asked to call.
    let MessageResponse::ListServicesResponse(list) =
        reflection(gateway.address, MessageRequest::ListServices(String::new())).await
    else {
        panic!("not a service list");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.iter().any(|name| name == "grpc.health.v1.Health"),
        "{names:?}"
    );
    let MessageResponse::FileDescriptorResponse(files_of) = reflection(
        gateway.address,
        MessageRequest::FileContainingSymbol("grpc.health.v1.Health".into()),
    )
    .await
    else {
        panic!("not a file descriptor");
    };
    assert!(!files_of.file_descriptor_proto.is_empty());

    gateway.await_serving("").await;
    let channel = gateway.channel().await;
    let health = tonic_health::pb::health_client::HealthClient::new(channel.clone())
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health needs no token");
    assert_eq!(
        health.into_inner().status(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );
    let events = kvgate::client::subscribe(channel, "kvgate.v1.KvGate", 0).await;
    assert_eq!(events.unwrap_err().code(), tonic::Code::Unauthenticated);
}

#[tokio::test(flavor = "multi_thread")]
async fn status_without_a_token_shows_health_and_says_the_snapshot_needs_one() {
    let files = Files::new();
    let gateway = token_gateway(&files);
    gateway.await_serving("").await;
    let address = gateway.address.to_string();
    let output = kvgate(&["status", "--addr", &address]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("server") && stdout.contains("SERVING"),
        "{stdout}"
    );
    assert!(
        stdout.contains("UNAUTHENTICATED") && stdout.contains("--token-file"),
        "{stdout}"
    );
    let token = files.write("my-token", "router-secret\n");
    let output = kvgate(&[
        "status",
        "--addr",
        &address,
        "--token-file",
        &token.display().to_string(),
        "--json",
    ]);
    assert!(output.status.success());
    let status: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert!(status.get("snapshot_refused").is_none(), "{status}");
}
