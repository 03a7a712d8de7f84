//! Where the engine publishes its KV events, asked of the engine itself:
//! vLLM's `GET /kv_event_sources` (`--engine-http`), OpenEngine's
//! `Control.GetKvEventSources` and SGLang's `GetServerInfo` `kv_events`
//! descriptor (`--engine-grpc`).
//!
//! Invariant: an answer is usable only whole: every rank from 0 up to the
//! last one named has a TCP publisher with a port, and every wildcard host
//! (`*`, `0.0.0.0`, `::`) is replaced by the host kvgate reached the engine
//! at, so each endpoint can be dialled as given. Anything less is an error
//! naming what was asked; nothing here guesses a port.
//!
//! Files: `vllm.rs` reads vLLM's HTTP answer, `grpc.rs` OpenEngine's and
//! SGLang's, `follow.rs` asks again while kvgate runs and moves the rank
//! sockets when the engine's ports move.

mod follow;
mod grpc;
mod vllm;

use std::fmt;
use std::time::Duration;

use kvgate_endpoint::TcpEndpoint;

use crate::client::EngineTransport;
pub use follow::{RankTarget, follow};

/// How long one question to the engine may take.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(3);

/// The most bytes of an answer read (an answer of a few ranks is under 1 kB).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// One rank's publisher, as the engine reported it, dialable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankSource {
    /// The publisher (PUB).
    pub endpoint: TcpEndpoint,
    /// The replay ROUTER, when the engine has one.
    pub replay_endpoint: Option<TcpEndpoint>,
    /// The exact topic of the rank's messages.
    pub topic: String,
}

/// Which question the engine answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// vLLM's `GET /kv_event_sources`.
    VllmHttp,
    /// OpenEngine's `Control.GetKvEventSources`.
    OpenEngine,
    /// SGLang's `GetServerInfo`, its `kv_events` descriptor.
    SglangServerInfo,
}

impl Protocol {
    /// What kvgate asked, at `at` (a URL or a gRPC origin).
    pub fn question(self, at: &str) -> String {
        match self {
            Self::VllmHttp => format!("GET {}/kv_event_sources", at.trim_end_matches('/')),
            Self::OpenEngine => format!("openengine.v1.Control/GetKvEventSources at {at}"),
            Self::SglangServerInfo => {
                format!("sglang.runtime.v1.SglangService/GetServerInfo (kv_events) at {at}")
            }
        }
    }
}

/// What the engine said of its publishers, and to which question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovered {
    /// Rank r's publisher at index r.
    pub ranks: Vec<RankSource>,
    /// Rank 0's load publisher (rank r at its port + r), when the engine
    /// names one (SGLang's `load_endpoint_port_base`).
    pub load_endpoint: Option<TcpEndpoint>,
    /// The question answered, as [`Protocol::question`] words it.
    pub learned_from: String,
}

/// The engine named no usable source: every question asked and why its
/// answer would not do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the engine named no usable KV-event source: {}", .asked.join("; "))]
pub struct NothingUsable {
    /// Each question, with why its answer would not do.
    pub asked: Vec<String>,
}

/// The engine's servers kvgate may ask.
#[derive(Clone)]
pub struct Engine {
    /// vLLM's HTTP server (`--engine-http`).
    pub http: Option<http::Uri>,
    /// The engine's gRPC server (`--engine-grpc`), through the
    /// pass-through's connection pool.
    pub grpc: Option<(EngineTransport, http::Uri)>,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("http", &self.http)
            .field("grpc", &self.grpc.as_ref().map(|(_, origin)| origin))
            .finish()
    }
}

impl Engine {
    /// Asks the engine where each rank publishes: over HTTP when
    /// `--engine-http` is given, else OpenEngine's RPC, then SGLang's; the
    /// first usable answer counts.
    pub async fn ask(&self) -> Result<Discovered, NothingUsable> {
        let mut questions = Vec::new();
        if self.http.is_some() {
            questions.push(Protocol::VllmHttp);
        }
        if self.grpc.is_some() {
            questions.extend([Protocol::OpenEngine, Protocol::SglangServerInfo]);
        }
        let mut asked = Vec::new();
        for protocol in questions {
            let (at, answer) = self.answer(protocol).await;
            let question = protocol.question(&at.to_string());
            let host = host_of(at);
            let usable = answer.and_then(|answer| {
                let load_endpoint = answer
                    .load_endpoint
                    .map(|load| endpoint_of(&load, host))
                    .transpose()
                    .map_err(|why| format!("the load endpoint: {why}"))?;
                Ok((dialable(answer.ranks, host)?, load_endpoint))
            });
            match usable {
                Ok((ranks, load_endpoint)) => {
                    return Ok(Discovered {
                        ranks,
                        load_endpoint,
                        learned_from: question,
                    });
                }
                Err(why) => asked.push(format!("{question}: {why}")),
            }
        }
        Err(NothingUsable { asked })
    }

