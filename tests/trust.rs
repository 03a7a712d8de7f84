//! Who may connect (contract section 7): TLS and mTLS on the gRPC port,
//! bearer tokens, rotation of both by SIGHUP on a running binary, TLS
//! towards the engine and an upstream, and the start-up refusals. Real
//! rustls on loopback with certificates made here by rcgen.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::pki::{Authority, Files, Leaf};
use common::{DEADLINE, Gateway};
use kvgate::client::{Authorized, Target, TlsFlags, TlsPaths};
use kvgate::pem::FlagFile;
use kvgate::proto::common::KvEventBatch;
use kvgate_sim::{EnginePublisher, PublisherOptions};
use rcgen::KeyPair;
use tonic::codec::Streaming;
use tonic::{Code, Request, Response, Status};

const TEST_FLAGS: TlsFlags = TlsFlags {
    uri: "--addr",
    ca: "--ca",
    cert: "--cert",
    key: "--key",
};

/// How a test client reaches a gateway.
#[derive(Default)]
struct Client {
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    token_file: Option<PathBuf>,
}

impl Client {
    fn target(&self, address: SocketAddr) -> Target {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        Target::new(
            &format!("{scheme}://{address}"),
            &TlsPaths {
                ca: self.ca.clone(),
                cert: self.cert.clone(),
                key: self.key.clone(),
            },
            TEST_FLAGS,
            self.token_file
                .as_ref()
                .map(|path| FlagFile::new("--token-file", path)),
        )
        .expect("a valid client configuration")
    }

    async fn connect(&self, address: SocketAddr) -> anyhow::Result<Authorized> {
        tokio::time::timeout(DEADLINE, self.target(address).connect())
            .await
            .expect("connect settles before the deadline")
    }

    async fn subscribe(&self, address: SocketAddr) -> Result<Streaming<KvEventBatch>, Status> {
        let channel = self
            .connect(address)
            .await
            .map_err(|error| Status::unavailable(error.to_string()))?;
        kvgate::client::subscribe(channel, "kvgate.v1.KvGate", 0).await
    }

    /// Asserts that this client gets no message from the gateway: the
    /// connection, the call or the stream fails before any batch.
    async fn gets_nothing_from(&self, address: SocketAddr, publisher: &mut EnginePublisher) {
        let Ok(channel) = self.connect(address).await else {
            return;
        };
        // A call on a connection kvgate had refused and closed once hung
        // in the client with no timer left: a call that never answers
        // gets nothing either.
        let call = kvgate::client::subscribe(channel, "kvgate.v1.KvGate", 0);
        let Ok(Ok(mut stream)) = tokio::time::timeout(DEADLINE, call).await else {
            return;
        };
        // The TLS 1.3 server verifies a client certificate after the client
        // considers the handshake done: the refusal then ends the stream.
        publisher
            .publish(common::fence_payload(u64::MAX, 0))
            .await
            .unwrap();
        let first = tokio::time::timeout(DEADLINE, stream.message())
            .await
            .expect("the stream settles before the deadline");
        assert!(first.is_err(), "a refused client got {first:?}");
    }
}

async fn publisher() -> EnginePublisher {
    EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap()
}

/// Reads `stream` until a fence published now reaches it (publishing
/// another whenever the stream goes quiet: ZMQ's slow joiner may drop the
/// first). Fence numbers of this file are far from the shared helpers'.
async fn flowing(publisher: &mut EnginePublisher, stream: &mut Streaming<KvEventBatch>) {
    static NEXT_FENCE: AtomicU64 = AtomicU64::new(1 << 40);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stream stopped flowing"
        );
        let fence = NEXT_FENCE.fetch_add(1, Ordering::Relaxed);
        publisher
            .publish(common::fence_payload(fence, 0))
            .await
            .unwrap();
        while let Ok(received) =
            tokio::time::timeout(Duration::from_millis(50), stream.message()).await
        {
            let batch = received.expect("a healthy stream").expect("an open stream");
            let fences = batch.events.iter().filter_map(common::fence_number);
            if fences.into_iter().any(|seen| seen == fence) {
                return;
            }
        }
    }
}

