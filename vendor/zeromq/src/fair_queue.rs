//! Messages from every peer of a socket, each peer in turn, in the order
//! their connections became readable.
//!
//! Streams live in slots; a slot is ready at most once in `ready`, and a
//! stream's waker (made once per stream, not per poll) names its slot and
//! the stream's generation, so a wake for a stream since removed or
//! replaced is ignored, and a message costs no allocation and no hashing
//! of its peer's key: keys are looked up only to insert or remove a peer.

use futures::task::{waker_ref, ArcWake};
use futures::Stream;
use parking_lot::Mutex;

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};

pub(crate) struct QueueInner<S, K: Clone> {
    /// Each key's slot, for inserting and removing by key.
    places: HashMap<K, usize>,
    slots: Vec<Slot<S, K>>,
    /// Slots with no stream, for the next insert.
    vacant: Vec<usize>,
    /// Slots to poll, in the order their streams became ready, each once.
    ready: VecDeque<usize>,
    /// The generation the next inserted stream gets: never reused, so a
    /// waker outliving its stream can never mark another one ready.
    next_generation: u64,
    waker: Option<Waker>,
    /// Callback invoked when a stream ends (peer disconnected).
    /// Wrapped in Arc so it can be cloned and called outside the lock.
    on_disconnect: Option<Arc<dyn Fn(K) + Send + Sync>>,
}

struct Slot<S, K: Clone> {
    key: Option<K>,
    /// None while the slot is vacant, and while its stream is being polled
    /// (outside the lock).
    stream: Option<Pin<Box<S>>>,
    generation: u64,
    /// Whether the slot is in `ready`.
    queued: bool,
    /// The stream's waker, made at its first poll.
    waker: Option<Arc<StreamWaker<S, K>>>,
}

impl<S, K: Clone + Eq + Hash> QueueInner<S, K> {
    fn new() -> Self {
        Self {
            places: HashMap::new(),
            slots: Vec::new(),
            vacant: Vec::new(),
            ready: VecDeque::new(),
            next_generation: 0,
            waker: None,
            on_disconnect: None,
        }
    }

