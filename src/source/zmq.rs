//! ZMQ SUB sockets, one per data-parallel rank.
//!
//! [`RankSockets`] opens them (rank r at port + r or one endpoint per rank,
//! bind or connect, the size limit, peers that break the rules counted) for
//! the engine's KV-event publishers here and for its load publishers
//! (`load::push`), each read by its own [`RankSocketTask`].
//!
//! Each rank has its own task that keeps its socket polled (an idle SUB would
//! miss a restarted publisher's first messages), validates the
//! `[topic, sequence, payload]` framing and forwards messages in arrival
//! order. Malformed messages are counted and skipped; they never stop the task.
//! A rank task ends only at shutdown or once the drain is gone. A peer that
//! breaks ZMTP or the message size limit loses its connection, never the
//! task: a bound SUB goes on accepting, a connecting one reconnects (see
//! [`super::peer`]).
//!
//! With a replay endpoint, the task first primes: it forwards what the
//! engine's ring holds, up to the first message the live socket delivers,
//! and then goes on live from that message. A task that resumes an earlier
//! kvgate process's record (`--state-dir`) asks the ring for that record's
//! last message instead: the same bytes mean the same publisher, and only
//! what follows is forwarded, up to the first live message as in priming;
//! other bytes mean the engine restarted meanwhile (its rank is cleared,
//! then primed as usual); a ring that no longer reaches it leaves the live
//! socket's counter to tell a gap from a restart. Then, whenever a live message
//! reveals a hole before it (a gap, or numbers the SUB missed after it
//! joined or after the engine restarted), the task forwards what replay
//! still holds of the hole first. Replayed messages go to the drain as they
//! arrive. Invariant: per rank, the drain gets each engine message at most
//! once, in the publisher's order; a replay that breaks off, never answers
//! or never stops answering costs at most its bounds per hole (messages,
//! bytes, time: `FetchBounds`), and what it could not give is counted as
//! lost.

use std::future::Future;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvgate_endpoint::{EndpointError, RankEndpoints};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket, ZmqError, ZmqMessage};

use super::continuity::{Continuity, MAX_PLAUSIBLE_GAP, PublisherCursor, ResumePoint};
use super::discovery::RankTarget;
use super::peer::{PeerSocket, record_dropped_peer, socket_options};
use super::replay::{Fetch, FetchBounds, ReplayClient, ReplayError, Replayed};
use super::{DrainGone, EngineMessage, FrameError, SourceEvent, parse_sequence, send};
use prometheus_client::metrics::counter::Counter;

use crate::metrics::Metrics;
use crate::supervisor::{Supervisor, TaskName};

/// How kvgate reaches the engine's publishers.
#[derive(Clone, Debug)]
pub struct ZmqSourceConfig {
    /// Each rank's publisher.
    pub endpoint: RankEndpoints,
    /// Each rank's replay ROUTER.
    pub replay_endpoint: Option<RankEndpoints>,
    /// How long one replay request may take before what it got is kept and
    /// the rest counted as lost.
    pub replay_timeout: std::time::Duration,
    /// The most one replay fetch (priming, or one hole) may cost.
    pub replay_bounds: FetchBounds,
    pub dp_size: u32,
    /// Exact topic every message must carry (SUB filtering is only a prefix match).
    pub topic: String,
    /// Bind instead of connecting (the engine was given a concrete host and
    /// connects out).
    pub bind: bool,
    /// Largest message accepted from a publisher or replay endpoint.
    pub max_message_bytes: usize,
    /// Where an earlier kvgate process's record of each rank ended.
    pub resume: std::collections::BTreeMap<u32, ResumePoint>,
    /// Where each rank's publisher moves when the engine says so (learned
    /// from the engine, `discovery`); empty when the flags fix them.
    pub moves: Vec<watch::Receiver<RankTarget>>,
    /// Accept a message under any topic (the SUB still subscribes to
    /// `topic` as a prefix): Dynamo's indexer reads a worker so.
    pub any_topic: bool,
    /// Told whether a connecting socket has a publisher connected right now
    /// (true on each connection, false on each disconnection), for whoever
    /// reports the source's state.
    pub link: Option<watch::Sender<bool>>,
    /// Told whether a rank is fetching from its replay endpoint right now
    /// (priming, or filling a hole), for whoever reports the source's state.
    pub replaying: Option<watch::Sender<bool>>,
}

/// Says `true` on a `replaying` channel while it lives, `false` once dropped
/// (whichever way the fetch ended).
struct Replaying(Option<watch::Sender<bool>>);

impl Replaying {
    fn start(replaying: Option<&watch::Sender<bool>>) -> Self {
        if let Some(replaying) = replaying {
            replaying.send_replace(true);
        }
        Replaying(replaying.cloned())
    }
}

impl Drop for Replaying {
    fn drop(&mut self) {
        if let Some(replaying) = &self.0 {
            replaying.send_replace(false);
        }
    }
}

/// Splits `[topic, sequence (8 bytes BE), payload]`, holding the topic to
/// `topic` when one is given.
pub fn parse_frames(message: ZmqMessage, topic: Option<&[u8]>) -> Result<(u64, Bytes), FrameError> {
    let mut frames = message.into_vecdeque();
    if frames.len() != 3 {
        return Err(FrameError::WrongFrameCount);
    }
    let (Some(received_topic), Some(sequence), Some(payload)) =
        (frames.pop_front(), frames.pop_front(), frames.pop_front())
    else {
        return Err(FrameError::WrongFrameCount);
    };
    if topic.is_some_and(|topic| received_topic.as_ref() != topic) {
        return Err(FrameError::TopicMismatch);
    }
    Ok((parse_sequence(&sequence)?, payload))
}

