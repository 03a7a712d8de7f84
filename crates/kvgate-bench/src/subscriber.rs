//! The load run's routers: N real gRPC subscribers, each on its own HTTP/2
//! connection, all on one thread.
//!
//! They must cost less than kvgate, or the run measures them: the codec
//! hands over each message's bytes untouched and a scan of the top-level
//! fields reads the timestamp and counts the events, skipping their bodies
//! by length. No event is decoded.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::{Buf, Bytes};
use prost::encoding::{DecodeContext, decode_key, double, skip_field, uint64};
use tokio::task::JoinHandle;
use tonic::codec::Streaming;

use super::histogram::Histogram;
use super::worker::Worker;
use kvgate::client::{Authorized, RawBatches, Target, TlsFlags, TlsPaths, subscribe_with};
use kvgate::clock::unix_now;

/// What a subscriber needs of a `KvEventBatch`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchScan {
    pub sequence_number: u64,
    /// Unix seconds; kvgate copies the newest event's engine timestamp.
    pub timestamp: f64,
    pub events: u32,
    pub snapshot: bool,
}

/// Reads the top-level fields of an encoded `KvEventBatch`.
pub fn scan(mut message: &[u8]) -> Result<BatchScan, prost::DecodeError> {
    let mut batch = BatchScan::default();
    while message.has_remaining() {
        let (tag, wire_type) = decode_key(&mut message)?;
        let context = DecodeContext::default();
        match tag {
            1 => uint64::merge(wire_type, &mut batch.sequence_number, &mut message, context)?,
            2 => double::merge(wire_type, &mut batch.timestamp, &mut message, context)?,
            _ => {
                batch.events += u32::from(tag == 3);
                batch.snapshot |= tag == 7;
                skip_field(wire_type, tag, &mut message, context)?;
            }
        }
    }
    Ok(batch)
}

/// Live (not snapshot) events each subscriber has received so far, and
/// whether its stream has ended. The orchestration waits on it, and at
/// `--rate 0` the publisher paces itself by the slowest subscriber.
#[derive(Debug)]
pub struct Delivery {
    events: Vec<AtomicU64>,
    ended: Vec<AtomicBool>,
}

impl Delivery {
    pub fn new(subscribers: usize) -> Arc<Self> {
        Arc::new(Self {
            events: (0..subscribers).map(|_| AtomicU64::new(0)).collect(),
            ended: (0..subscribers).map(|_| AtomicBool::new(false)).collect(),
        })
    }

    pub fn subscribers(&self) -> usize {
        self.events.len()
    }

    pub fn events(&self) -> Vec<u64> {
        self.events
            .iter()
            .map(|events| events.load(Ordering::Relaxed))
            .collect()
    }

    /// Events received by the subscriber that has received the fewest.
    pub fn slowest(&self) -> u64 {
        self.events
            .iter()
            .map(|events| events.load(Ordering::Relaxed))
            .min()
            .unwrap_or(0)
    }

    pub fn ended(&self) -> Vec<bool> {
        self.ended
            .iter()
            .map(|ended| ended.load(Ordering::Relaxed))
            .collect()
    }
}

/// What one subscriber saw inside the measurement window.
#[derive(Debug, Default)]
pub struct Window {
    pub events: u64,
    pub batches: u64,
    /// Publish-to-receive latency, one sample per batch, in microseconds.
    pub latency: Histogram,
    /// Sequence numbers skipped over the whole stream (kvgate numbers each
    /// rank's batches +1, so any is a lost batch).
    pub sequence_gaps: u64,
    /// Why the stream ended, if it did before kvgate was stopped.
    pub error: Option<String>,
}

pub struct Subscribers {
    worker: Worker,
    tasks: Vec<JoinHandle<Window>>,
    recording: Arc<AtomicBool>,
}

impl Subscribers {
    /// Opens a stream per subscriber of `delivery` from
    /// `start_sequence_number` 0 on `service`'s `SubscribeKvEvents`, each
    /// over its own connection.
    pub async fn connect(
        address: &str,
        service: &str,
        delivery: &Arc<Delivery>,
    ) -> anyhow::Result<Self> {
        let count = delivery.subscribers();
        let worker = Worker::start("bench-subscribers")?;
        let (address, service) = (address.to_owned(), service.to_owned());
        // Connections drive themselves from tasks on the runtime that opens them.
        let streams = worker
            .spawn(async move {
                let mut streams = Vec::with_capacity(count);
                for _ in 0..count {
                    let channel = connect_plaintext("the gateway under test at", &address).await?;
                    let stream = subscribe_with(channel, &service, 0, RawBatches)
                        .await
                        .map_err(|status| anyhow::anyhow!("SubscribeKvEvents refused: {status}"))?;
                    streams.push(stream);
                }
                anyhow::Ok(streams)
            })
            .await??;
        let recording = Arc::new(AtomicBool::new(false));
        let tasks = streams
            .into_iter()
            .enumerate()
            .map(|(index, stream)| {
                worker.spawn(receive(
                    stream,
                    (Arc::clone(delivery), index),
                    Arc::clone(&recording),
                ))
            })
            .collect();
        Ok(Self {
            worker,
            tasks,
            recording,
        })
    }