    pub fn insert(&mut self, k: K, s: S) {
        if let Some(old) = self.places.remove(&k) {
            self.vacate(old);
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        let slot = Slot {
            key: Some(k.clone()),
            stream: Some(Box::pin(s)),
            generation,
            queued: false,
            waker: None,
        };
        let index = if let Some(index) = self.vacant.pop() {
            // A vacated slot may still be in `ready`; it stays there once.
            let queued = self.slots[index].queued;
            self.slots[index] = Slot { queued, ..slot };
            index
        } else {
            self.slots.push(slot);
            self.slots.len() - 1
        };
        self.places.insert(k, index);
        self.mark_ready(index, generation);
        if let Some(w) = &self.waker {
            w.wake_by_ref();
        }
    }

    pub fn remove(&mut self, k: &K) {
        if let Some(index) = self.places.remove(k) {
            self.vacate(index);
        }
    }

    /// Clear all streams and the ready queue.
    ///
    /// Used during shutdown to ensure TCP connections are closed even when
    /// other components (like reconnect tasks) hold Arc references to the inner.
    pub fn clear(&mut self) {
        self.places.clear();
        self.slots.clear();
        self.vacant.clear();
        self.ready.clear();
        // Wake the waker so any pending poll_next returns
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    fn vacate(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        slot.key = None;
        slot.stream = None;
        slot.waker = None;
        // No stream has this generation any more.
        slot.generation = u64::MAX;
        self.vacant.push(index);
    }

    /// The slot at `index` if it still belongs to the stream of
    /// `generation`: not vacated, refilled or cleared since.
    fn slot_of(&mut self, index: usize, generation: u64) -> Option<&mut Slot<S, K>> {
        self.slots
            .get_mut(index)
            .filter(|slot| slot.generation == generation)
    }

    /// Queues the slot if it still holds the stream of `generation` and is
    /// not queued yet; says whether it did.
    fn mark_ready(&mut self, index: usize, generation: u64) -> bool {
        match self.slot_of(index, generation) {
            Some(slot) if !slot.queued => {
                slot.queued = true;
                self.ready.push_back(index);
                true
            }
            _ => false,
        }
    }

    /// Puts back a stream polled outside the lock, unless its slot was
    /// vacated (or cleared) meanwhile; says whether it did.
    fn restore(&mut self, index: usize, generation: u64, stream: Pin<Box<S>>) -> bool {
        self.slot_of(index, generation)
            .map(|slot| slot.stream = Some(stream))
            .is_some()
    }
}

#[cfg(test)]
impl<S, K: Clone + Eq + Hash> QueueInner<S, K> {
    fn streams_mut(&mut self) -> impl Iterator<Item = &mut Pin<Box<S>>> {
        self.slots
            .iter_mut()
            .filter_map(|slot| slot.stream.as_mut())
    }

    fn stream_mut(&mut self, k: &K) -> Option<&mut Pin<Box<S>>> {
        let index = *self.places.get(k)?;
        self.slots[index].stream.as_mut()
    }
}

pub struct FairQueue<S, K: Clone> {
    block_on_no_clients: bool,
    inner: Arc<Mutex<QueueInner<S, K>>>,
}

/// Wakes the queue's task for one stream, and queues that stream's slot.
struct StreamWaker<S, K: Clone> {
    /// Weak: the queue owns the wakers of its streams.
    queue: Weak<Mutex<QueueInner<S, K>>>,
    index: usize,
    generation: u64,
}

impl<S, K> ArcWake for StreamWaker<S, K>
where
    S: Send,
    K: Clone + Eq + Hash + Send + Sync,
{
    fn wake_by_ref(arc_self: &Arc<Self>) {
        let Some(queue) = arc_self.queue.upgrade() else {
            return;
        };
        let mut inner = queue.lock();
        // The queue's waker is kept, not taken: the task's next poll then
        // finds it current and clones nothing.
        if inner.mark_ready(arc_self.index, arc_self.generation) {
            if let Some(waker) = &inner.waker {
                waker.wake_by_ref();
            }
        }
    }
}

impl<S, T, K> Stream for FairQueue<S, K>
where
    T: Send,
    S: Stream<Item = T> + Send + 'static,
    K: Eq + Hash + Unpin + Clone + Send + Sync + 'static,
{
    type Item = (K, T);

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let fair_queue = self.get_mut();
        let mut inner = fair_queue.inner.lock();
        if !inner
            .waker
            .as_ref()
            .is_some_and(|waker| waker.will_wake(cx.waker()))
        {
            inner.waker = Some(cx.waker().clone());
        }
        // Only the slots ready now: a stream that becomes ready while it is
        // polled waits for the next call rather than being polled again in
        // this one.
        let mut remaining_ready = inner.ready.len();
        while remaining_ready > 0 {
            remaining_ready -= 1;
            let Some(index) = inner.ready.pop_front() else {
                break;
            };
            let slot = &mut inner.slots[index];
            slot.queued = false;
            let Some(mut io_stream) = slot.stream.take() else {
                continue;
            };
            let generation = slot.generation;
            let key = slot.key.clone().expect("a slot with a stream has its key");
            let waker = Arc::clone(slot.waker.get_or_insert_with(|| {
                Arc::new(StreamWaker {
                    queue: Arc::downgrade(&fair_queue.inner),
                    index,
                    generation,
                })
            }));
            drop(inner);
            let polled = io_stream
                .as_mut()
                .poll_next(&mut Context::from_waker(&waker_ref(&waker)));
            inner = fair_queue.inner.lock();
            match polled {
                Poll::Ready(Some(res)) => {
                    // It may hold more: poll it again in its turn.
                    if inner.restore(index, generation, io_stream) {
                        inner.mark_ready(index, generation);
                    }
                    return Poll::Ready(Some((key, res)));
                }
                Poll::Ready(None) => {
                    // Peer disconnected. Don't put the stream back. A slot
                    // vacated or refilled meanwhile was removed, replaced or
                    // cleared by the socket itself, which needs no telling
                    // (and told, would drop the peer now under that key).
                    let ended_here = inner.slot_of(index, generation).is_some();
                    if ended_here {
                        inner.places.remove(&key);
                        inner.vacate(index);
                    }
                    // Call the callback outside the lock (to avoid deadlock
                    // if it accesses inner).
                    if let Some(callback) = inner.on_disconnect.clone().filter(|_| ended_here) {
                        drop(inner);
                        callback(key);
                        inner = fair_queue.inner.lock();
                    }
                    // Go on polling the other streams rather than end here.
                }
                Poll::Pending => {
                    inner.restore(index, generation, io_stream);
                }
            }
        }

        let should_wake = !inner.ready.is_empty();
        let result = if !inner.places.is_empty() || fair_queue.block_on_no_clients {
            Poll::Pending
        } else {
            Poll::Ready(None)
        };
        drop(inner);

        if should_wake {
            cx.waker().wake_by_ref();
        }
        result
    }
}

impl<S, K: Clone + Eq + Hash> FairQueue<S, K> {
    pub fn new(block_on_no_clients: bool) -> Self {
        Self {
            block_on_no_clients,
            inner: Arc::new(Mutex::new(QueueInner::new())),
        }
    }

