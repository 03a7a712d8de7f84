//! Shared harness of the end-to-end tests: the real `kvgate` binary, real
//! ZMQ publishers and real tonic subscribers, all on loopback.

#![allow(dead_code)]

pub mod index;
pub mod pki;
pub mod raw_codec;
pub mod recording;
pub mod router;
pub mod socket_dir;
pub mod zmtp;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use kvgate::proto::common::KvEventBatch;
use tonic::codec::Streaming;
use tonic::transport::Channel;

/// Upper bound for anything a test waits on.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Lines of a kvgate's stderr kept to say why it did not start: the last
/// ones, the reason among them.
const STDERR_LINES_KEPT: usize = 64;

/// A running `kvgate` process, killed by pid when dropped.
pub struct Gateway {
    /// Taken by `terminate`, which waits for the exit.
    child: Option<Child>,
    pub address: SocketAddr,
    /// The admin HTTP address, when started with `--metrics-listen`.
    pub admin: Option<SocketAddr>,
}

impl Gateway {
    /// Starts `kvgate serve --listen 127.0.0.1:0 <args>` and waits until it
    /// reports its address.
    pub fn start(args: &[&str]) -> Self {
        Self::start_listening("127.0.0.1:0", args)
    }

    /// Starts `kvgate serve --listen <listen> <args>` and waits until it
    /// reports its address.
    pub fn start_listening(listen: &str, args: &[&str]) -> Self {
        Self::spawn(listen, args, &[], |_| {})
    }

