//! kvgate under test, as a child process: started like an operator would,
//! measured through `/proc`, killed by pid however the run ends.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long kvgate may take to report its address.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// The line kvgate prints on stdout once it serves.
const SERVING: &str = "kvgate: serving gRPC on ";

pub struct Gateway {
    child: Child,
    address: String,
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
            .args(extra)
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
            .map_err(|error| anyhow::anyhow!("cannot start {}: {error}", binary.display()))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Reads on to the end, so kvgate never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix(SERVING) {
                    let address = rest.split(',').next().unwrap_or_default().to_owned();
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(address);
                    }
                }
            }
        });
        // From here on, dropping `gateway` kills the child.
        let mut gateway = Self {
            child,
            address: String::new(),
        };
        gateway.address = match tokio::time::timeout(START_TIMEOUT, rx).await {
            Ok(Ok(address)) => address,
            Ok(Err(_)) => {
                let status = gateway.child.wait()?;
                anyhow::bail!("{} serve exited before serving: {status}", binary.display())
            }
            Err(_) => anyhow::bail!("{} did not report its address in time", binary.display()),
        };
        Ok(gateway)
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
