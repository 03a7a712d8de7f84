//! kvgate as a gRPC client: `kvgate tail`, `kvgate status`, the upstream
//! source and the pass-through towards the engine, over plaintext or TLS,
//! with a bearer token when given one.
//!
//! Invariant: credentials are read and checked when the target is built
//! (at start), so a bad flag fails naming it before anything connects (a
//! [`UsageError`]); an `https://` target always verifies the server against
//! the CA it was given (there is no "insecure" mode), and a TLS flag on a
//! plaintext target is refused rather than ignored. A connection or call that fails is
//! explained in one line naming the cause and the flag to change.

use std::path::PathBuf;
use std::task::{Context, Poll};

use http::HeaderValue;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::ClientConfig;
use tonic::body::Body;
use tonic::codec::{Codec, Streaming};
use tonic::transport::{Channel, Endpoint};
use tower::Service;

use crate::connect_error::Cause;
use crate::pem::{self, FlagFile};
use crate::proto::common::{KvEventBatch, SubscribeKvEventsRequest};
use crate::token_file::read_tokens;
use crate::usage_error::UsageError;

/// The connector of every outgoing connection: TLS for `https://`.
pub type Connector = HttpsConnector<HttpConnector>;

/// An HTTP/2 client of calls to the engine (forwarded calls and kvgate's
/// own `GetLoads` polls each have one, on connections of their own).
pub type EngineTransport = hyper_util::client::legacy::Client<Connector, Body>;

/// The flags a client's TLS files come from, for error messages.
#[derive(Clone, Copy, Debug)]
pub struct TlsFlags {
    /// The flag of the address.
    pub uri: &'static str,
    /// The flag of the CA file.
    pub ca: &'static str,
    /// The flag of the client certificate.
    pub cert: &'static str,
    /// The flag of the client certificate's key.
    pub key: &'static str,
}

/// A client's TLS files as given on the command line.
#[derive(Clone, Debug, Default)]
pub struct TlsPaths {
    /// The CA that signed the server's certificate.
    pub ca: Option<PathBuf>,
    /// A client certificate and its key, for servers that require mTLS.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key.
    pub key: Option<PathBuf>,
}

impl TlsPaths {
    fn any(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }
}

/// The connector for `uri`: plaintext for `http://`, TLS verified against
/// the CA (and with the client certificate, if any) for `https://`. Every
/// error is a [`UsageError`] naming the flag.
pub fn connector(uri: &http::Uri, paths: &TlsPaths, flags: TlsFlags) -> anyhow::Result<Connector> {
    tls_connector(uri, paths, flags).map_err(|error| UsageError::from_error(&error).into())
}

fn tls_connector(uri: &http::Uri, paths: &TlsPaths, flags: TlsFlags) -> anyhow::Result<Connector> {
    match (&paths.cert, &paths.key) {
        (Some(_), None) => anyhow::bail!(
            "{} needs {} (the client certificate's private key)",
            flags.cert,
            flags.key
        ),
        (None, Some(_)) => anyhow::bail!(
            "{} needs {} (the client certificate it belongs to)",
            flags.key,
            flags.cert
        ),
        _ => {}
    }
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    // The TLS layer above handles https:// itself.
    http.enforce_http(false);
    let config = match uri.scheme_str() {
        Some("http") => {
            if paths.ca.is_none() && paths.any() {
                anyhow::bail!(
                    "{} and {} are for TLS: add {} (the CA that signed the server's certificate) \
                     and connect to https://",
                    flags.cert,
                    flags.key,
                    flags.ca
                );
            }
            if paths.any() {
                anyhow::bail!(
                    "{} {uri} is plaintext: TLS files ({}, {}, {}) need an https:// URI",
                    flags.uri,
                    flags.ca,
                    flags.cert,
                    flags.key
                );
            }
            // Never used: every connection is plaintext.
            tls_config(None, None)?
        }
        Some("https") => {
            let ca = paths.ca.as_ref().map(|path| FlagFile::new(flags.ca, path));
            let Some(ca) = ca else {
                anyhow::bail!(
                    "{} {uri} is https://: give {} (the CA that signed its certificate)",
                    flags.uri,
                    flags.ca
                );
            };
            let identity = pem::pair(
                paths
                    .cert
                    .as_ref()
                    .map(|path| FlagFile::new(flags.cert, path)),
                paths
                    .key
                    .as_ref()
                    .map(|path| FlagFile::new(flags.key, path)),
                flags.cert,
                flags.key,
            )?;
            tls_config(Some(&ca), identity.as_ref())?
        }
        _ => anyhow::bail!(
            "{} {uri}: expected http://HOST:PORT or https://HOST:PORT",
            flags.uri
        ),
    };
    Ok(HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http2()
        .wrap_connector(http))
}

