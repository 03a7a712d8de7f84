//! A load sweep's figures: per run, what was published, what each
//! subscriber received and how late, and what the relay under test (kvgate
//! or a peer) and the tool itself cost; rendered as a table, JSON and the
//! issues' targets, kvgate against the peer where one ran.

use std::fmt::Write;

use serde::Serialize;

use super::procfs::Machine;
use super::subject::KVGATE;

/// The rate the latency targets are stated at.
const TARGET_RATE: u64 = 20_000;
/// Busier than this, kvgate competed with the tool for CPU.
const SATURATED_PERCENT: f64 = 90.0;
/// Other processes or the hypervisor taking more than this of the CPUs
/// make a run's figures noisy.
pub const DISTURBED_PERCENT: f64 = 10.0;
/// A subject whose RSS grew by this share or more over the measured
/// window (and by at least [`GROWING_MIN_MB`]) was still filling its
/// buffers: its figures include the growth's page faults and reallocations.
const GROWING_SHARE: f64 = 0.05;
const GROWING_MIN_MB: f64 = 2.0;
/// Subscriber counts the comparison with a peer is stated at.
const PEER_COUNTS: [usize; 3] = [1, 8, 32];
/// How many times less CPU per delivered event than the peer kvgate aims at.
const PEER_CPU_RATIO: f64 = 3.0;

/// A run's figures as written out: the machine, what was asked, each run,
/// the targets judged from them and notes on what the figures do not show.
/// A load sweep's by default; `kvgate-bench index` has a config of its own.
#[derive(Debug, Serialize)]
#[serde(bound(serialize = "C: Serialize, C::Run: Serialize"))]
pub struct Report<C: Judged = Config> {
    pub machine: Machine,
    pub config: C,
    pub runs: Vec<C::Run>,
    pub targets: Vec<TargetCheck>,
    /// Where the figures measure the tool rather than the subject.
    pub notes: Vec<String>,
}

/// What asked for a report's runs, and so how they are judged.
pub trait Judged {
    type Run;
    fn targets(&self, runs: &[Self::Run]) -> Vec<TargetCheck>;
    fn notes(&self, machine: &Machine, runs: &[Self::Run]) -> Vec<String>;
}

impl Judged for Config {
    type Run = RunReport;

    fn targets(&self, runs: &[RunReport]) -> Vec<TargetCheck> {
        targets(self, runs)
    }

    fn notes(&self, machine: &Machine, runs: &[RunReport]) -> Vec<String> {
        notes(machine, runs)
    }
}

#[derive(Debug, Serialize)]
pub struct Config {
    /// Events per second asked for; 0 = as fast as every subscriber receives.
    pub rate_events_per_s: u64,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub blocks_per_store: usize,
    pub block_size: u32,
    pub live_blocks: usize,
    /// The recording or trace published instead of the steady mix.
    pub workload: Option<String>,
    pub kvgate: String,
    pub serve_args: Vec<String>,
    /// The peer measured alternately with kvgate, if any.
    pub peer: Option<PeerConfig>,
}

#[derive(Debug, Serialize)]
pub struct PeerConfig {
    pub name: String,
    pub command: String,
    pub method: String,
}

#[derive(Debug, Serialize)]
pub struct RunReport {
    /// `kvgate`, or the peer's name.
    pub subject: String,
    pub subscribers: usize,
    pub window_s: f64,
    pub published_events_per_s: f64,
    /// Events per second each subscriber received: the mean and the
    /// slowest subscriber.
    pub delivered_events_per_s_mean: f64,
    pub delivered_events_per_s_min: f64,
    pub batches_per_s_per_subscriber: f64,
    /// Engine publish to subscriber receive, one sample per batch.
    pub latency_ms: Latency,
    /// Events published after the warm-up that some subscriber never got,
    /// summed over subscribers.
    pub missing_events: u64,
    /// Batch sequence numbers skipped, summed over subscribers.
    pub sequence_gaps: u64,
    /// Streams that ended before the run did, and the first reason.
    pub streams_ended_early: usize,
    pub first_stream_error: Option<String>,
    /// What the subject cost (named `kvgate` since the tool measured only
    /// kvgate; a peer's run reports the peer's process here).
    pub kvgate: KvgateCost,
    pub tool: ToolCost,
    /// CPU used by kvgate and the tool together, as a share of all CPUs.
    pub machine_busy_percent: f64,
    /// CPU used by every other process meanwhile, as a share of all CPUs.
    pub others_busy_percent: f64,
    /// CPU time the hypervisor gave elsewhere, as a share of all CPUs.
    pub steal_percent: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub samples: u64,
}