    /// Set a callback to be invoked when a stream ends (peer disconnected).
    ///
    /// The callback receives the key of the disconnected stream.
    pub fn set_on_disconnect<F>(&mut self, callback: F)
    where
        F: Fn(K) + Send + Sync + 'static,
    {
        self.inner.lock().on_disconnect = Some(Arc::new(callback));
    }

    pub(crate) fn inner(&self) -> Arc<Mutex<QueueInner<S, K>>> {
        self.inner.clone()
    }
}

#[cfg(test)]
mod test {
    use crate::async_rt;
    use crate::fair_queue::FairQueue;
    use futures::task::noop_waker;
    use futures::Future;
    use futures::{stream, Stream, StreamExt};
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// Test stream that yields Pending for the first N polls, then emits messages FIFO
    struct TestStream {
        pending_polls: usize,
        messages: VecDeque<&'static str>,
    }

    struct CountPendingStream {
        poll_count: usize,
    }

    struct WakePendingStream {
        poll_count: usize,
    }

    struct WakeThenReadyStream {
        poll_count: usize,
        message: Option<&'static str>,
    }

    impl TestStream {
        fn new(pending_polls: usize, messages: &[&'static str]) -> Self {
            Self {
                pending_polls,
                messages: messages.iter().copied().collect(),
            }
        }

        fn ready(messages: &[&'static str]) -> Self {
            Self::new(0, messages)
        }

        fn pending_once(messages: &[&'static str]) -> Self {
            Self::new(1, messages)
        }
    }

    impl Stream for CountPendingStream {
        type Item = &'static str;

        fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            self.get_mut().poll_count += 1;
            Poll::Pending
        }
    }

    impl Stream for WakePendingStream {
        type Item = &'static str;

        fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            self.get_mut().poll_count += 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    impl Stream for WakeThenReadyStream {
        type Item = &'static str;

        fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            let this = self.get_mut();
            this.poll_count += 1;
            if this.poll_count == 1 {
                cx.waker().wake_by_ref();
                Poll::Pending
            } else {
                Poll::Ready(this.message.take())
            }
        }
    }

    impl Stream for TestStream {
        type Item = &'static str;

        fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            let this = self.get_mut();
            if this.pending_polls > 0 {
                this.pending_polls -= 1;
                return Poll::Pending;
            }
            Poll::Ready(this.messages.pop_front())
        }
    }

    enum UnifiedStream {
        Test(TestStream),
        CountPending(CountPendingStream),
        WakePending(WakePendingStream),
    }

    impl Stream for UnifiedStream {
        type Item = &'static str;

        fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            match self.get_mut() {
                UnifiedStream::Test(stream) => Pin::new(stream).poll_next(cx),
                UnifiedStream::CountPending(stream) => Pin::new(stream).poll_next(cx),
                UnifiedStream::WakePending(stream) => Pin::new(stream).poll_next(cx),
            }
        }
    }

    /// Ready with `message` at every poll; keeps the waker of each poll.
    struct WakerKeepingStream {
        wakers: std::sync::Arc<std::sync::Mutex<Vec<std::task::Waker>>>,
        message: Option<&'static str>,
    }

    impl Stream for WakerKeepingStream {
        type Item = &'static str;

        fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            self.wakers.lock().unwrap().push(cx.waker().clone());
            match self.message {
                Some(message) => Poll::Ready(Some(message)),
                None => Poll::Pending,
            }
        }
    }

