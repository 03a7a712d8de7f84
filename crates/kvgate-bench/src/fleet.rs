//! The simulated fleet of an index run: one ZMQ XPUB per engine rank on
//! 127.0.0.1, each registered with the index under test over Dynamo's
//! `POST /register`, publishing vLLM 0.33 batches of whole request chains,
//! the workload of `benchmarks/dynamo-index/peer.py measure` (same tokens,
//! same chains, same batching), so figures from either are comparable.
//!
//! Invariants: chain `c` of rank `r` has the same tokens in every run; its
//! first `shared_blocks` blocks are the same on every rank (a system prompt),
//! the rest the rank's own. A rank's sends are in its chain order, so the
//! index has applied all of a rank's stores once its last chain matches in
//! full. The sockets are XPUBs so that a subscriber's arrival is seen: PUB
//! drops what is sent before (ZMQ's slow joiner), and XPUB's send waits for
//! the subscriber to take each message rather than dropping it.
//!
//! Churn keeps the live count constant the way vLLM's LRU would: every
//! chain stored evicts the rank's oldest chain, one `BlockRemoved` per
//! block, leaf first.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use zeromq::{Socket, SocketRecv, SocketSend, XPubSocket, ZmqMessage};

use super::http_client::Connection;
use kvgate::clock::unix_now;
use kvgate_sim::{SimEvent, encode_batch};

/// The model every rank serves.
pub const MODEL: &str = "m";
/// How long an index may take to subscribe to a rank it registered.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(20);
/// How often churn sends what has come due.
const CHURN_TICK: Duration = Duration::from_millis(2);
/// Token ids stay below this (peer.py's bound).
const TOKEN_MODULUS: u64 = 4_000_000_000;

/// The fleet's layout and its request chains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FleetShape {
    pub ranks: usize,
    /// Ranks `r` and `r + 1` are data-parallel ranks of one worker unless a
    /// multiple of this lies between them.
    pub ranks_per_worker: usize,
    pub blocks_per_rank: usize,
    pub block_size: u32,
    pub chain_blocks: usize,
    pub shared_blocks: usize,
    /// Chains stored per batch during the initial ingest (one scheduler
    /// step's worth).
    pub chains_per_batch: usize,
}

impl FleetShape {
    /// Chains each rank holds.
    pub fn chains(&self) -> usize {
        self.blocks_per_rank / self.chain_blocks
    }

    /// (rank, block) pairs held once every chain is stored.
    pub fn live_blocks(&self) -> u64 {
        (self.ranks * self.chains() * self.chain_blocks) as u64
    }

    pub fn instance_id(&self, rank: usize) -> u64 {
        (rank / self.ranks_per_worker) as u64 + 1
    }

    pub fn dp_rank(&self, rank: usize) -> u32 {
        u32::try_from(rank % self.ranks_per_worker).expect("ranks per worker fit u32")
    }

    /// Chain `chain`'s tokens on `rank`, as peer.py's `chain_tokens`.
    pub fn chain_tokens(&self, rank: usize, chain: usize) -> Vec<u32> {
        let block_size = u64::from(self.block_size);
        (0..self.chain_blocks)
            .flat_map(|block| {
                let owner = if block < self.shared_blocks {
                    0
                } else {
                    rank as u64 + 1
                };
                let base = ((owner * 100_003 + chain as u64) * 64 + block as u64) * block_size;
                (0..block_size).map(move |k| ((base + k) % TOKEN_MODULUS) as u32)
            })
            .collect()
    }

