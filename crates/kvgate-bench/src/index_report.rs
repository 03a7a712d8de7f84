//! An index run's figures: per subject and round, what ingesting the fleet
//! cost (CPU per block, memory per live block), what queries cost and how
//! long they took, and at fleet scale how queries fared at a fixed rate
//! while every rank kept storing; rendered as a table, JSON and the issue's
//! targets, kvgate against the peer where one ran.

use std::fmt::Write;

use serde::Serialize;

use super::procfs::Machine;
use super::report::{
    DISTURBED_PERCENT, Judged, Latency, Report, TargetCheck, mean, write_machine,
    write_targets_and_notes,
};
use super::subject::KVGATE;

/// How many times less CPU per query than the peer kvgate aims at.
const QUERY_CPU_RATIO: f64 = 3.0;
/// How many times less memory per live block, and CPU per ingested block.
const INGEST_RATIO: f64 = 2.0;
/// The fleet-scale targets: live blocks indexed within this much RSS...
const FLEET_RSS_MB: f64 = 1_000.0;
/// ... and answering at this rate with this p99 while every rank stores.
const FLEET_QUERY_RATE: f64 = 5_000.0;
const FLEET_P99_MS: f64 = 1.0;
const FLEET_STORE_RATE: f64 = 500.0;
/// 256 workers x 32,768 blocks.
const FLEET_LIVE_BLOCKS: u64 = 256 * 32_768;
/// Share of the asked query rate a fleet run must answer to count as
/// keeping up.
const KEPT_UP_SHARE: f64 = 0.99;

pub type IndexReport = Report<IndexConfig>;

#[derive(Debug, Serialize)]
pub struct IndexConfig {
    pub ranks: usize,
    pub ranks_per_worker: usize,
    pub blocks_per_rank: usize,
    pub block_size: u32,
    pub chain_blocks: usize,
    pub shared_blocks_per_chain: usize,
    pub chains_per_batch: usize,
    pub live_blocks: u64,
    /// Closed-loop queries per run, over `connections` keep-alive
    /// connections.
    pub queries: usize,
    pub connections: usize,
    /// The fleet-scale phase: seconds of queries at `query_rate` while every
    /// rank stores `store_blocks_per_s_per_rank`; 0 = none.
    pub steady_s: f64,
    pub query_rate: f64,
    pub store_blocks_per_s_per_rank: f64,
    pub kvgate: String,
    /// The peer index measured alternately with kvgate, if any.
    pub peer: Option<IndexPeerConfig>,
}

#[derive(Debug, Serialize)]
pub struct IndexPeerConfig {
    pub name: String,
    pub command: String,
}

#[derive(Debug, Serialize)]
pub struct IndexRunReport {
    /// `kvgate`, or the peer's name.
    pub subject: String,
    pub ingest: Ingest,
    pub memory: IndexMemory,
    /// The closed-loop query phase, if it ran.
    pub queries: Option<Queries>,
    /// The fleet-scale phase, if it ran.
    pub steady: Option<Steady>,
}

#[derive(Debug, Serialize)]
pub struct Ingest {
    /// Blocks published (every rank's), in `stores` store events.
    pub blocks: u64,
    pub stores: u64,
    /// From the first publish until every rank's last chain matched in
    /// full.
    pub seconds: f64,
    /// The subject's CPU over that time, and per block.
    pub cpu_s: f64,
    pub cpu_us_per_block: f64,
    /// What the subject's `/metrics` says it holds: kvgate's live blocks
    /// (`kvgate_index_blocks`), Dynamo's stores applied
    /// (`dynamo_kvrouter_kv_cache_events_applied`, stored, ok).
    pub held_blocks_reported: Option<u64>,
    pub stores_applied_reported: Option<u64>,
    pub publisher_cpu_s: f64,
}

#[derive(Debug, Serialize)]
pub struct IndexMemory {
    /// RSS once started, before the first registration.
    pub rss_before_mb: f64,
    /// RSS once every rank is registered and subscribed to, before the
    /// first block: what following the ranks costs whatever they hold.
    pub rss_registered_mb: f64,
    /// RSS at rest: a second after the last block was applied.
    pub rss_after_ingest_mb: f64,
    /// (RSS at rest after ingest - RSS before) / live blocks.
    pub bytes_per_live_block: f64,
    /// (RSS at rest after ingest - RSS registered) / live blocks: the
    /// blocks' own cost, the ranks' connections left out.
    pub bytes_per_live_block_beyond_registration: f64,
}

