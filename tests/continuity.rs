//! Continuity across kvgate restarts with `--state-dir` (contract section 8),
//! end to end: the real binary killed and restarted on one directory, a real
//! ZMQ publisher with a replay ring, a simulated engine as the truth, and
//! every batch admitted by the router-rules mirror.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::router::{Admission, RouterView};
use common::{
    DEADLINE, Gateway, await_metric_where, http_get, metric_sample, next_batch,
    output_within_deadline, poll_until, subscribe, sync_streams_observing, true_blocks,
};
use kvgate::proto::common::KvEventBatch;
use kvgate_sim::{EnginePublisher, PublisherOptions, SimConfig, SimEngine, encode_batch};
use rand::{Rng, SeedableRng};
use tonic::codec::Streaming;

const SERVICE: &str = "kvgate.v1.KvGate";

/// A scratch directory under /tmp, removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "continuity-{name}-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    fn state(&self) -> PathBuf {
        self.0.join("state")
    }
}

/// Removes the announcement marks kvgate kept, beside its state
/// directories, for the directories in `dir`.
fn remove_marks_of_dirs_in(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.metadata().is_ok_and(|metadata| metadata.is_dir())
            && let Ok(mark) = kvgate::store::mark_of(&entry.path())
        {
            let _ = std::fs::remove_file(mark);
        }
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        remove_marks_of_dirs_in(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The engine side: a simulated cache published through a real PUB with a
/// replay ring of `ring` messages.
struct Engine {
    cache: SimEngine,
    publisher: EnginePublisher,
}

impl Engine {
    async fn new(ring: usize, seed: u64) -> Self {
        let options = PublisherOptions {
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            buffer_steps: ring,
            ..PublisherOptions::default()
        };
        Self {
            cache: engine_cache(seed),
            publisher: EnginePublisher::bind("tcp://127.0.0.1:0", &options)
                .await
                .unwrap(),
        }
    }

    async fn steps(&mut self, steps: usize) {
        for _ in 0..steps {
            self.step().await;
        }
    }

    async fn step(&mut self) {
        let mut payload = Vec::new();
        encode_batch(1.0, &self.cache.step(), Some(0), &mut payload);
        self.publisher.publish(payload.into()).await.unwrap();
    }

    /// A kvgate on this engine keeping its state in `dir`.
    fn gateway(&self, dir: &Path) -> Gateway {
        self.gateway_configured(dir, &[], |_| {})
    }

    fn gateway_configured(
        &self,
        dir: &Path,
        extra: &[&str],
        configure: impl FnOnce(&mut Command),
    ) -> Gateway {
        let mut args = vec![
            "--zmq-endpoint",
            self.publisher.endpoint(),
            "--zmq-replay-endpoint",
            self.publisher.replay_endpoint().unwrap(),
            "--zmq-replay-timeout-ms",
            "10000",
            "--metrics-listen",
            "127.0.0.1:0",
            "--state-sync-ms",
            "50",
            "--state-dir",
            dir.to_str().unwrap(),
        ];
        // A loaded CI machine can hold a test's kvgate off the CPU for
        // longer than the default bound, which would pause persistence and
        // renumber a restart: tests of that bound set it themselves.
        if !extra.contains(&"--state-io-timeout-ms") {
            args.extend_from_slice(&["--state-io-timeout-ms", "5000"]);
        }
        args.extend_from_slice(extra);
        Gateway::start_configured(&args, configure)
    }
}

/// A cache that keeps its system prompts' blocks live for the whole test
/// while it evicts older requests' blocks.
fn engine_cache(seed: u64) -> SimEngine {
    SimEngine::new(SimConfig {
        seed,
        block_size: 4,
        capacity_blocks: 600,
        ..SimConfig::default()
    })
    .unwrap()
}

/// Subscribes with `router`'s cursor (0 for a snapshot); a refusal fails
/// the test.
async fn resume(gateway: &Gateway, router: &mut RouterView) -> Streaming<KvEventBatch> {
    router.reconnecting();
    let cursor = router.resume_cursor();
    subscribe(gateway.channel().await, SERVICE, cursor)
        .await
        .unwrap_or_else(|status| panic!("cursor {cursor} refused: {status:?}"))
}

fn admit(router: &mut RouterView, batch: &KvEventBatch, context: &str) {
    let admission = router.admit(batch);
    assert!(
        matches!(
            admission,
            Admission::Applied | Admission::SnapshotChunk | Admission::LoadOnly
        ),
        "{context}: batch {} of rank {:?} admitted as {admission:?}",
        batch.sequence_number,
        batch.dp_rank
    );
}

/// Follows `stream` into `router` until the engine's newest message is in
/// (fences published until one arrives, as the slow joiner requires).
async fn catch_up(
    engine: &mut Engine,
    stream: &mut Streaming<KvEventBatch>,
    router: &mut RouterView,
    context: &str,
) {
    sync_streams_observing(
        &mut engine.publisher,
        0,
        std::slice::from_mut(stream),
        |_, batch| admit(router, batch, context),
    )
    .await;
}

/// A new subscriber's snapshot, as a router holds it.
async fn snapshot(gateway: &Gateway) -> RouterView {
    let mut router = RouterView::new();
    let mut stream = resume(gateway, &mut router).await;
    let first = next_batch(&mut stream).await;
    let count = first.snapshot.as_ref().expect("a snapshot chunk").count;
    admit(&mut router, &first, "snapshot");
    for _ in 1..count {
        let chunk = next_batch(&mut stream).await;
        admit(&mut router, &chunk, "snapshot");
    }
    router
}

/// Kills `gateway` (SIGKILL); what it sent before reaches `router`.
async fn kill(gateway: Gateway, stream: &mut Streaming<KvEventBatch>, router: &mut RouterView) {
    drop(gateway);
    drain_after_stop(stream, router, "before the kill").await;
}

/// Admits what `stream` still yields from a kvgate that was stopped.
async fn drain_after_stop(
    stream: &mut Streaming<KvEventBatch>,
    router: &mut RouterView,
    context: &str,
) {
    while let Ok(Ok(Some(batch))) = tokio::time::timeout(DEADLINE, stream.message()).await {
        admit(router, &batch, context);
    }
}

/// Runs kvgate on `dir` while the engine takes `steps` steps, follows it
/// into `router`, then kills it.
async fn run_then_kill(engine: &mut Engine, dir: &Path, router: &mut RouterView, steps: usize) {
    let gateway = engine.gateway(dir);
    let mut stream = resume(&gateway, router).await;
    engine.steps(steps).await;
    catch_up(engine, &mut stream, router, "before the kill").await;
    kill(gateway, &mut stream, router).await;
}

async fn metric(gateway: &Gateway, series: &str) -> f64 {
    let (_, text) = http_get(gateway.admin.unwrap(), "/metrics").await;
    metric_sample(&text, series).unwrap_or_else(|| panic!("no {series}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_resumes_exactly_across_kills_and_restarts_on_the_same_state_dir() {
    let seed = rand::random::<u64>();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let scratch = ScratchDir::new("kill");
    // A ring far shorter than the test: the old blocks a snapshot must
    // still hold at the end are out of the engine's reach.
    let ring = 48;
    let mut engine = Engine::new(ring, seed).await;
    let mut router = RouterView::new();
    let mut published = 0;
    for iteration in 0..10 {
        let context = format!("seed {seed}, iteration {iteration}");
        let mut gateway = engine.gateway(&scratch.state());
        let mut stream = resume(&gateway, &mut router).await;
        catch_up(&mut engine, &mut stream, &mut router, &context).await;
        assert_eq!(
            router.blocks(0),
            true_blocks(&engine.cache),
            "{context}: resumed state"
        );

        // Under load, stop kvgate after a random number of batches: killed
        // mostly, sometimes terminated.
        let steps = rng.random_range(4..24);
        let stop_after = rng.random_range(0..steps);
        let publishing = tokio::spawn(async move {
            for _ in 0..steps {
                engine.step().await;
                tokio::task::yield_now().await;
            }
            engine
        });
        let mut publishing = std::pin::pin!(publishing);
        let mut read = 0;
        let finished = loop {
            if read >= stop_after {
                break None;
            }
            tokio::select! {
                message = stream.message() => {
                    let batch = message.expect("healthy").expect("open");
                    admit(&mut router, &batch, &context);
                    read += 1;
                }
                engine = &mut publishing => break Some(engine.unwrap()),
            }
        };
        if iteration % 4 == 3 {
            assert!(gateway.terminate().success(), "{context}");
        } else {
            drop(gateway);
        }
        // What kvgate sent before it went still reaches the router.
        drain_after_stop(&mut stream, &mut router, &context).await;
        engine = match finished {
            Some(engine) => engine,
            None => publishing.await.unwrap(),
        };
        // Meanwhile the engine goes on, within its ring.
        engine.steps(rng.random_range(0..8)).await;
        published += steps;
    }
    assert!(published > ring, "the test outlived the ring");

    let gateway = engine.gateway(&scratch.state());
    let mut stream = resume(&gateway, &mut router).await;
    catch_up(&mut engine, &mut stream, &mut router, "final").await;
    assert_eq!(router.blocks(0), true_blocks(&engine.cache), "seed {seed}");
    assert!(router.gaps.is_empty(), "seed {seed}: {:?}", router.gaps);
    assert_eq!(router.restarts, 0, "seed {seed}");
    let fresh = snapshot(&gateway).await;
    assert_eq!(
        fresh.blocks(0),
        true_blocks(&engine.cache),
        "seed {seed}: a new subscriber's snapshot holds blocks the ring no longer reaches"
    );
    assert_eq!(
        metric(&gateway, "kvgate_engine_messages_lost_total").await,
        0.0
    );
}

#[tokio::test]
async fn an_engine_restarted_while_kvgate_was_down_reaches_the_router_as_an_ownerless_clear() {
    let scratch = ScratchDir::new("engine-restart");
    let mut engine = Engine::new(1000, 7).await;
    let mut router = RouterView::new();
    run_then_kill(&mut engine, &scratch.state(), &mut router, 30).await;

    // A new engine process: its counter starts over, its cache is empty.
    engine.publisher.restart();
    engine.cache = engine_cache(8);
    engine.steps(3).await;
    let gateway = engine.gateway(&scratch.state());
    let mut stream = resume(&gateway, &mut router).await;
    catch_up(&mut engine, &mut stream, &mut router, "after").await;
    assert_eq!(router.blocks(0), true_blocks(&engine.cache));
    assert!(router.gaps.is_empty());
    assert_eq!(router.restarts, 0, "the clear came at the next number");
    assert!(metric(&gateway, "kvgate_engine_restarts_total").await >= 1.0);
}

#[tokio::test]
async fn a_gap_the_engine_can_no_longer_replay_is_counted_and_the_cursor_still_resumes() {
    let scratch = ScratchDir::new("gap");
    let mut engine = Engine::new(16, 9).await;
    let mut router = RouterView::new();
    run_then_kill(&mut engine, &scratch.state(), &mut router, 5).await;
    engine.steps(40).await;

    let gateway = engine.gateway(&scratch.state());
    let mut stream = resume(&gateway, &mut router).await;
    catch_up(&mut engine, &mut stream, &mut router, "after").await;
    assert!(router.gaps.is_empty());
    let lost = metric(&gateway, "kvgate_engine_messages_lost_total").await;
    assert!(lost >= 24.0, "{lost} lost");
}

#[tokio::test]
async fn a_second_kvgate_on_the_same_state_dir_and_ports_exits_naming_the_dir_and_the_holder() {
    let scratch = ScratchDir::new("owner");
    let engine = Engine::new(100, 1).await;
    let first = engine.gateway(&scratch.state());
    // The first one holds the ports too: the directory is what is named.
    let second = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--demo", "--listen"])
        .arg(first.address.to_string())
        .arg("--metrics-listen")
        .arg(first.admin.expect("an admin port").to_string())
        .arg("--state-dir")
        .arg(scratch.state())
        .env("RUST_LOG", "off")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let second = output_within_deadline(second);
    assert_eq!(second.status.code(), Some(1), "{second:?}");
    let error = String::from_utf8_lossy(&second.stderr);
    assert!(error.contains(scratch.state().to_str().unwrap()), "{error}");
    assert!(error.contains(&first.pid().to_string()), "{error}");
    assert!(!error.contains("cannot listen"), "{error}");
}

/// Runs kvgate on `dir` until what the engine published is logged and
/// checkpointed, then stops it with SIGTERM.
async fn fill_state_dir(engine: &mut Engine, dir: &Path) {
    let mut gateway =
        engine.gateway_configured(dir, &["--state-checkpoint-bytes", "64KiB"], |_| {});
    let mut router = RouterView::new();
    let mut stream = resume(&gateway, &mut router).await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while metric(&gateway, "kvgate_state_checkpoints_total").await == 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "never checkpointed");
        engine.steps(10).await;
        catch_up(engine, &mut stream, &mut router, "filling").await;
    }
    engine.steps(10).await;
    catch_up(engine, &mut stream, &mut router, "filling").await;
    assert!(gateway.terminate().success());
}

fn state_files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            let name = path.file_name().unwrap().to_str().unwrap();
            name.starts_with(prefix) && !name.contains("damaged")
        })
        .collect();
    files.sort();
    files
}

