//! What an operator reads: with `--log-format json` every line kvgate writes
//! is a JSON object on stderr (the start-up banner too) and stdout stays
//! quiet; the engine's arrival is one "waiting" line, then one "connected"
//! line; no Rust `Option` noise in fields; no colours in a pipe.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use kvgate_sim::{EnginePublisher, PublisherOptions};

/// A kvgate child, killed by pid when dropped.
struct Running(Option<Child>);

impl Running {
    /// Kills it and returns what it wrote on stdout.
    fn stop(mut self) -> Vec<u8> {
        let mut child = self.0.take().expect("running");
        child.kill().unwrap();
        child.wait_with_output().unwrap().stdout
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `kvgate ARGS` with `RUST_LOG=info` and hands every stderr line to
/// the returned channel.
fn start(args: &[&str]) -> (Running, mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("KVGATE_LOG_FORMAT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate starts");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (Running(Some(child)), rx)
}

/// Lines read until one contains `needle` (that one included).
fn lines_until(lines: &mpsc::Receiver<String>, needle: &str) -> Vec<String> {
    let deadline = std::time::Instant::now() + common::DEADLINE;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                let done = line.contains(needle);
                seen.push(line);
                if done {
                    return seen;
                }
            }
            Err(_) => panic!("no line with {needle:?}; saw {seen:#?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn with_json_logs_every_stderr_line_is_json_and_stdout_stays_quiet() {
    let (kvgate, lines) = start(&[
        "--log-format",
        "json",
        "serve",
        "--demo",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let mut seen = lines_until(&lines, "serving gRPC on");
    seen.extend(lines_until(&lines, "watch the demo stream"));
    let objects: Vec<serde_json::Value> = seen
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}")))
        .collect();
    let banner = objects
        .iter()
        .find_map(|object| {
            object["fields"]["message"]
                .as_str()?
                .strip_prefix("kvgate: serving gRPC on ")
        })
        .expect("the banner as a JSON line");
    let address: std::net::SocketAddr = banner.split(',').next().unwrap().parse().unwrap();
    // It does serve there.
    let channel = tonic::transport::Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .expect("kvgate serves on the address of its JSON banner");
    drop(channel);
    for line in &seen {
        assert!(!line.contains("Some("), "{line}");
        assert!(!line.contains('\u{1b}'), "{line}");
    }
    let stdout = kvgate.stop();
    assert!(
        stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&stdout)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_engine_that_starts_late_is_one_waiting_line_then_one_connected_line() {
    // A port nothing listens on yet; the engine binds it after kvgate starts.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let (_kvgate, lines) = start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--zmq-endpoint",
        &endpoint,
    ]);
    let before = lines_until(&lines, "waiting for the engine at");
    assert!(before.last().unwrap().contains(&endpoint), "{before:#?}");
    let _engine = EnginePublisher::bind(&endpoint, &PublisherOptions::default())
        .await
        .unwrap();
    let between = lines_until(&lines, "engine connected");
    for line in before.iter().chain(&between) {
        assert!(!line.contains('\u{1b}'), "no colours in a pipe: {line:?}");
        assert!(!line.contains("Some("), "{line}");
    }
    let chatter: Vec<&String> = between[..between.len() - 1]
        .iter()
        .filter(|line| line.contains("engine") || line.contains("econnect"))
        .collect();
    assert!(
        chatter.is_empty(),
        "one waiting line, one connected line: {between:#?}"
    );
}

#[test]
fn an_unreachable_upstream_is_reported_under_its_flag_with_its_cause() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let upstream = format!("http://127.0.0.1:{port}");
    let (_kvgate, lines) = start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--upstream-grpc",
        &upstream,
    ]);
    let line = lines_until(&lines, "cannot connect").pop().unwrap();
    assert!(
        line.contains(&format!("--upstream-grpc {upstream}"))
            && line.to_ascii_lowercase().contains("connection refused"),
        "{line}"
    );
}

#[test]
fn a_tool_that_cannot_reach_the_gateway_names_addr_and_the_cause() {
    let output = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["status", "--addr", "kvgate-test.invalid:5"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("--addr kvgate-test.invalid:5") && stderr.contains("no such host"),
        "{stderr}"
    );
}
