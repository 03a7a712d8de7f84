//! A gateway that cannot do its job says so (contract section 7): a task
//! that dies ends the process with a non-zero code, naming the task, so the
//! orchestrator restarts it.

mod common;

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc as std_mpsc;

use tokio::io::AsyncWriteExt;

/// Runs `kvgate serve <args>` until it exits on its own (bounded by the
/// deadline, then killed by pid); returns its exit status and stderr.
fn serve_until_exit(args: &[&str]) -> (ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate binary starts");
    let pid = child.id().to_string();
    let mut stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std_mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        let _ = tx.send((child.wait(), text));
    });
    match rx.recv_timeout(common::DEADLINE) {
        Ok((status, stderr)) => (status.expect("wait for kvgate"), stderr),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
            panic!("kvgate kept running although its source cannot work");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_engine_endpoint_that_is_no_zmq_publisher_ends_kvgate_non_zero_naming_the_source_task() {
    // What an engine's HTTP port answers to a ZMTP greeting.
    let not_zmq = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", not_zmq.local_addr().unwrap());
    let peer = tokio::spawn(async move {
        while let Ok((mut connection, _)) = not_zmq.accept().await {
            let _ = connection
                .write_all(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")
                .await;
        }
    });

    let (status, stderr) =
        tokio::task::spawn_blocking(move || serve_until_exit(&["--zmq-endpoint", &endpoint]))
            .await
            .unwrap();
    peer.abort();
    assert_eq!(status.code(), Some(1), "exit status {status}; {stderr}");
    assert!(
        stderr.contains("the ZMQ source of rank 0 failed: cannot connect to the engine publisher"),
        "{stderr}"
    );
}
