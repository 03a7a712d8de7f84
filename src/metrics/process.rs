//! Process metrics read from `/proc/self` at scrape time (prometheus-client
//! has no process collector): CPU seconds, resident memory, open and maximum
//! file descriptors, start time.
//!
//! Invariant: a scrape never fails because of them; a value `/proc` does not
//! give is left out of that scrape, and on other systems the collector
//! exports nothing.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

#[derive(Debug, Default)]
pub(crate) struct ProcessCollector;

/// What one scrape reads about this process.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct ProcessSample {
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<i64>,
    pub open_fds: Option<i64>,
    pub max_fds: Option<i64>,
    pub start_time_seconds: Option<f64>,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sample = ProcessSample::read();
        if let Some(seconds) = sample.cpu_seconds {
            encode_one(
                &mut encoder,
                "process_cpu_seconds",
                "User and system CPU time spent by kvgate, in seconds",
                ConstCounter::new(seconds),
            )?;
        }
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory of kvgate, in bytes",
                sample.resident_bytes,
            ),
            (
                "process_open_fds",
                "File descriptors kvgate has open",
                sample.open_fds,
            ),
            (
                "process_max_fds",
                "Most file descriptors kvgate may open (RLIMIT_NOFILE)",
                sample.max_fds,
            ),
        ];
        for (name, help, value) in gauges {
            if let Some(value) = value {
                encode_one(&mut encoder, name, help, ConstGauge::new(value))?;
            }
        }
        if let Some(seconds) = sample.start_time_seconds {
            encode_one(
                &mut encoder,
                "process_start_time_seconds",
                "Start time of kvgate since the Unix epoch, in seconds",
                ConstGauge::new(seconds),
            )?;
        }
        Ok(())
    }
}

/// Writes one unlabelled metric with its descriptor.
fn encode_one(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: impl EncodeMetric,
) -> Result<(), std::fmt::Error> {
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

#[cfg(target_os = "linux")]
impl ProcessSample {
    pub(crate) fn read() -> Self {
        let ticks = clock_ticks_per_second();
        let stat = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|text| StatFields::parse(&text));
        let page_size = page_size();
        Self {
            cpu_seconds: stat
                .as_ref()
                .zip(ticks)
                .map(|(stat, ticks)| (stat.utime + stat.stime) as f64 / ticks),
            resident_bytes: stat
                .as_ref()
                .zip(page_size)
                .map(|(stat, page)| stat.rss_pages.saturating_mul(page)),
            open_fds: std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|entries| entries.count() as i64),
            max_fds: std::fs::read_to_string("/proc/self/limits")
                .ok()
                .and_then(|text| soft_limit(&text, "Max open files")),
            start_time_seconds: stat.as_ref().zip(ticks).and_then(|(stat, ticks)| {
                Some(boot_time_seconds()? + stat.start_ticks as f64 / ticks)
            }),
        }
    }
}

#[cfg(not(target_os = "linux"))]
impl ProcessSample {
    pub(crate) fn read() -> Self {
        Self::default()
    }
}

/// The fields of `/proc/self/stat` kvgate exports (proc(5)).
#[derive(Debug, PartialEq)]
struct StatFields {
    utime: u64,
    stime: u64,
    start_ticks: u64,
    rss_pages: i64,
}

impl StatFields {
    /// The command name (field 2) may hold spaces and parentheses, so fields
    /// are counted from the last `)`.
    fn parse(text: &str) -> Option<Self> {
        let after_name = &text[text.rfind(')')? + 1..];
        // Field 3 (state) is the first after the name.
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let field = |number: usize| fields.get(number - 3).copied();
        Some(Self {
            utime: field(14)?.parse().ok()?,
            stime: field(15)?.parse().ok()?,
            start_ticks: field(22)?.parse().ok()?,
            rss_pages: field(24)?.parse().ok()?,
        })
    }
}

/// The soft limit on the `/proc/self/limits` line starting with `name`.
fn soft_limit(limits: &str, name: &str) -> Option<i64> {
    let line = limits.lines().find(|line| line.starts_with(name))?;
    let soft = line[name.len()..].split_whitespace().next()?;
    match soft {
        "unlimited" => Some(i64::MAX),
        value => value.parse().ok(),
    }
}

#[cfg(target_os = "linux")]
fn boot_time_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|line| line.starts_with("btime "))?;
    line["btime ".len()..].trim().parse().ok()
}

#[cfg(target_os = "linux")]
fn clock_ticks_per_second() -> Option<f64> {
    // SAFETY: sysconf reads a constant of the system and has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks > 0).then_some(ticks as f64)
}

#[cfg(target_os = "linux")]
fn page_size() -> Option<i64> {
    // SAFETY: as above.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (size > 0).then_some(size as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_end_of_a_command_name_with_spaces() {
        let text = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 9 0 1234 \
                    10000000 512 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            StatFields::parse(text),
            Some(StatFields {
                utime: 250,
                stime: 75,
                start_ticks: 1234,
                rss_pages: 512,
            })
        );
    }

    #[test]
    fn the_soft_open_files_limit_is_read_and_unlimited_is_the_largest_value() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        assert_eq!(soft_limit(limits, "Max open files"), Some(1024));
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(soft_limit(unlimited, "Max open files"), Some(i64::MAX));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_reports_cpu_memory_and_descriptors() {
        let sample = ProcessSample::read();
        assert!(sample.resident_bytes.is_some_and(|bytes| bytes > 0));
        assert!(sample.open_fds.is_some_and(|fds| fds >= 3));
        assert!(sample.max_fds.is_some_and(|fds| fds > 0));
        assert!(sample.cpu_seconds.is_some_and(|seconds| seconds >= 0.0));
        assert!(
            sample
                .start_time_seconds
                .is_some_and(|seconds| seconds > 1e9)
        );
    }
}
