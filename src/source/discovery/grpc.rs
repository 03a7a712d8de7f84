//! The engine's gRPC answers: OpenEngine's `Control.GetKvEventSources`
//! (ai-dynamo/openengine, one source per rank with its transport, encoding,
//! endpoint, replay endpoint and topic) and SGLang's `GetServerInfo`, whose
//! `json_info` carries the `kv_events` descriptor (SGLang 0.5.23:
//! `describe_kv_events_publisher`, a host, base ports and the rank count).

use serde::Deserialize;

use super::{ASK_TIMEOUT, Answer, Reported};
use crate::client::EngineTransport;
use crate::proto::openengine::v1 as openengine;
use crate::proto::sglang_runtime::v1 as sglang;

fn call_failed(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

fn request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(ASK_TIMEOUT);
    request
}

/// The ZMQ msgpack sources OpenEngine reports; sources of another transport
/// or encoding are not kvgate's to read.
pub(super) async fn open_engine(
    transport: &EngineTransport,
    origin: &http::Uri,
) -> Result<Answer, String> {
    let mut client =
        openengine::control_client::ControlClient::with_origin(transport.clone(), origin.clone());
    let call =
        client.get_kv_event_sources(request(openengine::GetKvEventSourcesRequest::default()));
    let answer = tokio::time::timeout(ASK_TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {ASK_TIMEOUT:?}"))?
        .map_err(|status| call_failed(&status))?
        .into_inner();
    from_open_engine(answer.sources).map(Answer::from)
}

fn from_open_engine(sources: Vec<openengine::KvEventSource>) -> Result<Vec<Reported>, String> {
    let mut others = Vec::new();
    let mut reported = Vec::new();
    for (index, source) in sources.into_iter().enumerate() {
        let readable = source.transport.eq_ignore_ascii_case("zmq")
            && matches!(
                source.encoding.to_ascii_lowercase().as_str(),
                "" | "msgpack"
            );
        if !readable {
            others.push(format!("{}/{}", source.transport, source.encoding));
            continue;
        }
        let address = source
            .endpoint_addr
            .ok_or_else(|| format!("source {index} has no endpoint_addr"))?;
        reported.push(Reported {
            rank: source.data_parallel_rank.unwrap_or(index as u32),
            endpoint: format!("tcp://{}:{}", bracketed(&address.host), address.port),
            replay_endpoint: Some(source.replay_endpoint),
            topic: source.topic,
        });
    }
    if reported.is_empty() && !others.is_empty() {
        return Err(format!(
            "no ZMQ msgpack source (sources: {})",
            others.join(", ")
        ));
    }
    Ok(reported)
}

/// SGLang's `describe_kv_events_publisher()`: rank r publishes at
/// `endpoint_port_base + r`, its replay at `replay_endpoint_port_base + r`.
#[derive(Deserialize)]
struct Descriptor {
    publisher: String,
    endpoint_host: String,
    endpoint_port_base: u16,
    #[serde(default)]
    topic: String,
    dp_size: u32,
    #[serde(default)]
    replay_endpoint_port_base: Option<u16>,
    /// Present only when SGLang publishes its load
    /// (`--load-publish-endpoint`).
    #[serde(default)]
    load_endpoint_port_base: Option<u16>,
}

#[derive(Deserialize)]
struct ServerInfo {
    #[serde(default)]
    kv_events: Option<Descriptor>,
}

/// The ranks SGLang's `GetServerInfo` describes.
pub(super) async fn sglang(
    transport: &EngineTransport,
    origin: &http::Uri,
) -> Result<Answer, String> {
    let mut client = sglang::sglang_service_client::SglangServiceClient::with_origin(
        transport.clone(),
        origin.clone(),
    );
    let call = client.get_server_info(request(sglang::GetServerInfoRequest {}));
    let answer = tokio::time::timeout(ASK_TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {ASK_TIMEOUT:?}"))?
        .map_err(|status| call_failed(&status))?
        .into_inner();
    from_sglang(&answer.json_info)
}

fn from_sglang(json_info: &str) -> Result<Answer, String> {
    let info: ServerInfo = serde_json::from_str(json_info)
        .map_err(|error| format!("json_info is not a server-info object: {error}"))?;
    let descriptor = info.kv_events.ok_or(
        "json_info has no kv_events descriptor (publishing is off, or SGLang is older than 0.5.23)",
    )?;
    if descriptor.publisher != "zmq" {
        return Err(format!("publisher {:?} is not zmq", descriptor.publisher));
    }
    let host = bracketed(&descriptor.endpoint_host);
    let port = |base: u16, rank: u32| {
        u16::try_from(u32::from(base) + rank)
            .map_err(|_| format!("rank {rank} of base port {base} is beyond 65535"))
    };
    let ranks = (0..descriptor.dp_size)
        .map(|rank| {
            Ok(Reported {
                rank,
                endpoint: format!(
                    "tcp://{host}:{}",
                    port(descriptor.endpoint_port_base, rank)?
                ),
                replay_endpoint: descriptor
                    .replay_endpoint_port_base
                    .map(|base| port(base, rank).map(|port| format!("tcp://{host}:{port}")))
                    .transpose()?,
                topic: descriptor.topic.clone(),
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(Answer {
        ranks,
        load_endpoint: descriptor
            .load_endpoint_port_base
            .map(|base| format!("tcp://{host}:{base}")),
    })
}

/// An IPv6 host in the brackets an endpoint needs.
fn bracketed(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_s_descriptor_gives_each_rank_its_base_plus_rank_ports() {
        let info = r#"{"model_path": "m", "kv_events": {"publisher": "zmq", "endpoint_host": "*",
            "endpoint_port_base": 5557, "topic": "", "block_size": 16, "dp_size": 2,
            "replay_endpoint_port_base": 5567, "load_endpoint_port_base": 5577, "load_topic": "load"}}"#;
        let answer = from_sglang(info).unwrap();
        assert_eq!(answer.load_endpoint.as_deref(), Some("tcp://*:5577"));
        let ranks = answer.ranks;
        assert_eq!(ranks.len(), 2);
        assert_eq!(ranks[1].endpoint, "tcp://*:5558");
        assert_eq!(ranks[1].replay_endpoint.as_deref(), Some("tcp://*:5568"));
        let v6 = info.replace("\"*\"", "\"::\"");
        assert_eq!(
            from_sglang(&v6).unwrap().ranks[0].endpoint,
            "tcp://[::]:5557"
        );
    }

    #[test]
    fn sglang_without_a_descriptor_or_with_garbage_is_an_error_saying_so() {
        assert!(
            from_sglang(r#"{"kv_events": null}"#)
                .unwrap_err()
                .contains("no kv_events")
        );
        assert!(from_sglang("not json").unwrap_err().contains("json_info"));
        let overflow = r#"{"kv_events": {"publisher": "zmq", "endpoint_host": "h",
            "endpoint_port_base": 65535, "dp_size": 2}}"#;
        assert!(from_sglang(overflow).unwrap_err().contains("beyond 65535"));
    }

    #[test]
    fn open_engine_s_zmq_msgpack_sources_are_read_and_others_named_when_none_is() {
        let source = |transport: &str, encoding: &str, rank| openengine::KvEventSource {
            transport: transport.into(),
            endpoint_addr: Some(openengine::KvEndpoint {
                host: "10.0.0.5".into(),
                port: 5557 + rank,
                protocol: "tcp".into(),
            }),
            replay_endpoint: String::new(),
            data_parallel_rank: Some(rank),
            encoding: encoding.into(),
            ..Default::default()
        };
        let read = from_open_engine(vec![
            source("zmq", "msgpack", 0),
            source("grpc", "protobuf", 1),
        ]);
        assert_eq!(read.unwrap()[0].endpoint, "tcp://10.0.0.5:5557");
        let none = from_open_engine(vec![source("grpc", "protobuf", 0)]).unwrap_err();
        assert!(none.contains("grpc/protobuf"), "{none}");
    }
}