#[derive(Debug, Serialize)]
pub struct Queries {
    pub queries: u64,
    /// Answered 200; the others are `failed`.
    pub answered: u64,
    pub failed: u64,
    pub connections: usize,
    pub seconds: f64,
    pub queries_per_s: f64,
    pub cpu_s: f64,
    pub cpu_us_per_query: f64,
    /// Client-side, request written to answer read.
    pub latency_ms: Latency,
    /// The tool's query thread.
    pub client_cpu_s: f64,
    pub client_cpu_us_per_query: f64,
    pub others_busy_percent: f64,
}

#[derive(Debug, Serialize)]
pub struct Steady {
    pub seconds: f64,
    pub query_rate: f64,
    pub queries: u64,
    pub answered: u64,
    pub failed: u64,
    pub answered_per_s: f64,
    /// Each query's round trip plus the wait behind earlier queries on its
    /// connection that the subject's answers would have caused had the
    /// client sent every query at its time (a stall counts against every
    /// query it delayed; the client's own timer does not).
    pub latency_ms: Latency,
    /// What the ranks stored and evicted, over the phase's scheduled
    /// seconds (not the backlog a slow subject answers after them).
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub stored_blocks_per_s_per_rank: f64,
    pub cpu_s: f64,
    pub cpu_percent_of_one_core: f64,
    pub rss_end_mb: f64,
    pub peak_rss_mb: f64,
    pub client_cpu_s: f64,
    pub publisher_cpu_s: f64,
    pub others_busy_percent: f64,
}

impl Judged for IndexConfig {
    type Run = IndexRunReport;

    fn targets(&self, runs: &[IndexRunReport]) -> Vec<TargetCheck> {
        targets(self, runs)
    }

    fn notes(&self, _: &Machine, runs: &[IndexRunReport]) -> Vec<String> {
        notes(runs)
    }
}

impl IndexReport {
    pub fn table(&self) -> String {
        let config = &self.config;
        let machine = &self.machine;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "kvgate-bench index: {} ranks ({} per worker) x {} blocks = {} live blocks, chains \
             of {} blocks ({} shared), {} per batch, block size {}",
            config.ranks,
            config.ranks_per_worker,
            config.blocks_per_rank,
            config.live_blocks,
            config.chain_blocks,
            config.shared_blocks_per_chain,
            config.chains_per_batch,
            config.block_size,
        );
        write_machine(&mut out, machine);
        let _ = writeln!(
            out,
            "{:<8} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>8} {:>8} {:>8} {:>10}",
            "index",
            "ingest µs/b",
            "B/block",
            "B/b beyond",
            "RSS MB",
            "queries",
            "µs/query",
            "q/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "client µs"
        );
        for run in &self.runs {
            let _ = write!(
                out,
                "{:<8} {:>12.2} {:>10.1} {:>10.1} {:>10.1}",
                run.subject,
                run.ingest.cpu_us_per_block,
                run.memory.bytes_per_live_block,
                run.memory.bytes_per_live_block_beyond_registration,
                run.memory.rss_after_ingest_mb,
            );
            match &run.queries {
                Some(queries) => {
                    let _ = writeln!(
                        out,
                        " {:>10} {:>10.1} {:>9.0} {:>8.3} {:>8.3} {:>8.3} {:>10.1}",
                        queries.answered,
                        queries.cpu_us_per_query,
                        queries.queries_per_s,
                        queries.latency_ms.p50,
                        queries.latency_ms.p99,
                        queries.latency_ms.max,
                        queries.client_cpu_us_per_query,
                    );
                }
                None => out.push_str("   (no closed-loop queries)\n"),
            }
        }
        if self.runs.iter().any(|run| run.steady.is_some()) {
            let _ = writeln!(
                out,
                "\nfleet scale: {} queries/s for {} s while every rank stores {} blocks/s \
                 (evicting as many)\n",
                config.query_rate, config.steady_s, config.store_blocks_per_s_per_rank
            );
            let _ = writeln!(
                out,
                "{:<8} {:>10} {:>10} {:>8} {:>8} {:>8} {:>14} {:>10} {:>9} {:>9} {:>10}",
                "index",
                "answered",
                "q/s",
                "p50 ms",
                "p99 ms",
                "max ms",
                "stored b/s/rk",
                "CPU % core",
                "RSS MB",
                "peak MB",
                "client s"
            );
            for run in &self.runs {
                let Some(steady) = &run.steady else { continue };
                let _ = writeln!(
                    out,
                    "{:<8} {:>10} {:>10.0} {:>8.3} {:>8.3} {:>8.3} {:>14.0} {:>10.0} {:>9.1} {:>9.1} {:>10.2}",
                    run.subject,
                    steady.answered,
                    steady.answered_per_s,
                    steady.latency_ms.p50,
                    steady.latency_ms.p99,
                    steady.latency_ms.max,
                    steady.stored_blocks_per_s_per_rank,
                    steady.cpu_percent_of_one_core,
                    steady.rss_end_mb,
                    steady.peak_rss_mb,
                    steady.client_cpu_s,
                );
            }
        }
        write_targets_and_notes(&mut out, &self.targets, &self.notes);
        out
    }
}

