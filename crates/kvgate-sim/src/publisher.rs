//! An engine-side KV-event publisher that behaves like vLLM 0.33's
//! `ZmqEventPublisher` on the wire.
//!
//! Invariants: every live message is `[topic, seq as 8 bytes big-endian,
//! payload]`; `seq` counts messages from 0 unless the caller restarts or skips
//! it; with a replay endpoint, a ROUTER keeps the last `buffer_steps` messages
//! sent and answers a request `[identity, "", start]` with
//! `["", topic, seq, payload]` for each kept message with `seq >= start`,
//! oldest first, then `["", "", ff×8, ""]` (engine-wire.md, "Replay ROUTER
//! protocol"). Requests of any other shape get no answer, as in vLLM.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage, ZmqResult};

use kvgate_endpoint::TcpEndpoint;

/// The sequence frame that ends a replay.
const END_SEQ: [u8; 8] = [0xff; 8];

/// vLLM's `KVEventsConfig` knobs besides the endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublisherOptions {
    pub topic: String,
    /// Where the replay ROUTER binds (it always binds, even when the PUB
    /// connects); `None` disables replay.
    pub replay_endpoint: Option<String>,
    /// How many recent messages the replay ring keeps.
    pub buffer_steps: usize,
}

impl Default for PublisherOptions {
    fn default() -> Self {
        Self {
            topic: String::new(),
            replay_endpoint: None,
            buffer_steps: 10_000,
        }
    }
}

/// One engine rank's publisher; see the module docs.
pub struct EnginePublisher {
    socket: PubSocket,
    endpoint: String,
    topic: Bytes,
    next_seq: u64,
    replay: Option<ReplayServer>,
}

impl EnginePublisher {
    /// Binds the PUB socket. `tcp://*:PORT` means all interfaces, as in
    /// libzmq, and port 0 an ephemeral port: [`Self::endpoint`] reports the
    /// resolved one.
    pub async fn bind(endpoint: &str, options: &PublisherOptions) -> ZmqResult<Self> {
        let mut socket = PubSocket::new();
        let endpoint = socket.bind(&bind_address(endpoint)).await?.to_string();
        Self::start(socket, endpoint, options).await
    }

    /// Connects the PUB socket to a bound SUB, as vLLM does for endpoints
    /// without a wildcard. Unlike libzmq, the zeromq crate waits until the
    /// SUB accepts (retrying for up to 30 s) and never reconnects a PUB.
    pub async fn connect(endpoint: &str, options: &PublisherOptions) -> ZmqResult<Self> {
        let mut socket = PubSocket::new();
        socket.connect(endpoint).await?;
        Self::start(socket, endpoint.to_owned(), options).await
    }

    async fn start(
        socket: PubSocket,
        endpoint: String,
        options: &PublisherOptions,
    ) -> ZmqResult<Self> {
        let topic = Bytes::from(options.topic.clone());
        let replay = match &options.replay_endpoint {
            Some(replay_endpoint) => Some(
                ReplayServer::bind(replay_endpoint, topic.clone(), options.buffer_steps).await?,
            ),
            None => None,
        };
        Ok(Self {
            socket,
            endpoint,
            topic,
            next_seq: 0,
            replay,
        })
    }

    /// The PUB endpoint: the resolved bind address, or the connect target.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay ROUTER's resolved bind address, if replay is on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay.as_ref().map(|replay| replay.endpoint.as_str())
    }

    /// The sequence number the next message gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Sends `[topic, seq, payload]` and returns its seq. PUB semantics: a
    /// subscriber whose subscription has not arrived yet misses it, and with
    /// no subscriber at all the message only goes to the replay ring.
    pub async fn publish(&mut self, payload: Bytes) -> ZmqResult<u64> {
        // vLLM takes the number before sending, so a failed send leaves a gap.
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut message = ZmqMessage::from(self.topic.clone());
        message.push_back(seq_frame(seq));
        message.push_back(payload.clone());
        self.socket.send(message).await?;
        if let Some(replay) = &self.replay {
            replay.ring().push(seq, payload);
        }
        Ok(seq)
    }

    /// Simulates an engine restart: numbering starts over at 0 and the replay
    /// ring is empty. The sockets stay up; to also drop the connections,
    /// drop this publisher and bind a new one on the same endpoint.
    pub fn restart(&mut self) {
        self.next_seq = 0;
        if let Some(replay) = &self.replay {
            replay.ring().entries.clear();
        }
    }

    /// Numbers `payload` and keeps it in the replay ring without sending it:
    /// a message the network lost (PUB high-water mark) that replay can
    /// still recover.
    pub fn lose_in_transit(&mut self, payload: Bytes) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(replay) = &self.replay {
            replay.ring().push(seq, payload);
        }
        seq
    }

    /// Sends arbitrary frames, bypassing numbering: for feeding a
    /// subscriber malformed messages.
    pub async fn send_frames(&mut self, frames: Vec<Bytes>) -> ZmqResult<()> {
        let mut frames = frames.into_iter();
        let Some(first) = frames.next() else {
            return Ok(());
        };
        let mut message = ZmqMessage::from(first);
        for frame in frames {
            message.push_back(frame);
        }
        self.socket.send(message).await
    }

    /// Simulates `lost` messages that were numbered but never sent (vLLM's
    /// encode failures, HWM drops): a gap replay cannot fill.
    pub fn skip(&mut self, lost: u64) {
        self.next_seq += lost;
    }
}

