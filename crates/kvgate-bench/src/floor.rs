//! `--floor-receivers`: the receivers of `benchmarks/floor.py`, in Rust and
//! all on one thread, for libzmq's side (SUB sockets on the engine's PUB),
//! kvgate's (gRPC subscribers) and the floor relay's (`--floor-relay`,
//! length-prefixed payloads on plain TCP) alike.
//!
//! The floor is a cost per delivery, which holds only while every receiver
//! keeps up: one that falls behind is written several messages at a time,
//! by libzmq as by kvgate. Python's receivers fell behind at 64; these read
//! as `kvgate-bench`'s subscribers do (raw bytes, nothing decoded, one
//! thread), so both sides are arranged alike at any count.
//!
//! floor.py drives it with its receivers' line protocol on stdin: `ready?`
//! answers 1 once every receiver has had a message (else 0), `count` the
//! messages received so far; the end of stdin ends the process.

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use zeromq::{Socket, SocketRecv, SubSocket};

use super::floor_relay::LENGTH_BYTES;
use super::subscriber::connect_plaintext;
use kvgate::client::{RawBatches, subscribe_with};

/// Who is read, with its address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FloorTarget {
    /// SUB sockets on a ZMQ PUB (`zmq:tcp://HOST:PORT`).
    Zmq(String),
    /// kvgate's `SubscribeKvEvents` streams, one connection each
    /// (`grpc:HOST:PORT`).
    Grpc(String),
    /// The floor relay's plain TCP connections (`tcp:IP:PORT`).
    Tcp(String),
}

impl std::str::FromStr for FloorTarget {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.split_once(':') {
            Some(("zmq", endpoint)) if !endpoint.is_empty() => Ok(Self::Zmq(endpoint.to_owned())),
            Some(("grpc", address)) if !address.is_empty() => Ok(Self::Grpc(address.to_owned())),
            // A socket address, so a ZMQ endpoint (`tcp://…`) is never taken for one.
            Some(("tcp", address)) if address.parse::<std::net::SocketAddr>().is_ok() => {
                Ok(Self::Tcp(address.to_owned()))
            }
            _ => Err(format!(
                "{text:?} is none of zmq:ENDPOINT, grpc:HOST:PORT and tcp:IP:PORT"
            )),
        }
    }
}

/// Connects `count` receivers to `target` on this (current-thread) runtime,
/// then answers floor.py until its stdin ends.
pub async fn serve(target: FloorTarget, count: usize) -> anyhow::Result<()> {
    let counts: Arc<Vec<AtomicU64>> = Arc::new((0..count).map(|_| AtomicU64::new(0)).collect());
    // A receiver whose stream ends would never be ready: floor.py is told,
    // rather than left waiting for it.
    let ended = Arc::new(AtomicU64::new(0));
    for index in 0..count {
        let counts = Arc::clone(&counts);
        let ended = Arc::clone(&ended);
        match &target {
            FloorTarget::Zmq(endpoint) => {
                let mut socket = SubSocket::new();
                socket
                    .connect(endpoint)
                    .await
                    .with_context(|| format!("SUB socket to {endpoint}"))?;
                socket.subscribe("").await?;
                tokio::spawn(async move {
                    while socket.recv().await.is_ok() {
                        counts[index].fetch_add(1, Ordering::Relaxed);
                    }
                    ended.fetch_add(1, Ordering::Relaxed);
                });
            }
            FloorTarget::Grpc(address) => {
                let channel = connect_plaintext("the gateway at", address).await?;
                let mut stream = subscribe_with(channel, "kvgate.v1.KvGate", 0, RawBatches)
                    .await
                    .map_err(|status| anyhow::anyhow!("SubscribeKvEvents refused: {status}"))?;
                tokio::spawn(async move {
                    while let Ok(Some(_)) = stream.message().await {
                        counts[index].fetch_add(1, Ordering::Relaxed);
                    }
                    ended.fetch_add(1, Ordering::Relaxed);
                });
            }
            FloorTarget::Tcp(address) => {
                let mut stream = TcpStream::connect(address)
                    .await
                    .with_context(|| format!("the floor relay at {address}"))?;
                tokio::spawn(async move {
                    let mut payload = Vec::new();
                    while read_frame(&mut stream, &mut payload).await.is_ok() {
                        counts[index].fetch_add(1, Ordering::Relaxed);
                    }
                    ended.fetch_add(1, Ordering::Relaxed);
                });
            }
        }
    }
    // Blocking reads of stdin stay off the receivers' thread.
    tokio::task::spawn_blocking(move || answer(&counts, &ended)).await?
}

/// Reads one length-prefixed payload of the floor relay into `payload`.
async fn read_frame(stream: &mut TcpStream, payload: &mut Vec<u8>) -> std::io::Result<()> {
    let mut length = [0; LENGTH_BYTES];
    stream.read_exact(&mut length).await?;
    payload.resize(u32::from_be_bytes(length) as usize, 0);
    stream.read_exact(payload).await?;
    Ok(())
}

fn answer(counts: &[AtomicU64], ended: &AtomicU64) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let ended = ended.load(Ordering::Relaxed);
        anyhow::ensure!(ended == 0, "{ended} receivers' streams ended");
        let reply = match line?.trim() {
            "ready?" => u64::from(counts.iter().all(|c| c.load(Ordering::Relaxed) > 0)),
            "count" => counts.iter().map(|c| c.load(Ordering::Relaxed)).sum(),
            other => anyhow::bail!("unknown command {other:?} (ready? or count)"),
        };
        writeln!(stdout, "{reply}")?;
        stdout.flush()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::FloorTarget;

    #[test]
    fn a_floor_target_names_its_kind() {
        assert_eq!(
            "zmq:tcp://127.0.0.1:5557".parse(),
            Ok(FloorTarget::Zmq("tcp://127.0.0.1:5557".to_owned()))
        );
        assert_eq!(
            "grpc:127.0.0.1:50061".parse(),
            Ok(FloorTarget::Grpc("127.0.0.1:50061".to_owned()))
        );
        assert_eq!(
            "tcp:127.0.0.1:40000".parse(),
            Ok(FloorTarget::Tcp("127.0.0.1:40000".to_owned()))
        );
        for bad in ["tcp://127.0.0.1:5557", "zmq:", "tcp:", "http:x"] {
            assert!(bad.parse::<FloorTarget>().is_err(), "{bad}");
        }
    }
}