fn targets(config: &IndexConfig, runs: &[IndexRunReport]) -> Vec<TargetCheck> {
    let mut checks = Vec::new();
    let peer = config.peer.as_ref().map(|peer| peer.name.as_str());
    let of = |subject: &str, pick: fn(&IndexRunReport) -> Option<f64>| {
        mean(
            runs.iter()
                .filter(|run| run.subject == subject)
                .filter_map(pick),
        )
    };
    // The peer's mean over kvgate's.
    let ratio = |pick: fn(&IndexRunReport) -> Option<f64>| {
        let peer = peer?;
        Some(of(peer, pick)? / of(KVGATE, pick)?)
    };
    let no_peer = peer.is_none().then(|| "no peer ran".to_owned());
    let peer_name = peer.unwrap_or("the peer");
    // A target met when the peer's mean is at least `at_least` times kvgate's.
    let peer_over_kvgate =
        |target: String, pick: fn(&IndexRunReport) -> Option<f64>, at_least: f64| {
            let measured = ratio(pick);
            TargetCheck {
                target,
                measured,
                met: measured.map(|ratio| ratio >= at_least),
                note: no_peer.clone(),
            }
        };
    checks.push(peer_over_kvgate(
        format!(
            "{peer_name}'s CPU per query >= {QUERY_CPU_RATIO}x kvgate's at {} connections (x)",
            config.connections
        ),
        |run| Some(run.queries.as_ref()?.cpu_us_per_query),
        QUERY_CPU_RATIO,
    ));
    checks.push(peer_over_kvgate(
        format!("{peer_name}'s query p99 over kvgate's (x, >= 1)"),
        |run| Some(run.queries.as_ref()?.latency_ms.p99),
        1.0,
    ));
    checks.push(peer_over_kvgate(
        format!("{peer_name}'s memory per live block >= {INGEST_RATIO}x kvgate's (x)"),
        |run| Some(run.memory.bytes_per_live_block),
        INGEST_RATIO,
    ));
    checks.push(peer_over_kvgate(
        format!(
            "{peer_name}'s memory per live block beyond what registering the ranks took \
             >= {INGEST_RATIO}x kvgate's (x)"
        ),
        |run| Some(run.memory.bytes_per_live_block_beyond_registration),
        INGEST_RATIO,
    ));
    checks.push(peer_over_kvgate(
        format!("{peer_name}'s CPU per ingested block >= {INGEST_RATIO}x kvgate's (x)"),
        |run| Some(run.ingest.cpu_us_per_block),
        INGEST_RATIO,
    ));
    checks.extend(fleet_targets(config, runs));
    checks
}