    /// A stand-in for an engine's block hashes: like vLLM's, each a digest
    /// of its parent's hash and its tokens, so every rank names a shared
    /// block alike.
    pub fn chain_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let mut parent = 0;
        tokens
            .chunks(self.block_size as usize)
            .map(|block| {
                let bytes: Vec<u8> = block.iter().flat_map(|token| token.to_le_bytes()).collect();
                parent = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent);
                parent
            })
            .collect()
    }

    /// The `/query` body asking for chain `chain` of `rank` in full.
    pub fn query_body(&self, rank: usize, chain: usize) -> Bytes {
        let body = serde_json::json!({
            "token_ids": self.chain_tokens(rank, chain),
            "model_name": MODEL,
        });
        Bytes::from(body.to_string())
    }

    /// The score of a rank holding a whole chain.
    pub fn full_score(&self) -> u64 {
        self.chain_blocks as u64 * u64::from(self.block_size)
    }

    fn stored(&self, rank: usize, chain: usize) -> SimEvent {
        let tokens = self.chain_tokens(rank, chain);
        SimEvent::Stored {
            hashes: self.chain_hashes(&tokens),
            parent: None,
            tokens,
            block_size: self.block_size,
        }
    }

    /// One `BlockRemoved` per block of the chain, leaf first.
    fn evicted(&self, rank: usize, chain: usize) -> impl Iterator<Item = SimEvent> {
        self.chain_hashes(&self.chain_tokens(rank, chain))
            .into_iter()
            .rev()
            .map(|hash| SimEvent::Removed { hashes: vec![hash] })
    }

    fn payload(&self, rank: usize, events: &[SimEvent]) -> Bytes {
        let mut out = Vec::new();
        encode_batch(unix_now(), events, Some(self.dp_rank(rank)), &mut out);
        out.into()
    }
}

/// What a phase of publishing sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub batches: u64,
}

/// Every rank's socket; lives on the publisher's thread.
pub struct Fleet {
    shape: FleetShape,
    sockets: Vec<XPubSocket>,
    endpoints: Vec<String>,
    /// The sequence number of each rank's next message.
    next_seq: Vec<u64>,
    /// Per rank, the oldest chain still held and the next chain to store.
    oldest: Vec<usize>,
    newest: Vec<usize>,
}

impl Fleet {
    /// Binds one XPUB per rank on an ephemeral loopback port.
    pub async fn bind(shape: FleetShape) -> anyhow::Result<Self> {
        let mut sockets = Vec::with_capacity(shape.ranks);
        let mut endpoints = Vec::with_capacity(shape.ranks);
        for _ in 0..shape.ranks {
            let mut socket = XPubSocket::new();
            endpoints.push(socket.bind("tcp://127.0.0.1:0").await?.to_string());
            sockets.push(socket);
        }
        Ok(Self {
            shape,
            sockets,
            endpoints,
            next_seq: vec![0; shape.ranks],
            oldest: vec![0; shape.ranks],
            newest: vec![shape.chains(); shape.ranks],
        })
    }