#[derive(Debug, Serialize)]
pub struct KvgateCost {
    pub cpu_s: f64,
    pub cpu_percent_of_one_core: f64,
    /// kvgate's CPU time over the window divided by the batches delivered,
    /// summed over subscribers: what one delivery costs, ingest included.
    pub cpu_us_per_batch_delivered: f64,
    /// The same per event: batches differ in size between relays.
    pub cpu_us_per_event_delivered: f64,
    pub idle_rss_mb: f64,
    pub peak_rss_mb: f64,
    /// RSS at the start and at the end of the measured window.
    pub window_rss_mb: [f64; 2],
}

#[derive(Debug, Serialize)]
pub struct ToolCost {
    /// The one thread all subscribers run on.
    pub subscribers_cpu_s: f64,
    pub subscribers_cpu_percent_of_one_core: f64,
    pub publisher_cpu_s: f64,
    pub subscribers_cheaper_than_kvgate: bool,
}

#[derive(Debug, Serialize)]
pub struct TargetCheck {
    pub target: String,
    /// What was measured, in the target's unit; `None` if the sweep did not
    /// include the runs it needs.
    pub measured: Option<f64>,
    pub met: Option<bool>,
    pub note: Option<String>,
}

impl<C: Judged> Report<C> {
    pub fn new(machine: Machine, config: C, runs: Vec<C::Run>) -> Self {
        let targets = config.targets(&runs);
        let notes = config.notes(&machine, &runs);
        Self {
            machine,
            config,
            runs,
            targets,
            notes,
        }
    }
}

impl Report {
    /// The rate asked for, in words.
    pub fn rate_label(&self) -> String {
        rate_label(self.config.rate_events_per_s)
    }

    pub fn table(&self) -> String {
        let config = &self.config;
        let machine = &self.machine;
        let mut out = String::new();
        let traffic = match &config.workload {
            Some(file) => format!("the traffic of {file}"),
            None => format!(
                "stores of {} blocks x {} tokens",
                config.blocks_per_store, config.block_size
            ),
        };
        let _ = writeln!(
            out,
            "kvgate-bench: {}, {} s measured after {} s warm-up, {traffic}",
            self.rate_label(),
            config.duration_s,
            config.warmup_s,
        );
        write_machine(&mut out, machine);
        let _ = writeln!(
            out,
            "{:<8} {:>5} {:>12} {:>22} {:>24} {:>41} {:>18} {:>22} {:>13} {:>8}",
            "",
            "",
            "published",
            "delivered/s per sub",
            "latency ms",
            "relay CPU",
            "relay RSS MB",
            "tool CPU s",
            "CPUs busy %",
            "missing"
        );
        let _ = writeln!(
            out,
            "{:<8} {:>5} {:>12} {:>11} {:>10} {:>7} {:>7} {:>8} {:>8} {:>13} {:>9} {:>8} {:>8} {:>8} {:>21} {:>13} {:>8}",
            "relay",
            "subs",
            "events/s",
            "mean",
            "min",
            "p50",
            "p99",
            "max",
            "s",
            "% of a core",
            "µs/batch",
            "µs/event",
            "idle",
            "peak",
            "subscribers publisher",
            "run   others",
            "events"
        );
        for run in &self.runs {
            let _ = writeln!(
                out,
                "{:<8} {:>5} {:>12.0} {:>11.0} {:>10.0} {:>7.2} {:>7.2} {:>8.2} {:>8.2} {:>13.0} {:>9.1} {:>8.2} {:>8.1} {:>8.1} {:>11.2} {:>9.2} {:>5.0} {:>7.0} {:>8}",
                run.subject,
                run.subscribers,
                run.published_events_per_s,
                run.delivered_events_per_s_mean,
                run.delivered_events_per_s_min,
                run.latency_ms.p50,
                run.latency_ms.p99,
                run.latency_ms.max,
                run.kvgate.cpu_s,
                run.kvgate.cpu_percent_of_one_core,
                run.kvgate.cpu_us_per_batch_delivered,
                run.kvgate.cpu_us_per_event_delivered,
                run.kvgate.idle_rss_mb,
                run.kvgate.peak_rss_mb,
                run.tool.subscribers_cpu_s,
                run.tool.publisher_cpu_s,
                run.machine_busy_percent,
                run.others_busy_percent + run.steal_percent,
                run.missing_events,
            );
        }
        write_targets_and_notes(&mut out, &self.targets, &self.notes);
        out
    }
}