    /// Starts `kvgate serve --listen 127.0.0.1:0 <args>` with `env` set.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn("127.0.0.1:0", args, env, |_| {})
    }

    /// Starts `kvgate serve --listen 127.0.0.1:0 <args>` with `configure`
    /// applied to the command last (where stderr goes, limits set before
    /// exec).
    pub fn start_configured(args: &[&str], configure: impl FnOnce(&mut Command)) -> Self {
        Self::spawn("127.0.0.1:0", args, &[], configure)
    }

    fn spawn(
        listen: &str,
        args: &[&str],
        env: &[(&str, &str)],
        configure: impl FnOnce(&mut Command),
    ) -> Self {
        Self::try_spawn(listen, args, env, configure)
            .unwrap_or_else(|failure| panic!("kvgate did not report its address: {failure}"))
    }

    /// Starts kvgate with ports `free_ports(n)` chose, `args(base)` naming
    /// them, and, should another process take one of them before kvgate
    /// binds it, starts it again on others (at most 5 tries): a port is
    /// free only until somebody binds it or connects from it. Returns the
    /// gateway and the base port it bound.
    pub fn start_on_free_ports(n: u16, args: impl Fn(u16) -> Vec<String>) -> (Self, u16) {
        Self::start_listening_on_free_ports(n, |base| ("127.0.0.1:0".to_owned(), args(base)))
    }

    /// `start_on_free_ports`, with `--listen` among the addresses chosen:
    /// `args(base)` gives it and the rest.
    pub fn start_listening_on_free_ports(
        n: u16,
        args: impl Fn(u16) -> (String, Vec<String>),
    ) -> (Self, u16) {
        let mut failures = Vec::new();
        for _ in 0..5 {
            let base = free_ports(n);
            let (listen, args) = args(base);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            match Self::try_spawn(&listen, &args, &[], |_| {}) {
                Ok(gateway) => return (gateway, base),
                Err(failure) if failure.port_was_taken() => failures.push(failure),
                Err(failure) => panic!("kvgate did not start: {failure}"),
            }
        }
        panic!("kvgate found its ports taken 5 times: {failures:?}");
    }

    fn try_spawn(
        listen: &str,
        args: &[&str],
        env: &[(&str, &str)],
        configure: impl FnOnce(&mut Command),
    ) -> Result<Self, StartFailure> {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kvgate"));
        command
            .arg("serve")
            // The banner this harness reads is on stdout in text format.
            .args(["--log-format", "text"])
            .args(["--listen", listen])
            .args(args)
            .envs(env.iter().copied())
            .env(
                "RUST_LOG",
                std::env::var("KVGATE_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        configure(&mut command);
        let mut child = command.spawn().expect("kvgate binary starts");
        // Through the test's own stderr, which the test harness captures
        // (a spawned thread inherits the capture) and shows only when the
        // test fails: the warnings a test provokes on purpose stay quiet.
        // A test that sent stderr elsewhere reads it there. The last lines
        // are kept too, to tell why kvgate did not start.
        let stderr_lines = std::sync::Arc::new(std::sync::Mutex::new(VecDeque::new()));
        let stderr_ended = child.stderr.take().map(|stderr| {
            let lines = std::sync::Arc::clone(&stderr_lines);
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    eprintln!("kvgate: {line}");
                    let mut lines = lines.lock().unwrap();
                    if lines.len() == STDERR_LINES_KEPT {
                        lines.pop_front();
                    }
                    lines.push_back(line);
                }
            })
        });
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std_mpsc::channel();
        std::thread::spawn(move || {
            let mut admin = None;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) =
                    line.strip_prefix("kvgate: metrics, /healthz and /status on http://")
                {
                    admin = rest.parse::<SocketAddr>().ok();
                }
                if let Some(rest) = line.strip_prefix("kvgate: serving gRPC on ") {
                    let address = rest.split(',').next().unwrap_or_default().to_owned();
                    let _ = tx.send((address, admin));
                }
            }
        });
        match rx.recv_timeout(DEADLINE) {
            Ok((address, admin)) => Ok(Self {
                child: Some(child),
                address: address.parse().expect("a socket address"),
                admin,
            }),
            Err(_) => {
                let _ = child.kill();
                let exit = child.wait().expect("wait for kvgate");
                // Everything it wrote, now that it is gone.
                if let Some(ended) = stderr_ended {
                    let _ = ended.join();
                }
                let stderr = std::mem::take(&mut *stderr_lines.lock().unwrap()).into();
                Err(StartFailure { exit, stderr })
            }
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("still running").id()
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.url())
            .unwrap()
            .connect_timeout(DEADLINE)
            .connect()
            .await
            .expect("connect to kvgate")
    }

    /// Sends SIGTERM and waits (bounded) for the exit status.
    /// Waits (bounded) until gRPC health says SERVING for `service` (""
    /// for the whole server): kvgate announces its address before its
    /// source is up, and health follows the source.
    pub async fn await_serving(&self, service: &str) {
        use tonic_health::pb::health_check_response::ServingStatus;
        use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
        let mut watch = HealthClient::new(self.channel().await)
            .watch(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health needs no token")
            .into_inner();
        loop {
            let status = tokio::time::timeout(DEADLINE, watch.message())
                .await
                .expect("a status before the deadline")
                .expect("a good status")
                .expect("an open watch");
            if status.status == ServingStatus::Serving as i32 {
                return;
            }
        }
    }

    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("still running");
        let pid = child.id().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill runs");
        assert!(status.success());
        let (tx, rx) = std_mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        match rx.recv_timeout(DEADLINE) {
            Ok(exit) => exit.expect("wait for kvgate"),
            Err(_) => {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
                panic!("kvgate did not exit after SIGTERM");
            }
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Why kvgate stopped before reporting its address.
#[derive(Debug)]
pub struct StartFailure {
    pub exit: std::process::ExitStatus,
    /// The last lines of its stderr, unless the test sent that elsewhere.
    pub stderr: Vec<String>,
}

impl StartFailure {
    /// Whether it stopped because a port it was to bind was in use: its
    /// last word (`main`'s error, not a warning) says so.
    fn port_was_taken(&self) -> bool {
        self.stderr.last().is_some_and(|line| {
            line.starts_with("kvgate: ") && line.contains("Address already in use")
        })
    }
}

impl std::fmt::Display for StartFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}; stderr: {}", self.exit, self.stderr.join(" | "))
    }
}

/// `VmRSS` of a live (not zombie) process, in KiB.
pub fn live_rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// Subscribes through a stock tonic client to `service`'s `SubscribeKvEvents`.
#[allow(unused_imports)]
pub use kvgate::client::subscribe;