    /// Registers every rank with the index at `address` (Dynamo's API, 201
    /// expected) and waits until it has subscribed to each.
    pub async fn register(&mut self, address: &str) -> anyhow::Result<()> {
        let mut connection = Connection::open(address).await?;
        for (rank, socket) in self.sockets.iter_mut().enumerate() {
            let body = serde_json::json!({
                "instance_id": self.shape.instance_id(rank),
                "dp_rank": self.shape.dp_rank(rank),
                "model_name": MODEL,
                "block_size": self.shape.block_size,
                "endpoint": self.endpoints[rank],
            });
            let answer = connection
                .post("/register", Bytes::from(body.to_string()))
                .await?;
            anyhow::ensure!(
                answer.status == 201,
                "registering rank {rank}: {} {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            );
            // XPUB hands over each subscription message; seeing one is
            // what tells a publisher its subscriber will get what follows.
            tokio::time::timeout(SUBSCRIBE_TIMEOUT, socket.recv())
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "the index did not subscribe to rank {rank} within {SUBSCRIBE_TIMEOUT:?}"
                    )
                })??;
        }
        Ok(())
    }

    /// Publishes every rank's chains, batch by batch, ranks interleaved.
    pub async fn ingest(&mut self) -> anyhow::Result<Sent> {
        let shape = self.shape;
        let chains = shape.chains();
        let step = shape.chains_per_batch;
        let mut sent = Sent::default();
        for first in (0..chains).step_by(step) {
            for rank in 0..shape.ranks {
                let events: Vec<SimEvent> = (first..chains.min(first + step))
                    .map(|chain| shape.stored(rank, chain))
                    .collect();
                self.send(rank, shape.payload(rank, &events)).await?;
                sent.stored_blocks += (events.len() * shape.chain_blocks) as u64;
                sent.batches += 1;
            }
        }
        Ok(sent)
    }

    /// Until `stop`, every rank stores `blocks_per_s` blocks a second, a
    /// whole chain at a time, each evicting the rank's oldest chain; the
    /// ranks' schedules are staggered so they do not all send at once.
    pub async fn churn(
        &mut self,
        blocks_per_s: f64,
        stop: Arc<AtomicBool>,
    ) -> anyhow::Result<Sent> {
        let shape = self.shape;
        let chains_per_s = blocks_per_s / shape.chain_blocks as f64;
        let start = Instant::now();
        let mut due_sent = vec![0u64; shape.ranks];
        let mut sent = Sent::default();
        let mut ticks = tokio::time::interval(CHURN_TICK);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        while !stop.load(Ordering::Relaxed) {
            ticks.tick().await;
            let elapsed = start.elapsed().as_secs_f64();
            for (rank, stored) in due_sent.iter_mut().enumerate() {
                let phase = rank as f64 / shape.ranks as f64;
                let due = (elapsed * chains_per_s + phase).floor() as u64;
                while *stored < due {
                    let (oldest, newest) = (self.oldest[rank], self.newest[rank]);
                    let mut events = vec![shape.stored(rank, newest)];
                    events.extend(shape.evicted(rank, oldest));
                    self.send(rank, shape.payload(rank, &events)).await?;
                    self.oldest[rank] += 1;
                    self.newest[rank] += 1;
                    *stored += 1;
                    sent.stored_blocks += shape.chain_blocks as u64;
                    sent.removed_blocks += shape.chain_blocks as u64;
                    sent.batches += 1;
                }
            }
        }
        Ok(sent)
    }

    /// `[topic, seq, payload]`, as vLLM's publisher sends.
    async fn send(&mut self, rank: usize, payload: Bytes) -> anyhow::Result<()> {
        let seq = self.next_seq[rank];
        self.next_seq[rank] += 1;
        let mut message = ZmqMessage::from(Bytes::new());
        message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        message.push_back(payload);
        self.sockets[rank].send(message).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> FleetShape {
        FleetShape {
            ranks: 5,
            ranks_per_worker: 4,
            blocks_per_rank: 100,
            block_size: 4,
            chain_blocks: 8,
            shared_blocks: 4,
            chains_per_batch: 3,
        }
    }

    #[test]
    fn ranks_share_a_chains_prefix_and_nothing_after_it() {
        let shape = shape();
        let (one, other) = (shape.chain_tokens(0, 3), shape.chain_tokens(4, 3));
        assert_eq!(one.len(), 32);
        assert_eq!(one[..16], other[..16]);
        assert!(one[16..].iter().all(|token| !other[16..].contains(token)));
        let (hashes, others) = (shape.chain_hashes(&one), shape.chain_hashes(&other));
        assert_eq!(hashes[..4], others[..4]);
        assert!(hashes[4..].iter().all(|hash| !others.contains(hash)));
        assert_ne!(
            shape.chain_tokens(0, 4)[..16],
            one[..16],
            "each chain its own prefix"
        );
    }

    #[test]
    fn the_tokens_are_peer_pys() {
        // peer.py: chain_tokens(rank=2, chain=5, length=8, shared=4, bs=4).
        let tokens = shape().chain_tokens(2, 5);
        assert_eq!(tokens[..2], [5 * 64 * 4, 5 * 64 * 4 + 1]);
        let owner_base = ((3 * 100_003 + 5) * 64 + 4) * 4;
        assert_eq!(tokens[16], owner_base);
    }

    #[test]
    fn ranks_map_to_workers_of_dp_ranks() {
        let shape = shape();
        let layout: Vec<_> = (0..5)
            .map(|rank| (shape.instance_id(rank), shape.dp_rank(rank)))
            .collect();
        assert_eq!(layout, [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]);
        assert_eq!(shape.chains(), 12);
        assert_eq!(shape.live_blocks(), 5 * 12 * 8);
        assert_eq!(shape.full_score(), 32);
    }
}