    /// The engine's answer to `protocol`'s question, and where it was asked.
    async fn answer(&self, protocol: Protocol) -> (&http::Uri, Result<Answer, String>) {
        match (protocol, &self.http, &self.grpc) {
            (Protocol::VllmHttp, Some(url), _) => (url, vllm::ask(url).await),
            (Protocol::OpenEngine, _, Some((transport, origin))) => {
                (origin, grpc::open_engine(transport, origin).await)
            }
            (Protocol::SglangServerInfo, _, Some((transport, origin))) => {
                (origin, grpc::sglang(transport, origin).await)
            }
            _ => unreachable!("only the servers given are asked"),
        }
    }
}

fn host_of(uri: &http::Uri) -> &str {
    uri.host().unwrap_or("127.0.0.1")
}

/// An engine's answer, not yet checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Answer {
    ranks: Vec<Reported>,
    /// Rank 0's load publisher.
    load_endpoint: Option<String>,
}

impl From<Vec<Reported>> for Answer {
    fn from(ranks: Vec<Reported>) -> Self {
        Self {
            ranks,
            load_endpoint: None,
        }
    }
}

/// One rank's publisher as an engine's answer gives it, not yet checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Reported {
    rank: u32,
    endpoint: String,
    replay_endpoint: Option<String>,
    topic: String,
}

/// The ranks in order, each endpoint parsed with a wildcard host replaced
/// by `host`; ranks must run from 0 without a hole or a repeat.
fn dialable(mut reported: Vec<Reported>, host: &str) -> Result<Vec<RankSource>, String> {
    if reported.is_empty() {
        return Err("no KV-event publisher is enabled".into());
    }
    reported.sort_by_key(|source| source.rank);
    let mut ranks = Vec::with_capacity(reported.len());
    for (expected, source) in reported.into_iter().enumerate() {
        if source.rank as usize != expected {
            return Err(format!(
                "ranks must run from 0 without a hole or a repeat, but rank {expected} is \
                 missing or named twice"
            ));
        }
        let endpoint = endpoint_of(&source.endpoint, host)
            .map_err(|why| format!("rank {}'s endpoint: {why}", source.rank))?;
        let replay_endpoint = source
            .replay_endpoint
            .filter(|replay| !replay.is_empty())
            .map(|replay| endpoint_of(&replay, host))
            .transpose()
            .map_err(|why| format!("rank {}'s replay endpoint: {why}", source.rank))?;
        ranks.push(RankSource {
            endpoint,
            replay_endpoint,
            topic: source.topic,
        });
    }
    Ok(ranks)
}

/// `text` as a dialable TCP endpoint: a wildcard host becomes `host`.
fn endpoint_of(text: &str, host: &str) -> Result<TcpEndpoint, String> {
    let parsed: TcpEndpoint = text.parse().map_err(|error| format!("{error}"))?;
    if parsed.port() == 0 {
        return Err(format!("{text:?} has port 0 (not bound yet)"));
    }
    if !parsed.is_wildcard() {
        return Ok(parsed);
    }
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    format!("tcp://{host}:{}", parsed.port())
        .parse()
        .map_err(|error| format!("{error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reported(rank: u32, endpoint: &str, replay: Option<&str>) -> Reported {
        Reported {
            rank,
            endpoint: endpoint.into(),
            replay_endpoint: replay.map(Into::into),
            topic: "kv".into(),
        }
    }

    #[test]
    fn wildcard_hosts_become_the_engine_s_host_and_concrete_ones_stay() {
        let ranks = dialable(
            vec![
                reported(1, "tcp://0.0.0.0:5558", Some("tcp://*:5568")),
                reported(0, "tcp://*:5557", None),
                reported(2, "tcp://10.0.0.9:6000", Some("")),
            ],
            "engine.local",
        )
        .unwrap();
        let names: Vec<String> = ranks.iter().map(|r| r.endpoint.to_string()).collect();
        assert_eq!(
            names,
            [
                "tcp://engine.local:5557",
                "tcp://engine.local:5558",
                "tcp://10.0.0.9:6000"
            ]
        );
        assert_eq!(
            ranks[1].replay_endpoint.as_ref().unwrap().to_string(),
            "tcp://engine.local:5568"
        );
        assert!(ranks[0].replay_endpoint.is_none() && ranks[2].replay_endpoint.is_none());
        let v6 = dialable(vec![reported(0, "tcp://[::]:5557", None)], "::1").unwrap();
        assert_eq!(v6[0].endpoint.to_string(), "tcp://[::1]:5557");
    }

    #[test]
    fn an_answer_with_a_hole_a_repeat_no_port_or_no_rank_is_refused_naming_why() {
        let refused = |sources: Vec<Reported>| dialable(sources, "h").unwrap_err();
        assert!(refused(vec![]).contains("no KV-event publisher"));
        assert!(refused(vec![reported(1, "tcp://*:1", None)]).contains("rank 0 is missing"));
        assert!(
            refused(vec![
                reported(0, "tcp://*:1", None),
                reported(0, "tcp://*:2", None)
            ])
            .contains("rank 1 is missing or named twice")
        );
        assert!(refused(vec![reported(0, "tcp://*:0", None)]).contains("port 0"));
        assert!(refused(vec![reported(0, "ipc:///tmp/kv", None)]).contains("rank 0's endpoint"));
        assert!(
            refused(vec![reported(0, "tcp://*:1", Some("tcp://*"))])
                .contains("rank 0's replay endpoint")
        );
    }
}