    #[test]
    fn a_stream_is_polled_with_the_same_waker_every_time() {
        let waker = noop_waker();
        let mut cx = Context::from_waker(&waker);
        let wakers = std::sync::Arc::default();
        let mut fair_queue: FairQueue<WakerKeepingStream, &str> = FairQueue::new(false);
        fair_queue.inner().lock().insert(
            "peer",
            WakerKeepingStream {
                wakers: std::sync::Arc::clone(&wakers),
                message: Some("m"),
            },
        );
        for _ in 0..3 {
            assert_eq!(
                Pin::new(&mut fair_queue).poll_next(&mut cx),
                Poll::Ready(Some(("peer", "m")))
            );
        }
        let wakers = wakers.lock().unwrap();
        assert_eq!(wakers.len(), 3);
        assert!(wakers.iter().all(|w| w.will_wake(&wakers[0])));
    }

    #[test]
    fn a_wake_for_a_removed_stream_does_not_poll_the_stream_now_in_its_slot() {
        let waker = noop_waker();
        let mut cx = Context::from_waker(&waker);
        let wakers = std::sync::Arc::default();
        let mut fair_queue: FairQueue<WakerKeepingStream, &str> = FairQueue::new(true);
        fair_queue.inner().lock().insert(
            "gone",
            WakerKeepingStream {
                wakers: std::sync::Arc::clone(&wakers),
                message: None,
            },
        );
        assert!(Pin::new(&mut fair_queue).poll_next(&mut cx).is_pending());
        fair_queue.inner().lock().remove(&"gone");
        let next_wakers = std::sync::Arc::default();
        fair_queue.inner().lock().insert(
            "next",
            WakerKeepingStream {
                wakers: std::sync::Arc::clone(&next_wakers),
                message: None,
            },
        );
        assert!(Pin::new(&mut fair_queue).poll_next(&mut cx).is_pending());
        assert_eq!(next_wakers.lock().unwrap().len(), 1, "polled once, as new");

        let stale = wakers.lock().unwrap()[0].clone();
        stale.wake();
        assert!(Pin::new(&mut fair_queue).poll_next(&mut cx).is_pending());
        assert_eq!(
            next_wakers.lock().unwrap().len(),
            1,
            "the removed stream's wake must not poll the stream in its slot"
        );
        // The stream's own wake still does.
        let own = next_wakers.lock().unwrap()[0].clone();
        own.wake();
        assert!(Pin::new(&mut fair_queue).poll_next(&mut cx).is_pending());
        assert_eq!(next_wakers.lock().unwrap().len(), 2);
    }

    type BoxedStream = Pin<Box<dyn Stream<Item = &'static str> + Send>>;

    #[test]
    fn a_stream_replaced_while_it_ended_does_not_report_its_key_disconnected() {
        let waker = noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut fair_queue: FairQueue<BoxedStream, &str> = FairQueue::new(true);
        let disconnected = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = std::sync::Arc::clone(&disconnected);
        fair_queue.set_on_disconnect(move |key| seen.lock().unwrap().push(key));
        let inner = fair_queue.inner();
        // Ends, but only after the socket gave its key to a new stream.
        let mut replaced = false;
        let ending: BoxedStream = Box::pin(futures::stream::poll_fn(move |_| {
            if !replaced {
                replaced = true;
                let reconnected: BoxedStream = Box::pin(futures::stream::pending());
                inner.lock().insert("peer", reconnected);
            }
            Poll::Ready(None)
        }));
        fair_queue.inner().lock().insert("peer", ending);
        assert!(Pin::new(&mut fair_queue).poll_next(&mut cx).is_pending());
        assert!(
            disconnected.lock().unwrap().is_empty(),
            "the key now names a live stream"
        );
        assert!(fair_queue.inner().lock().stream_mut(&"peer").is_some());
    }