fn flip_byte(path: &Path, from_end: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    let at = bytes.len() - from_end;
    bytes[at] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_state_dir_is_set_aside_and_kvgate_serves_only_the_engines_blocks() {
    type Damage = fn(&Path);
    let damages: [(&str, Damage); 5] = [
        ("flipped checkpoint byte", |dir| {
            let checkpoint = state_files(dir, "checkpoint-").pop().unwrap();
            flip_byte(&checkpoint, 100);
        }),
        ("flipped segment byte", |dir| {
            let segment = state_files(dir, "segment-").pop().unwrap();
            flip_byte(&segment, 30);
        }),
        ("truncated segment", |dir| {
            let segment = state_files(dir, "segment-").pop().unwrap();
            let len = std::fs::metadata(&segment).unwrap().len();
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(&segment)
                .unwrap();
            file.set_len(len / 2).unwrap();
        }),
        ("unknown version and a directory for a checkpoint", |dir| {
            for segment in state_files(dir, "segment-") {
                let mut bytes = std::fs::read(&segment).unwrap();
                bytes[8] = 99;
                std::fs::write(&segment, bytes).unwrap();
            }
            let checkpoint = state_files(dir, "checkpoint-").pop().unwrap();
            std::fs::remove_file(&checkpoint).unwrap();
            std::fs::create_dir(&checkpoint).unwrap();
        }),
        ("checkpoint and segment swapped", |dir| {
            let checkpoint = state_files(dir, "checkpoint-").pop().unwrap();
            let segment = state_files(dir, "segment-").pop().unwrap();
            let aside = dir.join("aside");
            std::fs::rename(&checkpoint, &aside).unwrap();
            std::fs::rename(&segment, &checkpoint).unwrap();
            std::fs::rename(&aside, &segment).unwrap();
        }),
    ];
    for (what, damage) in damages {
        let scratch = ScratchDir::new("damage");
        // A ring that holds everything: even started fresh, kvgate can know
        // every block, so anything else in a snapshot would be a lie.
        let mut engine = Engine::new(10_000, 3).await;
        fill_state_dir(&mut engine, &scratch.state()).await;
        assert!(!state_files(&scratch.state(), "checkpoint-").is_empty());
        damage(&scratch.state());

        let gateway = engine.gateway(&scratch.state());
        let mut router = RouterView::new();
        let mut stream = resume(&gateway, &mut router).await;
        catch_up(&mut engine, &mut stream, &mut router, what).await;
        assert_eq!(router.blocks(0), true_blocks(&engine.cache), "{what}");
        let fresh = snapshot(&gateway).await;
        assert_eq!(fresh.blocks(0), true_blocks(&engine.cache), "{what}");
        let (_, text) = http_get(gateway.admin.unwrap(), "/metrics").await;
        let damaged: f64 = ["checksum", "unknown_version", "not_a_file", "malformed"]
            .iter()
            .filter_map(|kind| {
                metric_sample(
                    &text,
                    &format!("kvgate_state_damaged_total{{reason=\"{kind}\"}}"),
                )
            })
            .sum();
        if what != "truncated segment" {
            assert!(damaged >= 1.0, "{what}: nothing set aside");
            let kept = std::fs::read_dir(scratch.state())
                .unwrap()
                .filter(|entry| {
                    entry
                        .as_ref()
                        .unwrap()
                        .file_name()
                        .to_str()
                        .unwrap()
                        .contains(".damaged-")
                })
                .count();
            assert!(kept >= 1, "{what}: the damaged file is kept");
        }
    }
}

/// Makes every file kvgate writes stop growing at 64 KiB (`RLIMIT_FSIZE`):
/// the log fills, and from then on the disk takes no byte of it.
fn files_stop_at_64_kib(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: 64 << 10,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Publishes, followed by `router`, until `gateway` pauses persistence.
async fn follow_until_paused(
    engine: &mut Engine,
    gateway: &Gateway,
    stream: &mut Streaming<KvEventBatch>,
    router: &mut RouterView,
    context: &str,
) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while metric(gateway, "kvgate_state_paused").await == 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{context}: never paused"
        );
        engine.steps(10).await;
        catch_up(engine, stream, router, context).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_that_fills_pauses_persistence_while_serving_goes_on_and_it_resumes() {
    let scratch = ScratchDir::new("full");
    let mut engine = Engine::new(10_000, 5).await;
    let gateway = engine.gateway_configured(&scratch.state(), &[], files_stop_at_64_kib);
    let admin = gateway.admin.unwrap();
    let mut router = RouterView::new();
    let mut stream = resume(&gateway, &mut router).await;
    follow_until_paused(&mut engine, &gateway, &mut stream, &mut router, "filling").await;
    let (_, status) = http_get(admin, "/status").await;
    assert!(status.contains("File too large"), "{status}");
    // Serving went on.
    engine.steps(5).await;
    catch_up(&mut engine, &mut stream, &mut router, "paused").await;
    assert_eq!(router.blocks(0), true_blocks(&engine.cache));
    assert!(router.gaps.is_empty());
    // A new segment fits again: persistence resumes (at the next cycle
    // after its retry delay) with a checkpoint.
    let checkpoints = metric(&gateway, "kvgate_state_checkpoints_total").await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while metric(&gateway, "kvgate_state_paused").await == 1.0 {
        assert!(tokio::time::Instant::now() < deadline, "never resumed");
        engine.step().await;
        catch_up(&mut engine, &mut stream, &mut router, "resuming").await;
    }
    await_metric_where(
        admin,
        "kvgate_state_checkpoints_total",
        "a new checkpoint",
        |now| now > checkpoints,
    )
    .await;
    assert!(metric(&gateway, "kvgate_state_write_failures_total").await >= 1.0);
}

/// Engine messages kvgate has taken from rank 0's publisher.
async fn messages_taken(gateway: &Gateway) -> f64 {
    let (_, text) = http_get(gateway.admin.unwrap(), "/metrics").await;
    metric_sample(&text, "kvgate_engine_messages_total{rank=\"0\"}").unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_position_is_announced_or_cut_for_a_snapshot_before_its_batch_is_in_the_log_and_serving_goes_on_while_the_write_waits()
 {
    let scratch = ScratchDir::new("held-log");
    let mut engine = Engine::new(1000, 13).await;
    // A disk slower than this pauses persistence instead (below).
    let gateway = engine.gateway_configured(
        &scratch.state(),
        &["--state-io-timeout-ms", "10000"],
        |_| {},
    );
    let mut router = RouterView::new();
    let mut early = resume(&gateway, &mut router).await;
    // The first segment of a new directory starts at position 1; the log
    // writer opens it at its first cycle, and that open now waits for a
    // reader, as a write waits for a slow disk.
    let segment = scratch.state().join("segment-00000000000000000001.log");
    common::replace_with_fifo(&segment);
    past_the_slow_joiner(&mut engine, &gateway).await;
    // The source goes on taking the engine's messages while the first
    // write waits (the drain takes up to its bound of cycles out): the
    // admin port answers, and so would the engine's.
    let taken = messages_taken(&gateway).await;
    engine.steps(10).await;
    await_metric_where(
        gateway.admin.unwrap(),
        "kvgate_engine_messages_total{rank=\"0\"}",
        "the ten steps taken",
        |now| now >= taken + 10.0,
    )
    .await;
    let channel = gateway.channel().await;
    let late = tokio::spawn(async move {
        let mut stream = subscribe(channel, SERVICE, 0).await.expect("subscribed");
        let mut view = RouterView::new();
        let first = next_batch(&mut stream).await;
        let count = first.snapshot.as_ref().expect("a snapshot chunk").count;
        admit(&mut view, &first, "late snapshot");
        for _ in 1..count {
            admit(&mut view, &next_batch(&mut stream).await, "late snapshot");
        }
        view
    });
    // Nothing written, so nothing announced and no cut: for a while,
    // neither subscriber gets a byte.
    let window = std::time::Duration::from_millis(500);
    if let Ok(message) = tokio::time::timeout(window, early.message()).await {
        panic!("announced before it was written: {message:?}");
    }
    assert!(
        !late.is_finished(),
        "a snapshot cut before the log was written"
    );

    let reader = std::thread::spawn(move || std::fs::read(segment).unwrap());
    catch_up(&mut engine, &mut early, &mut router, "released").await;
    assert_eq!(router.blocks(0), true_blocks(&engine.cache));
    assert!(router.gaps.is_empty(), "{:?}", router.gaps);
    let late = tokio::time::timeout(DEADLINE, late)
        .await
        .expect("the snapshot once the log was written")
        .unwrap();
    assert_eq!(late.blocks(0), true_blocks(&engine.cache));
    drop(gateway);
    let log = reader.join().unwrap();
    assert!(
        log.starts_with(b"KVGLOG\0\0"),
        "the log went to the held segment"
    );
}

/// Publishes fences until kvgate has taken one of the engine's messages
/// (past the engine socket's slow joiner; a fence removes nothing).
async fn past_the_slow_joiner(engine: &mut Engine, gateway: &Gateway) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut fence = 1u64 << 40;
    while messages_taken(gateway).await == 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "no message taken");
        engine
            .publisher
            .publish(common::fence_payload(fence, 0))
            .await
            .unwrap();
        fence += 1;
    }
}

