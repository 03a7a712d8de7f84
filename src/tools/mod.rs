//! Command-line clients of a gateway, `kvgate tail` and `kvgate status`, and
//! the shell integration (completions, man page). They talk gRPC only, like
//! any router would.

pub mod record;
pub mod shell;
pub mod status;
pub mod tail;

use std::path::PathBuf;

use crate::client::{Authorized, Target, TlsFlags, TlsPaths};
use crate::pem::FlagFile;

const FLAGS: TlsFlags = TlsFlags {
    uri: "--addr",
    ca: "--ca",
    cert: "--cert",
    key: "--key",
};

/// Where the gateway is and the credentials to reach it with.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// The gateway's gRPC address (host:port, http://host:port or
    /// https://host:port).
    #[arg(long, env = "KVGATE_ADDR", default_value = "127.0.0.1:50061")]
    pub addr: String,
    /// The CA that signed the gateway's certificate: connect over TLS
    /// (host:port then means https://).
    #[arg(long, env = "KVGATE_CA", value_name = "PEM")]
    pub ca: Option<PathBuf>,
    /// A client certificate, for a gateway that requires one (mTLS).
    #[arg(long, env = "KVGATE_CERT", value_name = "PEM")]
    pub cert: Option<PathBuf>,
    /// The client certificate's private key.
    #[arg(long, env = "KVGATE_KEY", value_name = "PEM")]
    pub key: Option<PathBuf>,
    /// A file whose first token is sent as `authorization: Bearer <token>`.
    #[arg(long, env = "KVGATE_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<PathBuf>,
}

impl GatewayArgs {
    /// Connects with the credentials given.
    pub async fn connect(&self) -> anyhow::Result<Authorized> {
        self.target()?.connect().await
    }

    /// The gateway with its credentials loaded and checked, to connect to
    /// (again).
    pub fn target(&self) -> anyhow::Result<Target> {
        let paths = TlsPaths {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
        };
        let token = self
            .token_file
            .as_ref()
            .map(|path| FlagFile::new("--token-file", path));
        Target::new(&self.addr, &paths, FLAGS, token)
    }
}

/// A gRPC status as grpcurl shows it: the code's canonical name first
/// (`OUT_OF_RANGE: cursor 42 is older than the history`).
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
    format!("{name}: {}", status.message())
}
