//! `--floor-relay`: a relay that does nothing but relay, the floor under
//! any gateway's CPU per delivered event on this machine.
//!
//! It does the least a relay must: a ZMQ SUB on the engine's PUB (the same
//! `zeromq` crate and tokio runtime kvgate uses, on one thread, as
//! kvgate's one worker), and every message's payload written once to each
//! connected receiver (a 4-byte length, then the payload, in one write).
//! No decoding, no batching, no HTTP/2 or gRPC framing, no state. What its
//! process spends per delivered event is what kvgate would spend if its
//! conversion, state, history and gRPC were free: the wake-ups, the ZMQ
//! read and the loopback writes, which no relay can avoid.
//!
//! `benchmarks/floor.py --relay` starts it, reads the address it prints on
//! its first line, connects `--floor-receivers tcp:ADDRESS` to it and
//! measures its CPU like kvgate's.

use std::io::Write;

use anyhow::Context;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use zeromq::{Socket, SocketRecv, SubSocket};

/// Bytes before each payload on a receiver's connection: its length.
pub const LENGTH_BYTES: usize = 4;

/// Relays `endpoint`'s messages to every receiver that connects, until the
/// engine's socket fails.
pub async fn serve(endpoint: String) -> anyhow::Result<()> {
    let mut engine = SubSocket::new();
    engine
        .connect(&endpoint)
        .await
        .with_context(|| format!("SUB socket to {endpoint}"))?;
    engine.subscribe("").await?;
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot listen on 127.0.0.1")?;
    let mut stdout = std::io::stdout().lock();
    writeln!(
        stdout,
        "floor relay listening on {}",
        listener.local_addr()?
    )?;
    stdout.flush()?;
    drop(stdout);
    let mut receivers: Vec<TcpStream> = Vec::new();
    let mut frame = Vec::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (receiver, _) = accepted.context("accepting a receiver")?;
                receiver.set_nodelay(true)?;
                receivers.push(receiver);
            }
            message = engine.recv() => {
                let message = message.context("the engine's socket failed")?;
                // vLLM's frames: topic, sequence number, payload.
                let Some(payload) = message.into_vec().pop() else { continue };
                frame.clear();
                let length = u32::try_from(payload.len()).context("payload over 4 GiB")?;
                frame.extend_from_slice(&length.to_be_bytes());
                frame.extend_from_slice(&payload);
                let mut index = 0;
                while index < receivers.len() {
                    if receivers[index].write_all(&frame).await.is_ok() {
                        index += 1;
                    } else {
                        // A receiver that left is dropped; the others go on.
                        receivers.swap_remove(index);
                    }
                }
            }
        }
    }
}
