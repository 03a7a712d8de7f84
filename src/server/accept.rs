//! The step between a TCP accept and HTTP/2: whatever turns an accepted
//! stream into the connection's byte stream (nothing for plaintext, a TLS
//! handshake for TLS).
//!
//! Invariant: an acceptor runs inside the connection's own task, under the
//! handshake timeout, so a slow or silent peer never holds up the accept
//! loop or any other connection.

use std::future::Future;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// Turns an accepted TCP stream into the byte stream HTTP/2 is served over.
pub trait Acceptor: Send + Sync + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    fn accept(&self, stream: TcpStream) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

/// Serves HTTP/2 straight over TCP (h2c with prior knowledge, as gRPC
/// clients speak it without TLS).
pub struct Plaintext;

impl Acceptor for Plaintext {
    type Io = TcpStream;

    async fn accept(&self, stream: TcpStream) -> std::io::Result<TcpStream> {
        Ok(stream)
    }
}
