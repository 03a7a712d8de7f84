//! TLS on the gRPC port, optionally requiring client certificates (mTLS).
//!
//! Invariant: every handshake uses the configuration in force when it
//! starts; a reload swaps the configuration for later handshakes only, so
//! connections already open keep their streams, and a reload that fails
//! leaves the old material in force. A refused handshake is counted by a
//! reason from a closed set and logged at most once a second.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tracing::warn;

use crate::metrics::{Metrics, ReasonLabel};
use crate::pem::{self, FlagFile};

/// The files named by `--tls-cert`, `--tls-key` and `--tls-client-ca`.
#[derive(Clone, Debug)]
pub struct ServerTlsFiles {
    pub cert: FlagFile,
    pub key: FlagFile,
    /// When set, clients must present a certificate issued by this CA.
    pub client_ca: Option<FlagFile>,
}

impl ServerTlsFiles {
    /// Reads and checks every file; errors name the flag and the file.
    pub fn load(&self) -> anyhow::Result<ServerConfig> {
        let provider = pem::provider();
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(ca.roots()?), provider)
                        .build()
                        .map_err(|error| anyhow::anyhow!("{ca}: {error}"))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let (chain, key) = pem::certified_key(&self.cert, &self.key)?;
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|error| anyhow::anyhow!("{} with {}: {error}", self.cert, self.key))?;
        // gRPC is HTTP/2 only.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// Why a client's TLS handshake failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// mTLS is required and the client presented no certificate.
    NoClientCertificate,
    /// The client's certificate does not chain to `--tls-client-ca` (or is
    /// expired, or not for client use).
    UntrustedClientCertificate,
    /// The client did not speak TLS at all (plaintext gRPC, HTTP/1.1).
    NotTls,
    /// The client ended the handshake with an alert: typically it does not
    /// trust kvgate's certificate (a CA missing on its side after a
    /// rotation, a name not in the certificate).
    ClientAlert,
    /// Anything else: a protocol error, no common version or ALPN, a client
    /// that went away mid-handshake.
    Other,
}

impl HandshakeFailure {
    pub const ALL: [Self; 5] = [
        Self::NoClientCertificate,
        Self::UntrustedClientCertificate,
        Self::NotTls,
        Self::ClientAlert,
        Self::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoClientCertificate => "no_client_certificate",
            Self::UntrustedClientCertificate => "untrusted_client_certificate",
            Self::NotTls => "not_tls",
            Self::ClientAlert => "client_alert",
            Self::Other => "other",
        }
    }

    fn of(error: &io::Error) -> Self {
        let tls_error = error
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        match tls_error {
            Some(rustls::Error::NoCertificatesPresented) => Self::NoClientCertificate,
            Some(rustls::Error::InvalidCertificate(_)) => Self::UntrustedClientCertificate,
            Some(rustls::Error::InvalidMessage(_)) => Self::NotTls,
            Some(rustls::Error::AlertReceived(_)) => Self::ClientAlert,
            _ => Self::Other,
        }
    }
}

/// Accepts TLS connections with the configuration currently in force.
#[derive(Clone)]
pub struct TlsAcceptor {
    files: Arc<ServerTlsFiles>,
    config: Arc<ArcSwap<ServerConfig>>,
    metrics: Metrics,
}

impl TlsAcceptor {
    /// Loads the files now: kvgate does not start with bad TLS material.
    pub fn new(files: ServerTlsFiles, metrics: Metrics) -> anyhow::Result<Self> {
        let config = files.load()?;
        Ok(Self {
            files: Arc::new(files),
            config: Arc::new(ArcSwap::from_pointee(config)),
            metrics,
        })
    }

    /// The files the configuration comes from.
    pub fn files(&self) -> impl Iterator<Item = &FlagFile> {
        [&self.files.cert, &self.files.key]
            .into_iter()
            .chain(self.files.client_ca.as_ref())
    }

    /// Re-reads the files; on error the configuration in force stays.
    pub fn reload(&self) -> anyhow::Result<()> {
        let config = self.files.load()?;
        self.config.store(Arc::new(config));
        Ok(())
    }

    /// Runs the server side of the handshake on `stream`.
    pub async fn accept(&self, stream: TcpStream) -> io::Result<TlsStream<TcpStream>> {
        let peer = stream.peer_addr().ok();
        let acceptor = tokio_rustls::TlsAcceptor::from(self.config.load_full());
        acceptor.accept(stream).await.inspect_err(|error| {
            self.refused(HandshakeFailure::of(error), peer, error);
        })
    }

    fn refused(
        &self,
        reason: HandshakeFailure,
        peer: Option<SocketAddr>,
        error: &dyn std::fmt::Display,
    ) {
        self.metrics
            .tls_handshake_failures
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
        crate::logging::rate_limited("tls_handshake_failed", || {
            warn!(
                peer = ?peer,
                reason = reason.as_str(),
                %error,
                "TLS handshake refused (logged at most once a second; \
                 kvgate_tls_handshake_failures_total counts them all)"
            );
        });
    }
}

impl super::accept::Acceptor for TlsAcceptor {
    type Io = TlsStream<TcpStream>;

    async fn accept(&self, stream: TcpStream) -> io::Result<Self::Io> {
        TlsAcceptor::accept(self, stream).await
    }
}
