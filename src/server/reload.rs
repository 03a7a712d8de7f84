//! SIGHUP re-reads the server's certificates and the token file, so
//! rotation needs no restart.
//!
//! Invariant: each piece of material is swapped whole or not at all: a
//! file that is missing, unreadable or wrong is refused with a logged error
//! and what was in force stays in force. Connections and streams already
//! open are never touched. A SIGHUP with nothing to reload is logged, never
//! fatal.

use std::future::Future;

use tracing::{error, info};

use super::auth::Tokens;
use super::tls::TlsAcceptor;
use crate::metrics::{Metrics, ResultLabel};

/// Everything a SIGHUP re-reads.
#[derive(Clone, Default)]
pub struct Credentials {
    pub tls: Option<TlsAcceptor>,
    pub tokens: Option<Tokens>,
}

impl Credentials {
    /// Re-reads every file; logs and counts the outcome. True when all of
    /// them were taken.
    pub fn reload(&self, metrics: &Metrics) -> bool {
        let mut all_taken = true;
        if let Some(tls) = &self.tls {
            match tls.reload() {
                Ok(()) => info!("reloaded the TLS certificates"),
                Err(error) => {
                    all_taken = false;
                    error!("TLS certificates not reloaded, the old ones stay in force: {error:#}");
                }
            }
        }
        if let Some(tokens) = &self.tokens {
            match tokens.reload() {
                Ok(count) => info!(tokens = count, "reloaded the bearer tokens"),
                Err(error) => {
                    all_taken = false;
                    error!("bearer tokens not reloaded, the old ones stay in force: {error:#}");
                }
            }
        }
        if self.tls.is_none() && self.tokens.is_none() {
            info!("SIGHUP: no TLS certificates or token file to reload");
        }
        metrics
            .credential_reloads
            .get_or_create(&ResultLabel {
                result: if all_taken { "ok" } else { "failed" },
            })
            .inc();
        all_taken
    }
}

/// Installs the SIGHUP handler now (so a SIGHUP right after start-up no
/// longer ends the process) and returns the task that reloads on each
/// signal until `stop` resolves.
#[cfg(unix)]
pub fn on_sighup(
    credentials: Credentials,
    metrics: Metrics,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = signal(SignalKind::hangup())?;
    Ok(async move {
        tokio::pin!(stop);
        loop {
            tokio::select! {
                () = &mut stop => return,
                received = hangups.recv() => {
                    if received.is_none() {
                        return;
                    }
                    credentials.reload(&metrics);
                }
            }
        }
    })
}
