//! `kvgate-bench index-floor`: an index that indexes nothing, the floor
//! under any index's query latency on this machine, run as `kvgate-bench
//! index --peer` like Dynamo's.
//!
//! It does the least an index following the fleet must: a ZMQ SUB per
//! registered rank, every message read and dropped on a thread of its own
//! (as `kvgate index`'s feeds are), and on one other thread (as kvgate's
//! one query thread) every `/query` read to the end of its body and
//! answered with one stored answer of the size and shape kvgate writes:
//! every registered rank scored `--tokens`, in `scores` and again in
//! `instances`. No JSON is read, no tree walked, nothing stored. What its
//! queries wait for is what any index's would if its answers were free:
//! the wake-ups, loopback TCP and the cores the fleet's publishers and the
//! load tool share with it.
//!
//! Invariant: the stored answer names exactly the ranks registered so far
//! (rebuilt on each `POST /register`), so the load tool's wait for every
//! rank's last chain ends once every rank is registered.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use bytes::{Buf, Bytes, BytesMut};
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use zeromq::{Socket, SocketRecv, SubSocket};

use super::http_client::content_length;
use super::worker::Worker;

/// More header lines than this in a request is refused.
const MAX_HEADERS: usize = 32;
/// Read at least this much at a time.
const READ_CHUNK: usize = 64 * 1024;

/// Be the index floor.
#[derive(Debug, Clone, clap::Args)]
pub struct IndexFloorArgs {
    /// Where to answer Dynamo's HTTP API (127.0.0.1).
    #[arg(long)]
    port: u16,

    /// The device tokens every registered rank is credited in each answer
    /// (the load tool's whole chain: 32 blocks of 16 tokens).
    #[arg(long, default_value_t = 512)]
    tokens: u32,
}

/// The fields of `POST /register` the floor uses.
#[derive(Deserialize)]
struct Registration {
    instance_id: u64,
    #[serde(default)]
    dp_rank: u32,
    endpoint: String,
}

/// The registered ranks and the answer naming them.
struct Answers {
    tokens: u32,
    /// (instance id, dp rank), sorted.
    ranks: Vec<(u64, u32)>,
    /// The whole HTTP response to a query, head and body.
    query: Bytes,
}

impl Answers {
    fn new(tokens: u32) -> Self {
        let mut answers = Self {
            tokens,
            ranks: Vec::new(),
            query: Bytes::new(),
        };
        answers.rebuild();
        answers
    }

    fn register(&mut self, instance: u64, rank: u32) {
        if let Err(at) = self.ranks.binary_search(&(instance, rank)) {
            self.ranks.insert(at, (instance, rank));
            self.rebuild();
        }
    }

    /// Writes the answer in kvgate's shape: `scores` per worker and rank,
    /// `frequencies`, `instances` per worker with its ranks again in `dp`.
    fn rebuild(&mut self) {
        let tokens = self.tokens;
        let workers = self.ranks.chunk_by(|one, other| one.0 == other.0);
        let rank_map = |ranks: &[(u64, u32)]| {
            let entries: Vec<String> = ranks
                .iter()
                .map(|(_, rank)| format!("\"{rank}\":{tokens}"))
                .collect();
            format!("{{{}}}", entries.join(","))
        };
        let scores: Vec<String> = workers
            .clone()
            .map(|ranks| format!("\"{}\":{}", ranks[0].0, rank_map(ranks)))
            .collect();
        let instances: Vec<String> = workers
            .map(|ranks| {
                format!(
                    "\"{}\":{{\"longest_matched\":{tokens},\"gpu\":{tokens},\"dp\":{},\"cpu\":0,\"disk\":0}}",
                    ranks[0].0,
                    rank_map(ranks)
                )
            })
            .collect();
        let body = format!(
            "{{\"scores\":{{{}}},\"frequencies\":[],\"instances\":{{{}}}}}",
            scores.join(","),
            instances.join(",")
        );
        self.query = response("200 OK", &body);
    }
}

