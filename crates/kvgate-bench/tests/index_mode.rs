//! `kvgate-bench index` end to end at a tiny scale: the real tool, the real
//! `kvgate` binary beside it (`cargo test --workspace` builds both), a real
//! ZMQ fleet on loopback. Timings are not judged here (benchmarks are not
//! timed tests); what is judged is that the tool measured something: every
//! block it published was ingested, every query it asked was answered.

use std::process::Command;

use serde_json::Value;

#[test]
fn the_index_mode_ingests_every_block_it_publishes_and_answers_every_query_it_asks() {
    let json = std::env::temp_dir().join(format!("kvgate-bench-index-{}.json", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_kvgate-bench"))
        .args([
            "index",
            "--ranks",
            "3",
            "--ranks-per-worker",
            "2",
            "--blocks-per-rank",
            "256",
            "--chain",
            "32",
            "--chains-per-batch",
            "3",
            "--queries",
            "200",
            "--connections",
            "2",
            "--steady",
            "1",
            "--query-rate",
            "200",
            "--store-rate",
            "64",
            "--json",
        ])
        .arg(&json)
        .output()
        .expect("kvgate-bench runs");
    assert!(
        output.status.success(),
        "kvgate-bench index failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);

    // 3 ranks x 8 chains x 32 blocks.
    let live_blocks = 3 * 8 * 32;
    assert_eq!(report["config"]["live_blocks"], live_blocks);
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "one round of kvgate alone");
    let run = &runs[0];
    assert_eq!(run["subject"], "kvgate");
    assert_eq!(run["ingest"]["blocks"], live_blocks);
    assert_eq!(run["ingest"]["stores"], 3 * 8);
    assert_eq!(
        run["ingest"]["held_blocks_reported"], live_blocks,
        "kvgate's /metrics holds every block published"
    );
    assert!(run["memory"]["rss_after_ingest_mb"].as_f64().unwrap() > 0.0);

    let queries = &run["queries"];
    assert_eq!(queries["queries"], 200);
    assert_eq!(queries["answered"], 200);
    assert_eq!(queries["failed"], 0);
    assert_eq!(queries["latency_ms"]["samples"], 200);

    // One second at 200 queries/s, while every rank stored and evicted.
    let steady = &run["steady"];
    assert_eq!(steady["answered"], 200);
    assert_eq!(steady["failed"], 0);
    let stored = steady["stored_blocks"].as_u64().unwrap();
    assert!(stored >= 32, "every rank stored whole chains: {stored}");
    assert_eq!(steady["removed_blocks"].as_u64(), Some(stored));

    let targets = report["targets"].as_array().unwrap();
    assert!(
        targets.iter().any(|target| target["measured"].is_number()),
        "{targets:?}"
    );
}
