//! Fetching messages again from an engine publisher's replay ROUTER.
//!
//! Invariant: whatever a fetch returns is a run of consecutive engine
//! sequence numbers inside the range asked for, carrying the configured
//! topic, exactly as the ring holds them. It starts at the range's start
//! unless the ring no longer reaches back that far (the ROUTER then silently
//! starts at its oldest message), and it ends early, never with a hole, when
//! the ring runs out, a reply breaks the run, or the endpoint stops answering
//! within the timeout.
//!
//! Protocol (engine-wire.md, "Replay ROUTER protocol"): a fresh DEALER sends
//! `["", start as 8 bytes BE]`; the ROUTER answers every kept message with
//! `seq >= start`, oldest first, as `["", topic, seq, payload]` (vLLM ≥ 0.26,
//! SGLang 0.5.23) or `["", seq, payload]` (older), then an END whose seq frame
//! is all ones. There is no error reply, so silence is only detectable by a
//! timeout. SGLang's ROUTER drops whatever exceeds libzmq's default send limit
//! of 1000 messages, so long ranges are asked for in pieces of at most that
//! many, each on its own socket.

use std::ops::RangeInclusive;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, timeout_at};
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use super::{FrameError, parse_sequence};

/// The most messages asked for in one request: SGLang's ROUTER truncates
/// longer replies.
pub const MAX_PIECE: usize = 1000;

/// How long one piece (connect, request, replies) may take. Engines answer
/// within ~0.1 s when idle; this bounds how long a dead endpoint can hold
/// the live stream back.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// The seq frame of the reply that ends a replay.
const END: u64 = u64::MAX;

/// Why a fetch stopped before covering the range asked for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error("cannot reach the replay endpoint: {0}")]
    ConnectFailed(String),
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
    #[error("the replay connection failed: {0}")]
    Disconnected(String),
    #[error("malformed replay reply: {}", .0.as_str())]
    BadFrames(FrameError),
    #[error("replay sent seq {got} where {expected} was due")]
    NotContiguous { expected: u64, got: u64 },
}

/// What a fetch recovered; see the module docs for what `messages` holds.
#[derive(Clone, Debug, Default)]
pub struct Replayed {
    /// `(engine sequence, payload)`, consecutive, oldest first.
    pub messages: Vec<(u64, Bytes)>,
    /// Set when the fetch ended for another reason than covering the range
    /// or reaching the ring's newest message.
    pub stopped: Option<ReplayError>,
}

impl Replayed {
    /// Where the recovered record begins: the start asked for, or later when
    /// the ring had already dropped it.
    pub fn first(&self) -> Option<u64> {
        self.messages.first().map(|(seq, _)| *seq)
    }

    pub fn last(&self) -> Option<u64> {
        self.messages.last().map(|(seq, _)| *seq)
    }
}

/// One rank's replay endpoint.
#[derive(Clone, Debug)]
pub struct ReplayClient {
    address: String,
    topic: Bytes,
    timeout: Duration,
}

impl ReplayClient {
    /// `address` is a connect address (`tcp://HOST:PORT`); `timeout` bounds
    /// each piece.
    pub fn new(address: String, topic: Bytes, timeout: Duration) -> Self {
        Self {
            address,
            topic,
            timeout,
        }
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Fetches what the ring still holds of `wanted`; `0..=u64::MAX` asks for
    /// the whole ring. Never fails outright: a fetch that breaks off keeps
    /// the verified run it got so far and says why in `stopped`.
    pub async fn fetch(&self, wanted: RangeInclusive<u64>) -> Replayed {
        let mut collector = Collector::new(wanted, MAX_PIECE);
        let stopped = loop {
            if collector.is_done() {
                break None;
            }
            if let Err(error) = self.piece(&mut collector).await {
                break Some(error);
            }
        };
        Replayed {
            messages: collector.messages,
            stopped,
        }
    }

    /// Asks for the next piece on a fresh socket and reads it.
    async fn piece(&self, collector: &mut Collector) -> Result<(), ReplayError> {
        let deadline = Instant::now() + self.timeout;
        let mut options = SocketOptions::default();
        // The zeromq crate's connect retries until its own timeout (30 s by
        // default) rather than connecting in the background like libzmq.
        options.connect_timeout(self.timeout);
        let mut dealer = DealerSocket::with_options(options);
        timeout_at(deadline, dealer.connect(&self.address))
            .await
            .map_err(|_| {
                ReplayError::ConnectFailed(format!("no connection within {:?}", self.timeout))
            })?
            .map_err(|error| ReplayError::ConnectFailed(error.to_string()))?;
        timeout_at(deadline, dealer.send(request(collector.next_request())))
            .await
            .map_err(|_| ReplayError::Timeout(self.timeout))?
            .map_err(|error| ReplayError::ConnectFailed(error.to_string()))?;
        loop {
            let reply = timeout_at(deadline, dealer.recv())
                .await
                .map_err(|_| ReplayError::Timeout(self.timeout))?
                .map_err(|error| ReplayError::Disconnected(error.to_string()))?;
            let reply =
                parse_reply(&reply.into_vec(), &self.topic).map_err(ReplayError::BadFrames)?;
            if collector.accept(reply)? == Next::NewPiece {
                // Dropping the socket discards whatever else the ROUTER sends.
                return Ok(());
            }
        }
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
pub fn parse_reply(frames: &[Bytes], topic: &[u8]) -> Result<Reply, FrameError> {
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
    if received_topic.is_some_and(|received| received.as_ref() != topic) {
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
    NewPiece,
}

/// Checks replies against the range asked for and plans the pieces; the
/// pure half of a fetch.
#[derive(Debug)]
struct Collector {
    wanted: RangeInclusive<u64>,
    piece_size: usize,
    messages: Vec<(u64, Bytes)>,
    in_piece: usize,
    done: bool,
}

impl Collector {
    fn new(wanted: RangeInclusive<u64>, piece_size: usize) -> Self {
        Self {
            done: wanted.is_empty(),
            wanted,
            piece_size,
            messages: Vec::new(),
            in_piece: 0,
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

    fn accept(&mut self, reply: Reply) -> Result<Next, ReplayError> {
        let Reply::Message { seq, payload } = reply else {
            self.done = true;
            return Ok(Next::NewPiece);
        };
        let not_contiguous = match self.messages.last() {
            // A start the ring no longer holds begins at its oldest message.
            None => seq < *self.wanted.start(),
            Some((last, _)) => seq != last + 1,
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
            return Ok(Next::NewPiece);
        }
        self.messages.push((seq, payload));
        self.in_piece += 1;
        self.done = seq == *self.wanted.end();
        Ok(if self.done || self.in_piece == self.piece_size {
            Next::NewPiece
        } else {
            Next::Read
        })
    }

    fn next_expected(&self) -> u64 {
        self.messages
            .last()
            .map_or(*self.wanted.start(), |(last, _)| last + 1)
    }
}