/// Why the sockets could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    // Each cause is in the message, so not the error's `source`: as both,
    // `{:#}` printed it twice.
    #[error("rank {rank}'s publisher: {error}")]
    PublisherEndpoint { rank: u32, error: EndpointError },
    #[error("rank {rank}'s replay endpoint: {error}")]
    ReplayEndpoint { rank: u32, error: EndpointError },
    #[error("cannot subscribe to the topic: {0}")]
    Subscribe(ZmqError),
    #[error("cannot bind {address}: {error}")]
    Bind { address: String, error: ZmqError },
}

impl ZmqSourceConfig {
    /// Opens one socket per rank, each served by its own supervised task until
    /// shutdown. Bound sockets are listening when this returns; connecting
    /// sockets keep retrying in the background until the engine is up. `ready`
    /// becomes true once every rank is connected or bound.
    pub async fn start(
        self,
        events: mpsc::Sender<SourceEvent>,
        metrics: Metrics,
        ready: watch::Sender<bool>,
        supervisor: &Supervisor,
    ) -> Result<(), StartError> {
        let config = self;
        let ranks_up = Arc::new(RanksUp {
            up: AtomicU32::new(0),
            of: config.dp_size,
            ready,
        });
        let sockets = RankSockets {
            endpoint: &config.endpoint,
            dp_size: config.dp_size,
            topic: &config.topic,
            bind: config.bind,
            max_message_bytes: config.max_message_bytes,
            task_name: TaskName::SourceRank,
            peer: ENGINE,
            link: config.link.as_ref(),
        };
        let up = move || ranks_up.one_more();
        sockets
            .open(&metrics, supervisor, up, |rank, address| {
                let topic = (!config.any_topic).then(|| Bytes::from(config.topic.clone()));
                let replay = match &config.replay_endpoint {
                    Some(base) => Some(ReplayClient::new(
                        base.for_rank(rank)
                            .map_err(|error| StartError::ReplayEndpoint { rank, error })?
                            .connect_address(),
                        topic.clone(),
                        config.replay_timeout,
                        config.replay_bounds,
                        config.max_message_bytes,
                    )),
                    None => None,
                };
                let mut task = RankTask::new(
                    rank,
                    address,
                    topic,
                    replay,
                    events.clone(),
                    metrics.clone(),
                );
                task.resume = config.resume.get(&rank).copied();
                task.replaying = config.replaying.clone();
                task.moves = config.moves.get(rank as usize).map(|targets| Moves {
                    targets: targets.clone(),
                    topic: config.topic.clone(),
                    max_message_bytes: config.max_message_bytes,
                    replay_timeout: config.replay_timeout,
                    replay_bounds: config.replay_bounds,
                });
                Ok(task)
            })
            .await
    }
}

/// What reads one rank's SUB once it is bound or connected, until `stop`.
pub(crate) trait RankSocketTask: Send + 'static {
    fn run(self, socket: SubSocket, stop: CancellationToken) -> impl Future<Output = ()> + Send;
}

/// One SUB socket per rank at `endpoint` (rank r at port + r, or one
/// endpoint per rank), bound or connecting, each read by its own supervised
/// task: the engine's KV-event publishers and its load publishers alike.
pub(crate) struct RankSockets<'a> {
    pub endpoint: &'a RankEndpoints,
    pub dp_size: u32,
    /// Exact topic every message must carry; subscribed as a prefix.
    pub topic: &'a str,
    pub bind: bool,
    pub max_message_bytes: usize,
    pub task_name: fn(u32) -> TaskName,
    /// Who is at the other end, for the logs.
    pub peer: &'static str,
    /// Told each connection and disconnection of a connecting socket.
    pub link: Option<&'a watch::Sender<bool>>,
}

impl RankSockets<'_> {
    /// Opens every rank's socket; `task` makes the task that reads rank
    /// r's socket from its address. Bound sockets are listening when this
    /// returns; connecting ones keep retrying in the background until the
    /// engine is up. `up` is called once per rank connected or bound.
    pub async fn open<T: RankSocketTask>(
        &self,
        metrics: &Metrics,
        supervisor: &Supervisor,
        up: impl Fn() + Clone + Send + 'static,
        mut task: impl FnMut(u32, String) -> Result<T, StartError>,
    ) -> Result<(), StartError> {
        let peer = self.peer;
        for rank in 0..self.dp_size {
            let endpoint = self
                .endpoint
                .for_rank(rank)
                .map_err(|error| StartError::PublisherEndpoint { rank, error })?;
            let mut socket = sub_socket(self.max_message_bytes, self.topic)
                .await
                .map_err(StartError::Subscribe)?;
            let stop = supervisor.stopping();
            let address = if self.bind {
                endpoint.bind_address()
            } else {
                endpoint.connect_address()
            };
            let rank_task = task(rank, address.clone())?;
            let name = (self.task_name)(rank);
            if self.bind {
                let bound = socket
                    .bind(&address)
                    .await
                    .map_err(|error| StartError::Bind {
                        address: address.clone(),
                        error,
                    })?;
                info!(rank, %bound, "listening for {peer}");
                let handshakes = socket.monitor();
                let handshake_stop = stop.clone();
                let handshake_metrics = metrics.clone();
                supervisor.spawn(name, async move {
                    count_failed_handshakes(handshakes, address, handshake_metrics, handshake_stop)
                        .await;
                    Ok(())
                });
                up();
                supervisor.spawn(name, async move {
                    rank_task.run(socket, stop).await;
                    Ok(())
                });
            } else {
                if let Some(link) = self.link {
                    let links = socket.monitor();
                    let link = link.clone();
                    let link_stop = stop.clone();
                    supervisor.spawn(name, async move {
                        follow_link(links, link, link_stop).await;
                        Ok(())
                    });
                }
                let up = up.clone();
                let metrics = metrics.clone();
                info!(rank, "waiting for {peer} at {address}");
                supervisor.spawn(name, async move {
                    tokio::select! {
                        () = connect_until_up(&mut socket, &address, peer, &metrics) => {
                            info!(rank, %address, "{peer} connected");
                            up();
                            rank_task.run(socket, stop).await;
                        }
                        () = stop.cancelled() => {}
                    }
                    Ok(())
                });
            }
        }
        Ok(())
    }
}