/// The next batch, failing the test if none comes within the deadline.
pub async fn next_batch(stream: &mut Streaming<KvEventBatch>) -> KvEventBatch {
    tokio::time::timeout(DEADLINE, stream.message())
        .await
        .expect("a batch before the deadline")
        .expect("a healthy stream")
        .expect("the stream is still open")
}

/// `n` consecutive free loopback ports (for a publisher per rank at base + r).
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..100 {
        let first = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = first.local_addr().unwrap().port();
        if base.checked_add(n).is_none() {
            continue;
        }
        let rest: Result<Vec<_>, _> = (1..n)
            .map(|r| TcpListener::bind(("127.0.0.1", base + r)))
            .collect();
        if rest.is_ok() {
            return base;
        }
    }
    panic!("no {n} consecutive free ports");
}

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wire")
}

/// A fixture's payload bytes and its description.
pub fn fixture(name: &str) -> (Vec<u8>, serde_json::Value) {
    let dir = fixtures_dir();
    let payload = std::fs::read(dir.join(format!("{name}.msgpack"))).expect("fixture payload");
    let json = std::fs::read(dir.join(format!("{name}.json"))).expect("fixture json");
    (payload, serde_json::from_slice(&json).unwrap())
}

/// First hash of a fence removal ("kvgate" in ASCII): no engine stores it.
const FENCE_MARKER: i64 = 0x6b76_6761_7465_0000;

/// A vLLM-format payload `[ts, [BlockRemoved{block_hashes}], rank]`.
/// Removing blocks nobody stored changes no state, in kvgate or in a
/// router.
pub fn removed_payload(block_hashes: &[i64], rank: u32) -> bytes::Bytes {
    let mut out = Vec::new();
    rmp::encode::write_array_len(&mut out, 3).unwrap();
    rmp::encode::write_f64(&mut out, 1.0).unwrap();
    rmp::encode::write_array_len(&mut out, 1).unwrap();
    rmp::encode::write_map_len(&mut out, 2).unwrap();
    rmp::encode::write_str(&mut out, "type").unwrap();
    rmp::encode::write_str(&mut out, "BlockRemoved").unwrap();
    rmp::encode::write_str(&mut out, "block_hashes").unwrap();
    rmp::encode::write_array_len(&mut out, block_hashes.len() as u32).unwrap();
    for &hash in block_hashes {
        rmp::encode::write_sint(&mut out, hash).unwrap();
    }
    rmp::encode::write_uint(&mut out, u64::from(rank)).unwrap();
    out.into()
}

/// A removal of `[MARKER, n]`: a marker a test can publish and recognise in
/// every stream.
pub fn fence_payload(n: u64, rank: u32) -> bytes::Bytes {
    removed_payload(&[FENCE_MARKER, n as i64], rank)
}

/// Fence `n` as a proto event, for a source that speaks gRPC.
pub fn fence_event(n: u64) -> kvgate::proto::common::KvCacheEvent {
    use kvgate::proto::common::{KvBlocksRemoved, KvCacheEvent, kv_cache_event::Data};
    KvCacheEvent {
        event_id: 0,
        data: Some(Data::Removed(KvBlocksRemoved {
            block_hashes: vec![FENCE_MARKER, n as i64],
            ..Default::default()
        })),
    }
}

/// The fence number of `event`, if it is a fence.
pub fn fence_number(event: &kvgate::proto::common::KvCacheEvent) -> Option<u64> {
    use kvgate::proto::common::kv_cache_event::Data;
    match &event.data {
        Some(Data::Removed(removed)) => match removed.block_hashes.as_slice() {
            [FENCE_MARKER, n] => Some(*n as u64),
            _ => None,
        },
        _ => None,
    }
}

/// The first fence number a batch carries, if any.
pub fn fence_in(batch: &KvEventBatch) -> Option<u64> {
    batch.events.iter().find_map(fence_number)
}

/// Whether `batch` carries fence `n`. Fences published close together can
/// share a batch, so the first one is not enough.
pub fn carries_fence(batch: &KvEventBatch, n: u64) -> bool {
    batch
        .events
        .iter()
        .filter_map(fence_number)
        .any(|fence| fence == n)
}

