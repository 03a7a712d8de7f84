//! The TLS acceptor behind `axum::serve`'s `Listener`, until the serve loop
//! runs the handshake in each connection's own task.
//!
//! Invariant: one slow or silent client never holds up accepts: each
//! handshake runs in its own task, bounded in time (`HANDSHAKE_TIMEOUT`)
//! and in number (`MAX_HANDSHAKES`; beyond it new connections wait in the
//! kernel's backlog). Only finished handshakes reach the server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::server::TlsStream;
use tracing::warn;

use super::tls::TlsAcceptor;

/// Longest a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once.
const MAX_HANDSHAKES: usize = 1024;
/// Finished handshakes waiting for the server to take them.
const READY_QUEUE: usize = 64;

/// Connections whose TLS handshake succeeded.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Accepts on `listener` until this listener is dropped.
    pub fn new(listener: TcpListener, acceptor: TlsAcceptor) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (ready_tx, ready) = mpsc::channel(READY_QUEUE);
        tokio::spawn(accept_loop(listener, acceptor, ready_tx));
        Ok(Self { ready, local })
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    ready: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let accepted = tokio::select! {
            () = ready.closed() => return,
            permit = Arc::clone(&handshakes).acquire_owned() => {
                let Ok(permit) = permit else { return };
                tokio::select! {
                    () = ready.closed() => return,
                    accepted = listener.accept() => accepted.map(|accepted| (accepted, permit)),
                }
            }
        };
        let ((stream, peer), permit) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                crate::logging::rate_limited("tls_accept_failed", || {
                    warn!(%error, "cannot accept a connection");
                });
                // Out of file descriptors, typically: give others a moment.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Small batches must not wait for Nagle's algorithm.
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        let ready = ready.clone();
        tokio::spawn(async move {
            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
            drop(permit);
            match handshake {
                Ok(Ok(stream)) => {
                    let _ = ready.send((stream, peer)).await;
                }
                // Counted and logged by the acceptor.
                Ok(Err(_)) => {}
                Err(_) => acceptor.timed_out(Some(peer)),
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(accepted) => accepted,
            // The accept loop only ends once this listener is gone.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