/// A SUB socket subscribed to `topic`, not yet bound or connected.
async fn sub_socket(max_message_bytes: usize, topic: &str) -> Result<SubSocket, ZmqError> {
    let mut options = socket_options(max_message_bytes);
    options.no_connect_timeout();
    let mut socket = SubSocket::with_options(options);
    socket.subscribe(topic).await?;
    Ok(socket)
}

/// Counts a read error of a SUB socket reading `peer`, then pauses so that
/// a persistently failing socket cannot spin.
async fn socket_error(error: ZmqError, endpoint: &str, peer: &str, metrics: &Metrics) {
    if !record_dropped_peer(metrics, PeerSocket::Sub, endpoint, &error) {
        debug!(%endpoint, %error, "socket error reading {peer}; still listening");
    }
    tokio::time::sleep(ERROR_BACKOFF).await;
}

/// The next message on `socket`. A peer that breaks ZMTP or the size limit
/// costs its connection, never the socket: the error is counted and the
/// read goes on after a pause (so a persistently failing socket cannot spin).
pub(crate) async fn next_message(
    socket: &mut SubSocket,
    endpoint: &str,
    peer: &str,
    metrics: &Metrics,
) -> ZmqMessage {
    loop {
        match socket.recv().await {
            Ok(message) => return message,
            Err(error) => socket_error(error, endpoint, peer, metrics).await,
        }
    }
}

/// Counts the ranks that are connected or bound.
struct RanksUp {
    up: AtomicU32,
    of: u32,
    ready: watch::Sender<bool>,
}

impl RanksUp {
    fn one_more(&self) {
        if self.up.fetch_add(1, Ordering::Relaxed) + 1 == self.of {
            self.ready.send_replace(true);
        }
    }
}

