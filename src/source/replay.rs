//! Fetching messages again from an engine publisher's replay ROUTER.
//!
//! Invariant: whatever a fetch yields is a run of consecutive engine
//! sequence numbers inside the range asked for, carrying the configured
//! topic, exactly as the ring holds them, handed over one by one as they
//! arrive (a fetch keeps none of them). It starts at the range's start
//! unless the ring no longer reaches back that far (the ROUTER then silently
//! starts at its oldest message), and it ends early, never with a hole, when
//! the ring runs out, a reply breaks the run, the endpoint stops answering
//! within the timeout, or the fetch reaches one of its [`FetchBounds`]: an
//! endpoint that answers forever costs at most those bounds.
//!
//! Protocol (engine-wire.md, "Replay ROUTER protocol"): a fresh DEALER sends
//! `["", start as 8 bytes BE]`; the ROUTER answers every kept message with
//! `seq >= start`, oldest first, as `["", topic, seq, payload]` (vLLM ≥ 0.26,
//! SGLang 0.5.23) or `["", seq, payload]` (older), then an END whose seq frame
//! is all ones. There is no error reply, so silence is only detectable by a
//! timeout. SGLang's ROUTER drops whatever exceeds libzmq's default send limit
//! of 1000 messages, so long ranges are asked for in pieces of at most that
//! many, each on its own socket. A piece is read only as fast as the caller
//! takes its messages: the socket reads nothing ahead.

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, timeout_at};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqError, ZmqMessage};

use super::peer::{PeerDropReason, socket_options};
use super::{FrameError, parse_sequence};

/// The most messages asked for in one request: SGLang's ROUTER truncates
/// longer replies.
pub const MAX_PIECE: usize = 1000;

/// How long one piece (connect, request, replies) may take. Engines answer
/// within ~0.1 s when idle; this bounds how long a dead endpoint can hold
/// the live stream back.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a whole fetch may take: a ring of 100k small messages comes
/// back in about a second on loopback.
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// The most messages one fetch yields: ten times vLLM's default ring.
pub const DEFAULT_MAX_MESSAGES: u64 = 100_000;

/// The most payload bytes one fetch yields, unless the history is smaller.
pub const DEFAULT_MAX_BYTES: u64 = 64 << 20;

/// The seq frame of the reply that ends a replay.
const END: u64 = u64::MAX;

/// The most one fetch may cost, whatever the endpoint sends.
#[derive(Clone, Copy, Debug)]
pub struct FetchBounds {
    /// Messages yielded.
    pub messages: u64,
    /// Payload bytes yielded.
    pub bytes: u64,
    /// From the first request to the last reply, over every piece.
    pub time: Duration,
}

impl Default for FetchBounds {
    fn default() -> Self {
        Self {
            messages: DEFAULT_MAX_MESSAGES,
            bytes: DEFAULT_MAX_BYTES,
            time: DEFAULT_FETCH_TIMEOUT,
        }
    }
}

/// Which of the [`FetchBounds`] a fetch reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FetchBound {
    Messages,
    Bytes,
    Time,
}

impl FetchBound {
    /// Every bound, in label order.
    pub const ALL: [FetchBound; 3] = [Self::Messages, Self::Bytes, Self::Time];

    /// The `bound` label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Messages => "messages",
            Self::Bytes => "bytes",
            Self::Time => "time",
        }
    }
}

/// Why a fetch stopped before covering the range asked for.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("cannot reach the replay endpoint within {0:?}")]
    ConnectTimeout(Duration),
    #[error("cannot reach the replay endpoint: {0}")]
    ConnectFailed(Arc<ZmqError>),
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
    #[error("the replay connection failed: {0}")]
    Disconnected(Arc<ZmqError>),
    #[error("the replay endpoint was disconnected ({}): {detail}", .reason.as_str())]
    PeerDropped {
        reason: PeerDropReason,
        detail: Arc<ZmqError>,
    },
    #[error("malformed replay reply: {}", .0.as_str())]
    BadFrames(FrameError),
    #[error("replay sent seq {got} where {expected} was due")]
    NotContiguous { expected: u64, got: u64 },
    #[error("the fetch reached its {} bound", .0.as_str())]
    Bounded(FetchBound),
}

