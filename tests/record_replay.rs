//! Record and replay: `kvgate record` keeps a live stream through
//! a gateway restart and a dropped connection, `kvgate serve --replay-file`
//! plays it back to routers, damaged recordings are cut or refused with the
//! file and offset named, and `--trace-file` plays a Mooncake trace through
//! a simulated prefix cache.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::recording::{Scratch, store_batch, write_batches};
use common::router::{Admission, RouterView};
use common::{DEADLINE, Gateway, next_batch, subscribe};
use kvgate::proto::common::{KvEventBatch, kv_cache_event::Data};
use kvgate::recording::{Ending, Entry, Recording};
use prost::Message as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A running `kvgate record`, killed by pid when dropped.
struct Recorder(Option<Child>);

impl Recorder {
    fn start(address: &str, out: &Path, extra: &[&str]) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .args(["record", "--addr", address, "--flush-ms", "20", "--out"])
            .arg(out)
            .args(extra)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvgate record starts");
        Self(Some(child))
    }

    /// Sends `signal` and waits (bounded) for the exit.
    fn signal(&mut self, signal: &str) -> std::process::ExitStatus {
        let mut child = self.0.take().expect("still running");
        let pid = child.id().to_string();
        assert!(
            Command::new("kill")
                .args([signal, &pid])
                .status()
                .unwrap()
                .success()
        );
        let deadline = std::time::Instant::now() + DEADLINE;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "kvgate record did not exit after {signal}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A TCP proxy on loopback whose connections the test can cut: a dropped
/// connection between a subscriber and the gateway, with both still up.
struct Proxy {
    address: String,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(target: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let connections = Arc::new(Mutex::new(Vec::new()));
        let held = Arc::clone(&connections);
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let connection = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                held.lock().unwrap().push(connection);
            }
        });
        Self {
            address,
            connections,
            accept,
        }
    }

    /// Drops every connection open now.
    fn cut(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// Every intact record of a recording, and how it ended; a recording not
/// created yet reads as empty.
fn read_recording(path: &Path) -> (Vec<Entry>, Option<Ending>) {
    let Ok(mut recording) = Recording::open(&[path.to_owned()]) else {
        return (Vec::new(), None);
    };
    let entries = recording.by_ref().map(|record| record.entry).collect();
    (entries, recording.ending().cloned())
}

fn batches_in(entries: &[Entry]) -> usize {
    entries
        .iter()
        .filter(|entry| matches!(entry, Entry::Batch(_)))
        .count()
}

/// Polls the recording until `reached` says yes, failing at the deadline.
async fn await_recording(path: &Path, what: &str, reached: impl Fn(&[Entry]) -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let (entries, _) = read_recording(path);
        if reached(&entries) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the recording never had {what} ({} batches)",
            batches_in(&entries)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

type RankState = BTreeMap<i64, u32>;

fn rank_state(view: &RouterView, rank: i32) -> RankState {
    view.blocks(rank).into_iter().collect()
}

/// The states each rank went through while a router admitted the
/// recording, in order (starting empty), and the admissions.
fn recorded_states(entries: &[Entry], ranks: i32) -> (Vec<Vec<RankState>>, Vec<Admission>) {
    let mut view = RouterView::new();
    let mut states: Vec<Vec<RankState>> = (0..ranks).map(|_| vec![RankState::new()]).collect();
    let mut admissions = Vec::new();
    for entry in entries {
        match entry {
            Entry::Resync(_) => view.clear_worker(),
            Entry::Batch(bytes) => {
                let batch = KvEventBatch::decode(bytes.clone()).expect("a KvEventBatch");
                admissions.push(view.admit(&batch));
            }
        }
        for (rank, states) in (0..ranks).zip(states.iter_mut()) {
            let now = rank_state(&view, rank);
            if states.last() != Some(&now) {
                states.push(now);
            }
        }
    }
    (states, admissions)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_recording_across_a_restart_and_a_disconnect_replays_to_the_same_states_batch_for_batch()
{
    let scratch = Scratch::new("restart");
    let out = scratch.path("stream.kvrec");
    let engine = ["--demo", "--dp-size", "2"];
    let (mut gateway, _) = Gateway::start_listening_on_free_ports(1, |port| {
        let args = engine.iter().map(|&arg| arg.to_owned()).collect();
        (format!("127.0.0.1:{port}"), args)
    });
    // Restarted on the same port, which the recorder keeps dialling (a
    // restart cannot move to another port if this one was taken meanwhile).
    let listen = gateway.address.to_string();
    let proxy = Proxy::start(gateway.address).await;
    let mut recorder = Recorder::start(&proxy.address, &out, &["--dp-size", "2"]);
    await_recording(&out, "10 batches", |entries| batches_in(entries) >= 10).await;

    // The subscriber's connection drops; it resumes with its cursor.
    proxy.cut();
    let (before, _) = read_recording(&out);
    let resumed = batches_in(&before) + 10;
    await_recording(&out, "10 batches after the disconnect", |entries| {
        batches_in(entries) >= resumed
    })
    .await;

    // The gateway restarts: the recorder's cursor means nothing to the new
    // one, so it records a resync and the new snapshot.
    assert!(gateway.terminate().success());
    drop(gateway);
    let _gateway = Gateway::start_listening(&listen, &engine);
    await_recording(&out, "a resync and 10 batches after it", |entries| {
        entries
            .iter()
            .position(|entry| matches!(entry, Entry::Resync(_)))
            .is_some_and(|resync| batches_in(&entries[resync..]) >= 10)
    })
    .await;
    assert!(recorder.signal("-TERM").success(), "a clean exit");

    let (entries, ending) = read_recording(&out);
    assert_eq!(ending, Some(Ending::Closed), "SIGTERM closes the file");
    let (states, admissions) = recorded_states(&entries, 2);
    assert!(
        admissions.iter().all(|admission| matches!(
            admission,
            Admission::Applied | Admission::SnapshotChunk | Admission::LoadOnly
        )),
        "no batch twice, none skipped, no restart (load records beside): {admissions:?}"
    );
    let mut stats_recording = Recording::open(std::slice::from_ref(&out)).unwrap();
    let stats = kvgate::tools::record::Stats::of(&mut stats_recording).unwrap();
    assert_eq!((stats.resyncs, stats.gaps), (1, 0));
    assert_eq!(stats.ranks.len(), 2);

    // Played back as recorded, a router sees the recorded states of each
    // rank in order, from its first snapshot to the last state.
    let replay = Gateway::start(&["--replay-file", out.to_str().unwrap()]);
    let mut stream = subscribe(replay.channel().await, "kvgate.v1.KvGate", 0)
        .await
        .unwrap();
    let mut view = RouterView::new();
    let mut matched = [0_usize; 2];
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let finals: Vec<&RankState> = states.iter().map(|states| states.last().unwrap()).collect();
    loop {
        let batch = tokio::time::timeout_at(deadline, next_batch(&mut stream))
            .await
            .expect("the replay reaches the recording's last state");
        let admission = view.admit(&batch);
        assert!(
            matches!(
                admission,
                Admission::Applied | Admission::SnapshotChunk | Admission::LoadOnly
            ),
            "{admission:?}"
        );
        if batch
            .snapshot
            .as_ref()
            .is_some_and(|chunk| chunk.index + 1 < chunk.count)
        {
            continue;
        }
        for rank in 0..2 {
            let now = rank_state(&view, rank);
            let found = states[rank as usize][matched[rank as usize]..]
                .iter()
                .position(|state| *state == now)
                .unwrap_or_else(|| {
                    panic!(
                        "rank {rank} in a state the recording never had ({} blocks)",
                        now.len()
                    )
                });
            matched[rank as usize] += found;
        }
        if (0..2).all(|rank| rank_state(&view, rank) == *finals[rank as usize]) {
            break;
        }
    }
    assert!(
        finals.iter().all(|state| !state.is_empty()),
        "the recording ends with blocks on both ranks"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_recorders_file_reads_back_to_its_last_intact_record() {
    let scratch = Scratch::new("killed");
    let out = scratch.path("killed.kvrec");
    let gateway = Gateway::start(&["--demo"]);
    let mut recorder = Recorder::start(&gateway.address.to_string(), &out, &[]);
    await_recording(&out, "20 batches", |entries| batches_in(entries) >= 20).await;
    let (seen, _) = read_recording(&out);
    let status = recorder.signal("-KILL");
    assert!(!status.success());

    let (entries, ending) = read_recording(&out);
    assert!(entries.len() >= seen.len(), "nothing written is lost");
    assert_eq!(entries[..seen.len()], seen[..]);
    assert!(
        matches!(ending, Some(Ending::Unclosed { .. } | Ending::Cut { .. })),
        "{ending:?}"
    );
    let (_, admissions) = recorded_states(&entries, 1);
    assert!(
        admissions.iter().all(|admission| matches!(
            admission,
            Admission::Applied | Admission::SnapshotChunk | Admission::LoadOnly
        )),
        "{admissions:?}"
    );
    let printed = kvgate_cli(&["tail", "--file", out.to_str().unwrap()]);
    let lines = String::from_utf8_lossy(&printed.stdout).lines().count();
    assert!(
        lines >= batches_in(&entries),
        "tail --file prints every batch"
    );
}

/// Runs the `kvgate` binary to its end.
fn kvgate_cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .env("RUST_LOG", "error")
        .output()
        .expect("kvgate runs")
}

/// A closed recording of `n` batches of [`store_batch`] from 100.
fn write_recording(path: &Path, n: u64) {
    write_batches(path, (100..100 + n).map(store_batch));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_recording_carries_its_recorded_load_records() {
    use kvgate::proto::common::EngineLoad;
    let scratch = Scratch::new("loads");
    let path = scratch.path("loads.kvrec");
    let core = |running| EngineLoad {
        running_requests: running,
        ..Default::default()
    };
    let mut first = store_batch(100);
    first.load = Some(core(3));
    let load_only = KvEventBatch {
        sequence_number: 100,
        dp_rank: Some(0),
        load: Some(EngineLoad {
            running_requests: 7,
            cache_hit_rate: Some(0.5),
            load_only: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut last = store_batch(101);
    last.load = Some(core(9));
    write_batches(&path, [first, load_only, last]);

    let gateway = Gateway::start(&["--replay-file", path.to_str().unwrap()]);
    let mut stream = subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
        .await
        .unwrap();
    // The last event batch's core over the load-only record's other fields.
    loop {
        let batch = next_batch(&mut stream).await;
        if let Some(load) = batch
            .load
            .filter(|load| load.load_only && load.running_requests == 9)
        {
            assert_eq!(load.cache_hit_rate, Some(0.5));
            break;
        }
    }
}

#[test]
fn damaged_recordings_are_cut_or_refused_naming_the_file_and_the_offset() {
    let scratch = Scratch::new("damaged");
    let path = scratch.path("damaged.kvrec");
    let shown = path.to_str().unwrap();
    write_recording(&path, 50);
    let whole = std::fs::read(&path).unwrap();

    let stats = kvgate_cli(&["record", "--stats", shown]);
    assert!(stats.status.success());
    let text = String::from_utf8_lossy(&stats.stdout);
    assert!(text.contains("batches     50 "), "{text}");
    assert!(text.contains("stored      50 events, 50 blocks"), "{text}");
    assert!(text.contains("ending      closed cleanly"), "{text}");

    // A torn tail: everything before the torn frame prints, then the cut
    // is reported.
    std::fs::write(&path, &whole[..whole.len() - 80]).unwrap();
    let tail = kvgate_cli(&["tail", "--file", shown]);
    assert_eq!(tail.status.code(), Some(1));
    let printed = String::from_utf8_lossy(&tail.stdout).lines().count();
    assert!((40..50).contains(&printed), "{printed} batches printed");
    let error = String::from_utf8_lossy(&tail.stderr);
    assert!(
        error.contains(shown) && error.contains("damaged at offset") && error.contains("torn tail"),
        "{error}"
    );

    // A flipped bit in the middle: cut there, never a panic.
    let mut flipped = whole.clone();
    let middle = whole.len() / 2;
    flipped[middle] ^= 0x10;
    std::fs::write(&path, &flipped).unwrap();
    let stats = kvgate_cli(&["record", "--stats", shown]);
    assert_eq!(stats.status.code(), Some(1));
    let error = String::from_utf8_lossy(&stats.stderr);
    assert!(error.contains("damaged at offset"), "{error}");

    // A huge frame length right after the header: refused before any
    // allocation, nothing read.
    let header_end = whole.len() - frames_len(&whole);
    let mut huge = whole.clone();
    huge[header_end..header_end + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(&path, &huge).unwrap();
    let tail = kvgate_cli(&["tail", "--file", shown]);
    assert_eq!(tail.status.code(), Some(1));
    assert!(tail.stdout.is_empty());
    let error = String::from_utf8_lossy(&tail.stderr);
    assert!(
        error.contains(&format!("damaged at offset {header_end}")),
        "{error}"
    );

    // A future version and a foreign file are refused whole, by the
    // player too, naming its flag.
    let mut future = whole.clone();
    future[8] = 9;
    std::fs::write(&path, &future).unwrap();
    let serve = kvgate_cli(&["serve", "--listen", "127.0.0.1:0", "--replay-file", shown]);
    assert_eq!(serve.status.code(), Some(2));
    let error = String::from_utf8_lossy(&serve.stderr);
    assert!(
        error.contains("--replay-file") && error.contains("format version 9 is newer"),
        "{error}"
    );
    std::fs::write(&path, b"{\"timestamp\": 0}\n").unwrap();
    let tail = kvgate_cli(&["tail", "--file", shown]);
    assert!(!tail.status.success());
    let error = String::from_utf8_lossy(&tail.stderr);
    assert!(
        error.contains(shown) && error.contains("not a kvgate recording"),
        "{error}"
    );
}

/// Bytes after part 0's header.
fn frames_len(file: &[u8]) -> usize {
    let json_len = u32::from_le_bytes(file[10..14].try_into().unwrap()) as usize;
    file.len() - (18 + json_len)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_looped_replay_starts_each_pass_with_an_ownerless_clear() {
    let scratch = Scratch::new("loop");
    let path = scratch.path("loop.kvrec");
    write_recording(&path, 5);
    let gateway = Gateway::start(&[
        "--replay-file",
        path.to_str().unwrap(),
        "--replay-loop",
        "--replay-speed",
        "100",
    ]);
    let mut stream = subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
        .await
        .unwrap();
    let mut view = RouterView::new();
    let mut clears = 0;
    let full: BTreeSet<i64> = (100..105).collect();
    while clears < 3 {
        let batch = next_batch(&mut stream).await;
        assert_ne!(view.admit(&batch), Admission::Stale);
        let cleared = batch.events.iter().any(|event| {
            event
                .data
                .as_ref()
                .is_some_and(|data| matches!(data, Data::Cleared(c) if c.ownership.is_none()))
        });
        if cleared && batch.snapshot.is_none() {
            clears += 1;
        }
        let held: BTreeSet<i64> = view.blocks(0).into_keys().collect();
        assert!(held.is_subset(&full), "{held:?}");
    }
}

/// The sample trace's requests, each as its full 512-token blocks.
fn sample_trace() -> Vec<Vec<i64>> {
    std::fs::read_to_string(sample_path())
        .unwrap()
        .lines()
        .map(|line| {
            let request: serde_json::Value = serde_json::from_str(line).unwrap();
            let full = request["input_length"].as_u64().unwrap() as usize / 512;
            request["hash_ids"]
                .as_array()
                .unwrap()
                .iter()
                .take(full)
                .map(|id| id.as_i64().unwrap())
                .collect()
        })
        .collect()
}

fn sample_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trace/mooncake_sample.jsonl")
}

/// A trace stream as a router sees it: each rank's blocks in the snapshot
/// it started from, then the live events in order with their rank, read
/// until `done`.
struct TraceStream {
    view: RouterView,
    snapshot: BTreeMap<i32, BTreeSet<i64>>,
    live: Vec<(i32, Data)>,
}

async fn trace_stream(args: &[&str], done: impl Fn(&RouterView) -> bool) -> TraceStream {
    let gateway = Gateway::start(args);
    let mut stream = subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
        .await
        .unwrap();
    let mut trace = TraceStream {
        view: RouterView::new(),
        snapshot: BTreeMap::new(),
        live: Vec::new(),
    };
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !done(&trace.view) {
        let batch = tokio::time::timeout_at(deadline, next_batch(&mut stream))
            .await
            .expect("the trace plays to its end");
        let admission = trace.view.admit(&batch);
        assert!(
            matches!(
                admission,
                Admission::Applied | Admission::SnapshotChunk | Admission::LoadOnly
            ),
            "{admission:?}"
        );
        let rank = batch.dp_rank.unwrap_or(0);
        for event in batch.events {
            match (event.data, batch.snapshot.is_some()) {
                (Some(Data::Stored(stored)), true) => trace
                    .snapshot
                    .entry(rank)
                    .or_default()
                    .extend(stored.blocks.iter().map(|block| block.block_hash)),
                (Some(data), false) => trace.live.push((rank, data)),
                _ => {}
            }
        }
    }
    trace
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mooncake_trace_stores_each_requests_new_blocks_as_a_chain_from_its_shared_prefix() {
    let requests = sample_trace();
    let every_block: HashMap<i64, u32> = requests.iter().flatten().map(|&id| (id, 1)).collect();
    let trace = trace_stream(
        &[
            "--trace-file",
            sample_path().to_str().unwrap(),
            "--replay-speed",
            "2",
        ],
        |view| view.blocks(0) == every_block,
    )
    .await;
    // What a cache that never evicts stores for each request: the blocks
    // after the longest prefix seen before, hanging from its last block.
    let mut seen = BTreeSet::new();
    let mut expected = Vec::new();
    let mut hits = 0;
    for blocks in &requests {
        let hit = blocks.iter().take_while(|id| seen.contains(*id)).count();
        hits += hit;
        if hit < blocks.len() {
            expected.push((
                hit.checked_sub(1).map(|last| blocks[last]),
                blocks[hit..].to_vec(),
            ));
        }
        seen.extend(blocks.iter().copied());
    }
    assert!(hits > 0, "the sample shares prefixes");
    let stores: Vec<(Option<i64>, Vec<i64>)> = trace
        .live
        .into_iter()
        .map(|(rank, data)| {
            assert_eq!(rank, 0);
            match data {
                Data::Stored(stored) => (
                    stored.parent_block_hash,
                    stored.blocks.iter().map(|block| block.block_hash).collect(),
                ),
                other => panic!("only stores with room for every block: {other:?}"),
            }
        })
        .collect();
    assert!(
        stores.len() >= expected.len() / 2,
        "most of the trace played live ({} of {} stores)",
        stores.len(),
        expected.len()
    );
    assert_eq!(
        stores[..],
        expected[expected.len() - stores.len()..],
        "each live store is the next request's new blocks, from its shared prefix"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mooncake_trace_never_holds_more_than_the_cache_on_any_rank() {
    const CAPACITY: usize = 12;
    const SENTINEL: i64 = 1 << 40;
    // The sample, then one request of blocks no other has: once a rank
    // holds it, every request before it was served.
    let scratch = Scratch::new("trace");
    let trace_file = scratch.path("trace.jsonl");
    let mut text = std::fs::read_to_string(sample_path()).unwrap();
    text.push_str(&format!(
        "{{\"timestamp\": 8100, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [{SENTINEL}, {}]}}\n",
        SENTINEL + 1
    ));
    std::fs::write(&trace_file, text).unwrap();
    let trace = trace_stream(
        &[
            "--trace-file",
            trace_file.to_str().unwrap(),
            "--replay-speed",
            "2",
            "--trace-cache-blocks",
            &CAPACITY.to_string(),
            "--dp-size",
            "2",
        ],
        |view| (0..2).any(|rank| view.blocks(rank).contains_key(&SENTINEL)),
    )
    .await;
    let mut held = trace.snapshot;
    let mut removals = 0;
    let mut live_ranks = BTreeSet::new();
    for (rank, data) in trace.live {
        live_ranks.insert(rank);
        let held = held.entry(rank).or_default();
        match data {
            Data::Stored(stored) => {
                if let Some(parent) = stored.parent_block_hash {
                    assert!(held.contains(&parent), "a chain hangs from a held block");
                }
                for block in &stored.blocks {
                    assert!(held.insert(block.block_hash), "a block is stored once");
                }
            }
            Data::Removed(removed) => {
                removals += removed.block_hashes.len();
                for hash in removed.block_hashes {
                    assert!(held.remove(&hash), "only held blocks are evicted");
                }
            }
            Data::Cleared(_) => held.clear(),
        }
        assert!(
            held.len() <= CAPACITY,
            "rank {rank} holds {} blocks",
            held.len()
        );
    }
    assert!(removals > 0, "the small cache evicted");
    assert_eq!(live_ranks.len(), 2, "requests spread over both ranks");
    for (rank, blocks) in &held {
        let seen: BTreeSet<i64> = trace.view.blocks(*rank).into_keys().collect();
        assert_eq!(
            &seen, blocks,
            "rank {rank}: the router holds what the events say"
        );
    }
}

/// A stream with every kind of event and load record tail prints: stores
/// (with extra keys of each kind), removals, clears, a snapshot chunk, a
/// load record riding on a batch and a `load_only` one.
fn every_kind_of_batch() -> Vec<KvEventBatch> {
    use kvgate::proto::common::{
        EngineLoad, EngineMemory, KvBlock, KvBlockExtraKey, KvBlocksRemoved, KvBlocksStored,
        KvCacheCleared, KvCacheEvent, KvCacheTier, KvMultimodalKey, KvSnapshotChunk,
        kv_block_extra_key::Key,
    };
    let extra_keys = vec![
        KvBlockExtraKey {
            key: Some(Key::Text("lora-a".into())),
        },
        KvBlockExtraKey {
            key: Some(Key::Blob(vec![0, 255, 7])),
        },
        KvBlockExtraKey {
            key: Some(Key::Number(-3)),
        },
        KvBlockExtraKey {
            key: Some(Key::Multimodal(KvMultimodalKey {
                identifier: "image-1".into(),
                offset: 12,
            })),
        },
    ];
    let stored = KvCacheEvent {
        event_id: 1,
        data: Some(Data::Stored(KvBlocksStored {
            blocks: vec![KvBlock {
                block_hash: -9_007_199_254_740_993,
                token_ids: vec![1, 2, 3],
                block_size: 3,
                lora_id: Some(4),
                cache_level: Some(0),
                extra_keys,
            }],
            parent_block_hash: Some(77),
            tier: Some(KvCacheTier::Device as i32),
            medium: Some("GPU".into()),
            group_idx: Some(0),
            ..Default::default()
        })),
    };
    let removed = KvCacheEvent {
        event_id: 2,
        data: Some(Data::Removed(KvBlocksRemoved {
            block_hashes: vec![5, -6],
            tier: Some(KvCacheTier::Host as i32),
            cache_level: Some(1),
            ..Default::default()
        })),
    };
    let cleared = KvCacheEvent {
        event_id: 3,
        data: Some(Data::Cleared(KvCacheCleared {
            ownership: Some("engine".into()),
        })),
    };
    let load = EngineLoad {
        running_requests: 4,
        waiting_requests: 1,
        waiting_uncached_tokens: Some(256),
        token_usage: 0.5,
        gen_throughput: 812.5,
        max_running_requests: 64,
        age_ms: 3,
        sample: 12,
        max_total_num_tokens: Some(4096),
        num_used_tokens: Some(100),
        memory: Some(EngineMemory {
            kv_cache_gb: 1.5,
            token_capacity: 4096,
            ..Default::default()
        }),
        ..Default::default()
    };
    vec![
        KvEventBatch {
            sequence_number: 1,
            timestamp: 1.5,
            dp_rank: Some(0),
            events: vec![stored.clone()],
            snapshot: Some(KvSnapshotChunk {
                index: 0,
                count: 1,
                blocks: 1,
                unknown_before: 2,
            }),
            ..Default::default()
        },
        KvEventBatch {
            sequence_number: 2,
            dp_rank: Some(1),
            events: vec![stored, removed, cleared],
            load: Some(load.clone()),
            ..Default::default()
        },
        KvEventBatch {
            sequence_number: 2,
            dp_rank: Some(1),
            load: Some(EngineLoad {
                load_only: true,
                ..load
            }),
            ..Default::default()
        },
    ]
}

/// What `tail --json` must print for `batch`, made from the proto3 JSON
/// mapping as prost-reflect's serde prints it with its default options
/// (grpcurl's spelling): one line per event, its batch's number, rank and
/// snapshot beside the event's own fields, then a line for the load record.
fn proto3_json_lines(batch: &KvEventBatch) -> Vec<serde_json::Value> {
    use serde_json::{Map, Value};
    let pool = prost_reflect::DescriptorPool::decode(kvgate::proto::FILE_DESCRIPTOR_SET).unwrap();
    let descriptor = pool
        .get_message_by_name("smg.grpc.common.KvEventBatch")
        .unwrap();
    let message =
        prost_reflect::DynamicMessage::decode(descriptor, batch.encode_to_vec().as_slice())
            .unwrap();
    let Value::Object(mut json) = serde_json::to_value(&message).unwrap() else {
        panic!("a batch is a JSON object");
    };
    // The envelope tail gives every line (the mapping leaves out a zero).
    let mut envelope = Map::new();
    envelope.insert(
        "sequenceNumber".into(),
        json.remove("sequenceNumber").unwrap_or_else(|| "0".into()),
    );
    envelope.insert("dpRank".into(), json.remove("dpRank").unwrap_or(0.into()));
    let mut lines = Vec::new();
    for event in json.remove("events").into_iter().flat_map(|events| {
        let Value::Array(events) = events else {
            panic!("events are an array")
        };
        events
    }) {
        let mut line = envelope.clone();
        if let Some(snapshot) = json.get("snapshot") {
            line.insert("snapshot".into(), snapshot.clone());
        }
        let Value::Object(event) = event else {
            panic!("an event is an object")
        };
        line.extend(event);
        lines.push(Value::Object(line));
    }
    if let Some(load) = json.remove("load") {
        let mut line = envelope;
        line.insert("load".into(), load);
        lines.push(Value::Object(line));
    }
    lines
}

#[test]
fn tail_json_prints_every_field_in_proto3_json_names_as_grpcurl_does() {
    let scratch = Scratch::new("tail-json");
    let file = scratch.path("stream.kvrec");
    let batches = every_kind_of_batch();
    write_batches(&file, batches.clone());
    let printed = kvgate_cli(&["tail", "--file", file.to_str().unwrap(), "--json"]);
    assert!(printed.status.success(), "{printed:?}");
    let lines: Vec<serde_json::Value> = String::from_utf8(printed.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let expected: Vec<serde_json::Value> = batches.iter().flat_map(proto3_json_lines).collect();
    assert_eq!(lines, expected);
    // The names a router's operator greps for, spelled as grpcurl spells them.
    let text = serde_json::to_string(&lines).unwrap();
    for name in [
        "ageMs",
        "dpRank",
        "loadOnly",
        "maxRunningRequests",
        "maxTotalNumTokens",
        "extraKeys",
        "blockHashes",
        "parentBlockHash",
        "unknownBefore",
    ] {
        assert!(text.contains(&format!("\"{name}\"")), "{name} in {text}");
    }
    for snake in ["age_ms", "dp_rank", "load_only", "block_hash", "extra_keys"] {
        assert!(!text.contains(snake), "{snake} in {text}");
    }
}
