//! Why a gRPC connection failed, in the words an operator searches for:
//! "connection refused", "no such host", "TLS handshake failed: …", rather
//! than tonic's bare "transport error".
//!
//! Invariant: the deepest cause is always kept; a known one is named first.

use std::error::Error;

/// `error` and its causes as one line: the recognised cause first, then the
/// innermost message.
pub fn describe(error: &(dyn Error + 'static)) -> String {
    let mut causes = Vec::new();
    let mut next = Some(error);
    while let Some(cause) = next {
        causes.push(cause);
        next = cause.source();
    }
    let innermost = causes
        .last()
        .map(|cause| cause.to_string())
        .unwrap_or_default();
    let io_kind = causes
        .iter()
        .find_map(|cause| cause.downcast_ref::<std::io::Error>())
        .map(std::io::Error::kind);
    let text = causes
        .iter()
        .map(|cause| cause.to_string().to_ascii_lowercase())
        .collect::<Vec<_>>()
        .join(": ");
    let named = match io_kind {
        Some(std::io::ErrorKind::ConnectionRefused) => Some("connection refused"),
        Some(std::io::ErrorKind::TimedOut) => Some("timed out"),
        Some(std::io::ErrorKind::ConnectionReset) => Some("connection reset"),
        _ if text.contains("dns error")
            || text.contains("failed to lookup address")
            || text.contains("name or service not known") =>
        {
            Some("no such host")
        }
        _ if text.contains("tls") || text.contains("certificate") || text.contains("handshake") => {
            Some("TLS handshake failed")
        }
        _ => None,
    };
    match named {
        Some(named) if innermost.to_ascii_lowercase().contains(named) => innermost,
        Some(named) => format!("{named}: {innermost}"),
        None => innermost,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refused_connection_says_connection_refused() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let error = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
            .unwrap_err();
        let described = describe(&error).to_ascii_lowercase();
        assert!(described.starts_with("connection refused"), "{described}");
    }

    #[tokio::test]
    async fn an_unknown_host_says_no_such_host() {
        // `.invalid` never resolves (RFC 6761).
        let error = tonic::transport::Channel::from_static("http://kvgate-test.invalid:50051")
            .connect()
            .await
            .unwrap_err();
        let described = describe(&error);
        assert!(described.starts_with("no such host"), "{described}");
    }
}