impl ReplayError {
    fn from_recv(error: ZmqError) -> Self {
        match PeerDropReason::of(&error) {
            Some(reason) => Self::PeerDropped {
                reason,
                detail: Arc::new(error),
            },
            None => Self::Disconnected(Arc::new(error)),
        }
    }
}

/// What a fetch yielded, in numbers; see the module docs for the run.
#[derive(Clone, Debug, Default)]
pub struct Replayed {
    /// Where the yielded run begins: the start asked for, or later when the
    /// ring had already dropped it.
    pub first: Option<u64>,
    pub last: Option<u64>,
    /// Messages yielded.
    pub count: u64,
    /// Set when the fetch ended for another reason than covering the range
    /// or reaching the ring's newest message.
    pub stopped: Option<ReplayError>,
}

/// One rank's replay endpoint.
#[derive(Clone, Debug)]
pub struct ReplayClient {
    address: String,
    /// The topic a replayed message must carry; `None`: any.
    topic: Option<Bytes>,
    timeout: Duration,
    bounds: FetchBounds,
    max_message_bytes: usize,
}

impl ReplayClient {
    /// `address` is a connect address (`tcp://HOST:PORT`); `timeout` bounds
    /// each piece and `bounds` each fetch; a reply over `max_message_bytes`
    /// drops the connection.
    pub fn new(
        address: String,
        topic: Option<Bytes>,
        timeout: Duration,
        bounds: FetchBounds,
        max_message_bytes: usize,
    ) -> Self {
        Self {
            address,
            topic,
            timeout,
            bounds,
            max_message_bytes,
        }
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Starts fetching what the ring still holds of `wanted`; `0..=u64::MAX`
    /// asks for the whole ring. Nothing is asked before [`Fetch::next`].
    pub fn fetch(&self, wanted: RangeInclusive<u64>) -> Fetch<'_> {
        Fetch {
            client: self,
            collector: Collector::new(wanted, MAX_PIECE, self.bounds),
            deadline: Instant::now() + self.bounds.time,
            piece: None,
            stopped: None,
        }
    }

    /// Connects a fresh socket and asks from `start`; returns it with the
    /// piece's deadline.
    async fn open(
        &self,
        start: u64,
        fetch_deadline: Instant,
    ) -> Result<(DealerSocket, Instant), ReplayError> {
        let until = Instant::now() + self.timeout;
        let deadline = until.min(fetch_deadline);
        let mut dealer = DealerSocket::with_options(socket_options(self.max_message_bytes));
        // Unlike libzmq's, the zeromq crate's connect waits for the peer,
        // retrying a refused connection for up to 30 s.
        timeout_at(deadline, dealer.connect(&self.address))
            .await
            .map_err(|_| self.expired(until, fetch_deadline, ReplayError::ConnectTimeout))?
            .map_err(|error| ReplayError::ConnectFailed(Arc::new(error)))?;
        timeout_at(deadline, dealer.send(request(start)))
            .await
            .map_err(|_| self.expired(until, fetch_deadline, ReplayError::Timeout))?
            .map_err(|error| ReplayError::ConnectFailed(Arc::new(error)))?;
        Ok((dealer, until))
    }

    /// The error for a wait that ran out: the piece's own timeout, or the
    /// fetch's time bound when that came first.
    fn expired(
        &self,
        until: Instant,
        fetch_deadline: Instant,
        piece: fn(Duration) -> ReplayError,
    ) -> ReplayError {
        if fetch_deadline <= until {
            ReplayError::Bounded(FetchBound::Time)
        } else {
            piece(self.timeout)
        }
    }
}

/// A fetch under way: the verified run, message by message.
pub struct Fetch<'a> {
    client: &'a ReplayClient,
    collector: Collector,
    /// The fetch's time bound.
    deadline: Instant,
    /// The piece being read and its deadline; dropping the socket discards
    /// whatever else the ROUTER sends.
    piece: Option<(DealerSocket, Instant)>,
    stopped: Option<ReplayError>,
}

