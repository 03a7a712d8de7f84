//! Shared harness of the end-to-end tests: the real `kvgate` binary, real
//! ZMQ publishers and real tonic subscribers, all on loopback.

#![allow(dead_code)]

pub mod router;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use kvgate::proto::common::{KvEventBatch, SubscribeKvEventsRequest};
use tonic::codec::Streaming;
use tonic::transport::Channel;

/// Upper bound for anything a test waits on.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// A running `kvgate` process, killed by pid when dropped.
pub struct Gateway {
    child: Child,
    pub address: SocketAddr,
}

impl Gateway {
    /// Starts `kvgate serve --listen 127.0.0.1:0 <args>` and waits until it
    /// reports its address.
    pub fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", std::env::var("KVGATE_TEST_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("kvgate binary starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std_mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("kvgate: serving gRPC on ") {
                    let address = rest.split(',').next().unwrap_or_default().to_owned();
                    let _ = tx.send(address);
                }
            }
        });
        let address = match rx.recv_timeout(DEADLINE) {
            Ok(address) => address.parse().expect("a socket address"),
            Err(_) => {
                let _ = child.kill();
                panic!("kvgate did not report its address in time");
            }
        };
        Self { child, address }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
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
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
        let deadline = std::time::Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(std::time::Instant::now() < deadline, "kvgate did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Subscribes through a stock tonic client to `service`'s `SubscribeKvEvents`.
pub async fn subscribe(
    channel: Channel,
    service: &str,
    start_sequence_number: u64,
) -> Result<Streaming<KvEventBatch>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("channel ready");
    let path = format!("/{service}/SubscribeKvEvents").parse().unwrap();
    let request = SubscribeKvEventsRequest {
        start_sequence_number,
        load_records_before_first_batch: false,
    };
    let codec = tonic_prost::ProstCodec::<SubscribeKvEventsRequest, KvEventBatch>::default();
    grpc.server_streaming(tonic::Request::new(request), path, codec)
        .await
        .map(tonic::Response::into_inner)
}

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
        let rest: Result<Vec<_>, _> = (1..n).map(|r| TcpListener::bind(("127.0.0.1", base + r))).collect();
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
