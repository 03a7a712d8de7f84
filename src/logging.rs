//! Log set-up (`RUST_LOG`, plain or JSON lines) and a rate limiter for
//! warnings that a misbehaving peer could otherwise repeat thousands of times
//! a second.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global subscriber; `RUST_LOG` overrides the default `info`.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second init (tests, embedded use) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
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
