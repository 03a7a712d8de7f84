//! Just enough ZMTP 3.0 for a raw peer to reach kvgate's frame decoder,
//! over any stream (TCP or a Unix-domain socket): a NULL-mechanism
//! greeting, a READY command, and frame headers announcing any length.

use tokio::io::{AsyncWrite, AsyncWriteExt};

/// ZMTP flags byte: a command frame.
pub const COMMAND: u8 = 0b0000_0100;
/// ZMTP flags byte: a long (8-byte) length.
pub const LONG: u8 = 0b0000_0010;

/// Sends ZMTP 3.0's greeting, NULL mechanism.
pub async fn send_greeting(stream: &mut (impl AsyncWrite + Unpin)) {
    let mut greeting = [0u8; 64];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[12..16].copy_from_slice(b"NULL");
    stream.write_all(&greeting).await.unwrap();
}

/// Sends READY as a `socket_type` socket.
pub async fn send_ready(stream: &mut (impl AsyncWrite + Unpin), socket_type: &str) {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    stream
        .write_all(&[COMMAND, body.len() as u8])
        .await
        .unwrap();
    stream.write_all(&body).await.unwrap();
}

/// Sends a frame header with `flags` announcing `length` bytes (8-byte
/// length: give `LONG` in `flags`).
pub async fn announce(stream: &mut (impl AsyncWrite + Unpin), flags: u8, length: u64) {
    stream.write_all(&[flags]).await.unwrap();
    stream.write_all(&length.to_be_bytes()).await.unwrap();
}