/// Connects `socket` to `address`, retrying until it is up: the zeromq
/// crate waits out refused connections by itself but gives up on a failed
/// handshake, and a publisher that once fails one must not cost the rank.
/// After this, the socket reconnects on its own.
async fn connect_until_up(socket: &mut SubSocket, address: &str, peer: &str, metrics: &Metrics) {
    let mut backoff = CONNECT_BACKOFF_MIN;
    loop {
        match socket.connect(address).await {
            Ok(()) => return,
            Err(error) => {
                if !record_dropped_peer(metrics, PeerSocket::Sub, address, &error) {
                    warn!(%address, %error, "cannot connect to {peer}; retrying");
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(CONNECT_BACKOFF_MAX);
    }
}

const CONNECT_BACKOFF_MIN: Duration = Duration::from_millis(100);
const CONNECT_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Counts the engine-side peers a bound SUB dropped during the handshake
/// (the receive loop only sees errors after it), until the source stops.
async fn count_failed_handshakes(
    mut events: futures::channel::mpsc::Receiver<SocketEvent>,
    address: String,
    metrics: Metrics,
    stop: CancellationToken,
) {
    use futures::StreamExt;
    loop {
        tokio::select! {
            event = events.next() => match event {
                Some(SocketEvent::AcceptFailed(error)) => {
                    record_dropped_peer(&metrics, PeerSocket::Sub, &address, &error);
                }
                Some(_) => {}
                None => return,
            },
            () = stop.cancelled() => return,
        }
    }
}

/// Tells `link` each connection (true) and disconnection (false) of a
/// connecting socket, until the source stops.
async fn follow_link(
    mut events: futures::channel::mpsc::Receiver<SocketEvent>,
    link: watch::Sender<bool>,
    stop: CancellationToken,
) {
    use futures::StreamExt;
    loop {
        tokio::select! {
            event = events.next() => match event {
                Some(SocketEvent::Connected(..)) => {
                    link.send_replace(true);
                }
                Some(SocketEvent::Disconnected(_)) => {
                    link.send_replace(false);
                }
                Some(_) => {}
                None => return,
            },
            () = stop.cancelled() => return,
        }
    }
}

impl RankSocketTask for RankTask {
    fn run(self, socket: SubSocket, stop: CancellationToken) -> impl Future<Output = ()> + Send {
        self.run_rank(socket, stop)
    }
}

/// The receive loop of one rank.
struct RankTask {
    rank: u32,
    /// Where the SUB binds or connects, for the logs.
    endpoint: String,
    /// The topic every message must carry; `None`: any.
    topic: Option<Bytes>,
    replay: Option<ReplayClient>,
    events: mpsc::Sender<SourceEvent>,
    metrics: Metrics,
    /// This rank's accepted messages, resolved once.
    messages: Counter,
    cursor: PublisherCursor,
    /// Where an earlier kvgate process's record of this rank ended.
    resume: Option<ResumePoint>,
    /// Where the publisher moves, when the engine reports it.
    moves: Option<Moves>,
    /// Told while this rank fetches from its replay endpoint.
    replaying: Option<watch::Sender<bool>>,
}

/// What a rank needs to follow its publisher to another endpoint.
struct Moves {
    targets: watch::Receiver<RankTarget>,
    topic: String,
    max_message_bytes: usize,
    replay_timeout: Duration,
    replay_bounds: FetchBounds,
}

impl Moves {
    /// The next target, once the engine names another.
    async fn next(&mut self) -> RankTarget {
        if self.targets.changed().await.is_err() {
            // Nobody follows the engine any more: stay where we are.
            std::future::pending::<()>().await;
        }
        self.targets.borrow_and_update().clone()
    }
}

/// How resuming an earlier record went.
enum Resumed {
    /// The publisher is the one the record followed; the first live
    /// message, if one ended the ring's run, is not yet forwarded.
    Continued { first_live: Option<(u64, Bytes)> },
    /// The engine restarted since: the rank was cleared, prime it afresh.
    EngineRestarted,
}

/// Who is at the other end of the KV-event sockets, for the logs.
const ENGINE: &str = "the engine";

/// Pause after a socket error so a persistently failing socket cannot spin.
const ERROR_BACKOFF: Duration = Duration::from_millis(50);

/// Engine messages missing before a live one.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Hole {
    /// Between two live messages: whatever replay cannot give is lost.
    Gap(RangeInclusive<u64>),
    /// Before `next`, the first message since the publisher (re)started
    /// that was not primed. Numbers the ring no longer holds at its start
    /// precede kvgate's record (the drain reports them as `unknown_before`);
    /// only a break after what replay gives is lost.
    Opening { next: u64 },
}

impl Hole {
    fn missing(&self) -> Option<RangeInclusive<u64>> {
        match self {
            Self::Gap(missing) => Some(missing.clone()),
            Self::Opening { next } => next.checked_sub(1).map(|last| 0..=last),
        }
    }

    /// `recovered` is what a fetch of [`Self::missing`] returned.
    fn lost(&self, recovered: &Replayed) -> u64 {
        match self {
            Self::Gap(missing) => missing.end() - missing.start() + 1 - recovered.count,
            Self::Opening { next } => recovered.last.map_or(0, |last| next - 1 - last),
        }
    }
}

impl RankTask {
    fn new(
        rank: u32,
        endpoint: String,
        topic: Option<Bytes>,
        replay: Option<ReplayClient>,
        events: mpsc::Sender<SourceEvent>,
        metrics: Metrics,
    ) -> Self {
        Self {
            rank,
            endpoint,
            topic,
            replay,
            events,
            messages: metrics.rank_messages(rank),
            metrics,
            cursor: PublisherCursor::default(),
            resume: None,
            moves: None,
            replaying: None,
        }
    }

    async fn run_rank(mut self, mut socket: SubSocket, stop: CancellationToken) {
        let mut moves = self.moves.take();
        loop {
            let moved = async {
                match moves.as_mut() {
                    Some(moves) => moves.next().await,
                    None => std::future::pending().await,
                }
            };
            // Stopping may cut a replay short: what it would have given is
            // moot; so may a move: the publisher it came from is gone.
            tokio::select! {
                DrainGone = self.serve(&mut socket) => break,
                () = stop.cancelled() => break,
                target = moved => {
                    socket.close().await;
                    let Some(moves) = moves.as_ref() else { return };
                    match self.move_to(target, moves, &stop).await {
                        Some(moved) => socket = moved,
                        None => return,
                    }
                }
            }
        }
        socket.close().await;
    }

    /// Follows the publisher to `target`: an engine on other ports is a
    /// restarted engine, so the rank is cleared and primed afresh there.
    /// `None` when kvgate stops meanwhile.
    async fn move_to(
        &mut self,
        target: RankTarget,
        moves: &Moves,
        stop: &CancellationToken,
    ) -> Option<SubSocket> {
        info!(rank = self.rank, from = %self.endpoint, to = %target.endpoint, "following the engine's publisher");
        self.endpoint = target.endpoint;
        self.replay = target.replay.map(|address| {
            ReplayClient::new(
                address,
                self.topic.clone(),
                moves.replay_timeout,
                moves.replay_bounds,
                moves.max_message_bytes,
            )
        });
        self.cursor = PublisherCursor::default();
        self.metrics.engine_restarts.inc();
        let restarted = SourceEvent::PublisherRestarted { rank: self.rank };
        send(&self.events, restarted).await.ok()?;
        let mut socket = sub_socket(moves.max_message_bytes, &moves.topic)
            .await
            .ok()?;
        tokio::select! {
            () = connect_until_up(&mut socket, &self.endpoint, ENGINE, &self.metrics) => Some(socket),
            () = stop.cancelled() => None,
        }
    }

    /// Runs until the drain is gone. The SUB is not read while a hole is
    /// filled: the zeromq crate resubscribes after a reconnect on its own
    /// (not on the next read, as libzmq does) and the publisher queues
    /// meanwhile, so live messages are delayed, not lost.
    async fn serve(&mut self, socket: &mut SubSocket) -> DrainGone {
        let first_live = match self.prime(socket).await {
            Ok(first_live) => first_live,
            Err(gone) => return gone,
        };
        if let Some((engine_sequence, payload)) = first_live
            && let Err(gone) = self.forward(engine_sequence, payload).await
        {
            return gone;
        }
        loop {
            let message = next_message(socket, &self.endpoint, ENGINE, &self.metrics).await;
            if let Some((engine_sequence, payload)) = self.parse(message)
                && let Err(gone) = self.forward(engine_sequence, payload).await
            {
                return gone;
            }
        }
    }

    /// Forwards the replay ring's content so the state covers what the
    /// engine stored before kvgate joined, or, resuming an earlier record,
    /// what the engine published since. The first message the SUB delivers
    /// meanwhile ends priming there (see [`Self::fetch_beside_live`]) and
    /// is returned, not yet forwarded.
    async fn prime(&mut self, socket: &mut SubSocket) -> Result<Option<(u64, Bytes)>, DrainGone> {
        if let Some(point) = self.resume.take() {
            match self.resume_from(point, socket).await? {
                Resumed::Continued { first_live } => return Ok(first_live),
                Resumed::EngineRestarted => {}
            }
        }
        let Some(replay) = &self.replay else {
            return Ok(None);
        };
        let _replaying = Replaying::start(self.replaying.as_ref());
        let mut fetch = replay.fetch(0..=u64::MAX);
        let mut run = Vec::new();
        let first_live = self.fetch_beside_live(&mut fetch, &mut run, socket).await?;
        let primed = fetch.finish();
        if let Some(error) = &primed.stopped {
            self.count_replay_stop(error);
            warn!(rank = self.rank, replay = replay.address(), %error, "priming from the replay endpoint broke off");
        }
        match (primed.first, primed.last) {
            (Some(first), Some(last)) => info!(
                rank = self.rank,
                first, last, "primed from the replay endpoint"
            ),
            _ => info!(
                rank = self.rank,
                "primed from the replay endpoint: it held no message"
            ),
        }
        self.cursor.prime(&run);
        Ok(first_live)
    }

    /// Continues the record that ended at `point`. Once the ring proves the
    /// publisher is the same, what follows is forwarded like priming's run:
    /// up to the first live message, returned not yet forwarded.
    async fn resume_from(
        &mut self,
        point: ResumePoint,
        socket: &mut SubSocket,
    ) -> Result<Resumed, DrainGone> {
        let Some(replay) = &self.replay else {
            self.cursor.resume(point.last);
            return Ok(Resumed::Continued { first_live: None });
        };
        let mut fetch = replay.fetch(point.last..=u64::MAX);
        let mut run = Vec::new();
        let mut first_live = None;
        match fetch.next().await {
            Some((sequence, payload)) if sequence == point.last => {
                if !point.is(sequence, &payload) {
                    info!(
                        rank = self.rank,
                        engine_sequence = point.last,
                        "engine publisher restarted while kvgate was down"
                    );
                    self.metrics.engine_restarts.inc();
                    send(
                        &self.events,
                        SourceEvent::PublisherRestarted { rank: self.rank },
                    )
                    .await?;
                    return Ok(Resumed::EngineRestarted);
                }
                run.push((sequence, payload));
                first_live = self.fetch_beside_live(&mut fetch, &mut run, socket).await?;
                info!(
                    rank = self.rank,
                    last = point.last,
                    recovered = run.len() - 1,
                    "resumed the engine publisher where kvgate's record ended"
                );
                self.cursor.prime(&run);
            }
            // The ring no longer holds it (or holds nothing): the next live
            // number tells a gap (filled from the ring, the rest counted
            // lost) from a restart.
            _ => self.cursor.resume(point.last),
        }
        if let Some(error) = &fetch.finish().stopped {
            self.count_replay_stop(error);
        }
        Ok(Resumed::Continued { first_live })
    }

    /// Forwards `fetch`'s run as it arrives, keeping it in `run` (the
    /// cursor tells the live copies of these from a restarted engine's
    /// messages by their payloads; the fetch's byte bound bounds them).
    /// The SUB is read meanwhile up to its first message, which ends the
    /// fetch before it: however long the ring (or an endpoint that never
    /// stops answering), live messages wait for no more than what precedes
    /// them. Returns that first live message, not yet forwarded.
    async fn fetch_beside_live(
        &self,
        fetch: &mut Fetch<'_>,
        run: &mut Vec<(u64, Bytes)>,
        socket: &mut SubSocket,
    ) -> Result<Option<(u64, Bytes)>, DrainGone> {
        let mut first_live = None;
        loop {
            tokio::select! {
                replayed = fetch.next() => {
                    let Some((engine_sequence, payload)) = replayed else {
                        return Ok(first_live);
                    };
                    run.push((engine_sequence, payload.clone()));
                    self.metrics.engine_messages_recovered.inc();
                    self.send_message(engine_sequence, payload).await?;
                }
                received = socket.recv(), if first_live.is_none() => match received {
                    Ok(message) => {
                        if let Some((engine_sequence, payload)) = self.parse(message) {
                            fetch.end_before(engine_sequence);
                            first_live = Some((engine_sequence, payload));
                        }
                    }
                    Err(error) => socket_error(error, &self.endpoint, ENGINE, &self.metrics).await,
                },
            }
        }
    }

    /// The message's engine sequence and payload, or `None` (counted and
    /// skipped) when its framing is wrong.
    fn parse(&self, message: ZmqMessage) -> Option<(u64, Bytes)> {
        match parse_frames(message, self.topic.as_deref()) {
            Ok(parts) => {
                self.messages.inc();
                Some(parts)
            }
            Err(error) => {
                self.metrics.count_bad_message(error.as_str());
                warn_limited(self.rank, error.as_str());
                None
            }
        }
    }

    async fn forward(&mut self, engine_sequence: u64, payload: Bytes) -> Result<(), DrainGone> {
        let hole = match self.cursor.observe(engine_sequence, &payload) {
            Continuity::Echo => {
                debug!(
                    rank = self.rank,
                    engine_sequence, "skipped a live copy of a primed message"
                );
                return Ok(());
            }
            Continuity::Follows => None,
            Continuity::First => Some(Hole::Opening {
                next: engine_sequence,
            }),
            Continuity::Gap { missing } => Some(Hole::Gap(missing)),
            Continuity::Restarted => {
                info!(
                    rank = self.rank,
                    engine_sequence, "engine publisher restarted"
                );
                self.metrics.engine_restarts.inc();
                let restarted = SourceEvent::PublisherRestarted { rank: self.rank };
                send(&self.events, restarted).await?;
                // The SUB may have joined the new publisher late.
                Some(Hole::Opening {
                    next: engine_sequence,
                })
            }
            Continuity::Jumped => {
                self.count_jump(engine_sequence);
                let restarted = SourceEvent::PublisherRestarted { rank: self.rank };
                send(&self.events, restarted).await?;
                // Whatever the numbers between meant, no replay holds them.
                None
            }
        };
        if let Some(hole) = hole {
            self.recover(hole).await?;
        }
        self.send_message(engine_sequence, payload).await
    }

    /// Forwards what replay still holds of `hole`, as it arrives, and counts
    /// the rest.
    async fn recover(&mut self, hole: Hole) -> Result<(), DrainGone> {
        let Some(missing) = hole.missing() else {
            return Ok(());
        };
        let _replaying = Replaying::start(self.replaying.as_ref());
        let recovered = match &self.replay {
            Some(replay) => {
                let mut fetch = replay.fetch(missing.clone());
                while let Some((engine_sequence, payload)) = fetch.next().await {
                    self.metrics.engine_messages_recovered.inc();
                    self.send_message(engine_sequence, payload).await?;
                }
                let recovered = fetch.finish();
                if let Some(error) = &recovered.stopped {
                    self.count_replay_stop(error);
                    warn!(rank = self.rank, replay = replay.address(), ?missing, %error, "replay broke off");
                }
                recovered
            }
            None => Replayed::default(),
        };
        let count = recovered.count;
        let mut lost = hole.lost(&recovered);
        if lost > MAX_PLAUSIBLE_GAP {
            // The live message's number is that far past the replay ring's
            // last: a jump, not that many lost messages.
            self.count_jump(*missing.end() + 1);
            lost = 0;
        }
        self.metrics.engine_messages_lost.inc_by(lost);
        if lost > 0 {
            warn!(
                rank = self.rank,
                ?missing,
                recovered = count,
                lost,
                "engine messages lost"
            );
        } else if count > 0 {
            info!(
                rank = self.rank,
                ?missing,
                recovered = count,
                "engine messages recovered from replay"
            );
        }
        Ok(())
    }

    fn count_jump(&self, engine_sequence: u64) {
        self.metrics.engine_sequence_jumps.inc();
        crate::logging::rate_limited("engine_sequence_jump", || {
            warn!(
                rank = self.rank,
                engine_sequence,
                "the engine's message counter leapt more than {MAX_PLAUSIBLE_GAP} ahead: \
                 taken as a restart, not as lost messages (logged at most once a second; \
                 kvgate_engine_sequence_jumps_total counts them all)"
            );
        });
    }

    fn count_replay_stop(&self, stopped: &ReplayError) {
        match stopped {
            ReplayError::PeerDropped { reason, .. } => self
                .metrics
                .count_dropped_peer(PeerSocket::Replay.as_str(), reason.as_str()),
            ReplayError::Bounded(bound) => self.metrics.count_bounded_fetch(bound.as_str()),
            _ => {}
        }
    }

    async fn send_message(&self, engine_sequence: u64, payload: Bytes) -> Result<(), DrainGone> {
        let message = EngineMessage {
            rank: self.rank,
            engine_sequence,
            payload,
        };
        send(&self.events, SourceEvent::Message(message)).await
    }
}

/// Logs a malformed message at most once per second per rank and reason, so a
/// publisher spewing garbage cannot flood the log (the metric counts them all).
fn warn_limited(rank: u32, reason: &'static str) {
    crate::logging::rate_limited(reason, || {
        warn!(rank, reason, "skipped a malformed engine message");
    });
}

#[cfg(test)]
mod tests {
    use tokio::time::{Instant, timeout};

    use super::*;
    use kvgate_sim::{EndlessReplay, EnginePublisher, PublisherOptions};

    /// Upper bound on any single wait; the conditions themselves are awaited.
    const WAIT: Duration = Duration::from_secs(10);

    const TEST_MAX_MESSAGE_BYTES: usize = crate::source::peer::DEFAULT_MAX_MESSAGE_BYTES as usize;

    #[derive(Debug, PartialEq, Eq)]
    enum Seen {
        Message(u64, Bytes),
        Restarted,
    }

    fn seen(event: SourceEvent) -> Seen {
        match event {
            SourceEvent::Message(message) => {
                Seen::Message(message.engine_sequence, message.payload)
            }
            SourceEvent::PublisherRestarted { .. } => Seen::Restarted,
            other => panic!("a ZMQ source never sends {other:?}"),
        }
    }

    fn payload(name: &str) -> Bytes {
        Bytes::from(name.to_owned())
    }

    /// A rank task on a SUB that already receives everything `publisher`
    /// sends, so the tests decide what the SUB holds when the task starts.
    struct Harness {
        publisher: EnginePublisher,
        socket: Option<SubSocket>,
        events: mpsc::Receiver<SourceEvent>,
        sender: mpsc::Sender<SourceEvent>,
        metrics: Metrics,
        stop: CancellationToken,
    }

    impl Harness {
        async fn new() -> Self {
            let options = PublisherOptions {
                replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
                ..PublisherOptions::default()
            };
            let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &options)
                .await
                .unwrap();
            let mut socket = SubSocket::new();
            socket.connect(publisher.endpoint()).await.unwrap();
            socket.subscribe("").await.unwrap();
            // Slow joiner: warm up until a message arrives, then read to the last.
            let deadline = Instant::now() + WAIT;
            'subscribed: loop {
                assert!(Instant::now() < deadline, "the subscription never arrived");
                let last = publisher.publish(payload("warm-up")).await.unwrap();
                if let Ok(received) = timeout(Duration::from_millis(20), socket.recv()).await {
                    let mut received = received.unwrap();
                    loop {
                        let (seq, _) = parse_frames(received, Some(b"")).unwrap();
                        if seq == last {
                            break 'subscribed;
                        }
                        received = socket.recv().await.unwrap();
                    }
                }
            }
            let (sender, events) = mpsc::channel(1024);
            Self {
                publisher,
                socket: Some(socket),
                events,
                sender,
                metrics: Metrics::default(),
                stop: CancellationToken::new(),
            }
        }

        fn replay(&self, timeout: Duration) -> ReplayClient {
            let address = self.publisher.replay_endpoint().unwrap().to_owned();
            ReplayClient::new(
                address,
                Some(Bytes::new()),
                timeout,
                FetchBounds::default(),
                TEST_MAX_MESSAGE_BYTES,
            )
        }

        fn start(&mut self, replay: Option<ReplayClient>) {
            self.start_resuming(replay, None);
        }

        /// Starts the task as a restarted kvgate would, continuing a record
        /// that ended at `resume`.
        fn start_resuming(&mut self, replay: Option<ReplayClient>, resume: Option<ResumePoint>) {
            let mut task = RankTask::new(
                0,
                self.publisher.endpoint().to_owned(),
                Some(Bytes::new()),
                replay,
                self.sender.clone(),
                self.metrics.clone(),
            );
            task.resume = resume;
            let socket = self.socket.take().expect("started once");
            tokio::spawn(task.run_rank(socket, self.stop.clone()));
        }

        /// Every event up to and including the message numbered `seq`.
        /// Publishes `a`, loses `b` in transit, publishes `c`: the source
        /// forwards `a` then `c`, whatever it could recover of `b`.
        async fn a_then_c_with_b_lost(&mut self) {
            let first = self.publisher.publish(payload("a")).await.unwrap();
            assert_eq!(
                self.until(first).await,
                [Seen::Message(first, payload("a"))]
            );
            self.publisher.lose_in_transit(payload("b"));
            let last = self.publisher.publish(payload("c")).await.unwrap();
            assert_eq!(self.until(last).await, [Seen::Message(last, payload("c"))]);
        }

        async fn until(&mut self, seq: u64) -> Vec<Seen> {
            let mut events = Vec::new();
            loop {
                let event = timeout(WAIT, self.events.recv())
                    .await
                    .expect("an event in time")
                    .expect("the task is running");
                let event = seen(event);
                let done = matches!(event, Seen::Message(got, _) if got == seq);
                events.push(event);
                if done {
                    return events;
                }
            }
        }
    }

    impl Drop for Harness {
        fn drop(&mut self) {
            self.stop.cancel();
        }
    }

    fn numbers(events: &[Seen]) -> Vec<Option<u64>> {
        events
            .iter()
            .map(|event| match event {
                Seen::Message(seq, _) => Some(*seq),
                Seen::Restarted => None,
            })
            .collect()
    }

    #[tokio::test]
    async fn priming_forwards_the_ring_up_to_the_first_live_message_and_nothing_twice() {
        let mut harness = Harness::new().await;
        // The SUB holds these too: they went out live before the task started.
        let a = harness.publisher.publish(payload("a")).await.unwrap();
        let b = harness.publisher.publish(payload("b")).await.unwrap();
        harness.start(Some(harness.replay(crate::source::replay::DEFAULT_TIMEOUT)));
        let primed = harness.until(b).await;
        assert_eq!(numbers(&primed), (0..=b).map(Some).collect::<Vec<_>>());

        let c = harness.publisher.publish(payload("c")).await.unwrap();
        assert_eq!(harness.until(c).await, [Seen::Message(c, payload("c"))]);
        // Only the ring had what came before `a`; `a` and `b` come from
        // whichever of the ring and the SUB got there first.
        let recovered = harness.metrics.engine_messages_recovered.get();
        assert!((a..=b + 1).contains(&recovered), "{recovered}");
        assert_eq!(harness.metrics.engine_messages_lost.get(), 0);
    }

    #[tokio::test]
    async fn a_replay_endpoint_that_never_stops_answering_holds_back_no_live_message() {
        let mut harness = Harness::new().await;
        let endless = EndlessReplay::bind("tcp://127.0.0.1:0", Bytes::new(), 1000, payload("junk"))
            .await
            .unwrap();
        let bounds = FetchBounds {
            time: Duration::from_secs(60),
            ..FetchBounds::default()
        };
        // The SUB holds `a` when the task starts.
        let a = harness.publisher.publish(payload("a")).await.unwrap();
        harness.start(Some(ReplayClient::new(
            endless.endpoint().to_owned(),
            Some(Bytes::new()),
            crate::source::replay::DEFAULT_TIMEOUT,
            bounds,
            TEST_MAX_MESSAGE_BYTES,
        )));
        // Priming ends where the live messages begin, long before the bound.
        let primed = harness.until(a).await;
        assert_eq!(numbers(&primed), (0..=a).map(Some).collect::<Vec<_>>());
        assert_eq!(primed.last(), Some(&Seen::Message(a, payload("a"))));

        // A gap is bounded by the message that revealed it.
        harness.publisher.skip(3);
        let b = harness.publisher.publish(payload("b")).await.unwrap();
        let filled = harness.until(b).await;
        assert_eq!(numbers(&filled), (a + 1..=b).map(Some).collect::<Vec<_>>());
        assert_eq!(harness.metrics.engine_messages_lost.get(), 0);
    }

    #[tokio::test]
    async fn a_resumed_rank_whose_replay_endpoint_never_stops_answering_holds_back_no_live_message()
    {
        let mut harness = Harness::new().await;
        let junk = payload("junk");
        let endless = EndlessReplay::bind("tcp://127.0.0.1:0", Bytes::new(), 1000, junk.clone())
            .await
            .unwrap();
        let bounds = FetchBounds {
            time: Duration::from_secs(60),
            ..FetchBounds::default()
        };
        // The earlier record ended at message 0, which the ring proves by
        // its bytes; the SUB holds `a`, thousands of messages later, so the
        // ring's run cannot reach it before the SUB delivers it.
        harness.publisher.skip(5_000);
        let a = harness.publisher.publish(payload("a")).await.unwrap();
        harness.start_resuming(
            Some(ReplayClient::new(
                endless.endpoint().to_owned(),
                Some(Bytes::new()),
                crate::source::replay::DEFAULT_TIMEOUT,
                bounds,
                TEST_MAX_MESSAGE_BYTES,
            )),
            Some(ResumePoint::of(0, &junk)),
        );
        // What follows the record comes from the ring up to where the live
        // messages begin, long before the bound; then `a` itself, live.
        let resumed = harness.until(a).await;
        assert_eq!(numbers(&resumed), (1..=a).map(Some).collect::<Vec<_>>());
        assert_eq!(resumed.last(), Some(&Seen::Message(a, payload("a"))));

        let b = harness.publisher.publish(payload("b")).await.unwrap();
        assert_eq!(harness.until(b).await, [Seen::Message(b, payload("b"))]);
        assert_eq!(harness.metrics.engine_restarts.get(), 0);
        assert_eq!(harness.metrics.engine_messages_lost.get(), 0);
    }

    #[tokio::test]
    async fn an_engine_restarted_while_primed_numbers_are_pending_is_a_restart_not_an_echo() {
        let mut harness = Harness::new().await;
        let a = harness.publisher.publish(payload("a")).await.unwrap();
        harness.start(Some(harness.replay(crate::source::replay::DEFAULT_TIMEOUT)));
        harness.until(a).await;

        harness.publisher.restart();
        harness.publisher.lose_in_transit(payload("new 0"));
        harness.publisher.publish(payload("new 1")).await.unwrap();
        // The SUB still holds the live copy of `a` (an echo) before these.
        assert_eq!(
            harness.until(1).await,
            [
                Seen::Restarted,
                Seen::Message(0, payload("new 0")),
                Seen::Message(1, payload("new 1")),
            ]
        );
        assert_eq!(harness.metrics.engine_restarts.get(), 1);
    }

    #[tokio::test]
    async fn a_gap_is_filled_from_replay_before_the_message_that_revealed_it() {
        let mut harness = Harness::new().await;
        harness.start(Some(harness.replay(crate::source::replay::DEFAULT_TIMEOUT)));
        let first = harness.publisher.publish(payload("x1")).await.unwrap();
        harness.until(first).await;
        let recovered_before = harness.metrics.engine_messages_recovered.get();

        harness.publisher.lose_in_transit(payload("x2"));
        harness.publisher.lose_in_transit(payload("x3"));
        harness.publisher.publish(payload("x4")).await.unwrap();
        harness.publisher.skip(2);
        let last = harness.publisher.publish(payload("x5")).await.unwrap();

        assert_eq!(
            harness.until(last).await,
            [
                Seen::Message(first + 1, payload("x2")),
                Seen::Message(first + 2, payload("x3")),
                Seen::Message(first + 3, payload("x4")),
                Seen::Message(last, payload("x5")),
            ]
        );
        assert_eq!(
            harness.metrics.engine_messages_recovered.get() - recovered_before,
            2
        );
        assert_eq!(harness.metrics.engine_messages_lost.get(), 2);
    }

    #[tokio::test]
    async fn without_a_replay_endpoint_gaps_are_counted_and_nothing_is_primed() {
        let mut harness = Harness::new().await;
        harness.start(None);
        harness.a_then_c_with_b_lost().await;
        assert_eq!(harness.metrics.engine_messages_lost.get(), 1);
        assert_eq!(harness.metrics.engine_messages_recovered.get(), 0);
    }

    #[tokio::test]
    async fn a_replay_endpoint_that_never_answers_delays_each_hole_by_its_timeout_at_most() {
        let mut harness = Harness::new().await;
        let mut silent = zeromq::RouterSocket::new();
        let address = silent.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let timeout = Duration::from_millis(300);
        harness.start(Some(ReplayClient::new(
            address,
            Some(Bytes::new()),
            timeout,
            FetchBounds::default(),
            TEST_MAX_MESSAGE_BYTES,
        )));

        // Priming and the hole before `a` each wait out the timeout, and
        // then the live stream goes on.
        harness.a_then_c_with_b_lost().await;
        assert_eq!(harness.metrics.engine_messages_lost.get(), 1);
    }
}