    /// Starts or ends the measurement window.
    pub fn record(&self, on: bool) {
        self.recording.store(on, Ordering::Relaxed);
    }

    pub fn cpu_seconds(&self) -> std::io::Result<f64> {
        self.worker.cpu_seconds()
    }

    /// Each subscriber's window, once its stream has ended (stop kvgate
    /// first).
    pub async fn finish(self) -> anyhow::Result<Vec<Window>> {
        let mut windows = Vec::with_capacity(self.tasks.len());
        for task in self.tasks {
            windows.push(task.await?);
        }
        Ok(windows)
    }
}

async fn receive(
    mut stream: Streaming<Bytes>,
    (delivery, index): (Arc<Delivery>, usize),
    recording: Arc<AtomicBool>,
) -> Window {
    let mut window = Window::default();
    let mut last_sequence = None;
    let error = loop {
        let message = match stream.message().await {
            Ok(Some(message)) => message,
            Ok(None) => break "the stream ended".to_owned(),
            Err(status) => break status.to_string(),
        };
        let received = unix_now();
        let batch = match scan(&message) {
            Ok(batch) => batch,
            Err(error) => break format!("undecodable batch: {error}"),
        };
        if batch.snapshot {
            continue;
        }
        if let Some(last) = last_sequence.replace(batch.sequence_number) {
            window.sequence_gaps += batch.sequence_number.saturating_sub(last + 1);
        }
        // Empty batches carry kvgate's clock, not the engine's.
        if batch.events == 0 {
            continue;
        }
        delivery.events[index].fetch_add(u64::from(batch.events), Ordering::Relaxed);
        if recording.load(Ordering::Relaxed) {
            window.events += u64::from(batch.events);
            window.batches += 1;
            window
                .latency
                .record(((received - batch.timestamp) * 1e6).max(0.0) as u64);
        }
    };
    delivery.ended[index].store(true, Ordering::Relaxed);
    window.error = Some(error);
    window
}

/// Connects to `address` (`host:port` or `http://host:port`) in plaintext,
/// without a token; errors call the address `described_as`.
pub async fn connect_plaintext(
    described_as: &'static str,
    address: &str,
) -> anyhow::Result<Authorized> {
    if address.starts_with("https://") {
        anyhow::bail!("{described_as} {address}: only plaintext (http://) is supported here");
    }
    // No TLS file can be given, so no TLS flag is ever named.
    let flags = TlsFlags {
        uri: described_as,
        ca: "",
        cert: "",
        key: "",
    };
    Target::new(address, &TlsPaths::default(), flags, None)?
        .connect()
        .await
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use kvgate::proto::common::kv_cache_event::Data;
    use kvgate::proto::common::{
        KvBlock, KvBlocksRemoved, KvBlocksStored, KvCacheEvent, KvEventBatch, KvSnapshotChunk,
    };

    fn stored(hash: i64) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 9,
            data: Some(Data::Stored(KvBlocksStored {
                blocks: vec![KvBlock {
                    block_hash: hash,
                    token_ids: (0..16).collect(),
                    block_size: 16,
                    ..Default::default()
                }],
                parent_block_hash: Some(-5),
                ..Default::default()
            })),
        }
    }

    fn removed(hash: i64) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 10,
            data: Some(Data::Removed(KvBlocksRemoved {
                block_hashes: vec![hash],
                ..Default::default()
            })),
        }
    }

    #[test]
    fn the_scan_reads_what_prost_encoded() {
        let batch = KvEventBatch {
            sequence_number: 1_700_000_000_000_123,
            timestamp: 1_761_234_567.125,
            events: vec![stored(i64::MIN), removed(-1), removed(42)],
            dp_rank: Some(3),
            ..Default::default()
        };
        assert_eq!(
            scan(&batch.encode_to_vec()).unwrap(),
            BatchScan {
                sequence_number: 1_700_000_000_000_123,
                timestamp: 1_761_234_567.125,
                events: 3,
                snapshot: false,
            }
        );
    }

    #[test]
    fn the_scan_sees_snapshots_and_empty_batches() {
        let snapshot = KvEventBatch {
            sequence_number: 7,
            events: vec![stored(1)],
            snapshot: Some(KvSnapshotChunk {
                index: 0,
                count: 1,
                blocks: 1,
                unknown_before: 0,
            }),
            ..Default::default()
        };
        let scanned = scan(&snapshot.encode_to_vec()).unwrap();
        assert!(scanned.snapshot);
        assert_eq!((scanned.events, scanned.timestamp), (1, 0.0));

        let empty = KvEventBatch {
            sequence_number: 8,
            ..Default::default()
        };
        assert_eq!(
            scan(&empty.encode_to_vec()).unwrap(),
            BatchScan {
                sequence_number: 8,
                ..BatchScan::default()
            }
        );
    }

    #[test]
    fn a_cut_batch_is_an_error_not_a_short_count() {
        let batch = KvEventBatch {
            sequence_number: 1,
            timestamp: 2.0,
            events: vec![stored(1), removed(2)],
            ..Default::default()
        };
        let encoded = batch.encode_to_vec();
        for cut in [3, 8, encoded.len() - 2] {
            assert!(scan(&encoded[..cut]).is_err(), "cut at {cut}");
        }
    }
}