/// What the figures were measured on, as both reports' tables say it.
pub fn write_machine(out: &mut String, machine: &Machine) {
    let _ = writeln!(
        out,
        "machine: {} CPUs ({}), {:.1} GiB, Linux {}\n",
        machine.cpus, machine.cpu_model, machine.memory_gib, machine.kernel
    );
}

/// The targets' verdicts and the notes, as both reports end their tables.
pub fn write_targets_and_notes(out: &mut String, targets: &[TargetCheck], notes: &[String]) {
    if !targets.is_empty() {
        out.push_str("\ntargets (reported, not asserted):\n");
        for target in targets {
            let verdict = match (target.measured, target.met) {
                (Some(measured), Some(met)) => {
                    format!("{measured:.2}, {}", if met { "met" } else { "NOT met" })
                }
                _ => "not measured".to_owned(),
            };
            let _ = write!(out, "  {}: {verdict}", target.target);
            if let Some(note) = &target.note {
                let _ = write!(out, " ({note})");
            }
            out.push('\n');
        }
    }
    if !notes.is_empty() {
        out.push('\n');
        for note in notes {
            let _ = writeln!(out, "note: {note}");
        }
    }
}

/// The mean of `values`; `None` without any.
pub fn mean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (sum, count) = values
        .into_iter()
        .fold((0.0, 0usize), |(sum, count), value| {
            (sum + value, count + 1)
        });
    (count > 0).then(|| sum / count as f64)
}

fn rate_label(rate: u64) -> String {
    match rate {
        0 => "full speed (closed loop)".to_owned(),
        rate => format!("{rate} events/s"),
    }
}

fn targets(config: &Config, runs: &[RunReport]) -> Vec<TargetCheck> {
    let run = |subscribers| {
        runs.iter()
            .find(|run| run.subject == KVGATE && run.subscribers == subscribers)
    };
    let rate_note = (config.rate_events_per_s != TARGET_RATE).then(|| {
        format!(
            "stated at {TARGET_RATE} events/s; this sweep ran at {}",
            rate_label(config.rate_events_per_s)
        )
    });
    let mut checks = Vec::new();
    for (subscribers, limit_ms) in [(8, 2.0), (32, 5.0)] {
        let measured = run(subscribers).map(|run| run.latency_ms.p99);
        checks.push(TargetCheck {
            target: format!("p99 latency <= {limit_ms} ms with {subscribers} subscribers (ms)"),
            measured,
            met: measured.map(|p99| p99 <= limit_ms),
            note: rate_note.clone(),
        });
    }
    let scaling = run(1).zip(run(64)).map(|(one, many)| {
        100.0 * many.delivered_events_per_s_min / one.delivered_events_per_s_mean
    });
    checks.push(TargetCheck {
        target: "slowest of 64 subscribers >= 90% of 1 subscriber's events/s (%)".to_owned(),
        measured: scaling,
        met: scaling.map(|percent| percent >= 90.0),
        note: (config.rate_events_per_s != 0).then(|| {
            "at a fixed rate this only shows kvgate keeping up; --rate 0 measures the ceiling"
                .to_owned()
        }),
    });
    let idle = runs
        .iter()
        .filter(|run| run.subject == KVGATE)
        .map(|run| run.kvgate.idle_rss_mb)
        .reduce(f64::max);
    checks.push(TargetCheck {
        target: "idle RSS <= 30 MB (MB, largest over the runs)".to_owned(),
        measured: idle,
        met: idle.map(|mb| mb <= 30.0),
        note: None,
    });
    if let Some(peer) = &config.peer {
        checks.extend(against_peer(&peer.name, runs));
    }
    checks
}