/// kvgate's fleet-scale figures, the worst of its runs.
fn fleet_targets(config: &IndexConfig, runs: &[IndexRunReport]) -> Vec<TargetCheck> {
    let kvgate = || runs.iter().filter(|run| run.subject == KVGATE);
    let worst = |values: Vec<f64>| values.into_iter().reduce(f64::max);
    let steady: Vec<&Steady> = kvgate().filter_map(|run| run.steady.as_ref()).collect();
    let shape_note = |stated: bool, what: String| (!stated).then_some(what);
    let scale_note = shape_note(
        config.live_blocks == FLEET_LIVE_BLOCKS,
        format!(
            "stated at {FLEET_LIVE_BLOCKS} live blocks; this run held {}",
            config.live_blocks
        ),
    );
    let rate_note = shape_note(
        config.query_rate == FLEET_QUERY_RATE
            && config.store_blocks_per_s_per_rank == FLEET_STORE_RATE,
        format!(
            "stated at {FLEET_QUERY_RATE} queries/s and {FLEET_STORE_RATE} stored blocks/s per \
             rank; this run asked {} and {}",
            config.query_rate, config.store_blocks_per_s_per_rank
        ),
    )
    .or_else(|| scale_note.clone());
    let rss = worst(kvgate().map(|run| run.memory.rss_after_ingest_mb).collect());
    let p99 = worst(steady.iter().map(|run| run.latency_ms.p99).collect());
    let kept_up = worst(
        steady
            .iter()
            .map(|run| -run.answered_per_s / run.query_rate)
            .collect(),
    )
    .map(|share| -100.0 * share);
    vec![
        TargetCheck {
            target: format!(
                "kvgate's RSS with the fleet indexed <= {FLEET_RSS_MB} MB (MB, largest over \
                 its runs)"
            ),
            measured: rss,
            met: rss.map(|mb| mb <= FLEET_RSS_MB),
            note: scale_note,
        },
        TargetCheck {
            target: format!(
                "kvgate's query p99 <= {FLEET_P99_MS} ms at fleet scale while every rank \
                 stores (ms, largest over its runs)"
            ),
            measured: p99,
            met: p99.map(|ms| ms <= FLEET_P99_MS),
            note: rate_note.clone(),
        },
        TargetCheck {
            target: format!(
                "kvgate answers >= {}% of the asked query rate at fleet scale (%, smallest \
                 over its runs)",
                KEPT_UP_SHARE * 100.0
            ),
            measured: kept_up,
            met: kept_up.map(|percent| percent >= KEPT_UP_SHARE * 100.0),
            note: rate_note,
        },
    ]
}