/// The next batch of a read up to fence `n`, failing the test once
/// `deadline` passes: a stream that carries load records is never quiet
/// long enough for [`next_batch`]'s own deadline.
async fn next_batch_toward_fence(
    stream: &mut Streaming<KvEventBatch>,
    n: u64,
    deadline: tokio::time::Instant,
) -> KvEventBatch {
    tokio::time::timeout_at(deadline, next_batch(stream))
        .await
        .unwrap_or_else(|_| panic!("fence {n} before the deadline"))
}

/// Reads `stream` up to and including the batch with fence `n`.
pub async fn skip_past_fence(stream: &mut Streaming<KvEventBatch>, n: u64) -> Vec<KvEventBatch> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut skipped = Vec::new();
    loop {
        let batch = next_batch_toward_fence(stream, n, deadline).await;
        let done = carries_fence(&batch, n);
        skipped.push(batch);
        if done {
            return skipped;
        }
    }
}

/// Gets past ZMQ's slow joiner: publishes fences until kvgate forwards one
/// to `streams[0]`, then one last fence that every stream reads past. After
/// this, everything published reaches every stream. Returns that last fence.
pub async fn sync_streams(
    publisher: &mut kvgate_sim::EnginePublisher,
    rank: u32,
    streams: &mut [Streaming<KvEventBatch>],
) -> u64 {
    sync_streams_observing(publisher, rank, streams, |_, _| {}).await
}

/// [`sync_streams`], handing every batch read on the way to `observe` with
/// its stream's index (a router view must see them all).
pub async fn sync_streams_observing(
    publisher: &mut kvgate_sim::EnginePublisher,
    rank: u32,
    streams: &mut [Streaming<KvEventBatch>],
    mut observe: impl FnMut(usize, &KvEventBatch),
) -> u64 {
    static NEXT_FENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let fence = || NEXT_FENCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let first = fence();
    let mut probe_fence = first;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "kvgate never forwarded a fence"
        );
        publisher
            .publish(fence_payload(probe_fence, rank))
            .await
            .unwrap();
        let probe = tokio::time::timeout(Duration::from_millis(50), streams[0].message()).await;
        if let Ok(received) = probe {
            let batch = received.expect("healthy stream").expect("open stream");
            observe(0, &batch);
            // Only a fence of this call proves the engine's socket: a load
            // record, a snapshot chunk or a replayed batch (older fences
            // included) can all arrive before the subscription reaches
            // the publisher, and a fence published then is lost.
            let live = batch
                .events
                .iter()
                .filter_map(fence_number)
                .any(|n| (first..=probe_fence).contains(&n));
            if live {
                break;
            }
        }
        probe_fence = fence();
    }
    let last = fence();
    publisher.publish(fence_payload(last, rank)).await.unwrap();
    for (index, stream) in streams.iter_mut().enumerate() {
        for batch in skip_past_fence(stream, last).await {
            observe(index, &batch);
        }
    }
    last
}

