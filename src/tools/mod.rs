//! Command-line clients of a gateway, `kvgate tail` and `kvgate status`, and
//! the shell integration (completions, man page). They talk gRPC only, like
//! any router would, and are a layer above the gateway library: no gateway
//! module imports them (docs/architecture.md).
//!
//! Invariant: a failure is one line on stderr naming its cause and the flag
//! to change; output cut short by its reader (`| head`) ends quietly with
//! exit code 0, as Unix tools do.

pub mod index_status;
pub mod record;
pub mod shell;
pub mod status;
pub mod tail;

use std::path::PathBuf;

use tokio_stream::StreamExt;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

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

/// A gateway connected to.
pub struct Connected {
    /// Calls go here, with the token if one was given.
    pub channel: Authorized,
    /// Where it is and with which flags, to explain a failed call.
    pub target: Target,
}

impl Connected {
    /// `status` as the error of the command: the server's own status, or
    /// what kept the call from reaching it and the flag to change.
    pub fn failed(&self, what: &str, status: &tonic::Status) -> anyhow::Error {
        anyhow::anyhow!("{what}: {}", self.target.explain_status(status))
    }

    /// The services the gateway's reflection lists.
    pub async fn services(&self) -> Result<Vec<String>, tonic::Status> {
        let mut reflection = ServerReflectionClient::new(self.channel.clone());
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses = reflection
            .server_reflection_info(tokio_stream::iter([request]))
            .await?
            .into_inner();
        Ok(
            match responses
                .next()
                .await
                .transpose()?
                .and_then(|r| r.message_response)
            {
                Some(MessageResponse::ListServicesResponse(list)) => list
                    .service
                    .into_iter()
                    .map(|service| service.name)
                    .collect(),
                _ => Vec::new(),
            },
        )
    }
}

/// Whether a write failed because the reader went away (`kvgate tail |
/// head`): the output ends there, quietly and successfully.
pub fn reader_gone(error: &std::io::Error) -> bool {
    error.kind() == std::io::ErrorKind::BrokenPipe
}

/// Writes `text` to stdout; a reader that went away is no error.
pub fn print(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(error) if !reader_gone(&error) => Err(error.into()),
        _ => Ok(()),
    }
}

impl GatewayArgs {
    /// A channel with the credentials given; it connects at its first
    /// call (each command stops at the first call that cannot reach the
    /// gateway, so a refused certificate costs the server one handshake).
    pub fn connect(&self) -> anyhow::Result<Connected> {
        let paths = TlsPaths {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
        };
        let token = self
            .token_file
            .as_ref()
            .map(|path| FlagFile::new("--token-file", path));
        let target = Target::new(&self.addr, &paths, FLAGS, token)?;
        let channel = target.connect_lazily();
        Ok(Connected { channel, target })
    }
}
