//! The relay or index under test (kvgate, or a peer in its place), as a
//! child process: started like an operator would, measured through `/proc`,
//! stopped by pid like an orchestrator would (SIGTERM, then SIGKILL once
//! `STOP_GRACE` is up), and killed by pid however else the run ends.
//!
//! The clean exit matters beyond manners: an instrumented kvgate writes its
//! profile for `make release` (profile-guided optimization) only when it
//! exits.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long the relay may take to report its address or accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How often a peer's port is tried while it starts.
const START_POLL: Duration = Duration::from_millis(20);
/// How long the relay may take to exit once asked to.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How often a stopping relay is checked for its exit.
const STOP_POLL: Duration = Duration::from_millis(10);
/// The line kvgate prints on stdout once it serves.
const SERVING: &str = "kvgate: serving gRPC on ";
/// The line `kvgate index` prints on stdout once it answers.
const INDEX_SERVING: &str = "kvgate: index answering Dynamo's API on http://";

pub struct Gateway {
    child: Child,
    address: String,
    /// The process whose costs are measured, when it is not `child` itself.
    measured_pid: Option<u32>,
}

/// What a starting child says once it serves.
struct Announced {
    address: String,
    pid: Option<u32>,
}

impl Gateway {
    /// Runs `BINARY serve --listen 127.0.0.1:0 --zmq-endpoint ENDPOINT
    /// EXTRA...` and waits until it serves.
    pub async fn start(binary: &Path, endpoint: &str, extra: &[String]) -> anyhow::Result<Self> {
        let mut command = Command::new(binary);
        command
            .arg("serve")
            // Its banner is on stdout in text format, whatever the environment says.
            .args(["--log-format", "text"])
            .args(["--listen", "127.0.0.1:0", "--zmq-endpoint", endpoint])
            .args(extra);
        let what = format!("{} serve", binary.display());
        Self::launch(command, &what, |line| {
            let rest = line.strip_prefix(SERVING)?;
            Some(Announced {
                address: rest.split(',').next().unwrap_or_default().to_owned(),
                pid: None,
            })
        })
        .await
    }

    /// Runs `BINARY index --listen 127.0.0.1:0` and waits until it answers.
    pub async fn start_index(binary: &Path) -> anyhow::Result<Self> {
        let mut command = Command::new(binary);
        command.args(["index", "--log-format", "text", "--listen", "127.0.0.1:0"]);
        let what = format!("{} index", binary.display());
        Self::launch(command, &what, |line| {
            Some(Announced {
                address: line.strip_prefix(INDEX_SERVING)?.to_owned(),
                pid: None,
            })
        })
        .await
    }

    /// Runs `argv`, a peer that prints one JSON line `{"pid": PID, "url":
    /// "http://HOST:PORT"}` once it serves (`benchmarks/dynamo-index/peer.py
    /// serve`): PID is the process measured, which may be a child of the
    /// one started; stopping the one started stops it.
    pub async fn start_announcing_peer(argv: &[String]) -> anyhow::Result<Self> {
        let (program, args) = argv
            .split_first()
            .ok_or_else(|| anyhow::anyhow!("--peer is an empty command"))?;
        let mut command = Command::new(program);
        command.args(args);
        // Dynamo's info lines (one per listener) would interleave with the
        // report.
        if std::env::var_os("DYN_LOG").is_none() {
            command.env("DYN_LOG", "warn");
        }
        Self::launch(command, &format!("the peer {program}"), |line| {
            let announced: serde_json::Value = serde_json::from_str(line).ok()?;
            Some(Announced {
                address: announced["url"]
                    .as_str()?
                    .strip_prefix("http://")?
                    .to_owned(),
                pid: Some(u32::try_from(announced["pid"].as_u64()?).ok()?),
            })
        })
        .await
    }

