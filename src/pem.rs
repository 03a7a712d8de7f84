//! PEM files named on the command line: certificates, private keys and CA
//! bundles, for the server's TLS and for kvgate's own client connections.
//!
//! Invariant: every error names the flag the operator set and the file it
//! points at, and never quotes the file's contents (a key must not reach a
//! log). One crypto provider (ring) serves every TLS config kvgate builds.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Largest certificate, key, CA bundle or token file kvgate reads.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// A file as the operator gave it: the flag and its path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlagFile {
    /// The flag the operator set.
    pub flag: &'static str,
    /// The file it names.
    pub path: PathBuf,
}

impl FlagFile {
    /// The file at `path`, given with `flag`.
    pub fn new(flag: &'static str, path: impl Into<PathBuf>) -> Self {
        Self {
            flag,
            path: path.into(),
        }
    }

    /// The file's bytes; the error names the flag and the file. Only a
    /// regular file is read, opened without waiting for whatever else the
    /// path is ([`crate::regular_file`]). A file over
    /// `MAX_FILE_BYTES` is refused (a flag pointed at the wrong file must
    /// not fill the memory, now or at a reload). Reading a regular file can
    /// still stall (a hung network mount): a caller on the async runtime
    /// reads on a blocking thread, with a deadline.
    pub fn read(&self) -> anyhow::Result<Vec<u8>> {
        use std::io::Read as _;
        let file = crate::regular_file::open(&self.path).map_err(|refused| match refused {
            crate::regular_file::OpenRefused::Io(error) => {
                anyhow::Error::new(error).context(format!("{self}: cannot read"))
            }
            not_regular => anyhow::anyhow!("{self}: {not_regular}"),
        })?;
        let mut bytes = Vec::new();
        file.take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut bytes)
            .with_context(|| format!("{self}: cannot read"))?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            anyhow::bail!(
                "{self}: larger than {MAX_FILE_BYTES} bytes: not a certificate, key or token file"
            );
        }
        Ok(bytes)
    }

    /// Every certificate in the file (at least one).
    pub fn certificates(&self) -> anyhow::Result<Vec<CertificateDer<'static>>> {
        let bytes = self.read()?;
        let certificates = CertificateDer::pem_slice_iter(&bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| anyhow::anyhow!("{self}: not PEM: {error}"))?;
        if certificates.is_empty() {
            anyhow::bail!("{self}: no PEM certificate in it");
        }
        Ok(certificates)
    }

    /// The file's first private key (PKCS#8, PKCS#1 or SEC1).
    pub fn private_key(&self) -> anyhow::Result<PrivateKeyDer<'static>> {
        let bytes = self.read()?;
        PrivateKeyDer::from_pem_slice(&bytes).map_err(|error| match error {
            rustls_pki_types::pem::Error::NoItemsFound => {
                anyhow::anyhow!("{self}: no PEM private key in it")
            }
            error => anyhow::anyhow!("{self}: not a PEM private key: {error}"),
        })
    }

    /// The file's certificates as trust anchors.
    pub fn roots(&self) -> anyhow::Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        for certificate in self.certificates()? {
            roots
                .add(certificate)
                .map_err(|error| anyhow::anyhow!("{self}: not a usable CA certificate: {error}"))?;
        }
        Ok(roots)
    }
}

impl std::fmt::Display for FlagFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.flag, self.path.display())
    }
}

/// A certificate chain and the key that goes with it, checked to match.
pub fn certified_key(
    cert: &FlagFile,
    key: &FlagFile,
) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let chain = cert.certificates()?;
    let private_key = key.private_key()?;
    rustls::sign::CertifiedKey::from_der(chain.clone(), private_key.clone_key(), &provider())
        .map_err(|error| anyhow::anyhow!("{key} does not go with {cert}: {error}"))?;
    Ok((chain, private_key))
}

/// The crypto provider of every TLS config kvgate builds.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Both halves of an optional certificate/key pair, or neither.
pub fn pair(
    cert: Option<FlagFile>,
    key: Option<FlagFile>,
    cert_flag: &str,
    key_flag: &str,
) -> anyhow::Result<Option<(FlagFile, FlagFile)>> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some((cert, key))),
        (None, None) => Ok(None),
        (Some(cert), None) => anyhow::bail!("{cert} needs {key_flag} (its private key)"),
        (None, Some(key)) => anyhow::bail!("{key} needs {cert_flag} (its certificate)"),
    }
}
