//! A gateway that cannot do its job says so (contract section 7): a task
//! that dies ends the process with a non-zero code, naming the task, so the
//! orchestrator restarts it.

mod common;

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc as std_mpsc;

/// Runs `kvgate serve <args>` until it exits on its own (bounded by the
/// deadline, then killed by pid); returns its exit status and stderr.
fn serve_until_exit(args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
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
            panic!("kvgate kept running although one of its tasks died");
        }
    }
}

#[test]
fn a_log_writer_thread_that_panics_ends_kvgate_with_a_non_zero_code_rather_than_holding_every_batch_back()
 {
    // The debug build's fault hook makes the state directory's log writer
    // thread panic at its first cycle: the drain must not go on numbering
    // cycles nobody will write or announce while health says SERVING.
    let dir = std::env::temp_dir().join(format!(
        "supervision-log-writer-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let (status, stderr) = serve_until_exit(
        &["--demo", "--state-dir", dir.to_str().expect("a UTF-8 path")],
        &[("KVGATE_DEBUG_PANIC_TASK", "log-writer")],
    );
    common::remove_state_dir(&dir);
    assert_eq!(status.code(), Some(1), "exit status {status}; {stderr}");
    assert!(stderr.contains("the drain panicked"), "{stderr}");
    assert!(stderr.contains("log writer thread ended"), "{stderr}");
}

#[test]
fn a_drain_that_panics_ends_kvgate_with_a_non_zero_code_naming_the_task() {
    // The debug build's fault hook makes the real drain task panic where it
    // stands, as a bug in it would.
    let (status, stderr) = serve_until_exit(&["--demo"], &[("KVGATE_DEBUG_PANIC_TASK", "drain")]);
    assert_eq!(status.code(), Some(1), "exit status {status}; {stderr}");
    assert!(stderr.contains("the drain panicked"), "{stderr}");
}
