//! Why a gRPC connection or call failed, in the words an operator searches
//! for: "connection refused", "no such host", "the server requires a client
//! certificate", rather than tonic's bare "transport error" or a Debug chain
//! of hyper and rustls errors.
//!
//! Invariant: a description is one line; a recognised cause is named first
//! and the deepest message is kept after it. Which flag to change is for the
//! caller to say (it knows its flags): [`Cause`] carries what it needs.

use std::error::Error;

/// What went wrong on the way to the server, as far as a client can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// Nothing listens at the address.
    Refused,
    /// The host name resolves to no address.
    NoSuchHost,
    /// The connection or the call took too long.
    TimedOut,
    /// The peer closed or reset the connection. Right after a TLS 1.3
    /// handshake this is a server refusing the client's certificate (or its
    /// lack of one) before its alert could be read.
    Closed,
    /// The server's TLS alert: it requires a client certificate.
    ClientCertificateRequired,
    /// The server's TLS alert: it does not trust the client's certificate.
    ClientCertificateRefused,
    /// The server's certificate is not signed by the CA the client trusts.
    ServerCertificateUntrusted,
    /// The server's certificate names other hosts than the one dialled.
    ServerCertificateWrongName,
    /// The server's certificate has expired or is not yet valid.
    ServerCertificateExpired,
    /// A TLS client got an answer that is no TLS record: the server speaks
    /// plaintext.
    ServerNotTls,
    /// A plaintext HTTP/2 client got bytes that are no HTTP/2 frame: the
    /// server speaks TLS (its alert reads as a malformed frame), or is not
    /// a gRPC server.
    ServerNotPlaintextHttp2,
    /// Another TLS failure.
    OtherTls,
    /// Anything else.
    Other,
}

impl Cause {
    /// The cause in plain words, for logs that name no flag.
    pub fn as_words(self) -> Option<&'static str> {
        Some(match self {
            Self::Refused => "connection refused",
            Self::NoSuchHost => "no such host",
            Self::TimedOut => "timed out",
            Self::Closed => "connection closed by the server",
            Self::ClientCertificateRequired => "the server requires a client certificate",
            Self::ClientCertificateRefused => "the server does not trust the client certificate",
            Self::ServerCertificateUntrusted => {
                "the server's certificate is not signed by the CA given"
            }
            Self::ServerCertificateWrongName => {
                "the server's certificate does not name the host dialled"
            }
            Self::ServerCertificateExpired => "the server's certificate has expired",
            Self::ServerNotTls => "the server is not speaking TLS",
            Self::ServerNotPlaintextHttp2 => "the server is not speaking plaintext HTTP/2",
            Self::OtherTls => "TLS handshake failed",
            Self::Other => return None,
        })
    }
}