    /// Spawns `command` and waits until a line of its stdout is `announced`.
    async fn launch(
        mut command: Command,
        what: &str,
        announced: fn(&str) -> Option<Announced>,
    ) -> anyhow::Result<Self> {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // Its info lines would interleave with the report, and its ZMQ
        // socket's reconnection attempts once the publisher of a finished
        // run has gone say nothing about kvgate.
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "warn,zeromq=error");
        }
        let mut child = command
            .spawn()
            .map_err(|error| anyhow::anyhow!("cannot start {what}: {error}"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Reads on to the end, so the child never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(found) = announced(&line)
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(found);
                }
            }
        });
        // From here on, dropping `gateway` kills the child.
        let mut gateway = Self {
            child,
            address: String::new(),
            measured_pid: None,
        };
        let found = match tokio::time::timeout(START_TIMEOUT, rx).await {
            Ok(Ok(found)) => found,
            Ok(Err(_)) => {
                let status = gateway.child.wait()?;
                anyhow::bail!("{what} exited before serving: {status}")
            }
            Err(_) => anyhow::bail!("{what} did not report its address in time"),
        };
        gateway.address = found.address;
        gateway.measured_pid = found.pid;
        Ok(gateway)
    }

    /// Runs `argv` (a peer relay told to serve on `port`) and waits until
    /// `port` accepts connections: a peer prints no line kvgate-bench knows.
    pub async fn start_peer(argv: &[String], port: u16) -> anyhow::Result<Self> {
        let (program, args) = argv
            .split_first()
            .ok_or_else(|| anyhow::anyhow!("--peer is an empty command"))?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|error| anyhow::anyhow!("cannot start the peer {program}: {error}"))?;
        // From here on, dropping `gateway` kills the child.
        let mut gateway = Self {
            child,
            address: format!("127.0.0.1:{port}"),
            measured_pid: None,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(&gateway.address).is_err() {
            if let Some(status) = gateway.child.try_wait()? {
                anyhow::bail!("the peer {program} exited before serving: {status}");
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the peer {program} did not accept connections on {} within {START_TIMEOUT:?}",
                gateway.address
            );
            tokio::time::sleep(START_POLL).await;
        }
        Ok(gateway)
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// The process to measure: the one started, or the one it announced.
    pub fn pid(&self) -> u32 {
        self.measured_pid.unwrap_or_else(|| self.child.id())
    }

    /// Asks the relay to exit (SIGTERM) and waits for it; kills it if it
    /// is still running after `STOP_GRACE`.
    pub async fn stop(self) -> anyhow::Result<Stopped> {
        self.stop_within(STOP_GRACE).await
    }

    /// [`Self::stop`], saying on stderr when `name` did not exit cleanly.
    pub async fn stop_noting(self, name: &str) -> anyhow::Result<()> {
        match self.stop().await? {
            Stopped::Exited(status) if status.success() => {}
            Stopped::Exited(status) => {
                eprintln!("kvgate-bench: {name} exited with {status} when stopped");
            }
            Stopped::Killed => eprintln!(
                "kvgate-bench: {name} did not exit within its grace period and was killed"
            ),
        }
        Ok(())
    }

    async fn stop_within(mut self, grace: Duration) -> anyhow::Result<Stopped> {
        let pid = libc::pid_t::try_from(self.child.id())?;
        // SAFETY: `kill` only sends a signal. The pid is our child's, and
        // it cannot have been reused: the child is reaped only by
        // `try_wait` below or by `Drop`.
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(Stopped::Exited(status));
            }
            tokio::time::sleep(STOP_POLL).await;
        }
        self.child.kill()?;
        self.child.wait()?;
        Ok(Stopped::Killed)
    }
}

/// How a relay asked to stop ended.
#[derive(Debug)]
pub enum Stopped {
    /// It exited within the grace period, with this status.
    Exited(std::process::ExitStatus),
    /// It was still running at the end of the grace period, and was killed.
    Killed,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // Killed outright, a wrapper cannot stop the process it announced:
        // kill that one first, by its pid, and only while the wrapper that
        // started it still runs (a run stopped in order has none left).
        if let Some(pid) = self.measured_pid
            && matches!(self.child.try_wait(), Ok(None))
            && let Ok(pid) = libc::pid_t::try_from(pid)
        {
            // SAFETY: `kill` only sends a signal, to the peer's own process.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port free now, for a peer that cannot be told to pick its own
/// (`127.0.0.1:0`) and report it; another process could take it before the
/// peer binds it, which fails that run at start, never silently.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shell whose TERM handler is `on_term`, once it says it is set.
    fn shell(on_term: &str) -> Gateway {
        let script = format!("trap '{on_term}' TERM; echo ready; while :; do sleep 0.05; done");
        let mut child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("sh runs");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout is piped"))
            .read_line(&mut line)
            .expect("sh says it is ready");
        assert_eq!(line, "ready\n");
        Gateway {
            child,
            address: String::new(),
            measured_pid: None,
        }
    }

    #[tokio::test]
    async fn a_relay_is_asked_to_exit_with_sigterm_so_it_can_exit_cleanly() {
        match shell("exit 7").stop().await.unwrap() {
            Stopped::Exited(status) => assert_eq!(status.code(), Some(7), "its TERM handler ran"),
            Stopped::Killed => panic!("a relay that exits on SIGTERM was killed"),
        }
    }

    #[tokio::test]
    async fn a_relay_that_ignores_sigterm_is_killed_once_its_grace_is_up() {
        let gateway = shell("");
        let pid = gateway.pid();
        let stopped = gateway.stop_within(Duration::from_millis(200)).await;
        assert!(matches!(stopped.unwrap(), Stopped::Killed));
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "killed and reaped"
        );
    }

    #[tokio::test]
    async fn a_peers_announced_process_is_the_one_measured_and_dies_with_its_wrapper() {
        // A wrapper that starts the real peer (here a sleep), says so once
        // it serves, and would leave it running if killed outright.
        let script = r#"sleep 600 & echo "starting"; echo "{\"pid\": $!, \"url\": \"http://127.0.0.1:9\"}"; wait"#;
        let argv = ["sh", "-c", script].map(str::to_owned);
        let gateway = Gateway::start_announcing_peer(&argv).await.unwrap();
        let (wrapper, peer) = (gateway.child.id(), gateway.pid());
        assert_ne!(peer, wrapper, "the announced pid is measured");
        assert_eq!(gateway.address(), "127.0.0.1:9");
        // The wrapper's child (it may not have become `sleep` yet).
        let stat = std::fs::read_to_string(format!("/proc/{peer}/stat")).unwrap();
        let parent = stat.rsplit_once(')').unwrap().1.split_whitespace().nth(1);
        assert_eq!(parent, Some(wrapper.to_string().as_str()));
        drop(gateway);
        let deadline = Instant::now() + Duration::from_secs(10);
        // Reaped by whoever adopted it once its wrapper died.
        while Path::new(&format!("/proc/{peer}")).exists()
            && !std::fs::read_to_string(format!("/proc/{peer}/stat"))
                .is_ok_and(|stat| stat.contains(") Z"))
        {
            assert!(
                Instant::now() < deadline,
                "the announced process still runs"
            );
            tokio::time::sleep(STOP_POLL).await;
        }
    }
}
