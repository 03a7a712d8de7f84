//! The state directory on a real file system that fails under kvgate: an
//! ext4 image on a loop device, frozen (`fsfreeze`, as a snapshot tool or a
//! hung storage path does) or shut down (`FS_IOC_SHUTDOWN`, as
//! `errors=remount-ro` or a dying disk does). Routers see every announced
//! batch, health says why persistence paused, SIGTERM ends kvgate within
//! its grace, and no number is reused after a kill.
//!
//! These need root, a loop device, `mkfs.ext4` and `fsfreeze`: without them
//! they are skipped, except in CI (`CI=true`), where they fail.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::router::{Admission, RouterView};
use common::{
    DEADLINE, Gateway, http_get, metric_sample, next_batch, subscribe, sync_streams_observing,
    true_blocks,
};
use kvgate::proto::common::KvEventBatch;
use kvgate_sim::{EnginePublisher, PublisherOptions, SimConfig, SimEngine, encode_batch};
use tonic::codec::Streaming;

const SERVICE: &str = "kvgate.v1.KvGate";

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

/// The engine side: a simulated cache published through a real PUB with a
/// replay ring.
struct Engine {
    cache: SimEngine,
    publisher: EnginePublisher,
}

impl Engine {
    async fn new(seed: u64) -> Self {
        let options = PublisherOptions {
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            buffer_steps: 10_000,
            ..PublisherOptions::default()
        };
        Self {
            cache: SimEngine::new(SimConfig {
                seed,
                block_size: 4,
                capacity_blocks: 600,
                ..SimConfig::default()
            })
            .unwrap(),
            publisher: EnginePublisher::bind("tcp://127.0.0.1:0", &options)
                .await
                .unwrap(),
        }
    }

    async fn steps(&mut self, steps: usize) {
        for _ in 0..steps {
            let mut payload = Vec::new();
            encode_batch(1.0, &self.cache.step(), Some(0), &mut payload);
            self.publisher.publish(payload.into()).await.unwrap();
        }
    }

    fn gateway(&self, dir: &Path, extra: &[&str]) -> Gateway {
        let mut args = vec![
            "--zmq-endpoint",
            self.publisher.endpoint(),
            "--zmq-replay-endpoint",
            self.publisher.replay_endpoint().unwrap(),
            "--metrics-listen",
            "127.0.0.1:0",
            "--state-sync-ms",
            "50",
            "--state-dir",
            dir.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        Gateway::start(&args)
    }
}

fn admit(router: &mut RouterView, batch: &KvEventBatch, context: &str) {
    let admission = router.admit(batch);
    assert!(
        matches!(
            admission,
            Admission::Applied | Admission::SnapshotChunk | Admission::LoadOnly
        ),
        "{context}: batch {} admitted as {admission:?}",
        batch.sequence_number
    );
}

async fn resume(gateway: &Gateway, router: &mut RouterView) -> Streaming<KvEventBatch> {
    router.reconnecting();
    let cursor = router.resume_cursor();
    subscribe(gateway.channel().await, SERVICE, cursor)
        .await
        .unwrap_or_else(|status| panic!("cursor {cursor} refused: {status:?}"))
}

/// Follows `stream` until the engine's newest message is in.
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
        admit(&mut router, &next_batch(&mut stream).await, "snapshot");
    }
    router
}

async fn metric(gateway: &Gateway, series: &str) -> f64 {
    let (_, text) = http_get(gateway.admin.unwrap(), "/metrics").await;
    metric_sample(&text, series).unwrap_or_else(|| panic!("no {series}"))
}

async fn restore_outcome(gateway: &Gateway) -> String {
    let (_, status) = http_get(gateway.admin.unwrap(), "/status").await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    status["state_dir"]["restored"]["outcome"]
        .as_str()
        .unwrap_or_else(|| panic!("no outcome in {status}"))
        .to_owned()
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
        let mut engine = Engine::new(43).await;
        let mut gateway = engine.gateway(
            &fs.dir(&format!("state-{workers}")),
            &["--worker-threads", workers],
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
    let mut engine = Engine::new(47).await;
    let gateway = engine.gateway(&dir, &[]);
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

    let gateway = engine.gateway(&dir, &[]);
    let outcome = restore_outcome(&gateway).await;
    assert_eq!(outcome, "renumbered");
    for cursor in [middle, last] {
        let refused = subscribe(gateway.channel().await, SERVICE, cursor)
            .await
            .expect_err("a cursor of the old numbering");
        assert_eq!(
            refused.code(),
            tonic::Code::OutOfRange,
            "{outcome}: {refused:?}"
        );
    }
    // The state kept goes on, the engine's replay filling what the log
    // lacks.
    let mut fresh = RouterView::new();
    let mut stream = resume(&gateway, &mut fresh).await;
    catch_up(&mut engine, &mut stream, &mut fresh, "renumbered").await;
    assert_eq!(fresh.blocks(0), true_blocks(&engine.cache));
}