    #[async_rt::test]
    async fn test_fair_queue_ready() {
        let a = stream::iter(vec!["a1", "a2", "a3"]);
        let b = stream::iter(vec!["b1", "b2", "b3"]);
        let c = stream::iter(vec!["c1", "c2", "c3"]);

        let mut f_queue: FairQueue<_, u64> = FairQueue::new(false);
        {
            let inner = f_queue.inner();
            let mut inner_lock = inner.lock();
            inner_lock.insert(1, a);
            inner_lock.insert(2, b);
            inner_lock.insert(3, c);
        }

        let mut results = Vec::new();
        while let Some(i) = f_queue.next().await {
            results.push(i);
        }

        assert_eq!(
            results,
            vec![
                (1, "a1"),
                (2, "b1"),
                (3, "c1"),
                (1, "a2"),
                (2, "b2"),
                (3, "c2"),
                (1, "a3"),
                (2, "b3"),
                (3, "c3")
            ]
        );
    }

    #[async_rt::test]
    async fn test_fair_queue_next_future_can_be_dropped_after_pending() {
        let waker = noop_waker();
        let mut cx = Context::from_waker(&waker);

        let mut fair_queue: FairQueue<WakeThenReadyStream, &str> = FairQueue::new(false);
        {
            let inner = fair_queue.inner();
            let mut lock = inner.lock();
            lock.insert(
                "peer",
                WakeThenReadyStream {
                    poll_count: 0,
                    message: Some("message"),
                },
            );
        }

        {
            let mut next = fair_queue.next();
            assert!(
                matches!(Pin::new(&mut next).poll(&mut cx), Poll::Pending),
                "first poll should park the recv future"
            );
        }

        assert_eq!(fair_queue.next().await, Some(("peer", "message")));
    }

    #[async_rt::test]
    async fn test_fair_queue_different_size() {
        let a = stream::iter(vec!["a1", "a2", "a3"]);
        let b = stream::iter(vec!["b1"]);
        let c = stream::iter(vec!["c1", "c2"]);

        let mut f_queue: FairQueue<_, u64> = FairQueue::new(false);
        {
            let inner = f_queue.inner();
            let mut inner_lock = inner.lock();
            inner_lock.insert(1, a);
            inner_lock.insert(2, b);
            inner_lock.insert(3, c);
        }

        let mut results = Vec::new();
        while let Some(i) = f_queue.next().await {
            results.push(i);
        }

        // FairQueue continues polling all streams until all are exhausted
        assert_eq!(
            results,
            vec![
                (1, "a1"),
                (2, "b1"),
                (3, "c1"),
                (1, "a2"),
                (3, "c2"),
                (1, "a3")
            ]
        );
    }

    #[test]
    fn test_fair_queue_continues_on_pending() {
        let waker = noop_waker();
        let mut cx = Context::from_waker(&waker);

        let mut fair_queue: FairQueue<UnifiedStream, &str> = FairQueue::new(false);
        {
            let inner = fair_queue.inner();
            let mut lock = inner.lock();
            lock.insert(
                "slow",
                UnifiedStream::Test(TestStream::pending_once(&["s1"])),
            );
            lock.insert(
                "fast",
                UnifiedStream::Test(TestStream::ready(&["f1", "f2"])),
            );
        }

        // First poll should return fast stream (regression test: no starvation)
        let result = Pin::new(&mut fair_queue).poll_next(&mut cx);
        match result {
            Poll::Ready(Some((key, value))) => {
                assert_eq!(key, "fast");
                assert_eq!(value, "f1");
            }
            other => panic!("Expected fast stream first, got: {:#?}", other),
        }

        // Second poll: fast stream still ready, slow stream pending
        let result = Pin::new(&mut fair_queue).poll_next(&mut cx);
        match result {
            Poll::Ready(Some((key, value))) => {
                assert_eq!(key, "fast");
                assert_eq!(value, "f2");
            }
            other => panic!("Expected fast stream second, got: {:#?}", other),
        }

        // Third poll: With noop_waker, slow stream hasn't been re-polled
        let result = Pin::new(&mut fair_queue).poll_next(&mut cx);
        match result {
            Poll::Pending => {} // Expected with noop_waker
            other @ Poll::Ready(_) => panic!("Expected Pending, got: {:#?}", other),
        }
    }

