//! What a run measures: the kvgate binary, or a peer relay started from a
//! command template, so that kvgate and a peer are compared by one command
//! under the same engine, subscribers and clocks.
//!
//! An index run measures `kvgate index` or a peer index the same way
//! ([`IndexSubject`]).
//!
//! A peer is any process that relays the engine's ZMQ PUB to
//! `SubscribeKvEvents` streams of `KvEventBatch`es (the same wire format as
//! kvgate's): its command names where to listen and where the publisher is
//! through placeholders, and its method path names the service.

use std::path::PathBuf;

use super::gateway::{Gateway, free_port};

/// The service kvgate's subscribers use.
const KVGATE_SERVICE: &str = "kvgate.v1.KvGate";
/// The name runs of kvgate are reported under.
pub const KVGATE: &str = "kvgate";
const METHOD: &str = "SubscribeKvEvents";

pub enum Subject {
    Kvgate {
        binary: PathBuf,
        serve_args: Vec<String>,
    },
    Peer(Peer),
}

/// A peer relay: its name in the report, its command and its service.
#[derive(Clone, Debug)]
pub struct Peer {
    pub name: String,
    /// Whitespace-separated words (no shell), with `{port}`, `{address}`
    /// and `{zmq}` replaced by the port to serve gRPC on, `127.0.0.1:PORT`
    /// and the publisher's endpoint.
    pub command: String,
    /// The service of the method path `/SERVICE/SubscribeKvEvents`.
    pub service: String,
}

impl Peer {
    /// Checks the template and the method path, naming the flag at fault.
    pub fn new(name: String, command: String, method: &str) -> anyhow::Result<Self> {
        check_serves_somewhere(&command)?;
        anyhow::ensure!(
            command.contains("{zmq}"),
            "--peer {command:?} names no publisher: give it {{zmq}}"
        );
        let service = method
            .strip_prefix('/')
            .and_then(|path| path.strip_suffix(METHOD)?.strip_suffix('/'))
            .filter(|service| !service.is_empty() && !service.contains('/'))
            .ok_or_else(|| {
                anyhow::anyhow!("--peer-method {method:?} is not of the form /SERVICE/{METHOD}")
            })?;
        Ok(Self {
            name,
            command,
            service: service.to_owned(),
        })
    }

    /// The command's words for a peer serving on `port`, fed from `zmq`.
    fn argv(&self, port: u16, zmq: &str) -> Vec<String> {
        fill(&self.command, port)
            .into_iter()
            .map(|word| word.replace("{zmq}", zmq))
            .collect()
    }
}

/// A command template's words (split on whitespace, no shell) with `{port}`
/// and `{address}` (`127.0.0.1:PORT`) filled in.
fn fill(command: &str, port: u16) -> Vec<String> {
    command
        .split_whitespace()
        .map(|word| {
            word.replace("{port}", &port.to_string())
                .replace("{address}", &format!("127.0.0.1:{port}"))
        })
        .collect()
}

fn check_serves_somewhere(command: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        command.contains("{port}") || command.contains("{address}"),
        "--peer {command:?} says nowhere to serve: give it {{port}} or {{address}}"
    );
    Ok(())
}

/// What an index run measures: `kvgate index`, or a peer index speaking
/// Dynamo's HTTP API (Dynamo's own through
/// `benchmarks/dynamo-index/peer.py serve --port {port}`), fed by the same
/// fleet's registrations.
pub enum IndexSubject {
    Kvgate { binary: PathBuf },
    Peer(IndexPeer),
}

/// A peer index: its name in the report and its command, whose `{port}` (or
/// `{address}`) is where it must answer; it prints `{"pid": PID, "url":
/// URL}` once it does, PID being the process to measure.
#[derive(Clone, Debug)]
pub struct IndexPeer {
    pub name: String,
    pub command: String,
}

impl IndexPeer {
    /// Checks the template, naming the flag at fault.
    pub fn new(name: String, command: String) -> anyhow::Result<Self> {
        check_serves_somewhere(&command)?;
        Ok(Self { name, command })
    }
}

impl IndexSubject {
    pub fn name(&self) -> &str {
        match self {
            Self::Kvgate { .. } => KVGATE,
            Self::Peer(peer) => &peer.name,
        }
    }

    /// Starts the index with no worker; it answers once this returns.
    pub async fn start(&self) -> anyhow::Result<Gateway> {
        match self {
            Self::Kvgate { binary } => Gateway::start_index(binary).await,
            Self::Peer(peer) => {
                Gateway::start_announcing_peer(&fill(&peer.command, free_port()?)).await
            }
        }
    }
}

impl Subject {
    pub fn name(&self) -> &str {
        match self {
            Self::Kvgate { .. } => KVGATE,
            Self::Peer(peer) => &peer.name,
        }
    }

    pub fn service(&self) -> &str {
        match self {
            Self::Kvgate { .. } => KVGATE_SERVICE,
            Self::Peer(peer) => &peer.service,
        }
    }

    /// Starts the subject fed by the publisher at `zmq`; it serves once
    /// this returns.
    pub async fn start(&self, zmq: &str) -> anyhow::Result<Gateway> {
        match self {
            Self::Kvgate { binary, serve_args } => Gateway::start(binary, zmq, serve_args).await,
            Self::Peer(peer) => {
                let port = free_port()?;
                Gateway::start_peer(&peer.argv(port, zmq), port).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_command_gets_its_port_address_and_publisher() {
        let peer = Peer::new(
            "smg".to_owned(),
            "python  peer.py --port {port} --listen={address}\t{zmq}".to_owned(),
            "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
        )
        .unwrap();
        assert_eq!(peer.service, "vllm.grpc.engine.VllmEngine");
        assert_eq!(
            peer.argv(4242, "tcp://127.0.0.1:5557"),
            [
                "python",
                "peer.py",
                "--port",
                "4242",
                "--listen=127.0.0.1:4242",
                "tcp://127.0.0.1:5557"
            ]
        );
    }

    #[test]
    fn a_peer_without_placeholders_or_with_another_method_is_refused() {
        let method = "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents";
        let refused = |command: &str, method: &str| {
            Peer::new("p".to_owned(), command.to_owned(), method)
                .unwrap_err()
                .to_string()
        };
        assert!(refused("peer {zmq}", method).contains("nowhere to serve"));
        assert!(refused("peer {port}", method).contains("no publisher"));
        for bad in [
            "vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
            "/vllm.grpc.engine.VllmEngine/GetLoads",
            "//SubscribeKvEvents",
            "/a/b/SubscribeKvEvents",
        ] {
            assert!(
                refused("peer {port} {zmq}", bad).contains("--peer-method"),
                "{bad}"
            );
        }
    }
}