impl Fetch<'_> {
    /// The next message of the run, or `None` once the fetch has ended.
    pub async fn next(&mut self) -> Option<(u64, Bytes)> {
        while self.stopped.is_none() && !self.collector.is_done() {
            match self.step().await {
                Ok(Some(message)) => return Some(message),
                Ok(None) => {}
                Err(error) => {
                    self.piece = None;
                    self.stopped = Some(error);
                }
            }
        }
        self.piece = None;
        None
    }

    /// Narrows the range to what comes before `next`, which the live socket
    /// delivers: the fetch ends once the run reaches it.
    pub fn end_before(&mut self, next: u64) {
        self.collector.end_before(next);
    }

    /// What the fetch yielded and why it stopped.
    pub fn finish(self) -> Replayed {
        Replayed {
            first: self.collector.first,
            last: self.collector.last,
            count: self.collector.count,
            stopped: self.stopped,
        }
    }

    /// Reads one reply, asking for a piece first if none is open.
    async fn step(&mut self) -> Result<Option<(u64, Bytes)>, ReplayError> {
        let (dealer, until) = match &mut self.piece {
            Some(piece) => piece,
            slot @ None => {
                let start = self.collector.next_request();
                slot.insert(self.client.open(start, self.deadline).await?)
            }
        };
        let reply = timeout_at((*until).min(self.deadline), dealer.recv())
            .await
            .map_err(|_| {
                self.client
                    .expired(*until, self.deadline, ReplayError::Timeout)
            })?
            .map_err(ReplayError::from_recv)?;
        let reply = parse_reply(&reply.into_vec(), self.client.topic.as_deref())
            .map_err(ReplayError::BadFrames)?;
        let (message, next) = self.collector.accept(reply)?;
        if next == Next::PieceDone {
            self.piece = None;
        }
        Ok(message)
    }
}

/// The request frames for a replay starting at `start`.
fn request(start: u64) -> ZmqMessage {
    let mut message = ZmqMessage::from(Bytes::new());
    message.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
    message
}

/// One reply of the ROUTER, as a DEALER sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Message { seq: u64, payload: Bytes },
    End,
}

/// Reads `["", topic, seq, payload]` or `["", seq, payload]`. END is told
/// by its seq frame alone: vLLM's carries an empty topic, whatever the
/// configured one.
pub fn parse_reply(frames: &[Bytes], topic: Option<&[u8]>) -> Result<Reply, FrameError> {
    let [delimiter, rest @ ..] = frames else {
        return Err(FrameError::WrongFrameCount);
    };
    let (received_topic, seq, payload) = match rest {
        [received_topic, seq, payload] => (Some(received_topic), seq, payload),
        [seq, payload] => (None, seq, payload),
        _ => return Err(FrameError::WrongFrameCount),
    };
    if !delimiter.is_empty() {
        return Err(FrameError::MissingDelimiter);
    }
    let seq = parse_sequence(seq)?;
    if seq == END {
        return Ok(Reply::End);
    }
    if let (Some(received), Some(topic)) = (received_topic, topic)
        && received.as_ref() != topic
    {
        return Err(FrameError::TopicMismatch);
    }
    Ok(Reply::Message {
        seq,
        payload: payload.clone(),
    })
}

/// What to do after a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    Read,
    /// This piece is finished: ask again (or stop, if the fetch is done).
    PieceDone,
}

/// Checks replies against the range asked for and the bounds, and plans
/// the pieces; the pure half of a fetch.
#[derive(Debug)]
struct Collector {
    wanted: RangeInclusive<u64>,
    piece_size: usize,
    bounds: FetchBounds,
    first: Option<u64>,
    last: Option<u64>,
    count: u64,
    bytes: u64,
    in_piece: usize,
    done: bool,
}

impl Collector {
    fn new(wanted: RangeInclusive<u64>, piece_size: usize, bounds: FetchBounds) -> Self {
        Self {
            wanted,
            piece_size,
            bounds,
            first: None,
            last: None,
            count: 0,
            bytes: 0,
            in_piece: 0,
            done: false,
        }
    }

    fn is_done(&self) -> bool {
        self.done
    }

    /// Starts a piece; returns the seq to ask from.
    fn next_request(&mut self) -> u64 {
        self.in_piece = 0;
        self.next_expected()
    }

