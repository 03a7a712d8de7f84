//! A hostile replay ROUTER: it answers every request with a run of
//! consecutive messages from the start asked for, and never with the END
//! that closes a replay, so a client that follows it asks again forever.
//!
//! Invariant: each request gets exactly `per_request` messages
//! `["", topic, seq, payload]`, `seq` counting on from the start asked for,
//! all carrying the same payload; nothing else is ever sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tokio::task::JoinHandle;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqResult};

use crate::publisher::{bind_address, parse_start, reply, seq_frame};

/// The ROUTER and its serving task, stopped when dropped.
pub struct EndlessReplay {
    endpoint: String,
    requests: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl EndlessReplay {
    /// Binds `endpoint` (`tcp://127.0.0.1:0` picks a port) and serves.
    pub async fn bind(
        endpoint: &str,
        topic: Bytes,
        per_request: u64,
        payload: Bytes,
    ) -> ZmqResult<Self> {
        let mut router = RouterSocket::new();
        let endpoint = router.bind(&bind_address(endpoint)).await?.to_string();
        let requests = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&requests);
        let task = tokio::spawn(async move {
            while let Ok(request) = router.recv().await {
                let request = request.into_vec();
                let [identity, _delimiter, start] = request.as_slice() else {
                    continue;
                };
                counted.fetch_add(1, Ordering::Relaxed);
                let start = parse_start(start);
                for seq in start..start.saturating_add(per_request) {
                    let frames = [topic.clone(), seq_frame(seq), payload.clone()];
                    // The client dropped its socket: wait for the next one.
                    if router.send(reply(identity, frames)).await.is_err() {
                        break;
                    }
                }
            }
        });
        Ok(Self {
            endpoint,
            requests,
            task,
        })
    }

    /// Where the ROUTER listens, as `tcp://HOST:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Requests answered so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

impl Drop for EndlessReplay {
    fn drop(&mut self) {
        self.task.abort();
    }
}