fn tls_config(
    ca: Option<&FlagFile>,
    identity: Option<&(FlagFile, FlagFile)>,
) -> anyhow::Result<ClientConfig> {
    let roots = match ca {
        Some(ca) => ca.roots()?,
        None => rustls::RootCertStore::empty(),
    };
    let builder = ClientConfig::builder_with_provider(pem::provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    Ok(match identity {
        Some((cert, key)) => {
            let (chain, private_key) = pem::certified_key(cert, key)?;
            builder
                .with_client_auth_cert(chain, private_key)
                .map_err(|error| anyhow::anyhow!("{cert} with {key}: {error}"))?
        }
        None => builder.with_no_client_auth(),
    })
}

/// A gateway (or any `SubscribeKvEvents` server) to connect to, with its
/// credentials loaded and checked.
#[derive(Clone)]
pub struct Target {
    uri: http::Uri,
    /// The address as the user wrote it, for errors that name their flag.
    given: String,
    flags: TlsFlags,
    /// Whether a client certificate is presented (TLS only).
    client_certificate: bool,
    connector: Connector,
    authorization: Option<HeaderValue>,
}

impl Target {
    /// `address` is a URI, or `host:port` (https:// when a CA is given).
    /// The token is the first one in `token_file`.
    pub fn new(
        address: &str,
        paths: &TlsPaths,
        flags: TlsFlags,
        token_file: Option<FlagFile>,
    ) -> anyhow::Result<Self> {
        let given = address.to_owned();
        let address = if address.contains("://") {
            address.to_owned()
        } else if paths.ca.is_some() {
            format!("https://{address}")
        } else {
            format!("http://{address}")
        };
        let uri: http::Uri = address
            .parse()
            .map_err(|error| UsageError(format!("{} {address}: {error}", flags.uri)))?;
        let connector = connector(&uri, paths, flags)?;
        let authorization = token_file
            .map(|file| {
                let token = read_tokens(&file)
                    .map_err(|error| UsageError::from_error(&error))?
                    .swap_remove(0);
                HeaderValue::from_str(&format!("Bearer {token}"))
                    .map(|mut value| {
                        value.set_sensitive(true);
                        value
                    })
                    .map_err(|_| UsageError(format!("{file}: not a usable token")))
            })
            .transpose()?;
        Ok(Self {
            uri,
            given,
            flags,
            client_certificate: paths.cert.is_some(),
            connector,
            authorization,
        })
    }

    /// A failed call (`error`, with its chain) as one line naming the
    /// cause and the flag to change.
    pub fn explain(&self, error: &(dyn std::error::Error + 'static)) -> String {
        format!("{} {}: {}", self.flags.uri, self.given, self.why(error))
    }

    fn why(&self, error: &(dyn std::error::Error + 'static)) -> String {
        let flags = self.flags;
        let tls = self.uri.scheme_str() == Some("https");
        let host = self.uri.host().unwrap_or_default();
        match (crate::connect_error::cause(error), tls) {
            (Cause::Refused, _) => format!(
                "connection refused: nothing listens there (is the server running, and is {} right?)",
                flags.uri
            ),
            // TLS 1.3 finishes the client's handshake before the server has
            // checked its certificate; the server's refusal then shows as its
            // alert or, when the client wrote first, as a closed connection.
            (Cause::ClientCertificateRequired, _) | (Cause::Closed, true)
                if !self.client_certificate =>
            {
                format!(
                    "the server requires a client certificate: add {} and {}",
                    flags.cert, flags.key
                )
            }
            (Cause::ClientCertificateRefused | Cause::Closed, true) => format!(
                "the server does not trust the client certificate ({}): use one signed by the CA \
                 the server requires of its clients",
                flags.cert
            ),
            (Cause::ServerCertificateUntrusted, _) => format!(
                "the server's certificate is not signed by the CA in {}: give the CA that signed it",
                flags.ca
            ),
            (Cause::ServerCertificateWrongName, _) => format!(
                "the server's certificate does not name {host}: connect by a name or address it \
                 lists ({})",
                flags.uri
            ),
            (Cause::ServerCertificateExpired, _) => {
                "the server's certificate has expired or is not valid yet".to_owned()
            }
            (Cause::ServerNotTls, _) => format!(
                "the server is not speaking TLS: drop {} or use http://",
                flags.ca
            ),
            (Cause::ServerNotPlaintextHttp2 | Cause::Closed, false) => format!(
                "the server did not answer plaintext HTTP/2 (it may require TLS): add {} with the CA \
                 that signed its certificate, or use https://",
                flags.ca
            ),
            _ => crate::connect_error::describe(error),
        }
    }

    /// A failed call's status as one line: the server's own status as
    /// grpcurl shows it, or, when the call never reached the server,
    /// [`Self::explain`].
    pub fn explain_status(&self, status: &tonic::Status) -> String {
        match crate::connect_error::transport_failure(status) {
            Some(failure) => self.explain(failure),
            None => crate::connect_error::describe_status(status),
        }
    }

    /// The URI connected to.
    pub fn uri(&self) -> &http::Uri {
        &self.uri
    }

    /// A channel that connects at its first call, so that call's failure
    /// is the one connection attempt a command makes (no handshake made
    /// ahead of it for the server to refuse as well); explain it with
    /// [`Self::explain_status`].
    pub fn connect_lazily(&self) -> Authorized {
        let channel =
            Endpoint::from(self.uri.clone()).connect_with_connector_lazy(self.connector.clone());
        Authorized {
            channel,
            authorization: self.authorization.clone(),
        }
    }

    /// Connects (and completes the TLS handshake, if any).
    pub async fn connect(&self) -> anyhow::Result<Authorized> {
        let channel = Endpoint::from(self.uri.clone())
            .connect_with_connector(self.connector.clone())
            .await
            .map_err(|error| {
                anyhow::anyhow!(
                    "{} {}: cannot connect: {}",
                    self.flags.uri,
                    self.given,
                    self.why(&error)
                )
            })?;
        Ok(Authorized {
            channel,
            authorization: self.authorization.clone(),
        })
    }
}

/// A channel that puts the bearer token, if any, on every call.
#[derive(Clone)]
pub struct Authorized {
    channel: Channel,
    authorization: Option<HeaderValue>,
}

impl Service<http::Request<Body>> for Authorized {
    type Response = <Channel as Service<http::Request<Body>>>::Response;
    type Error = <Channel as Service<http::Request<Body>>>::Error;
    type Future = <Channel as Service<http::Request<Body>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Service::poll_ready(&mut self.channel, cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        if let Some(authorization) = &self.authorization {
            request
                .headers_mut()
                .insert(http::header::AUTHORIZATION, authorization.clone());
        }
        Service::call(&mut self.channel, request)
    }
}

/// Opens `SubscribeKvEvents` on `service` with a stock prost client.
pub async fn subscribe<T>(
    channel: T,
    service: &str,
    start_sequence_number: u64,
) -> Result<Streaming<KvEventBatch>, tonic::Status>
where
    T: tonic::client::GrpcService<Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let codec = tonic_prost::ProstCodec::<SubscribeKvEventsRequest, KvEventBatch>::default();
    subscribe_with(channel, service, start_sequence_number, codec).await
}

/// A `SubscribeKvEvents` codec that hands each batch over as the bytes it
/// came in (a view of tonic's receive buffer, not a copy), for readers that
/// keep or measure the bytes rather than the messages.
#[derive(Clone, Copy, Default)]
pub struct RawBatches;

impl Codec for RawBatches {
    type Encode = SubscribeKvEventsRequest;
    type Decode = bytes::Bytes;
    type Encoder = tonic_prost::ProstEncoder<SubscribeKvEventsRequest>;
    type Decoder = RawBatches;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawBatches
    }
}

impl tonic::codec::Decoder for RawBatches {
    type Item = bytes::Bytes;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<bytes::Bytes>, tonic::Status> {
        use bytes::Buf as _;
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// Opens `SubscribeKvEvents` on `service`, reading the batches with `codec`.
pub async fn subscribe_with<T, C>(
    channel: T,
    service: &str,
    start_sequence_number: u64,
    codec: C,
) -> Result<Streaming<C::Decode>, tonic::Status>
where
    T: tonic::client::GrpcService<Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
    C: Codec<Encode = SubscribeKvEventsRequest>,
    C::Decode: Send + Sync + 'static,
{
    let request = SubscribeKvEventsRequest {
        start_sequence_number,
        load_records_before_first_batch: false,
    };
    subscribe_requesting(channel, service, request, codec).await
}

/// Opens `SubscribeKvEvents` on `service` with `request` as it is.
pub async fn subscribe_requesting<T, C>(
    channel: T,
    service: &str,
    request: SubscribeKvEventsRequest,
    codec: C,
) -> Result<Streaming<C::Decode>, tonic::Status>
where
    T: tonic::client::GrpcService<Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
    C: Codec<Encode = SubscribeKvEventsRequest>,
    C::Decode: Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|error| tonic::Status::unavailable(error.into().to_string()))?;
    let path = format!("/{service}/SubscribeKvEvents")
        .parse()
        .map_err(|_| tonic::Status::invalid_argument(format!("bad service name {service:?}")))?;
    grpc.server_streaming(tonic::Request::new(request), path, codec)
        .await
        .map(tonic::Response::into_inner)
}