/// An HTTP/1.1 response with a JSON body.
fn response(status: &str, body: &str) -> Bytes {
    let mut out = String::with_capacity(body.len() + 96);
    write!(
        out,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("writing to a String");
    Bytes::from(out)
}

/// A refusal, its reason as Dynamo's indexer gives one (`{"error": ...}`).
fn refusal(status: &str, reason: impl std::fmt::Display) -> Bytes {
    response(
        status,
        &serde_json::json!({"error": reason.to_string()}).to_string(),
    )
}

/// Answers on `--port` until killed; prints `{"pid": PID, "url": URL}` once
/// it does, as `kvgate-bench index --peer` expects.
pub async fn serve(args: IndexFloorArgs) -> anyhow::Result<()> {
    let listener = TcpListener::bind(("127.0.0.1", args.port))
        .await
        .with_context(|| format!("--port {}", args.port))?;
    let mut stdout = std::io::stdout().lock();
    writeln!(
        stdout,
        "{}",
        serde_json::json!({
            "pid": std::process::id(),
            "url": format!("http://{}", listener.local_addr()?),
        })
    )?;
    stdout.flush()?;
    drop(stdout);
    answer_on(listener, args.tokens).await
}

/// Answers every connection `listener` accepts, each rank's feed on a
/// thread of its own.
async fn answer_on(listener: TcpListener, tokens: u32) -> anyhow::Result<()> {
    let feeds = Arc::new(Worker::start("floor-feeds")?);
    let answers = Arc::new(Mutex::new(Answers::new(tokens)));
    loop {
        let (connection, _) = listener.accept().await.context("accepting")?;
        connection.set_nodelay(true)?;
        let (answers, feeds) = (Arc::clone(&answers), Arc::clone(&feeds));
        tokio::spawn(async move {
            if let Err(error) = answer_connection(connection, &answers, &feeds).await {
                eprintln!("index floor: a connection ended: {error:#}");
            }
        });
    }
}

/// One keep-alive connection's requests, in turn, until the client closes.
async fn answer_connection(
    mut connection: TcpStream,
    answers: &Mutex<Answers>,
    feeds: &Worker,
) -> anyhow::Result<()> {
    let mut received = BytesMut::with_capacity(READ_CHUNK);
    loop {
        let Some((path, body)) = read_request(&mut connection, &mut received).await? else {
            return Ok(());
        };
        let answer = match path.as_str() {
            "/query" | "/query_by_hash" => answers.lock().expect("not poisoned").query.clone(),
            "/register" => register(&body, answers, feeds).await,
            _ => response("200 OK", ""),
        };
        connection.write_all(&answer).await?;
    }
}

/// The next request's path and body, or `None` once the client closed.
async fn read_request(
    connection: &mut TcpStream,
    received: &mut BytesMut,
) -> anyhow::Result<Option<(String, Bytes)>> {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut headers);
        if let httparse::Status::Complete(head) = request.parse(received)? {
            let path = request.path.unwrap_or_default().to_owned();
            let length = content_length(request.headers)?.unwrap_or(0);
            if received.len() >= head + length {
                received.advance(head);
                return Ok(Some((path, received.split_to(length).freeze())));
            }
        }
        received.reserve(READ_CHUNK);
        if connection.read_buf(received).await? == 0 {
            anyhow::ensure!(received.is_empty(), "the client closed mid-request");
            return Ok(None);
        }
    }
}

/// Subscribes to the rank's publisher (read and dropped on the feeds'
/// thread) and names the rank in every answer from now on.
async fn register(body: &[u8], answers: &Mutex<Answers>, feeds: &Worker) -> Bytes {
    let registration: Registration = match serde_json::from_slice(body) {
        Ok(registration) => registration,
        Err(error) => return refusal("422 Unprocessable Entity", error),
    };
    let endpoint = registration.endpoint.clone();
    let subscribed = feeds
        .spawn(async move {
            let mut socket = SubSocket::new();
            socket.connect(&endpoint).await?;
            socket.subscribe("").await?;
            tokio::spawn(async move { while socket.recv().await.is_ok() {} });
            anyhow::Ok(())
        })
        .await;
    match subscribed {
        Ok(Ok(())) => {
            answers
                .lock()
                .expect("not poisoned")
                .register(registration.instance_id, registration.dp_rank);
            response("201 Created", "{\"status\":\"ok\"}")
        }
        Ok(Err(error)) => refusal("400 Bad Request", format!("{error:#}")),
        Err(error) => refusal("500 Internal Server Error", error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http_client::Connection;
    use zeromq::XPubSocket;

    #[tokio::test]
    async fn a_registered_rank_is_followed_and_named_in_every_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let serving = tokio::spawn(answer_on(listener, 48));
        let mut publisher = XPubSocket::new();
        let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
        let mut connection = Connection::open(&address).await.unwrap();
        let body = serde_json::json!({
            "instance_id": 7, "dp_rank": 3, "model_name": "m", "block_size": 16,
            "endpoint": endpoint.to_string(),
        });
        let registered = connection
            .post("/register", Bytes::from(body.to_string()))
            .await
            .unwrap();
        assert_eq!(registered.status, 201);
        // XPUB hands over the floor's subscription.
        tokio::time::timeout(std::time::Duration::from_secs(10), publisher.recv())
            .await
            .expect("the floor subscribes")
            .unwrap();
        let refused = connection
            .post("/register", Bytes::from_static(b"{\"dp_rank\":0}"))
            .await
            .unwrap();
        assert_eq!(refused.status, 422);
        for _ in 0..2 {
            let answer = connection
                .post("/query", Bytes::from_static(b"{\"token_ids\":[1,2,3]}"))
                .await
                .unwrap();
            assert_eq!(answer.status, 200);
            let answer: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
            assert_eq!(answer["scores"], serde_json::json!({"7": {"3": 48}}));
        }
        serving.abort();
    }

    #[test]
    fn the_stored_answer_names_every_registered_rank_as_kvgate_would() {
        let mut answers = Answers::new(512);
        answers.register(2, 0);
        answers.register(1, 1);
        answers.register(1, 0);
        answers.register(1, 0);
        let text = String::from_utf8(answers.query.to_vec()).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(
            head.ends_with(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let answer: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(
            answer["scores"],
            serde_json::json!({"1": {"0": 512, "1": 512}, "2": {"0": 512}})
        );
        assert_eq!(
            answer["instances"]["1"],
            serde_json::json!({"longest_matched": 512, "gpu": 512, "dp": {"0": 512, "1": 512}, "cpu": 0, "disk": 0})
        );
    }
}
