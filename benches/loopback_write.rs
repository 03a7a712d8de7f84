//! The floor under one delivery: what a single `write` of a batch-sized
//! message to a loopback TCP peer costs the writing thread, in CPU time.
//!
//! kvgate writes every batch to every subscriber once; on loopback the
//! writer's system call also runs the receiving socket's TCP input and
//! wakes the reader, so this is the least a delivery can cost in the load
//! tool's setup, whatever kvgate does in user space. Two cases:
//!
//! * `reader-waiting`: one write every `CADENCE`, so the reader is asleep in
//!   `read` at each write, as a subscriber keeping up at 20k events/s is
//!   (a batch every ~1 ms). The cadence is spun outside the timed region.
//! * `reader-busy`: writes back to back, so the reader is mostly running
//!   when data arrives and is rarely woken: TCP alone.
//!
//! Each sample is the writing thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`)
//! around the `write`, what kvgate's CPU-per-delivery figure counts, less
//! the cost of reading that clock (a system call: the vDSO does not serve
//! it), measured beside every write. BENCHMARKS.md has the numbers.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};

/// Gap between writes when the reader should be waiting for each one: a
/// subscriber's batch every ~1 ms, as in the 20k events/s sweep.
const CADENCE: Duration = Duration::from_millis(1);
/// A delivered batch at 20k events/s in `kvgate-bench` (one 16-block store
/// and its 16 one-block removals) takes 1-2 KB with its gRPC and HTTP/2
/// framing; 256 bytes is a batch of a few removals.
const MESSAGE_SIZES: [usize; 2] = [256, 2048];

/// A connected loopback pair whose reading end is drained by a thread until
/// the writing end closes.
fn connected_pair() -> (TcpStream, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    // As kvgate's connections are.
    writer.set_nodelay(true).unwrap();
    let (mut reader, _) = listener.accept().unwrap();
    let drain = std::thread::spawn(move || {
        let mut buffer = vec![0u8; 1 << 16];
        while reader.read(&mut buffer).is_ok_and(|read| read > 0) {}
    });
    (writer, drain)
}

fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to fill in.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut now) };
    assert_eq!(status, 0, "the thread's CPU clock is readable");
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// CPU time of `iterations` writes of `message`, each `gap` after the
/// one before (none: back to back), without the clock's own cost.
fn timed_writes(
    writer: &mut TcpStream,
    message: &[u8],
    iterations: u64,
    gap: Option<Duration>,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut next = Instant::now();
    for _ in 0..iterations {
        if let Some(gap) = gap {
            // After a preemption, the next write still waits a whole gap.
            next = (next + gap).max(Instant::now());
            while Instant::now() < next {
                std::hint::spin_loop();
            }
        }
        let start = thread_cpu_time();
        let before = thread_cpu_time();
        writer.write_all(message).unwrap();
        let after = thread_cpu_time();
        total += (after - before).saturating_sub(before - start);
    }
    total
}

fn loopback_write(c: &mut Criterion) {
    let mut group = c.benchmark_group("loopback-write");
    for size in MESSAGE_SIZES {
        let message = vec![0x5au8; size];
        for (case, gap) in [("reader-waiting", Some(CADENCE)), ("reader-busy", None)] {
            let (mut writer, drain) = connected_pair();
            group.bench_function(format!("{case}/{size}B"), |b| {
                b.iter_custom(|iterations| timed_writes(&mut writer, &message, iterations, gap));
            });
            drop(writer);
            drain.join().unwrap();
        }
    }
    group.finish();
}

criterion_group!(benches, loopback_write);
fn main() {
    kvgate::allocator::bench_on_the_gateways_heap(); // `criterion_main!`
    benches();
    Criterion::default().configure_from_args().final_summary();
}