    #[test]
    fn test_fair_queue_multiple_clients_fairness() {
        let waker = noop_waker();
        let mut cx = Context::from_waker(&waker);

        let mut fair_queue: FairQueue<UnifiedStream, &str> = FairQueue::new(false);
        {
            let inner = fair_queue.inner();
            let mut lock = inner.lock();
            lock.insert(
                "fast",
                UnifiedStream::Test(TestStream::ready(&["f1", "f2", "f3"])),
            );
            lock.insert("slow", UnifiedStream::Test(TestStream::new(2, &["s1"])));
            lock.insert(
                "mid",
                UnifiedStream::Test(TestStream::new(1, &["m1", "m2"])),
            );
        }

        let mut messages = Vec::new();
        const MAX_ITERATIONS: usize = 20; // Upper bound - 3 for fast, 2 for mid, 1 for slow.

        for _ in 0..MAX_ITERATIONS {
            match Pin::new(&mut fair_queue).poll_next(&mut cx) {
                Poll::Ready(Some((key, value))) => {
                    messages.push(format!("{}:{}", key, value));

                    let has_slow = messages.iter().any(|m| m.starts_with("slow:"));
                    let fast_count = messages.iter().filter(|m| m.starts_with("fast:")).count();
                    let mid_count = messages.iter().filter(|m| m.starts_with("mid:")).count();

                    if has_slow && fast_count == 3 && mid_count == 2 {
                        break;
                    }
                }
                Poll::Ready(None) => break,
                Poll::Pending => {}
            }
        }

        // Ensure fast stream isn't starved by pending streams
        let fast_messages = messages.iter().filter(|m| m.starts_with("fast:")).count();
        assert!(
            fast_messages >= 1,
            "Fast stream was starved: {:?}",
            messages
        );
    }

    #[test]
    fn test_fair_queue_polls_ready_set_before_yielding_pending() {
        let waker = noop_waker();
        let mut cx = Context::from_waker(&waker);

        let mut fair_queue: FairQueue<UnifiedStream, &str> = FairQueue::new(false);
        {
            let inner = fair_queue.inner();
            let mut lock = inner.lock();
            lock.insert(
                "pending-1",
                UnifiedStream::CountPending(CountPendingStream { poll_count: 0 }),
            );
            lock.insert(
                "pending-2",
                UnifiedStream::CountPending(CountPendingStream { poll_count: 0 }),
            );
            lock.insert(
                "pending-3",
                UnifiedStream::CountPending(CountPendingStream { poll_count: 0 }),
            );
        }

        let result = Pin::new(&mut fair_queue).poll_next(&mut cx);
        assert!(
            matches!(result, Poll::Pending),
            "expected FairQueue to yield Pending, got {result:?}"
        );

        let inner = fair_queue.inner();
        let mut lock = inner.lock();
        let poll_count: usize = lock
            .streams_mut()
            .map(|stream| {
                let UnifiedStream::CountPending(stream) = stream.as_mut().get_mut() else {
                    panic!("unexpected stream type");
                };
                stream.poll_count
            })
            .sum();
        assert_eq!(
            poll_count, 3,
            "FairQueue should poll all initially ready streams before yielding Pending"
        );
    }

    #[test]
    fn test_fair_queue_defers_ready_events_generated_during_poll() {
        let waker = noop_waker();
        let mut cx = Context::from_waker(&waker);

        let mut fair_queue: FairQueue<UnifiedStream, &str> = FairQueue::new(false);
        {
            let inner = fair_queue.inner();
            let mut lock = inner.lock();
            lock.insert(
                "pending",
                UnifiedStream::WakePending(WakePendingStream { poll_count: 0 }),
            );
        }

        let result = Pin::new(&mut fair_queue).poll_next(&mut cx);
        assert!(
            matches!(result, Poll::Pending),
            "expected FairQueue to yield Pending, got {result:?}"
        );

        let inner = fair_queue.inner();
        let mut lock = inner.lock();
        assert_eq!(
            lock.ready.len(),
            1,
            "wake generated during poll should remain queued for a later poll"
        );
        assert_eq!(
            lock.slots.iter().filter(|slot| slot.queued).count(),
            1,
            "wake generated during poll should be tracked as queued"
        );
        let stream = lock.stream_mut(&"pending").unwrap();
        let UnifiedStream::WakePending(stream) = stream.as_mut().get_mut() else {
            panic!("unexpected stream type");
        };
        assert_eq!(
            stream.poll_count, 1,
            "FairQueue should not consume same-poll wake events immediately"
        );
    }
}