fn notes(runs: &[IndexRunReport]) -> Vec<String> {
    let mut notes = Vec::new();
    for run in runs {
        if let Some(queries) = &run.queries {
            if queries.failed > 0 {
                notes.push(format!(
                    "{} answered {} of {} queries with an error status",
                    run.subject, queries.failed, queries.queries
                ));
            }
            if queries.client_cpu_s >= queries.cpu_s {
                notes.push(format!(
                    "the query client used as much CPU as {} or more ({:.2} s vs {:.2} s): \
                     latency and queries/s there measure the client as much",
                    run.subject, queries.client_cpu_s, queries.cpu_s
                ));
            }
            if queries.others_busy_percent > DISTURBED_PERCENT {
                notes.push(format!(
                    "during a query phase of {} other processes used {:.0}% of the CPUs: its \
                     latencies are noisy",
                    run.subject, queries.others_busy_percent
                ));
            }
        }
        if let Some(steady) = &run.steady {
            if steady.failed > 0 {
                notes.push(format!(
                    "{} answered {} of {} fleet-scale queries with an error status",
                    run.subject, steady.failed, steady.queries
                ));
            }
            if steady.others_busy_percent > DISTURBED_PERCENT {
                notes.push(format!(
                    "during the fleet-scale phase of {} other processes used {:.0}% of the \
                     CPUs: its latencies are noisy",
                    run.subject, steady.others_busy_percent
                ));
            }
        }
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::machine;

    fn run(
        subject: &str,
        query_cpu_us: f64,
        p99: f64,
        bytes: f64,
        ingest_us: f64,
    ) -> IndexRunReport {
        IndexRunReport {
            subject: subject.to_owned(),
            ingest: Ingest {
                blocks: 1_000,
                stores: 100,
                seconds: 1.0,
                cpu_s: ingest_us * 1e-3,
                cpu_us_per_block: ingest_us,
                held_blocks_reported: None,
                stores_applied_reported: None,
                publisher_cpu_s: 0.1,
            },
            memory: IndexMemory {
                rss_before_mb: 10.0,
                // Registering the ranks took 10 of the bytes per block.
                rss_registered_mb: 10.0 + 10.0 * 1e-3,
                rss_after_ingest_mb: 10.0 + bytes * 1e-3,
                bytes_per_live_block: bytes,
                bytes_per_live_block_beyond_registration: bytes - 10.0,
            },
            queries: Some(Queries {
                queries: 1_000,
                answered: 1_000,
                failed: 0,
                connections: 4,
                seconds: 1.0,
                queries_per_s: 1_000.0,
                cpu_s: query_cpu_us * 1e-3,
                cpu_us_per_query: query_cpu_us,
                latency_ms: Latency {
                    p50: p99 / 2.0,
                    p99,
                    max: p99 * 2.0,
                    samples: 1_000,
                },
                client_cpu_s: 0.001,
                client_cpu_us_per_query: 1.0,
                others_busy_percent: 0.0,
            }),
            steady: None,
        }
    }

    fn config(peer: bool) -> IndexConfig {
        IndexConfig {
            ranks: 33,
            ranks_per_worker: 4,
            blocks_per_rank: 8_000,
            block_size: 16,
            chain_blocks: 32,
            shared_blocks_per_chain: 16,
            chains_per_batch: 8,
            live_blocks: 264_000,
            queries: 20_000,
            connections: 4,
            steady_s: 0.0,
            query_rate: 5_000.0,
            store_blocks_per_s_per_rank: 500.0,
            kvgate: "kvgate".to_owned(),
            peer: peer.then(|| IndexPeerConfig {
                name: "dynamo".to_owned(),
                command: "peer.py serve --port {port}".to_owned(),
            }),
        }
    }

    #[test]
    fn the_peer_is_judged_by_the_mean_of_its_rounds_over_kvgates() {
        let runs = vec![
            run(KVGATE, 20.0, 0.4, 50.0, 1.0),
            run("dynamo", 60.0, 0.5, 120.0, 1.5),
            run(KVGATE, 30.0, 0.6, 50.0, 1.0),
            run("dynamo", 100.0, 0.7, 120.0, 1.5),
        ];
        let report = IndexReport::new(machine(), config(true), runs);
        let verdicts: Vec<_> = report.targets[..5]
            .iter()
            .map(|target| (target.measured, target.met))
            .collect();
        assert_eq!(
            verdicts,
            [
                // (60 + 100) / 2 over (20 + 30) / 2.
                (Some(3.2), Some(true)),
                (Some(1.2), Some(true)),
                (Some(2.4), Some(true)),
                // (120 - 10) / (50 - 10).
                (Some(2.75), Some(true)),
                (Some(1.5), Some(false)),
            ]
        );
        assert!(report.table().contains("dynamo"));
        assert!(report.table().contains("NOT met"));
    }

    #[test]
    fn without_a_peer_or_a_fleet_phase_those_targets_are_not_measured() {
        let report = IndexReport::new(
            machine(),
            config(false),
            vec![run(KVGATE, 20.0, 0.4, 50.0, 1.0)],
        );
        assert!(report.targets[..5].iter().all(
            |target| target.measured.is_none() && target.note.as_deref() == Some("no peer ran")
        ));
        // RSS is measured in every run; the rate targets need the fleet phase.
        assert_eq!(report.targets[5].measured, Some(10.05));
        assert!(
            report.targets[5]
                .note
                .as_deref()
                .unwrap()
                .contains("264000")
        );
        assert_eq!(report.targets[6].measured, None);
        assert_eq!(report.targets[7].measured, None);
    }

    #[test]
    fn a_fleet_run_is_judged_by_its_worst_round() {
        let steady = |p99, answered_per_s| Steady {
            seconds: 10.0,
            query_rate: 5_000.0,
            queries: 50_000,
            answered: 50_000,
            failed: 0,
            answered_per_s,
            latency_ms: Latency {
                p50: 0.1,
                p99,
                max: 3.0,
                samples: 50_000,
            },
            stored_blocks: 1,
            removed_blocks: 1,
            stored_blocks_per_s_per_rank: 500.0,
            cpu_s: 10.0,
            cpu_percent_of_one_core: 100.0,
            rss_end_mb: 800.0,
            peak_rss_mb: 810.0,
            client_cpu_s: 1.0,
            publisher_cpu_s: 1.0,
            others_busy_percent: 0.0,
        };
        let mut first = run(KVGATE, 20.0, 0.4, 50.0, 1.0);
        first.steady = Some(steady(0.8, 5_000.0));
        let mut second = run(KVGATE, 20.0, 0.4, 50.0, 1.0);
        second.steady = Some(steady(1.2, 4_900.0));
        let mut config = config(false);
        config.live_blocks = FLEET_LIVE_BLOCKS;
        let report = IndexReport::new(machine(), config, vec![first, second]);
        assert_eq!(report.targets[5].note, None);
        assert_eq!(
            (report.targets[6].measured, report.targets[6].met),
            (Some(1.2), Some(false))
        );
        assert_eq!(
            (report.targets[7].measured, report.targets[7].met),
            (Some(98.0), Some(false))
        );
        assert!(report.table().contains("fleet scale"));
    }
}