    /// Takes a reply: the message to yield, if any, and what to do next.
    fn accept(&mut self, reply: Reply) -> Result<(Option<(u64, Bytes)>, Next), ReplayError> {
        let Reply::Message { seq, payload } = reply else {
            self.done = true;
            return Ok((None, Next::PieceDone));
        };
        let not_contiguous = match self.last {
            // A start the ring no longer holds begins at its oldest message.
            None => seq < *self.wanted.start(),
            Some(last) => seq != last + 1,
        };
        if not_contiguous {
            self.done = true;
            return Err(ReplayError::NotContiguous {
                expected: self.next_expected(),
                got: seq,
            });
        }
        if seq > *self.wanted.end() {
            self.done = true;
            return Ok((None, Next::PieceDone));
        }
        let size = payload.len() as u64;
        let bound = if self.count >= self.bounds.messages {
            Some(FetchBound::Messages)
        } else if self.bytes + size > self.bounds.bytes {
            Some(FetchBound::Bytes)
        } else {
            None
        };
        if let Some(bound) = bound {
            self.done = true;
            return Err(ReplayError::Bounded(bound));
        }
        self.first.get_or_insert(seq);
        self.last = Some(seq);
        self.count += 1;
        self.bytes += size;
        self.in_piece += 1;
        self.done = seq == *self.wanted.end();
        let next = if self.done || self.in_piece == self.piece_size {
            Next::PieceDone
        } else {
            Next::Read
        };
        Ok((Some((seq, payload)), next))
    }

    /// Ends the range just before `next`.
    fn end_before(&mut self, next: u64) {
        let Some(end) = next.checked_sub(1) else {
            self.done = true;
            return;
        };
        if end >= *self.wanted.end() {
            return;
        }
        self.wanted = *self.wanted.start()..=end;
        if end < *self.wanted.start() || self.last.is_some_and(|last| last >= end) {
            self.done = true;
        }
    }