/// The comparison with a peer at each count both subjects ran: the peer's figure
/// over kvgate's, each the mean of its rounds.
fn against_peer(peer: &str, runs: &[RunReport]) -> Vec<TargetCheck> {
    let mean = |subject: &str, subscribers: usize, pick: fn(&RunReport) -> f64| {
        mean(
            runs.iter()
                .filter(|run| run.subject == subject && run.subscribers == subscribers)
                .map(pick),
        )
    };
    let ratio = |subscribers, pick: fn(&RunReport) -> f64| {
        mean(peer, subscribers, pick)
            .zip(mean(KVGATE, subscribers, pick))
            .map(|(peer, kvgate)| peer / kvgate)
    };
    let mut checks = Vec::new();
    for subscribers in PEER_COUNTS {
        let cpu = ratio(subscribers, |run| run.kvgate.cpu_us_per_event_delivered);
        checks.push(TargetCheck {
            target: format!(
                "{peer}'s CPU per event delivered >= {PEER_CPU_RATIO}x kvgate's with \
                 {subscribers} subscribers (x)"
            ),
            measured: cpu,
            met: cpu.map(|ratio| ratio >= PEER_CPU_RATIO),
            note: None,
        });
        let p99 = ratio(subscribers, |run| run.latency_ms.p99);
        checks.push(TargetCheck {
            target: format!("{peer}'s p99 over kvgate's with {subscribers} subscribers (x, > 1)"),
            measured: p99,
            met: p99.map(|ratio| ratio > 1.0),
            note: None,
        });
        let rss = ratio(subscribers, |run| run.kvgate.peak_rss_mb);
        checks.push(TargetCheck {
            target: format!(
                "{peer}'s peak RSS over kvgate's with {subscribers} subscribers (x, > 1)"
            ),
            measured: rss,
            met: rss.map(|ratio| ratio > 1.0),
            note: None,
        });
    }
    checks
}

/// Where the tool stops measuring kvgate alone.
fn notes(machine: &Machine, runs: &[RunReport]) -> Vec<String> {
    let mut notes = Vec::new();
    let mut by_subscribers: Vec<&RunReport> = runs.iter().collect();
    by_subscribers.sort_by_key(|run| run.subscribers);
    match by_subscribers
        .iter()
        .find(|run| !run.tool.subscribers_cheaper_than_kvgate)
    {
        Some(run) => notes.push(format!(
            "from {} subscribers on, the subscribers used as much CPU as {} or more \
             ({:.2} s vs {:.2} s): figures there measure the tool as much as the relay",
            run.subscribers, run.subject, run.tool.subscribers_cpu_s, run.kvgate.cpu_s
        )),
        None if !runs.is_empty() => {
            notes.push("in every run the subscribers used less CPU than kvgate".to_owned());
        }
        None => {}
    }
    if let Some(run) = by_subscribers
        .iter()
        .find(|run| run.tool.subscribers_cpu_percent_of_one_core >= SATURATED_PERCENT)
    {
        notes.push(format!(
            "from {} subscribers on, the subscriber thread was busy {:.0}% of the time: \
             it, not kvgate, bounds throughput and adds latency",
            run.subscribers, run.tool.subscribers_cpu_percent_of_one_core
        ));
    }
    if let Some(run) = by_subscribers
        .iter()
        .find(|run| run.machine_busy_percent >= SATURATED_PERCENT)
    {
        notes.push(format!(
            "from {} subscribers on, kvgate and the tool kept {:.0}% of the {} CPUs busy: \
             kvgate competed with the tool for CPU, so its figures there are lower bounds",
            run.subscribers, run.machine_busy_percent, machine.cpus
        ));
    }
    for run in runs
        .iter()
        .filter(|run| run.others_busy_percent + run.steal_percent > DISTURBED_PERCENT)
    {
        notes.push(format!(
            "during the {}-subscriber run of {} other processes used {:.0}% of the CPUs and \
             the hypervisor took {:.0}%: its figures are noisy",
            run.subscribers, run.subject, run.others_busy_percent, run.steal_percent
        ));
    }
    notes.extend(growing_notes(runs));
    for run in runs
        .iter()
        .filter(|run| run.missing_events > 0 || run.sequence_gaps > 0)
    {
        notes.push(format!(
            "with {} subscribers, {} events never arrived from {} and {} batch sequence \
             numbers were skipped",
            run.subscribers, run.subject, run.missing_events, run.sequence_gaps
        ));
    }
    for run in runs.iter().filter(|run| run.streams_ended_early > 0) {
        notes.push(format!(
            "{} of {} streams of {} ended early with {} subscribers: {}",
            run.streams_ended_early,
            run.subscribers,
            run.subject,
            run.subscribers,
            run.first_stream_error
                .as_deref()
                .unwrap_or("no reason given"),
        ));
    }
    notes
}

