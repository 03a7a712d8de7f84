//! A usage error: a value the user set that kvgate cannot run with (a flag,
//! a file a flag names, a combination of flags). Any layer may raise one;
//! `main` exits with [`USAGE_EXIT_CODE`] for it (`usage::exit_code`).
//!
//! Invariant: the message names what the user set (the flag, and the file
//! or value), so it says what to change.

/// Exit code of every usage error, as of clap's own parse errors.
pub const USAGE_EXIT_CODE: u8 = 2;

/// A flag value kvgate cannot run with, found after parsing (a file it
/// names, a combination of flags, or a check that needs more than one
/// value).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

impl UsageError {
    /// `error` (its whole chain, on one line) as a usage error.
    pub fn from_error(error: &anyhow::Error) -> Self {
        Self(format!("{error:#}"))
    }
}