/// Replaces `path` with a FIFO nobody has open: opening it the ordinary way
/// waits for the other end for ever (reading for a writer, writing for a
/// reader).
pub fn replace_with_fifo(path: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt as _;
    let _ = std::fs::remove_file(path);
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: mkfifo reads the NUL-terminated path it is given.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// Whether `batch` is a `load_only` batch (no events, no cursor).
pub fn is_load_only(batch: &KvEventBatch) -> bool {
    batch.load.as_ref().is_some_and(|load| load.load_only)
}

/// A plain HTTP/1.0 GET on loopback: (status code, body).
pub async fn http_get(address: SocketAddr, path: &str) -> (u16, String) {
    http_exchange(address, "GET", path, None, None).await
}

/// One HTTP/1.0 exchange over a raw socket: (status, body text). A body (and
/// any POST) is sent with its length (a refused body may be answered before
/// it is all sent), typed `content_type` when given.
pub async fn http_exchange(
    address: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    content_type: Option<&str>,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut head = format!("{method} {path} HTTP/1.0\r\nHost: {address}\r\n");
    if let Some(content_type) = content_type {
        head.push_str(&format!("content-type: {content_type}\r\n"));
    }
    if body.is_some() || method == "POST" {
        let length = body.map_or(0, <[u8]>::len);
        head.push_str(&format!("content-length: {length}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let _ = stream.write_all(body.unwrap_or_default()).await;
    let mut response = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut response))
        .await
        .expect("a response before the deadline")
        .unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").expect("headers end");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("a status code");
    (status, body.to_owned())
}

/// Publishes `steps` scheduler steps of `engine` on rank 0, then fence
/// `fence` to tell where they end.
pub async fn publish_steps_then_fence(
    engine: &mut kvgate_sim::SimEngine,
    publisher: &mut kvgate_sim::EnginePublisher,
    steps: usize,
    fence: u64,
) {
    for _ in 0..steps {
        let mut payload = Vec::new();
        kvgate_sim::encode_batch(1.0, &engine.step(), Some(0), &mut payload);
        publisher.publish(payload.into()).await.unwrap();
    }
    publisher.publish(fence_payload(fence, 0)).await.unwrap();
}

/// The simulated engine's live blocks as a router's block set.
pub fn true_blocks(engine: &kvgate_sim::SimEngine) -> router::BlockSet {
    engine.live_blocks().map(|hash| (hash as i64, 1)).collect()
}

/// Admits every batch of `stream` into `view` up to the one carrying fence
/// `n`; returns them with their admissions.
pub async fn follow_to_fence(
    stream: &mut Streaming<KvEventBatch>,
    view: &mut router::RouterView,
    n: u64,
) -> Vec<(KvEventBatch, router::Admission)> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut seen = Vec::new();
    loop {
        let batch = next_batch_toward_fence(stream, n, deadline).await;
        let admission = view.admit(&batch);
        let done = carries_fence(&batch, n);
        seen.push((batch, admission));
        if done {
            return seen;
        }
    }
}

/// The value of the sample `name{labels}` in a Prometheus text exposition.
pub fn metric_sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        line.strip_prefix(series)?
            .trim()
            .split(' ')
            .next()?
            .parse()
            .ok()
    })
}

/// Polls the admin port's `/metrics` until `series` reads `value`, failing
/// the test at the deadline.
pub async fn await_metric(admin: SocketAddr, series: &str, value: f64) {
    await_metric_where(admin, series, &format!("= {value}"), |now| now == value).await;
}

/// Polls the admin port's `/metrics` until `series` satisfies `reached`
/// (described as `wanted` in the failure), failing the test at the
/// deadline; returns the value read. `/metrics` has no push, so this is the
/// tests' one poll loop.
pub async fn await_metric_where(
    admin: SocketAddr,
    series: &str,
    wanted: &str,
    reached: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let (_, text) = http_get(admin, "/metrics").await;
        let now = metric_sample(&text, series);
        if let Some(value) = now.filter(|&value| reached(value)) {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} is {now:?}, never {wanted}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A memory figure (`VmRSS:`, `VmHWM:`, ...) of the live (not zombie)
/// process `pid`, in KiB, from `/proc/<pid>/status`.
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process runs");
    let value = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_else(|| panic!("{name} in /proc/{pid}/status"))
    };
    assert!(!value("State:").starts_with('Z'), "the process died");
    value(field)
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{field} in kB"))
}

/// The peak resident memory of the live process `pid`, in KiB: a burst
/// between two samples counts too.
pub fn peak_rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmHWM:")
}