/// One note per subject and subscriber count whose runs still grew,
/// in the order the runs were made.
fn growing_notes(runs: &[RunReport]) -> Vec<String> {
    let mut groups: Vec<(&str, usize, Vec<&RunReport>)> = Vec::new();
    for run in runs {
        match groups
            .iter_mut()
            .find(|(subject, count, _)| *subject == run.subject && *count == run.subscribers)
        {
            Some((_, _, group)) => group.push(run),
            None => groups.push((&run.subject, run.subscribers, vec![run])),
        }
    }
    groups
        .into_iter()
        .filter_map(|(subject, count, group)| {
            let growing: Vec<[f64; 2]> = group
                .iter()
                .filter(|run| still_growing(run))
                .map(|run| run.kvgate.window_rss_mb)
                .collect();
            let most = growing
                .iter()
                .copied()
                .max_by(|a, b| (a[1] - a[0]).total_cmp(&(b[1] - b[0])))?;
            Some(format!(
                "in {} of {} {count}-subscriber runs of {subject} its RSS still grew while \
                 measured, by up to {:.1} MB ({:.1} to {:.1} MB): it was filling its buffers \
                 (kvgate: until its history holds --history-batches batches), so those \
                 figures are not its steady state's; a longer --warmup measures that",
                growing.len(),
                group.len(),
                most[1] - most[0],
                most[0],
                most[1],
            ))
        })
        .collect()
}