/// A kvgate on `dir`, and a router following it past the engine's first
/// steps.
async fn followed(
    engine: &mut Engine,
    dir: &Path,
) -> (Gateway, RouterView, Streaming<KvEventBatch>) {
    let gateway = engine.gateway(dir);
    let mut router = RouterView::new();
    let mut stream = resume(&gateway, &mut router).await;
    past_the_slow_joiner(engine, &gateway).await;
    engine.steps(10).await;
    catch_up(engine, &mut stream, &mut router, "before").await;
    (gateway, router, stream)
}

/// A new subscriber's view once the engine's newest message is in.
async fn snapshot_caught_up(engine: &mut Engine, gateway: &Gateway) -> RouterView {
    let mut router = RouterView::new();
    let mut stream = resume(gateway, &mut router).await;
    catch_up(engine, &mut stream, &mut router, "a new subscriber").await;
    router
}

/// Asserts `gateway` refuses `cursor` as a cursor of another numbering.
async fn refused_as_a_cursor(gateway: &Gateway, cursor: u64) {
    let refused = subscribe(gateway.channel().await, SERVICE, cursor)
        .await
        .expect_err("a cursor of another numbering");
    assert_eq!(
        refused.code(),
        tonic::Code::OutOfRange,
        "{cursor}: {refused:?}"
    );
}