/// A gateway with its admin port on a publisher that has published nothing
/// yet, with `extra` flags.
pub async fn gateway_on_a_publisher(extra: &[&str]) -> (Gateway, kvgate_sim::EnginePublisher) {
    let options = kvgate_sim::PublisherOptions::default();
    let publisher = kvgate_sim::EnginePublisher::bind("tcp://127.0.0.1:0", &options)
        .await
        .unwrap();
    let mut args = vec![
        "--zmq-endpoint",
        publisher.endpoint(),
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    (Gateway::start(&args), publisher)
}

/// Runs an external checker (`promtool`, `kubernetes-validate`) in `dir`;
/// `None` when it is not installed and this is not CI, where a missing
/// checker fails the test (`.ci/run` installs each one; `install` says how).
pub fn external_tool(
    tool: &str,
    args: &[&str],
    dir: &std::path::Path,
    install: &str,
) -> Option<std::process::Output> {
    match Command::new(tool).args(args).current_dir(dir).output() {
        Ok(output) => Some(output),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            let in_ci = std::env::var("CI").is_ok_and(|ci| ci == "true" || ci == "1");
            assert!(!in_ci, "{tool} is missing in CI: {install} (.ci/run does)");
            eprintln!("SKIPPED: {tool} not found on PATH ({install}); not checked");
            None
        }
        Err(error) => panic!("{tool} did not run: {error}"),
    }
}

/// Makes `command`'s process start with at most `limit` open files (soft
/// and hard), so it cannot raise the limit itself.
pub fn limit_open_files(command: &mut Command, limit: u64) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: between fork and exec only setrlimit runs, which allocates
    // nothing and takes no lock.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// Runs `kvgate <args>`, which must end by itself (a refused start): its
/// exit status and what it wrote on stderr.
pub fn exit_of(args: &[&str]) -> (Option<i32>, String) {
    let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate starts");
    let output = output_within_deadline(child);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output.status.code(), stderr)
}

/// Waits for `child` (its output piped) to end and returns its output; past
/// the deadline it is killed by its pid and the test fails.
pub fn output_within_deadline(mut child: Child) -> std::process::Output {
    let deadline = std::time::Instant::now() + DEADLINE;
    while child.try_wait().expect("wait for the child").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the child process did not end in time");
        }
        std::thread::park_timeout(Duration::from_millis(20));
    }
    child.wait_with_output().expect("the child's output")
}

/// A running `kvgate index`, killed by pid when dropped.
pub struct IndexProcess {
    child: Child,
    pub address: SocketAddr,
}

impl IndexProcess {
    /// Starts `kvgate index --listen 127.0.0.1:0 <args>` and waits until it
    /// reports its address.
    pub fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .args(["index", "--log-format", "text", "--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("kvgate starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(address) =
                    line.strip_prefix("kvgate: index answering Dynamo's API on http://")
                {
                    let _ = tx.send(address.parse::<SocketAddr>().unwrap());
                }
            }
        });
        let address = rx
            .recv_timeout(DEADLINE)
            .expect("kvgate index reports its address");
        IndexProcess { child, address }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for IndexProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Removes a state directory a kvgate kept, and the announcement mark it
/// kept for it in `/dev/shm` (which outlives every process by design).
pub fn remove_state_dir(dir: &std::path::Path) {
    if let Ok(mark) = kvgate::store::mark_of(dir) {
        let _ = std::fs::remove_file(mark);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// How long a test waits between two looks at what nothing announces.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// A wait, bounded by a deadline, for a condition nothing announces (an
/// answer over HTTP, a counter, a log line, what only `/proc` shows): each
/// look that finds it not yet true calls [`Polling::again`], which fails
/// the test with what the look saw once the deadline has passed. The one
/// place tests pause between looks.
pub struct Polling {
    deadline: tokio::time::Instant,
}

impl Polling {
    /// A wait of at most `within`.
    pub fn within(within: Duration) -> Self {
        Polling {
            deadline: tokio::time::Instant::now() + within,
        }
    }

    /// Whether the deadline has passed.
    pub fn expired(&self) -> bool {
        tokio::time::Instant::now() >= self.deadline
    }

    /// Fails the test with `seen` past the deadline; otherwise pauses
    /// before the next look.
    pub async fn again(&mut self, seen: impl std::fmt::Display) {
        assert!(!self.expired(), "{seen}");
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Polls `reached` until it holds, failing the test with `what` once
/// `within` has passed.
pub async fn poll_until(what: &str, within: Duration, mut reached: impl FnMut() -> bool) {
    let mut polling = Polling::within(within);
    while !reached() {
        polling.again(what).await;
    }
}
