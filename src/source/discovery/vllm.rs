//! vLLM's `GET /kv_event_sources` (vLLM 0.33 and 0.34, the API server's
//! `vllm/entrypoints/serve/kv_events/api_router.py`): per data-parallel rank
//! its `KVEventsConfig` as the engine core resolved it at bind time,
//! `{data_parallel_rank, endpoint, replay_endpoint, topic, ...}`. The list
//! comes bare or as `{"sources": [...]}` (the route has returned both);
//! other keys (`buffer_steps`, `hwm`, ...) are ignored.

use http_body_util::{BodyExt, Limited};
use hyper_util::rt::TokioIo;
use serde::Deserialize;

use super::{ASK_TIMEOUT, MAX_ANSWER_BYTES, Reported};

#[derive(Deserialize)]
#[serde(untagged)]
enum Answer {
    Bare(Vec<Source>),
    Wrapped { sources: Vec<Source> },
}

#[derive(Deserialize)]
struct Source {
    data_parallel_rank: u32,
    endpoint: String,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: Option<String>,
}

/// The ranks `url`'s `/kv_event_sources` names, or why there are none.
pub(super) async fn ask(url: &http::Uri) -> Result<Vec<Reported>, String> {
    let body = match tokio::time::timeout(ASK_TIMEOUT, get(url)).await {
        Ok(body) => body?,
        Err(_) => return Err(format!("no answer within {ASK_TIMEOUT:?}")),
    };
    parse(&body)
}

fn parse(body: &[u8]) -> Result<Vec<Reported>, String> {
    let answer: Answer = serde_json::from_slice(body)
        .map_err(|error| format!("not a list of KV-event sources: {error}"))?;
    let (Answer::Bare(sources) | Answer::Wrapped { sources }) = answer;
    Ok(sources
        .into_iter()
        .map(|source| Reported {
            rank: source.data_parallel_rank,
            endpoint: source.endpoint,
            replay_endpoint: source.replay_endpoint,
            topic: source.topic.unwrap_or_default(),
        })
        .collect())
}

/// The body of a `GET` of `url`'s `/kv_event_sources` over HTTP/1.1, at
/// most [`MAX_ANSWER_BYTES`].
async fn get(url: &http::Uri) -> Result<Vec<u8>, String> {
    let authority = url.authority().ok_or("the URL names no host")?.clone();
    let port = authority.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((authority.host(), port))
        .await
        .map_err(|error| format!("cannot connect: {error}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|error| format!("HTTP handshake: {error}"))?;
    let connection = tokio::spawn(connection);
    let path = format!("{}/kv_event_sources", url.path().trim_end_matches('/'));
    let request = http::Request::get(path)
        .header(http::header::HOST, authority.as_str())
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|error| error.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|error| format!("HTTP request: {error}"))?;
    let status = response.status();
    let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|error| format!("reading the answer: {error}"))?
        .to_bytes();
    connection.abort();
    if !status.is_success() {
        return Err(format!("HTTP {status}"));
    }
    Ok(body.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_list_and_a_wrapped_one_read_alike_and_other_keys_are_ignored() {
        let bare = br#"[{"data_parallel_rank": 1, "endpoint": "tcp://*:5558",
            "replay_endpoint": null, "topic": "kv", "buffer_steps": 10000}]"#;
        let wrapped = br#"{"sources": [{"data_parallel_rank": 1, "endpoint": "tcp://*:5558",
            "replay_endpoint": null, "topic": "kv", "hwm": 100000}]}"#;
        let expected = vec![Reported {
            rank: 1,
            endpoint: "tcp://*:5558".into(),
            replay_endpoint: None,
            topic: "kv".into(),
        }];
        assert_eq!(parse(bare).unwrap(), expected);
        assert_eq!(parse(wrapped).unwrap(), expected);
    }

    #[test]
    fn garbage_is_an_error_naming_what_was_expected() {
        for body in [&b"<html>"[..], b"{}", b"[{\"endpoint\": 5}]", b"null"] {
            assert!(
                parse(body).unwrap_err().starts_with("not a list"),
                "{body:?}"
            );
        }
    }
}