/// `/status`'s restore outcome.
async fn restore_outcome(gateway: &Gateway) -> String {
    let (_, status) = http_get(gateway.admin.unwrap(), "/status").await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    status["state_dir"]["restored"]["outcome"]
        .as_str()
        .unwrap_or_else(|| panic!("no outcome in {status}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_of_the_log_that_hangs_pauses_persistence_delivery_goes_on_health_says_why_and_sigterm_ends_it()
 {
    let scratch = ScratchDir::new("hung-open");
    let mut engine = Engine::new(1000, 17).await;
    let mut gateway =
        engine.gateway_configured(&scratch.state(), &["--state-io-timeout-ms", "250"], |_| {});
    let admin = gateway.admin.unwrap();
    let mut router = RouterView::new();
    let mut stream = resume(&gateway, &mut router).await;
    // The next segment's open waits for a reader forever, as an open on a
    // dead network mount does.
    common::replace_with_fifo(&scratch.state().join("segment-00000000000000000001.log"));
    past_the_slow_joiner(&mut engine, &gateway).await;
    engine.steps(30).await;
    catch_up(&mut engine, &mut stream, &mut router, "hung open").await;
    assert_eq!(router.blocks(0), true_blocks(&engine.cache));
    assert!(router.gaps.is_empty(), "{:?}", router.gaps);
    // A new subscriber's snapshot holds it all too.
    assert_eq!(
        snapshot(&gateway).await.blocks(0),
        true_blocks(&engine.cache)
    );
    assert_eq!(metric(&gateway, "kvgate_state_paused").await, 1.0);
    let (code, _) = http_get(admin, "/healthz").await;
    assert_eq!(code, 200, "serving, persistence paused");
    let (_, status) = http_get(admin, "/status").await;
    assert!(
        status.contains("opening a log segment: did not complete within 250ms"),
        "{status}"
    );
    let asked = std::time::Instant::now();
    assert!(gateway.terminate().success());
    assert!(
        asked.elapsed() < std::time::Duration::from_secs(5),
        "SIGTERM took {:?} with the writer hung",
        asked.elapsed()
    );
    drain_after_stop(&mut stream, &mut router, "stopped").await;

    // The log holds none of the batches announced: the next process
    // numbers anew, and the router's cursor is refused as a cursor.
    std::fs::remove_file(scratch.state().join("segment-00000000000000000001.log")).unwrap();
    let gateway = engine.gateway(&scratch.state());
    assert_eq!(restore_outcome(&gateway).await, "empty");
    refused_as_a_cursor(&gateway, router.resume_cursor()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_kvgate_whose_disk_took_nothing_after_a_point_restarts_under_a_numbering_no_cursor_of_the_old_reaches()
 {
    let scratch = ScratchDir::new("took-nothing");
    let mut engine = Engine::new(10_000, 19).await;
    let gateway = engine.gateway_configured(&scratch.state(), &[], files_stop_at_64_kib);
    let mut router = RouterView::new();
    let mut stream = resume(&gateway, &mut router).await;
    follow_until_paused(&mut engine, &gateway, &mut stream, &mut router, "filling").await;
    // Announced while the log takes nothing: a cursor in the middle of
    // them, and the last.
    engine.steps(5).await;
    catch_up(&mut engine, &mut stream, &mut router, "paused").await;
    let middle = router.resume_cursor();
    engine.steps(5).await;
    catch_up(&mut engine, &mut stream, &mut router, "paused").await;
    let last = router.resume_cursor();
    assert!(last > middle);
    kill(gateway, &mut stream, &mut router).await;

    let gateway = engine.gateway(&scratch.state());
    assert_eq!(restore_outcome(&gateway).await, "renumbered");
    for cursor in [middle, last] {
        refused_as_a_cursor(&gateway, cursor).await;
    }
    // The state kept goes on, the engine's replay filling what the log
    // lacks.
    assert_eq!(
        snapshot_caught_up(&mut engine, &gateway).await.blocks(0),
        true_blocks(&engine.cache)
    );
}

/// The names of the segments in `dir`.
fn segment_names(dir: &Path) -> Vec<String> {
    state_files(dir, "segment-")
        .iter()
        .map(|path| path.file_name().unwrap().to_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kvgate_whose_state_dir_was_replaced_pauses_saying_why_and_never_writes_into_the_new_one()
{
    let scratch = ScratchDir::new("replaced");
    let mut engine = Engine::new(1000, 23).await;
    let (first, mut router, mut stream) = followed(&mut engine, &scratch.state()).await;
    // The directory is moved away, a new one made at its path, and a
    // second kvgate takes it.
    std::fs::rename(scratch.state(), scratch.0.join("moved")).unwrap();
    let second = engine.gateway(&scratch.state());
    assert_eq!(restore_outcome(&second).await, "empty");
    follow_until_paused(&mut engine, &first, &mut stream, &mut router, "replaced").await;
    // Past the pause's retry: the first kvgate tries a new segment, and
    // finds the directory still not its own.
    let paused = std::time::Instant::now();
    while paused.elapsed() < std::time::Duration::from_millis(1500) {
        engine.steps(5).await;
        catch_up(&mut engine, &mut stream, &mut router, "replaced").await;
    }
    assert_eq!(metric(&first, "kvgate_state_paused").await, 1.0);
    let (_, status) = http_get(first.admin.unwrap(), "/status").await;
    assert!(status.contains("the directory was replaced"), "{status}");
    assert_eq!(
        router.blocks(0),
        true_blocks(&engine.cache),
        "delivery went on"
    );
    assert!(router.gaps.is_empty(), "{:?}", router.gaps);
    // Every segment in the new directory is the second kvgate's (a new
    // numbering's log starts at position 1; the first's is far past it).
    assert_eq!(
        segment_names(&scratch.state()),
        ["segment-00000000000000000001.log"]
    );
    let synced = std::fs::read(scratch.state().join("synced")).unwrap();
    let moved_synced = std::fs::read(scratch.0.join("moved").join("synced")).unwrap();
    assert_ne!(synced, moved_synced);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kvgate_whose_lock_was_taken_from_under_it_pauses_and_the_new_owner_numbers_anew() {
    let scratch = ScratchDir::new("lock-replaced");
    let mut engine = Engine::new(1000, 29).await;
    let (first, mut router, mut stream) = followed(&mut engine, &scratch.state()).await;
    // The lock file alone is unlinked: a second kvgate locks a new one.
    std::fs::remove_file(scratch.state().join("lock")).unwrap();
    let second = engine.gateway(&scratch.state());
    // The first still runs and announces: its numbering is not the
    // second's to continue.
    assert_eq!(restore_outcome(&second).await, "renumbered");
    follow_until_paused(&mut engine, &first, &mut stream, &mut router, "lock taken").await;
    // (Until the second kvgate made its lock, the first found none.)
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let (_, status) = http_get(first.admin.unwrap(), "/status").await;
        if status.contains("lock was replaced") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status}");
        engine.steps(1).await;
        catch_up(&mut engine, &mut stream, &mut router, "lock taken").await;
    }
    assert_eq!(
        router.blocks(0),
        true_blocks(&engine.cache),
        "delivery went on"
    );
    // The first's cursor means nothing to the second.
    refused_as_a_cursor(&second, router.resume_cursor()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segment_with_a_sparse_tail_of_64_gib_is_read_past_and_the_cursor_resumes() {
    let scratch = ScratchDir::new("sparse");
    let mut engine = Engine::new(1000, 31).await;
    let mut router = RouterView::new();
    let mut gateway = engine.gateway(&scratch.state());
    let mut stream = resume(&gateway, &mut router).await;
    engine.steps(20).await;
    catch_up(&mut engine, &mut stream, &mut router, "before").await;
    assert!(gateway.terminate().success());
    drain_after_stop(&mut stream, &mut router, "stopped").await;
    let newest = state_files(&scratch.state(), "segment-").pop().unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&newest)
        .unwrap()
        .set_len(64 << 30)
        .unwrap();

    let gateway = engine.gateway(&scratch.state());
    assert_eq!(restore_outcome(&gateway).await, "continued");
    let mut stream = resume(&gateway, &mut router).await;
    engine.steps(5).await;
    catch_up(&mut engine, &mut stream, &mut router, "after").await;
    assert_eq!(router.blocks(0), true_blocks(&engine.cache));
    assert!(router.gaps.is_empty(), "{:?}", router.gaps);
}

/// Our state directory, filled by our engine (seeded `seeds.0`), and
/// another kvgate's, filled `their_runs` times by another engine: the
/// directories and our engine.
async fn ours_and_anothers(
    name: &str,
    seeds: (u64, u64),
    their_runs: usize,
) -> (ScratchDir, ScratchDir, Engine) {
    let ours = ScratchDir::new(&format!("own-{name}"));
    let theirs = ScratchDir::new(&format!("their-{name}"));
    let mut engine = Engine::new(1000, seeds.0).await;
    let mut other = Engine::new(1000, seeds.1).await;
    fill_state_dir(&mut engine, &ours.state()).await;
    for _ in 0..their_runs {
        fill_state_dir(&mut other, &theirs.state()).await;
    }
    (ours, theirs, engine)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_kvgates_checkpoint_copied_in_is_set_aside_never_served() {
    let (ours, theirs, engine) = ours_and_anothers("checkpoint", (37, 41), 1).await;
    // Theirs in place of ours: the only checkpoint, named as written.
    for own in state_files(&ours.state(), "checkpoint-") {
        std::fs::remove_file(own).unwrap();
    }
    let copied = state_files(&theirs.state(), "checkpoint-").pop().unwrap();
    std::fs::copy(&copied, ours.state().join(copied.file_name().unwrap())).unwrap();

    let gateway = engine.gateway(&ours.state());
    let (_, status) = http_get(gateway.admin.unwrap(), "/status").await;
    assert!(status.contains(": foreign"), "{status}");
    let fresh = snapshot(&gateway).await;
    assert_eq!(fresh.blocks(0), true_blocks(&engine.cache));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_kvgates_segment_copied_in_is_set_aside_never_served() {
    // Theirs ran longer: its newest segment is named after ours.
    let (ours, theirs, engine) = ours_and_anothers("segment", (43, 47), 2).await;
    let own_newest = state_files(&ours.state(), "segment-").pop().unwrap();
    let copied = state_files(&theirs.state(), "segment-").pop().unwrap();
    let name = copied.file_name().unwrap();
    assert!(
        name > own_newest.file_name().unwrap(),
        "{copied:?} after {own_newest:?}"
    );
    std::fs::copy(&copied, ours.state().join(name)).unwrap();

    let gateway = engine.gateway(&ours.state());
    assert_eq!(restore_outcome(&gateway).await, "continued");
    let (_, status) = http_get(gateway.admin.unwrap(), "/status").await;
    assert!(status.contains(": foreign"), "{status}");
    assert_eq!(
        metric(&gateway, "kvgate_state_damaged_total{reason=\"foreign\"}").await,
        1.0
    );
    assert!(!ours.state().join(name).exists(), "renamed aside");
    let fresh = snapshot(&gateway).await;
    assert_eq!(fresh.blocks(0), true_blocks(&engine.cache));
}

// The state directory on a real file system that fails under kvgate: an
// ext4 image on a loop device, frozen (`fsfreeze`, as a snapshot tool or a
// hung storage path does) or shut down (`FS_IOC_SHUTDOWN`, as
// `errors=remount-ro` or a dying disk does). These need root, a loop
// device, `mkfs.ext4` and `fsfreeze`: without them they are skipped,
// except in CI (`CI=true`), where they fail (`.ci/run` installs the tools).

/// kvgate's shutdown grace, and what a stop may take beyond it (the
/// runtime's own exit).
const SIGTERM_WITHIN: Duration = Duration::from_secs(5);

/// An ext4 file system on a loop device, mounted for one test; unmounted
/// (thawed first) and removed when dropped.
struct LoopFs {
    image: PathBuf,
    mount: PathBuf,
}

impl LoopFs {
    /// `None` (the test is skipped) where this machine cannot make one,
    /// unless in CI, where that fails the test.
    fn new(name: &str) -> Option<Self> {
        let base = std::env::temp_dir().join(format!("disk-faults-{name}-{}", std::process::id()));
        let image = base.with_extension("img");
        let mount = base.with_extension("mnt");
        // SAFETY: geteuid cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let made = root
            && std::fs::File::create(&image)
                .and_then(|file| file.set_len(64 << 20))
                .is_ok()
            && run("mkfs.ext4", &["-q", "-F", image.to_str().unwrap()])
            && std::fs::create_dir_all(&mount).is_ok()
            && run(
                "mount",
                &[
                    "-o",
                    "loop",
                    image.to_str().unwrap(),
                    mount.to_str().unwrap(),
                ],
            );
        if made {
            return Some(Self { image, mount });
        }
        let _ = std::fs::remove_file(&image);
        let _ = std::fs::remove_dir(&mount);
        let in_ci = std::env::var("CI").is_ok_and(|ci| ci == "true" || ci == "1");
        let why = "needs root, a loop device, mkfs.ext4 (e2fsprogs) and fsfreeze (util-linux)";
        assert!(!in_ci, "a loop-mounted ext4 cannot be made in CI: {why}");
        eprintln!("SKIPPED: a loop-mounted ext4 cannot be made here ({why})");
        None
    }

    fn dir(&self, name: &str) -> PathBuf {
        self.mount.join(name)
    }

    fn freeze(&self) {
        assert!(run("fsfreeze", &["-f", self.mount.to_str().unwrap()]));
    }

    fn thaw(&self) {
        let _ = run("fsfreeze", &["-u", self.mount.to_str().unwrap()]);
    }

    /// Every write, open and rename from now on fails with EIO, and what
    /// was not in the journal is lost, as on a disk that died.
    fn shut_down(&self) {
        let root = std::fs::File::open(&self.mount).unwrap();
        // FS_IOC_SHUTDOWN (_IOR('X', 125, __u32)), without flushing the log.
        const FS_IOC_SHUTDOWN: libc::c_ulong = 0x8004_587D;
        const NOLOGFLUSH: u32 = 2;
        let flags = NOLOGFLUSH;
        use std::os::unix::io::AsRawFd;
        // SAFETY: the ioctl reads one u32 through the pointer, which lives
        // across the call.
        let done = unsafe { libc::ioctl(root.as_raw_fd(), FS_IOC_SHUTDOWN, &flags) };
        assert_eq!(done, 0, "{}", std::io::Error::last_os_error());
    }

    /// Commits everything written so far to the disk.
    fn sync(&self) {
        assert!(run("sync", &["-f", self.mount.to_str().unwrap()]));
    }

    /// Unmounts and mounts again: what the journal kept is all there is.
    fn remount(&self) {
        assert!(run("umount", &[self.mount.to_str().unwrap()]));
        assert!(run(
            "mount",
            &[
                "-o",
                "loop",
                self.image.to_str().unwrap(),
                self.mount.to_str().unwrap()
            ],
        ));
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        self.thaw();
        remove_marks_of_dirs_in(&self.mount);
        let _ = run("umount", &["-l", self.mount.to_str().unwrap()]);
        let _ = std::fs::remove_dir(&self.mount);
        let _ = std::fs::remove_file(&self.image);
    }
}

fn run(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .output()
        .is_ok_and(|output| output.status.success())
}

/// Sends SIGTERM and waits for `stream` to end: the gateway stopped
/// serving. Returns how long that took.
async fn terminate_and_see_the_stream_end(
    gateway: &mut Gateway,
    stream: &mut Streaming<KvEventBatch>,
) -> Duration {
    let asked = Instant::now();
    assert!(run("kill", &["-TERM", &gateway.pid().to_string()]));
    loop {
        match tokio::time::timeout(DEADLINE, stream.message()).await {
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None) | Err(_)) => return asked.elapsed(),
            Err(_) => panic!("the stream did not end after SIGTERM"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_file_system_pauses_persistence_while_every_batch_is_delivered_health_says_why_and_sigterm_ends_it()
 {
    let Some(fs) = LoopFs::new("freeze") else {
        return;
    };
    for workers in ["1", "2"] {
        let context = format!("--worker-threads {workers}");
        let mut engine = Engine::new(10_000, 43).await;
        let mut gateway = engine.gateway_configured(
            &fs.dir(&format!("state-{workers}")),
            &["--worker-threads", workers, "--state-io-timeout-ms", "250"],
            |_| {},
        );
        let admin = gateway.admin.unwrap();
        let mut router = RouterView::new();
        let mut stream = resume(&gateway, &mut router).await;
        engine.steps(5).await;
        catch_up(&mut engine, &mut stream, &mut router, &context).await;

        fs.freeze();
        engine.steps(30).await;
        catch_up(&mut engine, &mut stream, &mut router, &context).await;
        assert_eq!(router.blocks(0), true_blocks(&engine.cache), "{context}");
        assert!(router.gaps.is_empty(), "{context}: {:?}", router.gaps);
        assert_eq!(
            snapshot(&gateway).await.blocks(0),
            true_blocks(&engine.cache),
            "{context}: a new subscriber's snapshot"
        );
        let (code, _) = http_get(admin, "/healthz").await;
        assert_eq!(code, 200, "{context}");
        assert_eq!(
            metric(&gateway, "kvgate_state_paused").await,
            1.0,
            "{context}"
        );
        let (_, status) = http_get(admin, "/status").await;
        assert!(
            status.contains("did not complete within 250ms"),
            "{context}: {status}"
        );

        let took = terminate_and_see_the_stream_end(&mut gateway, &mut stream).await;
        assert!(took < SIGTERM_WITHIN, "{context}: SIGTERM took {took:?}");
        // The writer thread sleeps in the frozen file system until it
        // thaws; the process is gone once it does.
        fs.thaw();
        assert!(gateway.terminate().success(), "{context}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_system_shut_down_under_kvgate_then_a_kill_never_lets_the_next_process_reuse_a_number()
 {
    let Some(fs) = LoopFs::new("shutdown") else {
        return;
    };
    let dir = fs.dir("state");
    let mut engine = Engine::new(10_000, 47).await;
    let gateway = engine.gateway(&dir);
    let mut router = RouterView::new();
    let mut stream = resume(&gateway, &mut router).await;
    engine.steps(10).await;
    catch_up(&mut engine, &mut stream, &mut router, "before").await;
    // The log so far is on the disk, verified to its end after the kill.
    fs.sync();

    fs.shut_down();
    engine.steps(15).await;
    catch_up(&mut engine, &mut stream, &mut router, "shut down").await;
    let middle = router.resume_cursor();
    engine.steps(15).await;
    catch_up(&mut engine, &mut stream, &mut router, "shut down").await;
    let last = router.resume_cursor();
    assert_eq!(
        router.blocks(0),
        true_blocks(&engine.cache),
        "delivery went on"
    );
    assert_eq!(metric(&gateway, "kvgate_state_paused").await, 1.0);
    // As the OOM killer does.
    drop(gateway);
    fs.remount();

    let gateway = engine.gateway(&dir);
    let outcome = restore_outcome(&gateway).await;
    assert_eq!(outcome, "renumbered");
    for cursor in [middle, last] {
        refused_as_a_cursor(&gateway, cursor).await;
    }
    // The state kept goes on, the engine's replay filling what the log
    // lacks.
    assert_eq!(
        snapshot_caught_up(&mut engine, &gateway).await.blocks(0),
        true_blocks(&engine.cache)
    );
}

/// The state of each of `pid`'s threads (`R`, `S`, `D`, `Z`...).
fn thread_states(pid: u32) -> Vec<char> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten();
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("stat")).ok())
        .filter_map(|stat| {
            let after_name = &stat[stat.rfind(')')? + 1..];
            after_name.trim_start().chars().next()
        })
        .collect()
}

/// The state of `pid`'s main thread.
fn main_thread_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_kvgate_whose_state_dir_hangs_while_it_is_read_back() {
    let Some(fs) = LoopFs::new("frozen-start") else {
        return;
    };
    let dir = fs.dir("state");
    let engine = Engine::new(1000, 53).await;
    assert!(engine.gateway(&dir).terminate().success());
    fs.freeze();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--zmq-endpoint"])
        .arg(engine.publisher.endpoint())
        .arg("--state-dir")
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Taking the directory writes its lock: the start sleeps in the frozen
    // file system, before any port is bound.
    poll_until("never reached the frozen disk", DEADLINE, || {
        thread_states(pid).contains(&'D')
    })
    .await;
    assert!(run("kill", &["-TERM", &pid.to_string()]));
    poll_until(
        "SIGTERM while reading the directory back was not taken",
        SIGTERM_WITHIN,
        || main_thread_state(pid).is_none_or(|state| state == 'Z'),
    )
    .await;
    // The thread asleep in the file system goes once it thaws.
    fs.thaw();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_a_frozen_file_system_thaws_persistence_resumes_and_a_kill_after_the_new_checkpoint_continues_the_numbering()
 {
    let Some(fs) = LoopFs::new("thaw") else {
        return;
    };
    let dir = fs.dir("state");
    let mut engine = Engine::new(10_000, 59).await;
    let gateway = engine.gateway_configured(&dir, &["--state-io-timeout-ms", "1000"], |_| {});
    let admin = gateway.admin.unwrap();
    let mut router = RouterView::new();
    let mut stream = resume(&gateway, &mut router).await;
    engine.steps(10).await;
    catch_up(&mut engine, &mut stream, &mut router, "before").await;
    fs.freeze();
    follow_until_paused(&mut engine, &gateway, &mut stream, &mut router, "frozen").await;
    engine.steps(10).await;
    catch_up(&mut engine, &mut stream, &mut router, "frozen").await;

    fs.thaw();
    let checkpoints = metric(&gateway, "kvgate_state_checkpoints_total").await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while metric(&gateway, "kvgate_state_paused").await == 1.0 {
        assert!(tokio::time::Instant::now() < deadline, "never resumed");
        engine.steps(1).await;
        catch_up(&mut engine, &mut stream, &mut router, "thawed").await;
    }
    // The log is whole again from a new checkpoint on.
    await_metric_where(
        admin,
        "kvgate_state_checkpoints_total",
        "a new checkpoint",
        |now| now > checkpoints,
    )
    .await;
    engine.steps(5).await;
    catch_up(&mut engine, &mut stream, &mut router, "resumed").await;
    kill(gateway, &mut stream, &mut router).await;

    let gateway = engine.gateway(&dir);
    assert_eq!(restore_outcome(&gateway).await, "continued");
    let mut stream = resume(&gateway, &mut router).await;
    engine.steps(5).await;
    catch_up(&mut engine, &mut stream, &mut router, "continued").await;
    assert_eq!(router.blocks(0), true_blocks(&engine.cache));
    assert!(router.gaps.is_empty(), "{:?}", router.gaps);
    assert_eq!(router.restarts, 0);
}
