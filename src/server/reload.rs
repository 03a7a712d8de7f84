//! Rotation without a restart: SIGHUP re-reads the server's certificates and
//! the token file, and so does a change to their contents, checked every
//! `--credentials-check-seconds` (Kubernetes updates mounted Secrets in
//! place but sends no signal).
//!
//! Invariant: each piece of material is swapped whole or not at all: a
//! file that is missing, unreadable or wrong is refused with a logged error
//! and what was in force stays in force. Connections and streams already
//! open are never touched. A SIGHUP with nothing to reload is logged, never
//! fatal; a change that fails to load is reported once, not every check.

use std::future::Future;
use std::time::Duration;

use tracing::{error, info};

use super::auth::Tokens;
use super::tls::TlsAcceptor;
use crate::metrics::{Metrics, ResultLabel};

/// Whether a reload took every file it was asked to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReloadResult {
    Ok,
    /// At least one file was refused; its old contents stay in force.
    Failed,
}

impl ReloadResult {
    pub const ALL: [Self; 2] = [Self::Ok, Self::Failed];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Failed => "failed",
        }
    }
}
use crate::pem::FlagFile;

/// Everything a reload re-reads.
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
        if self.is_empty() {
            info!("no TLS certificates or token file to reload");
        }
        let result = if all_taken {
            ReloadResult::Ok
        } else {
            ReloadResult::Failed
        };
        metrics
            .credential_reloads
            .get_or_create(&ResultLabel {
                result: result.as_str(),
            })
            .inc();
        all_taken
    }

    fn is_empty(&self) -> bool {
        self.tls.is_none() && self.tokens.is_none()
    }

    fn files(&self) -> impl Iterator<Item = &FlagFile> {
        let tls = self.tls.iter().flat_map(TlsAcceptor::files);
        tls.chain(self.tokens.as_ref().map(Tokens::file))
    }

    /// A digest of every file's contents (an unreadable or oversized file
    /// counts as empty: its reload then reports why).
    fn fingerprint(&self) -> Vec<u8> {
        let mut context = ring::digest::Context::new(&ring::digest::SHA256);
        for file in self.files() {
            let contents = file.read().unwrap_or_default();
            context.update(&(contents.len() as u64).to_le_bytes());
            context.update(&contents);
        }
        context.finish().as_ref().to_vec()
    }
}

/// Installs the SIGHUP handler now (so a SIGHUP right after start-up no
/// longer ends the process) and returns the task that reloads on each
/// signal, and on each change seen every `check_every` (if set), until
/// `stop` resolves.
#[cfg(unix)]
pub fn reload_task(
    credentials: Credentials,
    metrics: Metrics,
    check_every: Option<Duration>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = signal(SignalKind::hangup())?;
    Ok(async move {
        tokio::pin!(stop);
        let check_every = check_every.filter(|_| !credentials.is_empty());
        let mut checks = check_every.map(|period| {
            let mut checks = tokio::time::interval(period);
            checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            checks
        });
        let mut seen = credentials.fingerprint();
        loop {
            let check = async {
                match checks.as_mut() {
                    Some(checks) => {
                        checks.tick().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = &mut stop => return,
                received = hangups.recv() => {
                    if received.is_none() {
                        return;
                    }
                    info!("SIGHUP: reloading certificates and tokens");
                    seen = credentials.fingerprint();
                    credentials.reload(&metrics);
                }
                () = check => {
                    let now = credentials.fingerprint();
                    if now != seen {
                        info!("certificate or token files changed: reloading");
                        seen = now;
                        credentials.reload(&metrics);
                    }
                }
            }
        }
    })
}
