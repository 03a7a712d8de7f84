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
//! Files are read on a blocking thread, never on the async runtime, and
//! given `READ_DEADLINE`: a file that cannot be read in time (a hung network
//! mount) is refused like a bad one, and while such a read is still stuck no
//! other is started, so a stuck mount costs one thread, never the serving
//! path or SIGTERM.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
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

/// Longest kvgate waits for one round of reading the credential files.
pub const READ_DEADLINE: Duration = Duration::from_secs(5);

/// Runs the reads of credential files on a blocking thread, one round at a
/// time.
struct FileReader {
    /// How long a round may take (`READ_DEADLINE`).
    deadline: Duration,
    /// A round that overran its deadline and may still be running.
    stuck: Option<JoinHandle<Vec<u8>>>,
}

impl Default for FileReader {
    fn default() -> Self {
        Self {
            deadline: READ_DEADLINE,
            stuck: None,
        }
    }
}

impl FileReader {
    /// Runs `round` (which returns the fingerprint it saw) unless an earlier
    /// one is still stuck; `None` when it was not run or overran
    /// its deadline, with the refusal logged and counted.
    async fn run(
        &mut self,
        metrics: &Metrics,
        round: impl FnOnce() -> Vec<u8> + Send + 'static,
    ) -> Option<Vec<u8>> {
        if self
            .stuck
            .as_ref()
            .is_some_and(|stuck| !stuck.is_finished())
        {
            refused(
                metrics,
                "an earlier read of the certificate or token files is still stuck",
            );
            return None;
        }
        let mut reading = tokio::task::spawn_blocking(round);
        match tokio::time::timeout(self.deadline, &mut reading).await {
            Ok(Ok(fingerprint)) => {
                self.stuck = None;
                Some(fingerprint)
            }
            Ok(Err(panicked)) => std::panic::resume_unwind(panicked.into_panic()),
            Err(_) => {
                self.stuck = Some(reading);
                refused(
                    metrics,
                    &format!(
                        "reading the certificate or token files took over {:?}",
                        self.deadline
                    ),
                );
                None
            }
        }
    }
}

fn refused(metrics: &Metrics, why: &str) {
    error!("credentials not reloaded, the old ones stay in force: {why}");
    metrics
        .credential_reloads
        .get_or_create(&ResultLabel {
            result: ReloadResult::Failed.as_str(),
        })
        .inc();
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
        let mut reader = FileReader::default();
        let mut seen = {
            let credentials = credentials.clone();
            reader
                .run(&metrics, move || credentials.fingerprint())
                .await
                .unwrap_or_default()
        };
        loop {
            let check = async {
                match checks.as_mut() {
                    Some(checks) => {
                        checks.tick().await;
                    }
                    None => std::future::pending().await,
                }
            };
            let (credentials, metrics_now, last_seen) =
                (credentials.clone(), metrics.clone(), seen.clone());
            let round: Box<dyn FnOnce() -> Vec<u8> + Send> = tokio::select! {
                () = &mut stop => return,
                received = hangups.recv() => {
                    if received.is_none() {
                        return;
                    }
                    info!("SIGHUP: reloading certificates and tokens");
                    Box::new(move || {
                        let now = credentials.fingerprint();
                        credentials.reload(&metrics_now);
                        now
                    })
                }
                () = check => Box::new(move || {
                    let now = credentials.fingerprint();
                    if now != last_seen {
                        info!("certificate or token files changed: reloading");
                        credentials.reload(&metrics_now);
                    }
                    now
                }),
            };
            let read = tokio::select! {
                () = &mut stop => return,
                read = reader.run(&metrics, round) => read,
            };
            if let Some(now) = read {
                seen = now;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(metrics: &Metrics) -> u64 {
        metrics
            .credential_reloads
            .get_or_create(&ResultLabel {
                result: ReloadResult::Failed.as_str(),
            })
            .get()
    }

    // Real time: a blocking task holds tokio's paused clock still.
    #[tokio::test]
    async fn a_stuck_read_is_refused_at_the_deadline_and_no_other_starts_until_it_ends() {
        let metrics = Metrics::default();
        let mut reader = FileReader {
            deadline: Duration::from_millis(50),
            stuck: None,
        };
        let (release, stuck) = std::sync::mpsc::channel::<()>();
        let read = reader.run(&metrics, move || {
            let _ = stuck.recv();
            vec![1]
        });
        assert_eq!(read.await, None, "a read past the deadline");
        let second = reader.run(&metrics, || unreachable!("started beside a stuck read"));
        assert_eq!(second.await, None);
        assert_eq!(failed(&metrics), 2);

        release.send(()).unwrap();
        let stuck = reader.stuck.as_mut().expect("the stuck read is kept");
        assert_eq!(stuck.await.unwrap(), vec![1]);
        assert_eq!(reader.run(&metrics, || vec![2]).await, Some(vec![2]));
        assert_eq!(failed(&metrics), 2);
    }
}
