//! Files kvgate plays or reads are untrusted input, whatever the path
//! names: a FIFO or a device as `--replay-file`, `--trace-file`, a
//! recording's next part, `kvgate tail --file` or `kvgate record --stats`
//! is refused without waiting for it, naming the file and what it is; a
//! trace line under `--trace-max-line-bytes` costs a bounded amount of
//! memory whatever blocks it claims; a looped file that plays nothing stops
//! looping; a recording's frame of millions of tiny records costs its bytes,
//! not millions of records held at once.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::recording::{Scratch, header, store_batch, writer};
use common::router::RouterView;
use common::{DEADLINE, Gateway, next_batch, output_within_deadline, subscribe};
use kvgate::proto::common::KvEventBatch;
use prost::Message as _;

/// Runs `kvgate <args>` to its end (killed by pid past the deadline).
fn kvgate(args: &[&str]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate starts");
    output_within_deadline(child)
}

/// `kvgate serve` with `args`, expected to refuse to start: its stderr.
fn serve_refused(args: &[&str]) -> String {
    let mut all = vec!["serve", "--listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let output = kvgate(&all);
    assert!(!output.status.success(), "kvgate serve {args:?} started");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A gateway playing `args`, subscribed from a snapshot, read until rank
/// 0 holds `block`.
async fn await_block(gateway: &Gateway, block: i64) -> RouterView {
    let mut stream = subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
        .await
        .unwrap();
    let mut view = RouterView::new();
    while !view.blocks(0).contains_key(&block) {
        let batch = next_batch(&mut stream).await;
        view.admit(&batch);
    }
    view
}

#[test]
fn a_fifo_a_device_or_a_directory_as_an_input_file_is_refused_at_once_naming_it() {
    let scratch = Scratch::new("kinds");
    let fifo = scratch.path("fifo");
    common::replace_with_fifo(&fifo);
    let fifo = fifo.to_str().unwrap();
    let dir = scratch.0.to_str().unwrap();
    let cases: [(&[&str], &str, &str); 6] = [
        (&["--replay-file", fifo], fifo, "a FIFO, not a regular file"),
        (&["--trace-file", fifo], fifo, "a FIFO, not a regular file"),
        (
            &["--trace-file", "/dev/zero"],
            "/dev/zero",
            "a character device, not a regular file",
        ),
        (
            &["--trace-file", dir],
            dir,
            "a directory, not a regular file",
        ),
        (
            &["--replay-file", dir],
            dir,
            "a directory, not a regular file",
        ),
        (
            &["--replay-file", "/dev/zero"],
            "/dev/zero",
            "a character device, not a regular file",
        ),
    ];
    for (args, file, what) in cases {
        let stderr = serve_refused(args);
        assert!(
            stderr.contains(&format!("{file}: {what}")) && stderr.contains(args[0]),
            "{args:?}: {stderr}"
        );
    }
    for args in [
        ["tail", "--file", fifo],
        ["record", "--stats", fifo],
        ["tail", "--file", "/dev/zero"],
    ] {
        let output = kvgate(&args);
        assert!(!output.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&format!("{}: a ", args[2])) && stderr.contains("not a regular file"),
            "{args:?}: {stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fifo_as_a_recordings_next_part_cuts_the_reading_there_and_the_gateway_serves_on() {
    let scratch = Scratch::new("next-part");
    let first = scratch.path("rec.kvrec");
    let limits = kvgate::recording::WriterLimits {
        rotate_bytes: 1,
        frame_bytes: 4096,
    };
    let mut writer = kvgate::recording::Writer::create(&first, header(), limits).unwrap();
    writer.batch(0, &store_batch(100).encode_to_vec()).unwrap();
    // Past `rotate_bytes`: the part closes, saying the recording goes on.
    writer.flush().unwrap();
    writer
        .batch(1000, &store_batch(101).encode_to_vec())
        .unwrap();
    writer.finish().unwrap();
    let next = kvgate::recording::part_path(&first, 1);
    assert!(next.exists(), "the recording has a second part");
    common::replace_with_fifo(&next);

    let mut gateway = Gateway::start(&[
        "--replay-file",
        first.to_str().unwrap(),
        "--replay-speed",
        "max",
    ]);
    let view = tokio::time::timeout(DEADLINE, await_block(&gateway, 100))
        .await
        .expect("part 0 is played");
    assert!(!view.blocks(0).contains_key(&101));
    gateway.await_serving("").await;
    let exit = gateway.terminate();
    assert!(exit.success(), "SIGTERM ends it cleanly: {exit}");

    let next = next.display().to_string();
    for args in [
        vec!["tail", "--file", first.to_str().unwrap()],
        vec!["record", "--stats", first.to_str().unwrap()],
    ] {
        let output = kvgate(&args);
        assert!(!output.status.success(), "{args:?}: damage is an error");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&next) && stderr.contains("a FIFO, not a regular file"),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn a_trace_of_one_endless_line_of_zeros_fails_the_start_at_once() {
    let scratch = Scratch::new("sparse");
    let trace = scratch.path("zeros.jsonl");
    // 8 GiB of holes: read to its end, it would take most of a minute.
    std::fs::File::create(&trace)
        .unwrap()
        .set_len(8 << 30)
        .unwrap();
    let started = Instant::now();
    let stderr = serve_refused(&["--trace-file", trace.to_str().unwrap()]);
    assert!(
        stderr.contains("--trace-file") && stderr.contains("longer than"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

/// A trace line of `ids` distinct hash ids from `first`, claiming a prompt
/// of a trillion tokens.
fn huge_request(timestamp: u64, first: u64, ids: u64) -> String {
    let ids: Vec<String> = (first..first + ids).map(|id| id.to_string()).collect();
    format!(
        "{{\"timestamp\": {timestamp}, \"input_length\": 1000000000000, \"output_length\": 1, \"hash_ids\": [{}]}}\n",
        ids.join(",")
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trace_line_claiming_millions_of_blocks_costs_no_more_than_a_cache_of_them() {
    const CACHE: usize = 16_384;
    let scratch = Scratch::new("huge-line");
    let trace = scratch.path("huge.jsonl");
    // 500k and 1M hash ids, each of 512 one-token blocks: 256M and 512M
    // blocks claimed, 2 and 4 GiB collected uncapped.
    let first = huge_request(0, 1, 500_000);
    let second = huge_request(1, 1_000_000, 1_000_000);
    assert!(first.len() < 4 << 20 && second.len() < 16 << 20);
    std::fs::write(&trace, format!("{first}{second}")).unwrap();
    let gateway = Gateway::start(&[
        "--trace-file",
        trace.to_str().unwrap(),
        "--trace-block-tokens",
        "1",
        "--trace-max-line-bytes",
        "16MiB",
        "--replay-speed",
        "max",
    ]);
    // The second request's first block, as an engine of 1-token blocks
    // hashes it: trace block id × 512.
    let last_first_block = 1_000_000 * 512;
    let view = tokio::time::timeout(DEADLINE, await_block(&gateway, last_first_block))
        .await
        .expect("both requests are played");
    let held = view.blocks(0);
    assert_eq!(
        held.len(),
        CACHE,
        "the cache holds the second request's first blocks"
    );
    assert!(
        (0..CACHE as i64).all(|j| held.contains_key(&(last_first_block + j))),
        "a chain from its first block"
    );
    let peak_mib = common::peak_rss_kib(gateway.pid()) / 1024;
    eprintln!("peak RSS playing the trace: {peak_mib} MiB");
    assert!(peak_mib < 400, "peak RSS {peak_mib} MiB");
}

/// An empty closed recording, split: its header, and its closing frame.
fn header_and_closing(path: &Path) -> (Vec<u8>, Vec<u8>) {
    writer(path).finish().unwrap();
    let mut head = std::fs::read(path).unwrap();
    let json_len = u32::from_le_bytes(head[10..14].try_into().unwrap()) as usize;
    let closing = head.split_off(18 + json_len);
    (head, closing)
}

/// A recording whose part holds a header and then `garbage`: no intact
/// record.
fn recording_then(path: &Path, garbage: &[u8]) {
    let (mut file, _) = header_and_closing(path);
    file.extend_from_slice(garbage);
    std::fs::write(path, file).unwrap();
}

/// CPU seconds `pid` used so far (user + system), from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which ends at the last ')'.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf reads a constant of the system.
    ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// How long a stopped loop's gateway is watched for CPU it should not use.
const IDLE_WINDOW: Duration = Duration::from_secs(1);

/// Plays `args` at max speed with `--replay-loop`, its stderr in a file,
/// and checks that the loop stops (it says so), that the gateway then idles
/// (under 0.2 s of CPU in the second after), that it logged a few lines, not
/// a line a pass, and that SIGTERM ends it cleanly. Returns the log.
fn loop_stops_quietly(scratch: &Scratch, args: &[&str]) -> String {
    let log = scratch.path("stderr.log");
    let file = std::fs::File::create(&log).unwrap();
    let mut all = args.to_vec();
    all.extend(["--replay-loop", "--replay-speed", "max"]);
    let mut gateway = Gateway::start_configured(&all, |command| {
        command.stderr(file);
    });
    let deadline = Instant::now() + DEADLINE;
    while !std::fs::read_to_string(&log)
        .unwrap()
        .contains("not playing the file again")
    {
        assert!(Instant::now() < deadline, "the loop never stopped");
        std::thread::park_timeout(Duration::from_millis(20));
    }
    // Not a wait for an event: the window the idle CPU is measured over
    // (a loop that goes on would burn most of a core in it).
    let before = cpu_seconds(gateway.pid());
    std::thread::sleep(IDLE_WINDOW);
    let cpu = cpu_seconds(gateway.pid()) - before;
    let exit = gateway.terminate();
    let log = std::fs::read_to_string(log).unwrap();
    assert!(
        cpu < 0.2,
        "{cpu} s of CPU in the second after the loop stopped"
    );
    assert!(log.lines().count() < 20, "{log}");
    assert!(exit.success(), "SIGTERM ends it cleanly: {exit}");
    log
}

#[test]
fn a_looped_recording_with_no_intact_record_stops_looping_and_logs_little() {
    let scratch = Scratch::new("garbage-loop");
    let path = scratch.path("garbage.kvrec");
    recording_then(&path, &[0xff; 4096]);
    let log = loop_stops_quietly(&scratch, &["--replay-file", path.to_str().unwrap()]);
    assert!(log.contains("garbage.kvrec"), "the damage is named: {log}");
}

#[test]
fn a_looped_trace_that_stores_nothing_stops_looping_and_logs_little() {
    let scratch = Scratch::new("empty-loop");
    let trace = scratch.path("nothing.jsonl");
    // Prompts shorter than one block: nothing to store.
    let line = "{\"timestamp\": 0, \"input_length\": 100, \"hash_ids\": [1]}\n";
    std::fs::write(&trace, line.repeat(3)).unwrap();
    loop_stops_quietly(&scratch, &["--trace-file", trace.to_str().unwrap()]);
}

/// A recording of `frames` zstd frames, each 64 MiB of the tiniest batch
/// records, carrying `batch` (17 bytes each when it is empty), then a
/// frame with one store of block 42: a file of a few dozen KiB.
fn record_bomb(path: &Path, frames: usize, batch: &[u8]) {
    let body: Vec<u8> = [0_u8; 8]
        .into_iter()
        .chain([1])
        .chain(batch.iter().copied())
        .collect();
    let mut record = Vec::new();
    record.extend_from_slice(&(body.len() as u32).to_le_bytes());
    record.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
    record.extend_from_slice(&body);
    let raw = record.repeat((64 << 20) / record.len());
    let compressed = zstd::bulk::compress(&raw, 3).unwrap();
    let (mut file, closing) = header_and_closing(path);
    for _ in 0..frames {
        file.extend_from_slice(&(compressed.len() as u32).to_le_bytes());
        file.extend_from_slice(&crc32c::crc32c(&compressed).to_le_bytes());
        file.extend_from_slice(&compressed);
    }
    // Block 42 in a frame of its own, then the closing frame.
    let tail = frames_of(&store_batch(42));
    file.extend_from_slice(&tail);
    file.extend_from_slice(&closing);
    std::fs::write(path, file).unwrap();
}

/// The frames a writer makes for one batch, without the part's header and
/// closing frame.
fn frames_of(batch: &KvEventBatch) -> Vec<u8> {
    let dir = Scratch::new("one-batch");
    let path = dir.path("one.kvrec");
    let mut writer = writer(&path);
    writer.flush().unwrap();
    let empty = std::fs::metadata(&path).unwrap().len() as usize;
    writer.batch(0, &batch.encode_to_vec()).unwrap();
    writer.flush().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    bytes[empty..].to_vec()
}

/// Runs `kvgate <args>` to its end and returns its peak resident memory
/// in MiB, as the kernel counted it for that child (`wait4`).
fn peak_rss_of_run(args: &[&str]) -> (u64, std::process::ExitStatus) {
    use std::os::unix::process::ExitStatusExt as _;
    // Reaped by `wait4`, which alone says what the child's peak was.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvgate starts");
    let pid = child.id() as libc::pid_t;
    let deadline = Instant::now() + 3 * DEADLINE;
    loop {
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: wait4 writes the status and usage of our own child.
        let waited = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if waited == pid {
            return (
                usage.ru_maxrss as u64 / 1024,
                std::process::ExitStatus::from_raw(status),
            );
        }
        if Instant::now() > deadline {
            // SAFETY: kills our own child, by its pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("kvgate {args:?} did not end in time");
        }
        std::thread::park_timeout(Duration::from_millis(20));
    }
}

#[test]
fn tail_and_stats_read_a_recording_of_tiny_records_frame_by_frame_in_bounded_memory() {
    let scratch = Scratch::new("bomb-tools");
    let bomb = scratch.path("bomb.kvrec");
    record_bomb(&bomb, 2, &[]);
    assert!(
        std::fs::metadata(&bomb).unwrap().len() < 64 << 10,
        "a small file"
    );
    // The same commands on a recording of one batch, for the baseline.
    let small = scratch.path("small.kvrec");
    record_bomb(&small, 0, &[]);
    for command in [["record", "--stats"], ["tail", "--file"]] {
        let run = |path: &Path| {
            let mut args = command.to_vec();
            args.push(path.to_str().unwrap());
            let (peak_mib, exit) = peak_rss_of_run(&args);
            assert!(exit.success(), "{args:?}: {exit}");
            peak_mib
        };
        let (baseline, peak) = (run(&small), run(&bomb));
        eprintln!("{command:?}: peak RSS {peak} MiB, {baseline} MiB for one batch");
        // A frame decompressed (64 MiB) and little else.
        assert!(
            peak < baseline + 100,
            "{command:?}: peak RSS {peak} MiB against {baseline} MiB for one batch"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_recording_of_tiny_records_holds_a_frame_and_its_read_ahead_no_more() {
    let scratch = Scratch::new("bomb-serve");
    // Undecodable batches (a lone 0xff is no protobuf field): each is
    // counted as it is played, so the count says how far the frame is.
    let bomb = scratch.path("bomb.kvrec");
    record_bomb(&bomb, 1, &[0xff]);
    let small = scratch.path("small.kvrec");
    record_bomb(&small, 0, &[]);
    let replay = |path: &Path| {
        Gateway::start(&[
            "--replay-file",
            path.to_str().unwrap(),
            "--replay-speed",
            "max",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
    };
    let baseline = replay(&small);
    tokio::time::timeout(DEADLINE, await_block(&baseline, 42))
        .await
        .expect("the one batch is played");
    let baseline_mib = common::peak_rss_kib(baseline.pid()) / 1024;
    drop(baseline);

    let gateway = replay(&bomb);
    // Read whole, as the reader once did, the frame's 3.7M records were
    // held at once as soon as it was read: well before this many played.
    common::await_metric_where(
        gateway.admin.unwrap(),
        "kvgate_bad_messages_total{reason=\"recording_undecodable\"}",
        ">= 200000",
        |played| played >= 200_000.0,
    )
    .await;
    let peak_mib = common::peak_rss_kib(gateway.pid()) / 1024;
    eprintln!("peak RSS replaying: {peak_mib} MiB, {baseline_mib} MiB for one batch");
    // The README's bound for a replay: 64 MiB of records read ahead and
    // the frame being read (64 MiB decompressed; compressed, a few KiB).
    assert!(
        peak_mib < baseline_mib + 128,
        "peak RSS {peak_mib} MiB against {baseline_mib} MiB for one batch"
    );
}