/// libzmq binds `*` to every interface; the zeromq crate would look it up as a
/// host name.
pub(crate) fn bind_address(endpoint: &str) -> String {
    endpoint
        .parse::<TcpEndpoint>()
        .map_or_else(|_| endpoint.to_owned(), |tcp| tcp.bind_address())
}

pub(crate) fn seq_frame(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

struct ReplayServer {
    endpoint: String,
    ring: Arc<Mutex<Ring>>,
    task: JoinHandle<()>,
}

impl ReplayServer {
    async fn bind(endpoint: &str, topic: Bytes, buffer_steps: usize) -> ZmqResult<Self> {
        let mut router = RouterSocket::new();
        let endpoint = router.bind(&bind_address(endpoint)).await?.to_string();
        let ring = Arc::new(Mutex::new(Ring {
            capacity: buffer_steps,
            entries: VecDeque::new(),
        }));
        let task = tokio::spawn(serve_replays(router, Arc::clone(&ring), topic));
        Ok(Self {
            endpoint,
            ring,
            task,
        })
    }

    fn ring(&self) -> MutexGuard<'_, Ring> {
        lock(&self.ring)
    }
}

impl Drop for ReplayServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Every holder only pushes, clears or copies, so a panic elsewhere cannot
/// leave the ring half-updated.
fn lock(ring: &Mutex<Ring>) -> MutexGuard<'_, Ring> {
    ring.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Ring {
    capacity: usize,
    entries: VecDeque<(u64, Bytes)>,
}

impl Ring {
    fn push(&mut self, seq: u64, payload: Bytes) {
        self.entries.push_back((seq, payload));
        if self.entries.len() > self.capacity {
            self.entries.pop_front();
        }
    }

    fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        self.entries
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect()
    }
}

async fn serve_replays(mut router: RouterSocket, ring: Arc<Mutex<Ring>>, topic: Bytes) {
    loop {
        let request = match router.recv().await {
            Ok(request) => request.into_vec(),
            Err(error) => {
                tracing::warn!(%error, "simulated replay socket stopped");
                return;
            }
        };
        let [identity, _delimiter, start] = request.as_slice() else {
            tracing::warn!(frames = request.len(), "invalid replay request");
            continue;
        };
        let batches = lock(&ring).since(parse_start(start));
        if let Err(error) = answer(&mut router, identity, &topic, batches).await {
            tracing::warn!(%error, "replay reply failed");
        }
    }
}

/// vLLM reads the start with `int.from_bytes(frame, "big")`: any length is
/// accepted, and a value past u64 matches no kept message.
pub(crate) fn parse_start(frame: &[u8]) -> u64 {
    frame
        .iter()
        .try_fold(0u64, |start, &byte| {
            start.checked_mul(256).map(|start| start | u64::from(byte))
        })
        .unwrap_or(u64::MAX)
}

async fn answer(
    router: &mut RouterSocket,
    identity: &Bytes,
    topic: &Bytes,
    batches: Vec<(u64, Bytes)>,
) -> ZmqResult<()> {
    for (seq, payload) in batches {
        router
            .send(reply(identity, [topic.clone(), seq_frame(seq), payload]))
            .await?;
    }
    router
        .send(reply(
            identity,
            [Bytes::new(), Bytes::from_static(&END_SEQ), Bytes::new()],
        ))
        .await
}

