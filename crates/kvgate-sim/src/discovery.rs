//! The simulated engine answers where it publishes as vLLM's API server
//! does: `GET /kv_event_sources`, a JSON list with each rank's
//! `data_parallel_rank`, `endpoint`, `replay_endpoint`, `topic` and
//! `buffer_steps`, endpoints written with the wildcard host an engine bound
//! on every interface reports.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::task::JoinHandle;

use super::RankEndpoints;

/// The answer for `ranks`, as vLLM words it.
pub fn kv_event_sources(ranks: &[RankEndpoints], topic: &str, buffer_steps: usize) -> String {
    let wildcard = |endpoint: &str| {
        endpoint.rsplit_once(':').map_or_else(
            || endpoint.to_owned(),
            |(_, port)| format!("tcp://0.0.0.0:{port}"),
        )
    };
    let sources: Vec<serde_json::Value> = ranks
        .iter()
        .map(|rank| {
            serde_json::json!({
                "data_parallel_rank": rank.dp_rank,
                "endpoint": wildcard(&rank.endpoint),
                "replay_endpoint": rank.replay_endpoint.as_deref().map(wildcard),
                "topic": topic,
                "buffer_steps": buffer_steps,
            })
        })
        .collect();
    serde_json::Value::Array(sources).to_string()
}

/// Serves `answer` on `GET /kv_event_sources` at an ephemeral loopback
/// port until the returned task is aborted.
pub async fn serve(answer: String) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let answer = Bytes::from(answer);
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let answer = answer.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                        let answer = answer.clone();
                        async move {
                            let found = request.method() == hyper::Method::GET
                                && request.uri().path() == "/kv_event_sources";
                            let response = if found {
                                Response::builder()
                                    .header(hyper::header::CONTENT_TYPE, "application/json")
                                    .body(Full::new(answer))
                            } else {
                                Response::builder()
                                    .status(StatusCode::NOT_FOUND)
                                    .body(Full::new(Bytes::new()))
                            };
                            Ok::<_, Infallible>(response.expect("a static response builds"))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((address, task))
}
