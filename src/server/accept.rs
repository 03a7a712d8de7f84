//! Accepting connections: the bounded accept loop both ports run (a slot
//! per connection, at most the port's limit, all ended before it returns),
//! and the step between a TCP accept and HTTP/2, whatever turns an accepted
//! stream into the connection's byte stream (nothing for plaintext, a TLS
//! handshake for TLS).
//!
//! Invariant: an acceptor runs inside the connection's own task, under the
//! handshake timeout, so a slow or silent peer never holds up the accept
//! loop or any other connection. A failed accept (out of file descriptors,
//! most likely) is logged at most once a second per port and retried after
//! a pause, so the loop neither spins nor floods the log while it lasts.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tracing::warn;

/// Pause after a failed accept.
const ACCEPT_RETRY: Duration = Duration::from_millis(250);

/// The next connection `listener` accepts, on the port named `port` (for
/// the log, and as its rate limiter's key).
pub(crate) async fn next_connection(listener: &TcpListener, port: &'static str) -> TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => return stream,
            Err(error) => {
                crate::logging::rate_limited(port, || {
                    warn!(%error, "{port}: accept failed; retrying (logged at most once a second)");
                });
                tokio::time::sleep(ACCEPT_RETRY).await;
            }
        }
    }
}

/// Accepts on `listener` (the port named `port`) until `shutdown`
/// resolves. Each connection holds one of `max_connections` slots for as
/// long as the task `serve` makes of it runs; one over the limit goes to
/// `refuse` and is closed. Then every connection is told to stop (the
/// `watch` turns true) and the loop waits until all have ended.
pub(crate) async fn serve_bounded<Serve, Served>(
    listener: TcpListener,
    port: &'static str,
    max_connections: u32,
    shutdown: impl Future<Output = ()>,
    refuse: impl Fn(TcpStream),
    serve: Serve,
) where
    Serve: Fn(TcpStream, watch::Receiver<bool>) -> Served,
    Served: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(max_connections as usize));
    let (stop, stopped) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            stream = next_connection(&listener, port) => stream,
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            refuse(stream);
            continue;
        };
        let connection = serve(stream, stopped.clone());
        tokio::spawn(async move {
            connection.await;
            drop(slot);
        });
    }
    drop(listener);
    stop.send_replace(true);
    // Every slot back means every connection has ended.
    let _ = slots.acquire_many(max_connections).await;
}

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