/// The value of one series on the admin port's /metrics.
async fn metric(admin: SocketAddr, series: &str) -> f64 {
    let (_, metrics) = common::http_get(admin, "/metrics").await;
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{metrics}"))
}

/// Waits until the gateway has counted a refused handshake for `reason`
/// (the server counts it after its alert is on the way to the client).
async fn handshake_failure_counted(gateway: &Gateway, reason: &str) {
    let admin = gateway.admin.expect("started with --metrics-listen");
    let series = format!("kvgate_tls_handshake_failures_total{{reason=\"{reason}\"}}");
    common::await_metric_where(admin, &series, ">= 1", |now| now >= 1.0).await;
}

/// Sends SIGHUP and waits until the gateway has counted the reload's result.
async fn sighup(gateway: &Gateway, result: &str) {
    reloaded_after(gateway, result, || {
        let status = Command::new("kill")
            .args(["-HUP", &gateway.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    })
    .await;
}

/// Runs `action`, then waits until the gateway has counted one more reload
/// with `result`.
async fn reloaded_after(gateway: &Gateway, result: &str, action: impl FnOnce()) {
    let admin = gateway.admin.expect("started with --metrics-listen");
    let series = format!("kvgate_credential_reloads_total{{result=\"{result}\"}}");
    let before = metric(admin, &series).await;
    action();
    let wanted = format!("> {before}");
    common::await_metric_where(admin, &series, &wanted, |now| now > before).await;
}

/// The server-side files of an mTLS gateway.
struct MtlsFiles {
    files: Files,
}

impl MtlsFiles {
    fn new() -> Self {
        let files = Files::new();
        let servers = Authority::new("server CA");
        let clients = Authority::new("client CA");
        let server = servers.server();
        files.write("server.pem", &server.cert);
        files.write("server.key", &server.key);
        files.write("servers-ca.pem", &servers.pem());
        files.write("clients-ca.pem", &clients.pem());
        let router = clients.client("router");
        files.write("router.pem", &router.cert);
        files.write("router.key", &router.key);
        Self { files }
    }

    fn server_args(&self) -> Vec<String> {
        [
            ("--tls-cert", "server.pem"),
            ("--tls-key", "server.key"),
            ("--tls-client-ca", "clients-ca.pem"),
        ]
        .into_iter()
        .flat_map(|(flag, name)| [flag.to_owned(), self.files.path(name).display().to_string()])
        .collect()
    }

    /// A client trusting the server CA, with the router's certificate.
    fn router(&self) -> Client {
        Client {
            ca: Some(self.files.path("servers-ca.pem")),
            cert: Some(self.files.path("router.pem")),
            key: Some(self.files.path("router.key")),
            token_file: None,
        }
    }
}

fn start_gateway(publisher: &EnginePublisher, extra: &[String]) -> Gateway {
    let mut args: Vec<&str> = vec![
        "--zmq-endpoint",
        publisher.endpoint(),
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend(extra.iter().map(String::as_str));
    Gateway::start(&args)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_with_a_certificate_from_the_client_ca_streams_over_mtls() {
    let pki = MtlsFiles::new();
    let mut publisher = publisher().await;
    let gateway = start_gateway(&publisher, &pki.server_args());
    let mut stream = pki
        .router()
        .subscribe(gateway.address)
        .await
        .expect("mTLS subscriber admitted");
    flowing(&mut publisher, &mut stream).await;
    let channel = pki.router().connect(gateway.address).await.unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health is served under the same TLS");
    assert_eq!(
        health.into_inner().status(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_without_a_certificate_with_a_foreign_one_or_in_plaintext_gets_no_message_and_each_refusal_is_counted()
 {
    let pki = MtlsFiles::new();
    let mut publisher = publisher().await;
    let gateway = start_gateway(&publisher, &pki.server_args());
    // Someone is streaming all along, so there are messages to get.
    let mut admitted = pki.router().subscribe(gateway.address).await.unwrap();
    flowing(&mut publisher, &mut admitted).await;

    let no_certificate = Client {
        ca: Some(pki.files.path("servers-ca.pem")),
        ..Client::default()
    };
    no_certificate
        .gets_nothing_from(gateway.address, &mut publisher)
        .await;

    let foreign = Authority::new("someone else's CA").client("router");
    let foreign_client = Client {
        ca: Some(pki.files.path("servers-ca.pem")),
        cert: Some(pki.files.write("foreign.pem", &foreign.cert)),
        key: Some(pki.files.write("foreign.key", &foreign.key)),
        token_file: None,
    };
    foreign_client
        .gets_nothing_from(gateway.address, &mut publisher)
        .await;

    // Plaintext gRPC.
    Client::default()
        .gets_nothing_from(gateway.address, &mut publisher)
        .await;

    for reason in [
        "no_client_certificate",
        "untrusted_client_certificate",
        "not_tls",
    ] {
        handshake_failure_counted(&gateway, reason).await;
    }
    flowing(&mut publisher, &mut admitted).await;
}

/// A token file holding `tokens`, one a line, with a comment and a blank.
fn token_file(files: &Files, name: &str, tokens: &[&str]) -> PathBuf {
    let mut text = String::from("# bearer tokens of the routers\n\n");
    for token in tokens {
        text.push_str(&format!("  {token}  \n"));
    }
    files.write(name, &text)
}

fn bearer(files: &Files, name: &str, token: &str) -> Client {
    Client {
        token_file: Some(files.write(name, &format!("{token}\n"))),
        ..Client::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_without_a_known_bearer_token_is_unauthenticated_and_health_needs_none() {
    let files = Files::new();
    let tokens = token_file(&files, "tokens", &["router-a-secret", "router-b-secret"]);
    let mut publisher = publisher().await;
    let gateway = start_gateway(
        &publisher,
        &["--auth-token-file".into(), tokens.display().to_string()],
    );
    let missing = Client::default().subscribe(gateway.address).await;
    assert_eq!(missing.unwrap_err().code(), Code::Unauthenticated);
    let wrong = bearer(&files, "wrong", "router-c-secret")
        .subscribe(gateway.address)
        .await;
    assert_eq!(wrong.unwrap_err().code(), Code::Unauthenticated);
    let mut right = bearer(&files, "right", "router-b-secret")
        .subscribe(gateway.address)
        .await
        .expect("a known token streams");
    flowing(&mut publisher, &mut right).await;

    let channel = Client::default().connect(gateway.address).await.unwrap();
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health needs no token");

    let admin = gateway.admin.unwrap();
    for reason in ["missing", "unknown_token"] {
        let series = format!("kvgate_auth_failures_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(admin, &series).await, 1.0, "{series}");
    }
    for page in ["/metrics", "/status"] {
        let (_, body) = common::http_get(admin, page).await;
        assert!(!body.contains("secret"), "{page} shows a token:\n{body}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_rotated_by_sighup_take_effect_while_an_open_stream_keeps_flowing() {
    let files = Files::new();
    let tokens = token_file(&files, "tokens", &["old-token"]);
    let mut publisher = publisher().await;
    let gateway = start_gateway(
        &publisher,
        &[
            "--auth-token-file".into(),
            tokens.display().to_string(),
            // SIGHUP alone.
            "--credentials-check-seconds".into(),
            "0".into(),
        ],
    );
    let old = bearer(&files, "old", "old-token");
    let new = bearer(&files, "new", "new-token");
    let mut open = old.subscribe(gateway.address).await.unwrap();
    flowing(&mut publisher, &mut open).await;

    token_file(&files, "tokens", &["new-token"]);
    sighup(&gateway, "ok").await;
    let refused = old.subscribe(gateway.address).await;
    assert_eq!(refused.unwrap_err().code(), Code::Unauthenticated);
    let mut admitted = new.subscribe(gateway.address).await.expect("new token");
    flowing(&mut publisher, &mut admitted).await;
    flowing(&mut publisher, &mut open).await;

    // A bad new file is refused and the tokens in force stay.
    files.write("tokens", "# nothing but a comment\n");
    sighup(&gateway, "failed").await;
    new.subscribe(gateway.address)
        .await
        .expect("the tokens in force stay");
    flowing(&mut publisher, &mut open).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn certificates_rotated_by_sighup_serve_new_connections_while_an_open_stream_keeps_flowing() {
    let pki = MtlsFiles::new();
    let mut publisher = publisher().await;
    let mut args = pki.server_args();
    // SIGHUP alone.
    args.extend(["--credentials-check-seconds".into(), "0".into()]);
    let gateway = start_gateway(&publisher, &args);
    let mut open = pki.router().subscribe(gateway.address).await.unwrap();
    flowing(&mut publisher, &mut open).await;

    // The server moves to a certificate from a new CA.
    let new_servers = Authority::new("new server CA");
    let server = new_servers.server();
    pki.files.write("server.key", &server.key);
    pki.files.write("server.pem", &server.cert);
    sighup(&gateway, "ok").await;
    let trusts_new = Client {
        ca: Some(pki.files.write("new-servers-ca.pem", &new_servers.pem())),
        ..pki.router()
    };
    let mut rotated = trusts_new
        .subscribe(gateway.address)
        .await
        .expect("the new certificate is served");
    flowing(&mut publisher, &mut rotated).await;
    pki.router()
        .gets_nothing_from(gateway.address, &mut publisher)
        .await;
    handshake_failure_counted(&gateway, "client_alert").await;
    flowing(&mut publisher, &mut open).await;

    // A key that does not go with the certificate is refused; the
    // certificate in force stays.
    pki.files
        .write("server.key", &KeyPair::generate().unwrap().serialize_pem());
    sighup(&gateway, "failed").await;
    trusts_new
        .subscribe(gateway.address)
        .await
        .expect("the certificate in force stays");
    flowing(&mut publisher, &mut open).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn token_and_certificate_files_changed_on_disk_are_reloaded_without_a_signal() {
    let pki = MtlsFiles::new();
    let tokens = token_file(&pki.files, "tokens", &["old-token"]);
    let mut publisher = publisher().await;
    let mut args = pki.server_args();
    args.extend([
        "--auth-token-file".into(),
        tokens.display().to_string(),
        "--credentials-check-seconds".into(),
        "1".into(),
    ]);
    let gateway = start_gateway(&publisher, &args);
    let router = |token: &str| Client {
        token_file: Some(pki.files.write(token, &format!("{token}\n"))),
        ..pki.router()
    };
    let mut open = router("old-token")
        .subscribe(gateway.address)
        .await
        .unwrap();
    flowing(&mut publisher, &mut open).await;

    let new_servers = Authority::new("new server CA");
    let server = new_servers.server();
    pki.files.write("server.key", &server.key);
    pki.files.write("server.pem", &server.cert);
    token_file(&pki.files, "tokens", &["new-token"]);
    let rotated = Client {
        ca: Some(pki.files.write("new-servers-ca.pem", &new_servers.pem())),
        ..router("new-token")
    };
    // A check may catch the files half-written (a key ahead of its
    // certificate): it refuses them and the next check takes them all.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut admitted = loop {
        if let Ok(stream) = rotated.subscribe(gateway.address).await {
            break stream;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the changed files were never taken"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    flowing(&mut publisher, &mut admitted).await;
    let old_token = Client {
        token_file: Some(pki.files.path("old-token")),
        ..rotated
    };
    let refused = old_token.subscribe(gateway.address).await;
    assert_eq!(refused.unwrap_err().code(), Code::Unauthenticated);
    flowing(&mut publisher, &mut open).await;
}

/// The test engine's only message.
#[derive(Clone, PartialEq, prost::Message)]
struct Echo {
    #[prost(string, tag = "1")]
    text: String,
}

type EchoCodec = tonic_prost::ProstCodec<Echo, Echo>;

/// What the test engine saw: every call and its authorization header.
#[derive(Default)]
struct Seen {
    calls: AtomicUsize,
    authorization: Mutex<Vec<Option<String>>>,
}

/// An engine serving `/test.Engine/Unary`, in plaintext or behind `tls`.
async fn start_engine(tls: Option<rustls::ServerConfig>) -> (SocketAddr, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let route_seen = Arc::clone(&seen);
    let route = tower::service_fn(move |request: http::Request<axum::body::Body>| {
        let seen = Arc::clone(&route_seen);
        async move {
            seen.calls.fetch_add(1, Ordering::SeqCst);
            let header = request
                .headers()
                .get("authorization")
                .map(|value| value.to_str().unwrap().to_owned());
            seen.authorization.lock().unwrap().push(header);
            let request = request.map(tonic::body::Body::new);
            let mut grpc = tonic::server::Grpc::new(EchoCodec::default());
            let echo = tower::service_fn(|request: Request<Echo>| async move {
                Ok::<_, Status>(Response::new(Echo {
                    text: format!("echo {}", request.into_inner().text),
                }))
            });
            Ok::<_, std::convert::Infallible>(grpc.unary(echo, request).await)
        }
    });
    let router = axum::Router::new().route_service("/test.Engine/Unary", route);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    match tls {
        None => {
            tokio::spawn(async move { axum::serve(listener, router).await });
        }
        Some(config) => {
            let listener = EngineTls {
                listener,
                acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            };
            tokio::spawn(async move { axum::serve(listener, router).await });
        }
    }
    (address, seen)
}

/// The test engine's TLS: handshakes one after another (a test engine has
/// one client).
struct EngineTls {
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for EngineTls {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, SocketAddr) {
        loop {
            let Ok((stream, peer)) = self.listener.accept().await else {
                continue;
            };
            if let Ok(stream) = self.acceptor.accept(stream).await {
                return (stream, peer);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// An engine TLS config requiring client certificates from `clients`.
fn engine_tls(server: &Leaf, clients: &Authority) -> rustls::ServerConfig {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(clients.pem().as_bytes()).unwrap())
        .unwrap();
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![CertificateDer::from_pem_slice(server.cert.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(server.key.as_bytes()).unwrap(),
        )
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    config
}

async fn call_unary(channel: Authorized, text: &str) -> Result<Response<Echo>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    grpc.unary(
        Request::new(Echo { text: text.into() }),
        "/test.Engine/Unary".parse().unwrap(),
        EchoCodec::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pass_through_call_without_a_token_never_reaches_the_engine() {
    let files = Files::new();
    let tokens = token_file(&files, "tokens", &["router-secret"]);
    let (engine, seen) = start_engine(None).await;
    let publisher = publisher().await;
    let gateway = start_gateway(
        &publisher,
        &[
            "--auth-token-file".into(),
            tokens.display().to_string(),
            "--engine-grpc".into(),
            format!("http://{engine}"),
        ],
    );
    for client in [Client::default(), bearer(&files, "wrong", "not-the-secret")] {
        let channel = client.connect(gateway.address).await.unwrap();
        let refused = call_unary(channel, "hello").await.unwrap_err();
        assert_eq!(refused.code(), Code::Unauthenticated);
    }
    assert_eq!(
        seen.calls.load(Ordering::SeqCst),
        0,
        "nothing reached the engine"
    );

    let channel = bearer(&files, "right", "router-secret")
        .connect(gateway.address)
        .await
        .unwrap();
    let answer = call_unary(channel, "hello").await.expect("passed through");
    assert_eq!(answer.into_inner().text, "echo hello");
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        *seen.authorization.lock().unwrap(),
        [Some("Bearer router-secret".to_owned())],
        "the header reaches the engine unchanged"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kvgate_reaches_an_engine_over_tls_with_a_client_certificate() {
    let files = Files::new();
    let engine_servers = Authority::new("engine server CA");
    let engine_clients = Authority::new("engine client CA");
    let (engine, seen) =
        start_engine(Some(engine_tls(&engine_servers.server(), &engine_clients))).await;
    let kvgate_identity = engine_clients.client("kvgate");
    let ca = files.write("engine-ca.pem", &engine_servers.pem());
    let cert = files.write("kvgate.pem", &kvgate_identity.cert);
    let key = files.write("kvgate.key", &kvgate_identity.key);
    let publisher = publisher().await;
    let engine_uri = format!("https://{engine}");
    let with_certificate = start_gateway(
        &publisher,
        &[
            "--engine-grpc".into(),
            engine_uri.clone(),
            "--engine-tls-ca".into(),
            ca.display().to_string(),
            "--engine-tls-cert".into(),
            cert.display().to_string(),
            "--engine-tls-key".into(),
            key.display().to_string(),
        ],
    );
    let channel = Client::default()
        .connect(with_certificate.address)
        .await
        .unwrap();
    let answer = call_unary(channel, "over tls")
        .await
        .expect("engine answers");
    assert_eq!(answer.into_inner().text, "echo over tls");
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1);

    // Without a client certificate the engine lets nothing in.
    let without_certificate = start_gateway(
        &publisher,
        &[
            "--engine-grpc".into(),
            engine_uri,
            "--engine-tls-ca".into(),
            ca.display().to_string(),
        ],
    );
    let channel = Client::default()
        .connect(without_certificate.address)
        .await
        .unwrap();
    let refused = call_unary(channel, "no certificate").await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_chained_behind_a_gateway_streams_over_mtls_with_a_token() {
    let pki = MtlsFiles::new();
    let tokens = token_file(&pki.files, "tokens", &["downstream-secret"]);
    let mut publisher = publisher().await;
    let mut upstream_args = pki.server_args();
    upstream_args.extend(["--auth-token-file".into(), tokens.display().to_string()]);
    let upstream = start_gateway(&publisher, &upstream_args);
    let downstream = Gateway::start(&[
        "--upstream-grpc",
        &format!("https://localhost:{}", upstream.address.port()),
        "--upstream-tls-ca",
        &pki.files.path("servers-ca.pem").display().to_string(),
        "--upstream-tls-cert",
        &pki.files.path("router.pem").display().to_string(),
        "--upstream-tls-key",
        &pki.files.path("router.key").display().to_string(),
        "--upstream-token-file",
        &tokens.display().to_string(),
    ]);
    let mut stream = Client::default()
        .subscribe(downstream.address)
        .await
        .unwrap();
    flowing(&mut publisher, &mut stream).await;
}

/// Runs `kvgate serve` expecting it to refuse to start; returns its stderr.
fn refusal(args: &[&str]) -> String {
    let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--zmq-endpoint", "tcp://127.0.0.1:1"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let output = match rx.recv_timeout(DEADLINE) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
            panic!("kvgate started with {args:?}");
        }
    };
    assert!(!output.status.success(), "kvgate started with {args:?}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn assert_names(stderr: &str, flag: &str, file: &Path) {
    assert!(
        stderr.contains(&format!("{flag} {}", file.display())),
        "expected {flag} {} in: {stderr}",
        file.display()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kvgate_refuses_to_start_on_bad_trust_material_naming_the_flag_and_the_file() {
    let pki = MtlsFiles::new();
    let missing = pki.files.path("missing.pem");
    let cert = pki.files.path("server.pem");
    let key = pki.files.path("server.key");
    let (cert_arg, key_arg, missing_arg) = (
        cert.display().to_string(),
        key.display().to_string(),
        missing.display().to_string(),
    );

    let stderr = refusal(&["--tls-cert", &missing_arg, "--tls-key", &key_arg]);
    assert_names(&stderr, "--tls-cert", &missing);

    let stranger = pki.files.write(
        "stranger.key",
        &KeyPair::generate().unwrap().serialize_pem(),
    );
    let stderr = refusal(&[
        "--tls-cert",
        &cert_arg,
        "--tls-key",
        &stranger.display().to_string(),
    ]);
    assert_names(&stderr, "--tls-key", &stranger);
    assert_names(&stderr, "--tls-cert", &cert);

    let stderr = refusal(&[
        "--tls-cert",
        &cert_arg,
        "--tls-key",
        &key_arg,
        "--tls-client-ca",
        &missing_arg,
    ]);
    assert_names(&stderr, "--tls-client-ca", &missing);

    let not_pem = pki.files.write("not-pem.pem", "just some words\n");
    let stderr = refusal(&[
        "--tls-cert",
        &not_pem.display().to_string(),
        "--tls-key",
        &key_arg,
    ]);
    assert_names(&stderr, "--tls-cert", &not_pem);

    let empty = pki.files.write("empty-tokens", "# nobody yet\n\n");
    let stderr = refusal(&["--auth-token-file", &empty.display().to_string()]);
    assert_names(&stderr, "--auth-token-file", &empty);
    let stderr = refusal(&["--auth-token-file", &missing_arg]);
    assert_names(&stderr, "--auth-token-file", &missing);
    let huge = pki.files.write("huge-tokens", &"t".repeat(2 << 20));
    let stderr = refusal(&["--auth-token-file", &huge.display().to_string()]);
    assert_names(&stderr, "--auth-token-file", &huge);

    let stderr = refusal(&["--engine-grpc", "https://127.0.0.1:1"]);
    assert!(stderr.contains("--engine-tls-ca"), "{stderr}");
    let stderr = refusal(&[
        "--engine-grpc",
        "https://127.0.0.1:1",
        "--engine-tls-ca",
        &pki.files.path("servers-ca.pem").display().to_string(),
        "--engine-tls-cert",
        &pki.files.path("router.pem").display().to_string(),
        "--engine-tls-key",
        &missing_arg,
    ]);
    assert_names(&stderr, "--engine-tls-key", &missing);
    let stderr = refusal(&[
        "--engine-grpc",
        "http://127.0.0.1:1",
        "--engine-tls-ca",
        &pki.files.path("servers-ca.pem").display().to_string(),
    ]);
    assert!(stderr.contains("--engine-tls-ca"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fifo_given_as_a_credential_file_stops_kvgate_at_start_naming_the_flag() {
    let pki = MtlsFiles::new();
    let fifo = pki.files.path("fifo");
    common::replace_with_fifo(&fifo);
    let fifo_arg = fifo.display().to_string();
    let stderr = refusal(&["--auth-token-file", &fifo_arg]);
    assert_names(&stderr, "--auth-token-file", &fifo);
    assert!(stderr.contains("FIFO"), "{stderr}");
    let key_arg = pki.files.path("server.key").display().to_string();
    let stderr = refusal(&["--tls-cert", &fifo_arg, "--tls-key", &key_arg]);
    assert_names(&stderr, "--tls-cert", &fifo);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_file_replaced_by_a_fifo_is_refused_at_reload_and_serving_and_sigterm_go_on() {
    let files = Files::new();
    let tokens = token_file(&files, "tokens", &["router-token"]);
    let mut publisher = publisher().await;
    let mut gateway = start_gateway(
        &publisher,
        &[
            "--auth-token-file".into(),
            tokens.display().to_string(),
            // The periodic check reads the FIFO too.
            "--credentials-check-seconds".into(),
            "1".into(),
        ],
    );
    let router = bearer(&files, "router", "router-token");
    let mut open = router.subscribe(gateway.address).await.unwrap();
    flowing(&mut publisher, &mut open).await;

    common::replace_with_fifo(&tokens);
    sighup(&gateway, "failed").await;
    // A check that follows reads the FIFO again, and it is refused again
    // (the change is reported once), without freezing anything.
    let admin = gateway.admin.unwrap();
    let (status, body) = common::http_get(admin, "/healthz").await;
    assert_eq!(status, 200, "{body}");
    flowing(&mut publisher, &mut open).await;
    let mut another = router
        .subscribe(gateway.address)
        .await
        .expect("the tokens in force stay");
    flowing(&mut publisher, &mut another).await;
    let status = gateway.terminate();
    assert!(status.success(), "{status:?}");
}
