//! kvgate's one plain-HTTP client: a bounded `GET` over HTTP/1.1, for an
//! engine's discovery route (`GET /kv_event_sources`) and a gateway's
//! `/status` (`kvgate status --admin`).
//!
//! Invariant: whatever the peer does, a call ends within its timeout and
//! reads at most its byte limit; every failure is a sentence saying which
//! step failed.

use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use hyper_util::rt::TokioIo;

/// The body of `GET {url's path}{path}`, at most `limit` bytes, within
/// `timeout`; a status other than 2xx is an error naming it.
pub async fn get(
    url: &http::Uri,
    path: &str,
    limit: usize,
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    match tokio::time::timeout(timeout, get_bounded_in_size(url, path, limit)).await {
        Ok(body) => body,
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

async fn get_bounded_in_size(url: &http::Uri, path: &str, limit: usize) -> Result<Vec<u8>, String> {
    let authority = url.authority().ok_or("the URL names no host")?.clone();
    let port = authority.port_u16().unwrap_or(80);
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|error| format!("cannot connect: {error}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|error| format!("HTTP handshake: {error}"))?;
    let connection = tokio::spawn(connection);
    let target = format!("{}{path}", url.path().trim_end_matches('/'));
    let request = http::Request::get(target)
        .header(http::header::HOST, authority.as_str())
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|error| error.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|error| format!("HTTP request: {error}"));
    let answer = match response {
        Ok(response) => {
            let status = response.status();
            let body = Limited::new(response.into_body(), limit)
                .collect()
                .await
                .map_err(|error| format!("reading the answer: {error}"));
            match body {
                Ok(_) if !status.is_success() => Err(format!("HTTP {status}")),
                Ok(body) => Ok(body.to_bytes().to_vec()),
                Err(error) => Err(error),
            }
        }
        Err(error) => Err(error),
    };
    connection.abort();
    answer
}