    fn next_expected(&self) -> u64 {
        self.last.map_or(*self.wanted.start(), |last| last + 1)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::Value;
    use zeromq::RouterSocket;

    use super::*;
    use kvgate_sim::{EndlessReplay, EnginePublisher, PublisherOptions};

    fn unhex(hex: &Value) -> Bytes {
        let hex = hex.as_str().expect("a hex string");
        (0..hex.len())
            .step_by(2)
            .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).expect("hex digits"))
            .collect::<Vec<u8>>()
            .into()
    }

    fn frames(hex: &Value) -> Vec<Bytes> {
        hex.as_array().expect("frames").iter().map(unhex).collect()
    }

    fn message(seq: u64) -> Reply {
        Reply::Message {
            seq,
            payload: Bytes::from(format!("batch {seq}")),
        }
    }

    /// A collector that keeps the seqs it yields.
    struct Fed {
        collector: Collector,
        seqs: Vec<u64>,
    }

    impl Fed {
        fn new(wanted: RangeInclusive<u64>, piece_size: usize) -> Self {
            Self::bounded(wanted, piece_size, FetchBounds::default())
        }

        fn bounded(wanted: RangeInclusive<u64>, piece_size: usize, bounds: FetchBounds) -> Self {
            Self {
                collector: Collector::new(wanted, piece_size, bounds),
                seqs: Vec::new(),
            }
        }

        fn next_request(&mut self) -> u64 {
            self.collector.next_request()
        }

        fn is_done(&self) -> bool {
            self.collector.is_done()
        }

        fn accept(&mut self, reply: Reply) -> Result<Next, ReplayError> {
            let (message, next) = self.collector.accept(reply)?;
            self.seqs.extend(message.map(|(seq, _)| seq));
            Ok(next)
        }
    }

    /// Runs a whole fetch, keeping what it yields.
    async fn collect(mut fetch: Fetch<'_>) -> (Vec<(u64, Bytes)>, Replayed) {
        let mut messages = Vec::new();
        while let Some(message) = fetch.next().await {
            messages.push(message);
        }
        (messages, fetch.finish())
    }

    #[test]
    fn every_engine_reply_format_is_read_and_ends_on_the_all_ones_sequence() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wire");
        for format in [
            "vllm-0.33.0",
            "sglang-0.5.23",
            "vllm-0.23.0-array",
            "vllm-legacy-array",
        ] {
            let exchange = std::fs::read(root.join(format).join("replay-exchange.json")).unwrap();
            let exchange: Value = serde_json::from_slice(&exchange).unwrap();
            let topic = exchange["topic"].as_str().unwrap().as_bytes();
            for case in exchange["replay"].as_array().unwrap() {
                let start = case["request_start_seq"].as_u64().unwrap();
                assert_eq!(
                    request(start).into_vec(),
                    frames(&case["dealer_sends_hex"]),
                    "{format}: request frames for {start}"
                );
                let mut collector = Fed::new(start..=u64::MAX, MAX_PIECE);
                collector.next_request();
                let replies = case["dealer_receives_hex"].as_array().unwrap();
                for (n, reply) in replies.iter().enumerate() {
                    let reply = parse_reply(&frames(reply), Some(topic)).unwrap();
                    assert_eq!(reply == Reply::End, n == replies.len() - 1, "{format}");
                    collector.accept(reply).unwrap();
                }
                assert!(collector.is_done(), "{format}: END ends the fetch");
                let expected: Vec<u64> = case["dealer_receives_seqs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(Value::as_u64)
                    .collect();
                assert_eq!(collector.seqs, expected, "{format}: start {start}");
            }
        }
    }

    #[test]
    fn a_message_under_another_topic_is_refused_but_end_may_carry_any_topic() {
        let seq = |n: u64| Bytes::copy_from_slice(&n.to_be_bytes());
        let frames =
            |topic: &'static str, n: u64| [Bytes::new(), Bytes::from(topic), seq(n), Bytes::new()];
        assert_eq!(
            parse_reply(&frames("other", 3), Some(b"kv")),
            Err(FrameError::TopicMismatch)
        );
        assert_eq!(parse_reply(&frames("", END), Some(b"kv")), Ok(Reply::End));
        assert!(matches!(
            parse_reply(&frames("kv", 3), Some(b"kv")),
            Ok(Reply::Message { seq: 3, .. })
        ));
    }

    #[test]
    fn malformed_replies_are_refused_with_the_reason() {
        let seq = Bytes::copy_from_slice(&7u64.to_be_bytes());
        let cases = [
            (vec![Bytes::new(), seq.clone()], FrameError::WrongFrameCount),
            (vec![], FrameError::WrongFrameCount),
            (vec![Bytes::new(); 5], FrameError::WrongFrameCount),
            (
                vec![Bytes::from("x"), seq.clone(), Bytes::new()],
                FrameError::MissingDelimiter,
            ),
            (
                vec![Bytes::new(), Bytes::from_static(&[0; 7]), Bytes::new()],
                FrameError::BadSequenceFrame,
            ),
        ];
        for (frames, error) in cases {
            assert_eq!(parse_reply(&frames, Some(b"")), Err(error), "{frames:?}");
        }
    }

    #[test]
    fn a_start_the_ring_no_longer_holds_begins_at_its_oldest_message() {
        let mut collector = Fed::new(5..=9, MAX_PIECE);
        assert_eq!(collector.next_request(), 5);
        for seq in 7..=9 {
            collector.accept(message(seq)).unwrap();
        }
        assert!(collector.is_done());
        assert_eq!(collector.seqs, [7, 8, 9]);
    }

    #[test]
    fn replayed_numbers_must_run_on_and_the_run_stops_at_the_first_break() {
        let mut collector = Fed::new(0..=u64::MAX, MAX_PIECE);
        collector.next_request();
        collector.accept(message(0)).unwrap();
        collector.accept(message(1)).unwrap();
        assert!(matches!(
            collector.accept(message(3)),
            Err(ReplayError::NotContiguous {
                expected: 2,
                got: 3
            })
        ));
        assert!(collector.is_done());
        assert_eq!(collector.seqs, [0, 1]);

        let mut collector = Fed::new(4..=9, MAX_PIECE);
        collector.next_request();
        assert!(matches!(
            collector.accept(message(3)),
            Err(ReplayError::NotContiguous {
                expected: 4,
                got: 3
            })
        ));
    }

    #[test]
    fn a_bounded_fetch_ends_at_its_last_number_or_at_the_first_one_past_it() {
        let mut collector = Fed::new(2..=3, MAX_PIECE);
        collector.next_request();
        assert!(matches!(collector.accept(message(2)), Ok(Next::Read)));
        assert!(matches!(collector.accept(message(3)), Ok(Next::PieceDone)));
        assert!(collector.is_done());

        // The ring skips the range entirely (numbers the engine never sent).
        let mut collector = Fed::new(2..=3, MAX_PIECE);
        collector.next_request();
        assert!(matches!(collector.accept(message(4)), Ok(Next::PieceDone)));
        assert!(collector.is_done());
        assert!(collector.seqs.is_empty());
    }

    #[test]
    fn long_ranges_are_asked_for_in_pieces_each_continuing_after_the_last_message() {
        let mut collector = Fed::new(10..=u64::MAX, 3);
        assert_eq!(collector.next_request(), 10);
        assert!(matches!(collector.accept(message(10)), Ok(Next::Read)));
        assert!(matches!(collector.accept(message(11)), Ok(Next::Read)));
        assert!(matches!(collector.accept(message(12)), Ok(Next::PieceDone)));
        assert!(!collector.is_done());
        assert_eq!(collector.next_request(), 13);
        // A later piece may not start past where the last one stopped.
        assert!(matches!(
            collector.accept(message(15)),
            Err(ReplayError::NotContiguous {
                expected: 13,
                got: 15
            })
        ));

        let mut collector = Fed::new(10..=u64::MAX, 3);
        collector.next_request();
        for seq in 10..=12 {
            collector.accept(message(seq)).unwrap();
        }
        collector.next_request();
        assert!(matches!(collector.accept(message(13)), Ok(Next::Read)));
        assert!(matches!(collector.accept(Reply::End), Ok(Next::PieceDone)));
        assert!(collector.is_done());
        assert_eq!(collector.seqs, [10, 11, 12, 13]);
    }

    async fn ring_only_publisher(published: u64, buffer_steps: usize) -> EnginePublisher {
        let options = PublisherOptions {
            replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
            buffer_steps,
            ..PublisherOptions::default()
        };
        let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &options)
            .await
            .unwrap();
        for seq in 0..published {
            // Nobody subscribes: these only go to the ring.
            publisher
                .publish(Bytes::from(format!("batch {seq}")))
                .await
                .unwrap();
        }
        publisher
    }

    fn client(address: &str, timeout: Duration) -> ReplayClient {
        bounded_client(address, timeout, FetchBounds::default())
    }

    fn bounded_client(address: &str, timeout: Duration, bounds: FetchBounds) -> ReplayClient {
        ReplayClient::new(
            address.to_owned(),
            Some(Bytes::new()),
            timeout,
            bounds,
            crate::source::peer::DEFAULT_MAX_MESSAGE_BYTES as usize,
        )
    }

    #[tokio::test]
    async fn a_fetch_longer_than_a_piece_comes_back_whole_and_in_order() {
        let publisher = ring_only_publisher(2500, 10_000).await;
        let replay = client(publisher.replay_endpoint().unwrap(), DEFAULT_TIMEOUT);

        let (messages, all) = collect(replay.fetch(0..=u64::MAX)).await;
        assert!(all.stopped.is_none(), "{:?}", all.stopped);
        assert_eq!((messages.len(), all.count), (2500, 2500));
        for (n, (seq, payload)) in messages.iter().enumerate() {
            assert_eq!(*seq, n as u64);
            assert_eq!(payload, &Bytes::from(format!("batch {n}")));
        }

        let (messages, range) = collect(replay.fetch(990..=2001)).await;
        assert!(range.stopped.is_none(), "{:?}", range.stopped);
        assert_eq!((range.first, range.last), (Some(990), Some(2001)));
        assert_eq!((messages.len(), range.count), (1012, 1012));
    }

    #[tokio::test]
    async fn a_ring_smaller_than_what_was_published_starts_at_its_oldest() {
        let publisher = ring_only_publisher(30, 8).await;
        let replay = client(publisher.replay_endpoint().unwrap(), DEFAULT_TIMEOUT);
        let (_, primed) = collect(replay.fetch(0..=u64::MAX)).await;
        assert!(primed.stopped.is_none(), "{:?}", primed.stopped);
        assert_eq!((primed.first, primed.last), (Some(22), Some(29)));
    }

    #[tokio::test]
    async fn an_unreachable_endpoint_costs_one_timeout_and_returns_nothing() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        let replay = client(&format!("tcp://127.0.0.1:{port}"), timeout);
        let (messages, replayed) = collect(replay.fetch(0..=u64::MAX)).await;
        assert!(matches!(
            replayed.stopped,
            Some(ReplayError::ConnectTimeout(_) | ReplayError::ConnectFailed(_))
        ));
        assert!(messages.is_empty());
        assert!(started.elapsed() < timeout + Duration::from_secs(2));
    }

    #[tokio::test]
    async fn a_router_that_never_answers_times_out() {
        let mut router = RouterSocket::new();
        let address = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        let replay = client(&address, timeout);
        let (_, replayed) = collect(replay.fetch(0..=u64::MAX)).await;
        assert!(matches!(replayed.stopped, Some(ReplayError::Timeout(t)) if t == timeout));
        assert!(started.elapsed() < timeout + Duration::from_secs(2));
        // The request did arrive, framed as the engines expect.
        let request = router.recv().await.unwrap().into_vec();
        assert_eq!(request[1..], [Bytes::new(), Bytes::from_static(&[0; 8])]);
    }

    #[test]
    fn a_fetch_stops_at_its_message_or_byte_bound_with_the_run_it_had() {
        let reply = |seq: u64, bytes: usize| Reply::Message {
            seq,
            payload: Bytes::from(vec![0; bytes]),
        };
        let bounds = FetchBounds {
            messages: 2,
            ..FetchBounds::default()
        };
        let mut collector = Fed::bounded(0..=u64::MAX, MAX_PIECE, bounds);
        collector.next_request();
        collector.accept(reply(0, 1)).unwrap();
        collector.accept(reply(1, 1)).unwrap();
        assert!(matches!(
            collector.accept(reply(2, 1)),
            Err(ReplayError::Bounded(FetchBound::Messages))
        ));
        assert!(collector.is_done());
        assert_eq!(collector.seqs, [0, 1]);

        let bounds = FetchBounds {
            bytes: 10,
            ..FetchBounds::default()
        };
        let mut collector = Fed::bounded(0..=u64::MAX, MAX_PIECE, bounds);
        collector.next_request();
        collector.accept(reply(0, 6)).unwrap();
        assert!(matches!(
            collector.accept(reply(1, 5)),
            Err(ReplayError::Bounded(FetchBound::Bytes))
        ));
        assert_eq!(collector.seqs, [0]);

        // A run that ends exactly at a bound reached no bound.
        let mut collector = Fed::bounded(0..=u64::MAX, MAX_PIECE, bounds);
        collector.next_request();
        collector.accept(reply(0, 10)).unwrap();
        collector.accept(Reply::End).unwrap();
        assert!(collector.is_done());
    }

    #[test]
    fn a_fetch_narrowed_to_before_a_live_number_ends_when_its_run_reaches_it() {
        let mut collector = Fed::new(0..=u64::MAX, MAX_PIECE);
        collector.next_request();
        collector.accept(message(4)).unwrap();
        collector.collector.end_before(6);
        assert!(!collector.is_done());
        assert!(matches!(collector.accept(message(5)), Ok(Next::PieceDone)));
        assert!(collector.is_done());
        assert_eq!(collector.seqs, [4, 5]);

        // The run is already past the live number: nothing more to ask.
        let mut collector = Fed::new(0..=u64::MAX, MAX_PIECE);
        collector.next_request();
        collector.accept(message(0)).unwrap();
        collector.accept(message(1)).unwrap();
        collector.collector.end_before(1);
        assert!(collector.is_done());

        // Nothing comes before 0.
        let mut collector = Fed::new(0..=u64::MAX, MAX_PIECE);
        collector.collector.end_before(0);
        assert!(collector.is_done());
    }

    #[tokio::test]
    async fn an_endpoint_that_answers_forever_is_cut_at_the_fetchs_bounds() {
        let endless = EndlessReplay::bind(
            "tcp://127.0.0.1:0",
            Bytes::new(),
            1000,
            Bytes::from(vec![7; 16]),
        )
        .await
        .unwrap();
        let address = endless.endpoint();
        let bounds = FetchBounds {
            messages: 2500,
            ..FetchBounds::default()
        };
        let replay = bounded_client(address, DEFAULT_TIMEOUT, bounds);
        let (messages, replayed) = collect(replay.fetch(0..=u64::MAX)).await;
        assert!(matches!(
            replayed.stopped,
            Some(ReplayError::Bounded(FetchBound::Messages))
        ));
        assert_eq!((messages.len(), replayed.last), (2500, Some(2499)));

        // Only the clock can stop this one.
        let bounds = FetchBounds {
            messages: u64::MAX,
            bytes: u64::MAX,
            time: Duration::from_millis(300),
        };
        let replay = bounded_client(address, DEFAULT_TIMEOUT, bounds);
        let started = Instant::now();
        let (_, replayed) = collect(replay.fetch(0..=u64::MAX)).await;
        assert!(matches!(
            replayed.stopped,
            Some(ReplayError::Bounded(FetchBound::Time))
        ));
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}
