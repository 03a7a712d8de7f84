//! Log set-up (`RUST_LOG`, plain or JSON lines) and a rate limiter for
//! warnings that a misbehaving peer could otherwise repeat thousands of times
//! a second.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
/// How log lines are written on stderr.
pub enum LogFormat {
    /// One human-readable line per log event.
    Text,
    /// One JSON object per line.
    Json,
}

/// The default filter: the ZMQ library logs every peer's disconnection and
/// each reconnection attempt; kvgate says what matters about the engine.
const DEFAULT_FILTER: &str = "info,zeromq=error";

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Installs the global subscriber; `RUST_LOG` overrides `DEFAULT_FILTER`.
/// Colours only when stderr is a terminal.
pub fn init(format: LogFormat) {
    let _ = FORMAT.set(format);
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    // A second init (tests, embedded use) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// A start-up line for the operator (where kvgate serves, how to watch it):
/// on stdout as plain text, or a JSON log line on stderr with
/// `--log-format json`, so that stdout stays quiet.
pub fn announce(line: &str) {
    match FORMAT.get() {
        Some(LogFormat::Json) => tracing::info!(target: "kvgate", "{line}"),
        _ => println!("{line}"),
    }
}

const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Runs `log` unless the same `key` was logged less than a second ago.
pub fn rate_limited(key: &'static str, log: impl FnOnce()) {
    static LAST: OnceLock<Mutex<HashMap<&'static str, Instant>>> = OnceLock::new();
    let now = Instant::now();
    let mut last = LAST
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    match last.get(key) {
        Some(at) if now.duration_since(*at) < MIN_INTERVAL => {}
        _ => {
            last.insert(key, now);
            drop(last);
            log();
        }
    }
}
