//! Bearer tokens (`--auth-token-file`): every RPC but `grpc.health.v1` and
//! server reflection needs `authorization: Bearer <token>` with a token from
//! the file. Reflection is open because it serves kvgate's own descriptors
//! only (the protos of the public contract, never events, state or the
//! engine's answers), and tools such as grpcurl ask it before any call, so a
//! health check works without a token as probes need.
//!
//! Invariant: a call without a known token is answered UNAUTHENTICATED here,
//! before any route sees it: nothing reaches the engine, no event is sent.
//! An admitted call goes on with its headers untouched (the engine may check
//! the same header). Tokens are held only as SHA-256 digests and compared in
//! constant time, so neither their values nor their lengths leak through
//! timing, logs, metrics or `/status`. A reload that fails keeps the tokens
//! in force.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use axum::response::Response;
use futures::future::Either;
use subtle::ConstantTimeEq;
use tower::{Layer, Service};
use tracing::warn;

use crate::metrics::{Metrics, ReasonLabel};
use crate::pem::FlagFile;
use crate::token_file::read_tokens;

/// Paths that need no token: probes must work without credentials, and
/// reflection holds no data (module doc).
const OPEN_PREFIXES: [&str; 3] = [
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

type Digest = [u8; 32];

fn digest(token: &[u8]) -> Digest {
    let mut out = [0; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, token).as_ref());
    out
}

/// Why a call was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `authorization` header.
    Missing,
    /// An `authorization` header that is not `Bearer <token>`.
    Malformed,
    /// A bearer token that is not in the file.
    UnknownToken,
}

impl AuthFailure {
    pub const ALL: [Self; 3] = [Self::Missing, Self::Malformed, Self::UnknownToken];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Malformed => "malformed",
            Self::UnknownToken => "unknown_token",
        }
    }

    fn message(self) -> &'static str {
        match self {
            Self::Missing => "kvgate requires an authorization: Bearer <token> header",
            Self::Malformed => "kvgate requires authorization: Bearer <token>",
            Self::UnknownToken => "kvgate does not know this bearer token",
        }
    }
}

/// The tokens in force, shared by every connection.
#[derive(Clone)]
pub struct Tokens {
    file: Arc<FlagFile>,
    digests: Arc<ArcSwap<Vec<Digest>>>,
}

impl Tokens {
    /// Reads the file now: kvgate does not start without a usable token.
    pub fn load(file: FlagFile) -> anyhow::Result<Self> {
        let digests = Self::digests(&file)?;
        Ok(Self {
            file: Arc::new(file),
            digests: Arc::new(ArcSwap::from_pointee(digests)),
        })
    }

    /// The file the tokens come from.
    pub fn file(&self) -> &FlagFile {
        &self.file
    }

    /// Re-reads the file; returns how many tokens are now in force. On
    /// error the tokens in force stay.
    pub fn reload(&self) -> anyhow::Result<usize> {
        let digests = Self::digests(&self.file)?;
        let count = digests.len();
        self.digests.store(Arc::new(digests));
        Ok(count)
    }

    fn digests(file: &FlagFile) -> anyhow::Result<Vec<Digest>> {
        Ok(read_tokens(file)?
            .iter()
            .map(|token| digest(token.as_bytes()))
            .collect())
    }

    /// Whether `headers` carry a token in force.
    pub fn check(&self, headers: &http::HeaderMap) -> Result<(), AuthFailure> {
        let value = headers
            .get(http::header::AUTHORIZATION)
            .ok_or(AuthFailure::Missing)?;
        let token = bearer_token(value.as_bytes()).ok_or(AuthFailure::Malformed)?;
        let presented = digest(token);
        // Every token is compared, whichever matches.
        let known = self
            .digests
            .load()
            .iter()
            .fold(subtle::Choice::from(0), |known, digest| {
                known | digest.ct_eq(&presented)
            });
        if bool::from(known) {
            Ok(())
        } else {
            Err(AuthFailure::UnknownToken)
        }
    }
}

/// The token of `Bearer <token>` (the scheme is case-insensitive).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    (scheme.eq_ignore_ascii_case(b"Bearer ") && !token.is_empty()).then_some(token)
}

/// The layer that refuses calls without a token in force.
#[derive(Clone)]
pub struct RequireToken {
    tokens: Tokens,
    metrics: Metrics,
}

impl RequireToken {
    pub fn new(tokens: Tokens, metrics: Metrics) -> Self {
        Self { tokens, metrics }
    }

    fn refuse(&self, failure: AuthFailure) -> Response {
        self.metrics
            .auth_failures
            .get_or_create(&ReasonLabel {
                reason: failure.as_str(),
            })
            .inc();
        crate::logging::rate_limited("auth_refused", || {
            warn!(
                reason = failure.as_str(),
                "call refused UNAUTHENTICATED (logged at most once a second; \
                 kvgate_auth_failures_total counts them all)"
            );
        });
        tonic::Status::unauthenticated(failure.message()).into_http::<axum::body::Body>()
    }
}

impl<S> Layer<S> for RequireToken {
    type Service = TokenCheck<S>;

    fn layer(&self, inner: S) -> TokenCheck<S> {
        TokenCheck {
            inner,
            require: self.clone(),
        }
    }
}

/// A route behind [`RequireToken`].
#[derive(Clone)]
pub struct TokenCheck<S> {
    inner: S,
    require: RequireToken,
}

impl<S, B> Service<http::Request<B>> for TokenCheck<S>
where
    S: Service<http::Request<B>, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Either<std::future::Ready<Result<Response, Infallible>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let path = request.uri().path();
        if OPEN_PREFIXES.iter().any(|open| path.starts_with(open)) {
            return Either::Right(self.inner.call(request));
        }
        match self.require.tokens.check(request.headers()) {
            Ok(()) => Either::Right(self.inner.call(request)),
            Err(failure) => Either::Left(std::future::ready(Ok(self.require.refuse(failure)))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bearer_with_a_token_is_a_bearer_token() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bear"), None);
    }
}