fn still_growing(run: &RunReport) -> bool {
    let [start, end] = run.kvgate.window_rss_mb;
    let growth = end - start;
    growth >= GROWING_MIN_MB && growth >= start * GROWING_SHARE
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub fn run(subscribers: usize, p99: f64, delivered: f64, subscribers_cpu_s: f64) -> RunReport {
        RunReport {
            subject: KVGATE.to_owned(),
            subscribers,
            window_s: 10.0,
            published_events_per_s: 20_000.0,
            delivered_events_per_s_mean: delivered,
            delivered_events_per_s_min: delivered,
            batches_per_s_per_subscriber: 1_000.0,
            latency_ms: Latency {
                p50: p99 / 2.0,
                p99,
                max: p99 * 2.0,
                samples: 10_000,
            },
            missing_events: 0,
            sequence_gaps: 0,
            streams_ended_early: 0,
            first_stream_error: None,
            kvgate: KvgateCost {
                cpu_s: 2.0,
                cpu_percent_of_one_core: 20.0,
                cpu_us_per_batch_delivered: 20.0,
                cpu_us_per_event_delivered: 1.0,
                idle_rss_mb: 9.5,
                peak_rss_mb: 40.0,
                window_rss_mb: [39.0, 39.5],
            },
            tool: ToolCost {
                subscribers_cpu_s,
                subscribers_cpu_percent_of_one_core: subscribers_cpu_s * 10.0,
                publisher_cpu_s: 0.5,
                subscribers_cheaper_than_kvgate: subscribers_cpu_s < 2.0,
            },
            machine_busy_percent: 30.0,
            others_busy_percent: 1.0,
            steal_percent: 0.0,
        }
    }

    pub fn config(rate: u64) -> Config {
        Config {
            rate_events_per_s: rate,
            duration_s: 10.0,
            warmup_s: 2.0,
            blocks_per_store: 16,
            block_size: 16,
            live_blocks: 65_536,
            workload: None,
            kvgate: "kvgate".to_owned(),
            serve_args: Vec::new(),
            peer: None,
        }
    }

    pub fn machine() -> Machine {
        Machine {
            cpus: 2,
            cpu_model: "test".to_owned(),
            memory_gib: 1.0,
            kernel: "6.0".to_owned(),
        }
    }

    #[test]
    fn targets_are_judged_from_the_runs_that_exist() {
        let runs = vec![
            run(1, 0.5, 20_000.0, 0.5),
            run(8, 1.5, 20_000.0, 1.0),
            run(32, 6.0, 19_000.0, 2.5),
            run(64, 9.0, 17_000.0, 4.0),
        ];
        let report = Report::new(machine(), config(20_000), runs);
        let verdicts: Vec<_> = report
            .targets
            .iter()
            .map(|target| (target.measured, target.met))
            .collect();
        assert_eq!(
            verdicts,
            [
                (Some(1.5), Some(true)),
                (Some(6.0), Some(false)),
                (Some(85.0), Some(false)),
                (Some(9.5), Some(true)),
            ]
        );
        assert!(report.notes[0].starts_with("from 32 subscribers on"));
        assert!(report.table().contains("NOT met"));
    }

    #[test]
    fn a_run_whose_subject_still_grew_is_noted_as_not_its_steady_state() {
        let measured = |subject: &str, subscribers, rss_mb: [f64; 2]| {
            let mut run = run(subscribers, 0.5, 20_000.0, 0.5);
            run.subject = subject.to_owned();
            run.kvgate.window_rss_mb = rss_mb;
            run
        };
        let runs = vec![
            measured(KVGATE, 1, [35.0, 52.0]),
            // Grew 2% (a peer's heap breathing): steady.
            measured("smg", 8, [140.0, 143.0]),
            measured(KVGATE, 1, [35.0, 35.5]),
            measured(KVGATE, 8, [40.0, 44.0]),
            // Grew 7.5% but under 2 MB: steady.
            measured(KVGATE, 32, [20.0, 21.5]),
            measured("smg", 1, [100.0, 110.0]),
            measured(KVGATE, 1, [35.0, 44.0]),
        ];
        let report = Report::new(machine(), config(20_000), runs);
        let growing: Vec<&str> = report
            .notes
            .iter()
            .filter(|note| note.contains("RSS still grew"))
            .map(|note| note.split(':').next().unwrap())
            .collect();
        assert_eq!(
            growing,
            [
                "in 2 of 3 1-subscriber runs of kvgate its RSS still grew while measured, \
                 by up to 17.0 MB (35.0 to 52.0 MB)",
                "in 1 of 1 8-subscriber runs of kvgate its RSS still grew while measured, \
                 by up to 4.0 MB (40.0 to 44.0 MB)",
                "in 1 of 1 1-subscriber runs of smg its RSS still grew while measured, \
                 by up to 10.0 MB (100.0 to 110.0 MB)",
            ],
            "{:?}",
            report.notes
        );
    }

    #[test]
    fn a_sweep_without_the_counts_a_target_needs_leaves_it_unmeasured() {
        let report = Report::new(machine(), config(0), vec![run(8, 1.0, 50_000.0, 0.1)]);
        assert_eq!(report.targets[1].measured, None);
        assert_eq!(report.targets[2].met, None);
        assert!(
            report.targets[0]
                .note
                .as_deref()
                .unwrap()
                .contains("full speed")
        );
        assert_eq!(
            report.notes,
            ["in every run the subscribers used less CPU than kvgate"]
        );
    }

    #[test]
    fn a_peer_is_judged_by_the_mean_of_its_rounds_against_kvgates() {
        let peer = |subscribers, cpu_us, p99, rss| {
            let mut run = run(subscribers, p99, 20_000.0, 0.5);
            run.subject = "smg".to_owned();
            run.kvgate.cpu_us_per_event_delivered = cpu_us;
            run.kvgate.peak_rss_mb = rss;
            run
        };
        let runs = vec![
            run(1, 0.5, 20_000.0, 0.5),
            peer(1, 2.0, 0.5, 130.0),
            run(1, 0.5, 20_000.0, 0.5),
            peer(1, 4.0, 1.0, 130.0),
            run(8, 1.0, 20_000.0, 0.5),
            peer(8, 2.0, 2.0, 30.0),
        ];
        let mut config = config(20_000);
        config.peer = Some(PeerConfig {
            name: "smg".to_owned(),
            command: "smg {port} {zmq}".to_owned(),
            method: "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents".to_owned(),
        });
        let report = Report::new(machine(), config, runs);
        let verdicts: Vec<_> = report
            .targets
            .iter()
            .filter(|target| target.target.starts_with("smg's"))
            .map(|target| (target.measured, target.met))
            .collect();
        assert_eq!(
            verdicts,
            [
                // 1 subscriber: (2 + 4) / 2 over 1 µs; p99 0.75 over 0.5; 130 over 40 MB.
                (Some(3.0), Some(true)),
                (Some(1.5), Some(true)),
                (Some(3.25), Some(true)),
                (Some(2.0), Some(false)),
                (Some(2.0), Some(true)),
                (Some(0.75), Some(false)),
                (None, None),
                (None, None),
                (None, None),
            ]
        );
        // kvgate's own targets read kvgate's runs only.
        assert_eq!(report.targets[0].measured, Some(1.0));
        assert!(report.table().contains("smg "));
    }
}
