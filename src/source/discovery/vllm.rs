//! vLLM's `GET /kv_event_sources` (vLLM 0.33 and 0.34, the API server's
//! `vllm/entrypoints/serve/kv_events/api_router.py`): per data-parallel rank
//! its `KVEventsConfig` as the engine core resolved it at bind time,
//! `{data_parallel_rank, endpoint, replay_endpoint, topic, ...}`. The list
//! comes bare or as `{"sources": [...]}` (the route has returned both);
//! other keys (`buffer_steps`, `hwm`, ...) are ignored.

use serde::Deserialize;

use super::{ASK_TIMEOUT, Answer, MAX_ANSWER_BYTES, Reported};

#[derive(Deserialize)]
#[serde(untagged)]
enum Sources {
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
pub(super) async fn ask(url: &http::Uri) -> Result<Answer, String> {
    let body =
        crate::http_get::get(url, "/kv_event_sources", MAX_ANSWER_BYTES, ASK_TIMEOUT).await?;
    parse(&body).map(Answer::from)
}

fn parse(body: &[u8]) -> Result<Vec<Reported>, String> {
    let answer: Sources = serde_json::from_slice(body)
        .map_err(|error| format!("not a list of KV-event sources: {error}"))?;
    let (Sources::Bare(sources) | Sources::Wrapped { sources }) = answer;
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
