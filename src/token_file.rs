//! The bearer-token file format, shared by the server (the tokens it
//! accepts) and kvgate's clients (the token they send): one token a line,
//! blank lines and `#` comments ignored.
//!
//! Invariant: a file read here holds at least one token, and every token can
//! travel in an `authorization: Bearer` header; errors name the flag and the
//! file, never a token.

use crate::pem::FlagFile;

/// The tokens of a token file: one a line, blank lines and `#` comments
/// ignored; at least one.
pub fn read_tokens(file: &FlagFile) -> anyhow::Result<Vec<String>> {
    let bytes = file.read()?;
    let text = String::from_utf8(bytes).map_err(|_| anyhow::anyhow!("{file}: not UTF-8 text"))?;
    let tokens: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if tokens.is_empty() {
        anyhow::bail!("{file}: no token in it (one a line; blank lines and # comments ignored)");
    }
    if let Some(line) = tokens
        .iter()
        .position(|token| http::HeaderValue::from_str(&format!("Bearer {token}")).is_err())
    {
        anyhow::bail!(
            "{file}: token {} of the file has characters an HTTP header cannot carry",
            line + 1
        );
    }
    Ok(tokens)
}
