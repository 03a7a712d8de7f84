//! The HTTP/2 connection preface, checked before hyper sees the connection.
//!
//! Invariant: a connection's first bytes are read only until they are the
//! HTTP/2 client preface or differ from it (never a byte past it), and
//! whatever was read is replayed unchanged to whoever serves the
//! connection. On the gRPC port only an HTTP/2 connection is served;
//! anything else (HTTP/1.1 above all) gets a one-line HTTP/1.1 answer saying
//! why and is closed, so it is refused and counted rather than left to a
//! protocol error. On `kvgate index`'s port the first bytes choose between
//! gRPC and HTTP/1.1.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// What every HTTP/2 client sends first (RFC 9113 section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Why a connection is not served.
#[derive(Debug)]
pub(crate) enum NotServed {
    /// The peer spoke something other than HTTP/2 (HTTP/1.1, most likely).
    NotHttp2,
    /// The peer closed or failed before sending the whole preface.
    Closed(io::Error),
}

/// The answer to a peer that is not speaking HTTP/2.
const HTTP1_REFUSAL: &[u8] = b"HTTP/1.1 505 HTTP Version Not Supported\r\n\
    connection: close\r\ncontent-type: text/plain\r\ncontent-length: 42\r\n\r\n\
    kvgate serves gRPC over HTTP/2 only (h2c)\n";

/// What a connection's first bytes say it speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Spoken {
    /// The HTTP/2 preface, whole.
    Http2,
    /// Something else from its first bytes on (HTTP/1.1, most likely).
    Other,
}

/// Reads from `io` until its bytes are the preface or differ from it (never
/// a byte past it) and hands back what they are, with a stream that
/// replays them.
pub(crate) async fn sniff<Io>(mut io: Io) -> io::Result<(Spoken, Replayed<Io>)>
where
    Io: AsyncRead + Unpin,
{
    let mut received = [0u8; PREFACE.len()];
    let mut filled = 0;
    let spoken = loop {
        if filled == PREFACE.len() {
            break Spoken::Http2;
        }
        let read = io.read(&mut received[filled..]).await?;
        if read == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if received[filled..filled + read] != PREFACE[filled..filled + read] {
            filled += read;
            break Spoken::Other;
        }
        filled += read;
    };
    let replayed = Replayed {
        io,
        received,
        filled,
        replayed: 0,
    };
    Ok((spoken, replayed))
}

/// Reads the preface from `io` (never a byte past it) and hands back a
/// stream that replays it; anything else is answered 505 and closed.
pub(crate) async fn expect_preface<Io>(io: Io) -> Result<Replayed<Io>, NotServed>
where
    Io: AsyncRead + AsyncWrite + Unpin,
{
    match sniff(io).await.map_err(NotServed::Closed)? {
        (Spoken::Http2, replayed) => Ok(replayed),
        (Spoken::Other, mut refused) => {
            // Best effort: the peer may already be gone.
            let _ = refused.io.write_all(HTTP1_REFUSAL).await;
            let _ = refused.io.shutdown().await;
            Err(NotServed::NotHttp2)
        }
    }
}

/// A stream whose first bytes read are those [`sniff`] took from it.
#[derive(Debug)]
pub(crate) struct Replayed<Io> {
    io: Io,
    received: [u8; PREFACE.len()],
    filled: usize,
    replayed: usize,
}

impl<Io: AsyncRead + Unpin> AsyncRead for Replayed<Io> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.replayed < self.filled {
            let rest = &self.received[self.replayed..self.filled];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            self.replayed += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Replayed<Io> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_preface_is_replayed_before_the_rest_of_the_stream() {
        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(PREFACE).await.unwrap();
        client.write_all(b"frames").await.unwrap();
        drop(client);
        let mut replayed = expect_preface(server).await.unwrap();
        let mut all = Vec::new();
        replayed.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, [&PREFACE[..], b"frames"].concat());
    }

    #[tokio::test]
    async fn bytes_that_are_not_the_preface_are_told_apart_and_replayed_as_they_came() {
        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(b"PRI * HTTP/1.1\r\n").await.unwrap();
        drop(client);
        let (spoken, mut replayed) = sniff(server).await.unwrap();
        assert_eq!(spoken, Spoken::Other);
        let mut all = Vec::new();
        replayed.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"PRI * HTTP/1.1\r\n");
    }

    #[tokio::test]
    async fn an_http1_request_is_answered_505_and_refused() {
        let (mut client, server) = tokio::io::duplex(256);
        client
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let refused = expect_preface(server).await;
        assert!(matches!(refused, Err(NotServed::NotHttp2)), "{refused:?}");
        let mut answer = String::new();
        client.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 505 "), "{answer}");
        assert!(answer.ends_with("HTTP/2 only (h2c)\n"), "{answer}");
    }
}
