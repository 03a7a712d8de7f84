//! CPU time and memory of processes and threads, and a description of the
//! machine, read from Linux's `/proc`.

use std::io;

use serde::Serialize;

/// Linux's `USER_HZ`, the unit of CPU times in `/proc/*/stat`. The kernel
/// fixes it at 100 for user space on every architecture kvgate targets;
/// asking `sysconf(_SC_CLK_TCK)` would make `libc` a direct dependency for a
/// constant.
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// User plus system CPU seconds of process `pid` (all its threads).
pub fn process_cpu_seconds(pid: u32) -> io::Result<f64> {
    read_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// User plus system CPU seconds of thread `tid` of this process.
pub fn thread_cpu_seconds(tid: u32) -> io::Result<f64> {
    read_cpu_seconds(&format!("/proc/self/task/{tid}/stat"))
}

fn read_cpu_seconds(path: &str) -> io::Result<f64> {
    let stat = std::fs::read_to_string(path)?;
    parse_cpu_seconds(&stat).ok_or_else(|| invalid(path))
}

/// CPU time of the whole machine, summed over its CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SystemCpu {
    /// Seconds spent running anything (user, nice, system, interrupts).
    pub busy_s: f64,
    /// Seconds the hypervisor ran someone else while this VM wanted a CPU.
    pub steal_s: f64,
}

pub fn system_cpu() -> io::Result<SystemCpu> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    parse_system_cpu(&stat).ok_or_else(|| invalid("/proc/stat"))
}

/// Resident memory of a process now and at its peak, in MB (10^6 bytes,
/// the unit the targets are stated in).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Memory {
    pub rss_mb: f64,
    pub peak_rss_mb: f64,
}

pub fn memory(pid: u32) -> io::Result<Memory> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path)?;
    parse_memory(&status).ok_or_else(|| invalid(&path))
}

/// What the figures were measured on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_gib: f64,
    pub kernel: String,
}

pub fn machine() -> Machine {
    let read = |path| std::fs::read_to_string(path).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu_model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name")?.split_once(':'))
        .map_or_else(
            || "unknown".to_owned(),
            |(_, model)| model.trim().to_owned(),
        );
    let memory_gib =
        kib_field(&read("/proc/meminfo"), "MemTotal:").unwrap_or(0.0) / (1 << 20) as f64;
    Machine {
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
        cpu_model,
        memory_gib,
        kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
    }
}

/// utime + stime of a `stat` line. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted after its closing `)`.
fn parse_cpu_seconds(stat: &str) -> Option<f64> {
    let (_, after_name) = stat.rsplit_once(')')?;
    // Field 3 (state) is the first after the name; utime and stime are
    // fields 14 and 15.
    let mut fields = after_name.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some((user + system) as f64 / CLOCK_TICKS_PER_SECOND)
}

/// The `cpu` line: user nice system idle iowait irq softirq steal ...
fn parse_system_cpu(stat: &str) -> Option<SystemCpu> {
    let line = stat.lines().find_map(|line| line.strip_prefix("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [user, nice, system, _idle, _iowait, irq, softirq, steal, ..] = ticks[..] else {
        return None;
    };
    Some(SystemCpu {
        busy_s: (user + nice + system + irq + softirq) as f64 / CLOCK_TICKS_PER_SECOND,
        steal_s: steal as f64 / CLOCK_TICKS_PER_SECOND,
    })
}

fn parse_memory(status: &str) -> Option<Memory> {
    let mb = |name| Some(kib_field(status, name)? * 1024.0 / 1e6);
    Some(Memory {
        rss_mb: mb("VmRSS:")?,
        peak_rss_mb: mb("VmHWM:")?,
    })
}

/// A `Name:   1234 kB` line's value in KiB.
fn kib_field(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn invalid(path: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{path}: unexpected layout"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's id of the calling thread.
    fn current_thread_id() -> u32 {
        // SAFETY: gettid takes nothing and touches no memory.
        unsafe { libc::gettid() as u32 }
    }

    #[test]
    fn cpu_times_are_found_after_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (kv gate) (x)) S 1 4242 4242 0 -1 4194560 \
                    100 0 0 0 250 75 0 0 20 0 9 0 12345 1000000 500";
        assert_eq!(parse_cpu_seconds(stat), Some(3.25));
        assert_eq!(parse_cpu_seconds("4242 (truncated) S 1 2"), None);
    }

    #[test]
    fn this_process_and_thread_have_cpu_time_and_memory() {
        // Burn a little CPU so a clock tick is likely to have been charged.
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(30) {
            std::hint::black_box(spin.elapsed());
        }
        let pid = std::process::id();
        // The thread first: CPU time only grows, so the process's, read
        // after, includes all the thread's. Read the other way round, a tick
        // charged between the two reads put the thread ahead. Each figure is
        // user and system time truncated to a tick apiece, and the kernel
        // splits the two for a thread and for its process separately, so the
        // sums may still differ by the two truncations.
        let thread = thread_cpu_seconds(current_thread_id()).unwrap();
        let process = process_cpu_seconds(pid).unwrap();
        let truncation = 2.0 / CLOCK_TICKS_PER_SECOND;
        assert!(
            process + truncation >= thread && thread >= 0.0,
            "{process} < {thread}"
        );

        let memory = memory(pid).unwrap();
        assert!(memory.rss_mb > 0.0);
        assert!(memory.peak_rss_mb >= memory.rss_mb, "{memory:?}");
    }

    #[test]
    fn another_thread_has_its_own_id() {
        let main = current_thread_id();
        let other = std::thread::spawn(current_thread_id).join().unwrap();
        assert_ne!(main, other);
        assert!(thread_cpu_seconds(main).is_ok());
    }

    #[test]
    fn the_machine_line_of_proc_stat_sums_busy_time() {
        let stat = "cpu  1000 20 300 9000 40 5 6 70 0 0\ncpu0 500 10 150 4500 20 2 3 35 0 0\n";
        assert_eq!(
            parse_system_cpu(stat),
            Some(SystemCpu {
                busy_s: 13.31,
                steal_s: 0.7
            })
        );
        assert_eq!(parse_system_cpu("cpu  1 2 3\n"), None);
        let now = system_cpu().unwrap();
        assert!(now.busy_s > 0.0);
    }

    #[test]
    fn memory_lines_are_read_in_mb() {
        let status = "Name:\tkvgate\nVmHWM:\t   20000 kB\nVmRSS:\t   12500 kB\n";
        assert_eq!(
            parse_memory(status),
            Some(Memory {
                rss_mb: 12.8,
                peak_rss_mb: 20.48
            })
        );
        assert_eq!(parse_memory("Name:\tkvgate\n"), None);
    }

    #[test]
    fn the_machine_reports_at_least_one_cpu() {
        let machine = machine();
        assert!(machine.cpus >= 1);
        assert!(machine.memory_gib > 0.0);
    }
}