/// Every error in `error`'s chain, looking inside I/O and HTTP/2 errors
/// (whose `source` skips the error they wrap: a TLS alert read by the
/// HTTP/2 connection is an I/O error inside an `h2::Error`).
fn chain<'a>(error: &'a (dyn Error + 'static)) -> Vec<&'a (dyn Error + 'static)> {
    let mut causes = Vec::new();
    let mut next = Some(error);
    while let Some(cause) = next {
        causes.push(cause);
        next = if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            io.get_ref().map(|inner| inner as &(dyn Error + 'static))
        } else if let Some(io) = cause
            .downcast_ref::<h2::Error>()
            .and_then(h2::Error::get_io)
        {
            Some(io as &(dyn Error + 'static))
        } else {
            cause.source()
        };
    }
    causes
}

/// What `error` says went wrong.
pub fn cause(error: &(dyn Error + 'static)) -> Cause {
    let causes = chain(error);
    if let Some(tls) = causes
        .iter()
        .find_map(|cause| cause.downcast_ref::<rustls::Error>())
    {
        return tls_cause(tls);
    }
    let io_kind = causes
        .iter()
        .find_map(|cause| cause.downcast_ref::<std::io::Error>())
        .map(std::io::Error::kind);
    let text = causes
        .iter()
        .map(|cause| cause.to_string().to_ascii_lowercase())
        .collect::<Vec<_>>()
        .join(": ");
    if let Some(tls) = tls_cause_in_text(&text) {
        return tls;
    }
    match io_kind {
        Some(std::io::ErrorKind::ConnectionRefused) => return Cause::Refused,
        Some(std::io::ErrorKind::TimedOut) => return Cause::TimedOut,
        Some(
            std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof,
        ) => return Cause::Closed,
        _ => {}
    }
    if text.contains("dns error")
        || text.contains("failed to lookup address")
        || text.contains("name or service not known")
    {
        Cause::NoSuchHost
    } else if text.contains("frame with invalid size")
        || text.contains("frame_size_error")
        || text.contains("h2 protocol error")
    {
        Cause::ServerNotPlaintextHttp2
    } else if text.contains("connection closed") || text.contains("connection reset") {
        Cause::Closed
    } else if text.contains("tls") || text.contains("certificate") || text.contains("handshake") {
        Cause::OtherTls
    } else {
        Cause::Other
    }
}

/// The TLS cause that rustls's message names. An HTTP/2 connection hands
/// its I/O error to each of its calls as a kind and a message only, so the
/// `rustls::Error` itself is gone by then.
fn tls_cause_in_text(text: &str) -> Option<Cause> {
    let alert = |names: &[&str]| {
        names
            .iter()
            .any(|name| text.contains(&format!("received fatal alert: {name}")))
    };
    Some(if alert(&["certificaterequired"]) {
        Cause::ClientCertificateRequired
    } else if alert(&[
        "badcertificate",
        "unknownca",
        "certificateunknown",
        "unsupportedcertificate",
        "certificateexpired",
        "accessdenied",
    ]) {
        Cause::ClientCertificateRefused
    } else if text.contains("invalid peer certificate: unknownissuer")
        || text.contains("invalid peer certificate: badsignature")
    {
        Cause::ServerCertificateUntrusted
    } else if text.contains("not valid for name") || text.contains("notvalidforname") {
        Cause::ServerCertificateWrongName
    } else if text.contains("corrupt message of type invalidcontenttype") {
        Cause::ServerNotTls
    } else {
        return None;
    })
}

fn tls_cause(error: &rustls::Error) -> Cause {
    use rustls::{AlertDescription, CertificateError, InvalidMessage};
    match error {
        rustls::Error::AlertReceived(AlertDescription::CertificateRequired) => {
            Cause::ClientCertificateRequired
        }
        rustls::Error::AlertReceived(
            AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateExpired
            | AlertDescription::AccessDenied,
        ) => Cause::ClientCertificateRefused,
        rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer | CertificateError::BadSignature,
        ) => Cause::ServerCertificateUntrusted,
        rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => Cause::ServerCertificateWrongName,
        rustls::Error::InvalidCertificate(
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. },
        ) => Cause::ServerCertificateExpired,
        rustls::Error::InvalidMessage(InvalidMessage::InvalidContentType)
        | rustls::Error::InvalidMessage(InvalidMessage::UnknownProtocolVersion) => {
            Cause::ServerNotTls
        }
        _ => Cause::OtherTls,
    }
}

/// `error` and its causes as one line: the recognised cause first, then the
/// innermost message.
pub fn describe(error: &(dyn Error + 'static)) -> String {
    let innermost = chain(error)
        .last()
        .map(|cause| cause.to_string())
        .unwrap_or_default();
    match cause(error).as_words() {
        Some(named) if innermost.to_ascii_lowercase().contains(named) => innermost,
        Some(named) => format!("{named}: {innermost}"),
        None => innermost,
    }
}

/// The transport failure behind `status`, when the call never got a gRPC
/// answer (tonic makes such a status from a connection error).
pub fn transport_failure(status: &tonic::Status) -> Option<&(dyn Error + 'static)> {
    status.source()
}

/// A gRPC status as grpcurl shows it, on one line: the code's canonical
/// name first (`OUT_OF_RANGE: cursor 42 is older than the history`); for a
/// call that failed on the way, what failed (`UNAVAILABLE: connection
/// refused: …`) instead of tonic's "transport error".
pub fn describe_status(status: &tonic::Status) -> String {
    use tonic::Code;
    let name = match status.code() {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    };
    let message = match transport_failure(status) {
        Some(failure) => describe(failure),
        None => status.message().to_owned(),
    };
    // One line, whatever a peer put in its message.
    let message = message.split_whitespace().collect::<Vec<_>>().join(" ");
    if message.is_empty() {
        name.to_owned()
    } else {
        format!("{name}: {message}")
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
        assert_eq!(cause(&error), Cause::Refused);
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
        assert_eq!(cause(&error), Cause::NoSuchHost);
        let described = describe(&error);
        assert!(described.starts_with("no such host"), "{described}");
    }

    #[test]
    fn a_status_from_the_server_shows_its_code_name_and_message_on_one_line() {
        let status = tonic::Status::out_of_range("cursor 42\nis older");
        assert_eq!(describe_status(&status), "OUT_OF_RANGE: cursor 42 is older");
        let bare = tonic::Status::unimplemented("");
        assert_eq!(describe_status(&bare), "UNIMPLEMENTED");
    }

    #[test]
    fn tls_alerts_and_certificate_errors_name_their_cause() {
        use rustls::{AlertDescription, CertificateError, InvalidMessage};
        let io = |error: rustls::Error| std::io::Error::new(std::io::ErrorKind::InvalidData, error);
        for (error, expected) in [
            (
                rustls::Error::AlertReceived(AlertDescription::CertificateRequired),
                Cause::ClientCertificateRequired,
            ),
            (
                rustls::Error::AlertReceived(AlertDescription::UnknownCA),
                Cause::ClientCertificateRefused,
            ),
            (
                rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer),
                Cause::ServerCertificateUntrusted,
            ),
            (
                rustls::Error::InvalidCertificate(CertificateError::NotValidForName),
                Cause::ServerCertificateWrongName,
            ),
            (
                rustls::Error::InvalidMessage(InvalidMessage::InvalidContentType),
                Cause::ServerNotTls,
            ),
        ] {
            assert_eq!(cause(&io(error.clone())), expected, "{error}");
            // As an HTTP/2 connection hands it on: its kind and message.
            let retold = std::io::Error::other(error.to_string());
            assert_eq!(cause(&retold), expected, "{error}");
        }
    }
}