/// A reply to the DEALER `identity`: `["", frames...]` as it receives it.
pub(crate) fn reply(identity: &Bytes, frames: [Bytes; 3]) -> ZmqMessage {
    let mut message = ZmqMessage::from(identity.clone());
    message.push_back(Bytes::new());
    for frame in frames {
        message.push_back(frame);
    }
    message
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::Value;
    use tokio::time::{Instant, timeout};
    use zeromq::{DealerSocket, SubSocket};

    use super::*;

    /// Upper bound on any single wait; the conditions themselves are awaited.
    const WAIT: Duration = Duration::from_secs(10);

    fn replaying(topic: &str, buffer_steps: usize) -> PublisherOptions {
        PublisherOptions {
            topic: topic.to_owned(),
            replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
            buffer_steps,
        }
    }

    async fn next_frames(socket: &mut impl SocketRecv) -> Vec<Bytes> {
        timeout(WAIT, socket.recv())
            .await
            .expect("no message in time")
            .expect("socket failed")
            .into_vec()
    }

    fn seq(frames: &[Bytes]) -> u64 {
        u64::from_be_bytes(frames[1][..].try_into().expect("an 8-byte seq frame"))
    }

    async fn subscriber(endpoint: &str, topic: &str) -> SubSocket {
        let mut sub = SubSocket::new();
        sub.connect(endpoint).await.unwrap();
        sub.subscribe(topic).await.unwrap();
        sub
    }

    /// PUB drops what it sends before a subscription reaches it: publishes
    /// warm-up messages until one arrives, then reads up to the last one, so
    /// the subscriber's next message is the publisher's next.
    async fn wait_until_subscribed(publisher: &mut EnginePublisher, sub: &mut SubSocket) {
        let deadline = Instant::now() + WAIT;
        loop {
            assert!(Instant::now() < deadline, "the subscription never arrived");
            let last = publisher
                .publish(Bytes::from_static(b"warm-up"))
                .await
                .unwrap();
            if let Ok(received) = timeout(Duration::from_millis(20), sub.recv()).await {
                let mut received = seq(&received.unwrap().into_vec());
                while received < last {
                    received = seq(&next_frames(sub).await);
                }
                return;
            }
        }
    }

    fn request(start: u64) -> Vec<Bytes> {
        vec![Bytes::new(), seq_frame(start)]
    }

    /// Sends `frames` from a fresh DEALER and reads the replies up to END.
    async fn ask(replay_endpoint: &str, frames: Vec<Bytes>) -> Vec<Vec<Bytes>> {
        let mut dealer = DealerSocket::new();
        dealer.connect(replay_endpoint).await.unwrap();
        dealer
            .send(ZmqMessage::try_from(frames).unwrap())
            .await
            .unwrap();
        read_replay(&mut dealer).await
    }

    async fn read_replay(dealer: &mut DealerSocket) -> Vec<Vec<Bytes>> {
        let mut replies = Vec::new();
        loop {
            let reply = next_frames(dealer).await;
            let end = reply.get(2).is_some_and(|seq| seq[..] == END_SEQ);
            replies.push(reply);
            if end {
                return replies;
            }
        }
    }

    fn replayed_seqs(replies: &[Vec<Bytes>]) -> Vec<u64> {
        replies.iter().map(|reply| seq(&reply[1..])).collect()
    }

    fn unhex(hex: &Value) -> Bytes {
        let hex = hex.as_str().unwrap();
        (0..hex.len())
            .step_by(2)
            .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).unwrap())
            .collect::<Vec<u8>>()
            .into()
    }

    fn hex_frames(frames: &Value) -> Vec<Bytes> {
        frames.as_array().unwrap().iter().map(unhex).collect()
    }

    fn hex_messages(messages: &Value) -> Vec<Vec<Bytes>> {
        messages
            .as_array()
            .unwrap()
            .iter()
            .map(hex_frames)
            .collect()
    }

    #[tokio::test]
    async fn messages_are_topic_big_endian_seq_and_payload_numbered_from_zero() {
        let options = PublisherOptions {
            topic: "kv".to_owned(),
            ..PublisherOptions::default()
        };
        let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &options)
            .await
            .unwrap();
        assert!(publisher.endpoint().starts_with("tcp://127.0.0.1:"));
        assert!(
            !publisher.endpoint().ends_with(":0"),
            "{}",
            publisher.endpoint()
        );
        assert_eq!(
            publisher
                .publish(Bytes::from_static(b"unheard"))
                .await
                .unwrap(),
            0
        );

        let mut sub = subscriber(publisher.endpoint(), "kv").await;
        wait_until_subscribed(&mut publisher, &mut sub).await;
        let first = publisher.next_seq();
        let payloads = [b"one".as_slice(), b"two", b"three"].map(Bytes::from_static);
        for payload in &payloads {
            publisher.publish(payload.clone()).await.unwrap();
        }
        for (seq, payload) in (first..).zip(payloads) {
            let expected = vec![Bytes::from_static(b"kv"), seq_frame(seq), payload];
            assert_eq!(next_frames(&mut sub).await, expected);
        }
    }

    #[tokio::test]
    async fn live_frames_and_replays_match_a_real_vllm_0_33_publisher() {
        let exchange = std::fs::read(super::super::fixture("replay-exchange.json")).unwrap();
        let exchange: Value = serde_json::from_slice(&exchange).unwrap();
        let topic = exchange["topic"].as_str().unwrap();
        let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &replaying(topic, 4))
            .await
            .unwrap();
        let mut sub = subscriber(publisher.endpoint(), topic).await;
        wait_until_subscribed(&mut publisher, &mut sub).await;
        // The fixture's publisher was fresh: no warm-up in its numbers or ring.
        publisher.restart();

        let live = hex_messages(&exchange["live_frames_hex"]);
        for message in &live {
            publisher.publish(message[2].clone()).await.unwrap();
        }
        for message in &live {
            assert_eq!(&next_frames(&mut sub).await, message);
        }
        let replay_endpoint = publisher.replay_endpoint().unwrap();
        for case in exchange["replay"].as_array().unwrap() {
            let replies = ask(replay_endpoint, hex_frames(&case["dealer_sends_hex"])).await;
            assert_eq!(
                replies,
                hex_messages(&case["dealer_receives_hex"]),
                "start {}",
                case["request_start_seq"]
            );
        }
    }

    #[tokio::test]
    async fn a_replay_request_without_the_empty_delimiter_gets_no_answer() {
        let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &replaying("", 8))
            .await
            .unwrap();
        for payload in [b"zero".as_slice(), b"one"] {
            publisher
                .publish(Bytes::from_static(payload))
                .await
                .unwrap();
        }
        let mut dealer = DealerSocket::new();
        dealer
            .connect(publisher.replay_endpoint().unwrap())
            .await
            .unwrap();
        dealer.send(ZmqMessage::from(seq_frame(0))).await.unwrap();
        dealer
            .send(ZmqMessage::try_from(request(1)).unwrap())
            .await
            .unwrap();
        // Requests are answered in order, so an answer to the first would
        // start with seq 0.
        assert_eq!(
            replayed_seqs(&read_replay(&mut dealer).await),
            [1, u64::MAX]
        );
    }

    #[tokio::test]
    async fn a_restart_numbers_from_zero_again_and_empties_the_replay_ring() {
        let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &replaying("", 8))
            .await
            .unwrap();
        let mut sub = subscriber(publisher.endpoint(), "").await;
        wait_until_subscribed(&mut publisher, &mut sub).await;
        publisher
            .publish(Bytes::from_static(b"before"))
            .await
            .unwrap();
        let before = seq(&next_frames(&mut sub).await);

        publisher.restart();
        publisher
            .publish(Bytes::from_static(b"after"))
            .await
            .unwrap();

        assert!(before > 0);
        assert_eq!(seq(&next_frames(&mut sub).await), 0);
        let replies = ask(publisher.replay_endpoint().unwrap(), request(0)).await;
        assert_eq!(replayed_seqs(&replies), [0, u64::MAX]);
    }

    #[tokio::test]
    async fn skipped_numbers_leave_a_gap_that_replay_cannot_fill() {
        let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &replaying("", 8))
            .await
            .unwrap();
        let mut sub = subscriber(publisher.endpoint(), "").await;
        wait_until_subscribed(&mut publisher, &mut sub).await;
        let before_gap = publisher
            .publish(Bytes::from_static(b"kept"))
            .await
            .unwrap();
        publisher.skip(2);
        let after_gap = publisher
            .publish(Bytes::from_static(b"after"))
            .await
            .unwrap();

        assert_eq!(after_gap, before_gap + 3);
        assert_eq!(seq(&next_frames(&mut sub).await), before_gap);
        assert_eq!(seq(&next_frames(&mut sub).await), after_gap);
        let replies = ask(publisher.replay_endpoint().unwrap(), request(before_gap)).await;
        assert_eq!(replayed_seqs(&replies), [before_gap, after_gap, u64::MAX]);
    }

    #[tokio::test]
    async fn a_star_endpoint_binds_every_interface() {
        let mut publisher = EnginePublisher::bind("tcp://*:0", &PublisherOptions::default())
            .await
            .unwrap();
        let port = publisher
            .endpoint()
            .strip_prefix("tcp://0.0.0.0:")
            .unwrap_or_else(|| panic!("{}", publisher.endpoint()))
            .to_owned();
        let mut sub = subscriber(&format!("tcp://127.0.0.1:{port}"), "").await;
        wait_until_subscribed(&mut publisher, &mut sub).await;
    }

    #[tokio::test]
    async fn a_connecting_publisher_reaches_a_bound_subscriber() {
        let mut sub = SubSocket::new();
        let endpoint = sub.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        sub.subscribe("").await.unwrap();
        let mut publisher = EnginePublisher::connect(&endpoint, &PublisherOptions::default())
            .await
            .unwrap();
        assert_eq!(publisher.endpoint(), endpoint);
        wait_until_subscribed(&mut publisher, &mut sub).await;
        let seq_sent = publisher
            .publish(Bytes::from_static(b"hello"))
            .await
            .unwrap();
        assert_eq!(
            next_frames(&mut sub).await,
            [
                Bytes::new(),
                seq_frame(seq_sent),
                Bytes::from_static(b"hello")
            ]
        );
    }
}
