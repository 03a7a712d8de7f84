//! The golden wire fixtures (`tests/fixtures/wire`, a copy of the shared
//! corpus plus the payloads `make_native_fixtures.py` mirrors from
//! TensorRT-LLM's and vLLM 0.34's structs): every engine payload must convert
//! to exactly its `expected` batch content and `drops` counters (contract
//! section 2 and kvgate's additions).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kvgate::convert::{Converter, DropReason, EventKind, Tally};
use kvgate::proto::common::KvCacheEvent;
use serde_json::{Map, Value, json};

/// How many fixtures the corpus holds: a lost directory must fail, not pass
/// vacuously.
const FIXTURE_COUNT: usize = 70;

struct Fixture {
    name: String,
    payload: Vec<u8>,
    description: Value,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wire")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `*/*.msgpack` with its `.json`, in name order.
fn fixtures() -> Vec<Fixture> {
    let mut paths = Vec::new();
    for dir in std::fs::read_dir(root()).expect("tests/fixtures/wire exists") {
        let dir = dir.unwrap().path();
        if dir.is_dir() {
            for file in std::fs::read_dir(&dir).unwrap() {
                let path = file.unwrap().path();
                if path.extension().is_some_and(|e| e == "msgpack") {
                    paths.push(path);
                }
            }
        }
    }
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let relative = path.strip_prefix(root()).unwrap().with_extension("");
            Fixture {
                name: relative.to_string_lossy().into_owned(),
                payload: std::fs::read(&path).unwrap(),
                description: read_json(&path.with_extension("json")),
            }
        })
        .collect()
}

fn rank_of(fixture: &Fixture) -> u32 {
    fixture.description["input"]["dp_rank"]
        .as_u64()
        .map_or(0, |rank| rank as u32)
}

fn event_json(event: &KvCacheEvent) -> Value {
    kvgate::json::to_json(event, "smg.grpc.common.KvCacheEvent")
}

/// Converts a fixture with a fresh converter, in the fixture's `expected` form.
fn converted(fixture: &Fixture) -> (Value, Tally) {
    let mut tally = Tally::default();
    let result = Converter::new().convert(rank_of(fixture), &fixture.payload, &mut tally);
    let actual = match result {
        Ok(out) => {
            let mut object = Map::new();
            object.insert("decodes".into(), json!(true));
            object.insert("timestamp".into(), json!(out.timestamp));
            object.insert("events".into(), out.events.iter().map(event_json).collect());
            if let Some(rank) = out.dp_rank {
                object.insert("dp_rank".into(), json!(rank));
            }
            Value::Object(object)
        }
        Err(_) => json!({ "decodes": false, "events": [] }),
    };
    (actual, tally)
}

/// The `drops` object of a tally: non-zero counters only.
fn drops_json(tally: &Tally) -> Value {
    let forwarded = EventKind::ALL.iter().map(|&kind| {
        (
            format!("forwarded_{}", kind.as_str()),
            tally.forwarded(kind),
        )
    });
    let dropped = DropReason::ALL.iter().map(|&reason| {
        (
            format!("dropped_{}", reason.as_str()),
            tally.dropped(reason),
        )
    });
    forwarded
        .chain(dropped)
        .filter(|&(_, count)| count > 0)
        .map(|(key, count)| (key, json!(count)))
        .collect::<Map<_, _>>()
        .into()
}

/// Every path where `actual` differs from `expected`, one line each.
fn diff(path: &str, expected: &Value, actual: &Value, out: &mut Vec<String>) {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            let keys: BTreeSet<&String> = e.keys().chain(a.keys()).collect();
            for key in keys {
                let here = format!("{path}.{key}");
                match (e.get(key), a.get(key)) {
                    (Some(e), Some(a)) => diff(&here, e, a, out),
                    (Some(e), None) => out.push(format!("{here}: missing, expected {e}")),
                    (None, Some(a)) => out.push(format!("{here}: unexpected {a}")),
                    (None, None) => {}
                }
            }
        }
        (Value::Array(e), Value::Array(a)) if e.len() == a.len() => {
            for (i, (e, a)) in e.iter().zip(a).enumerate() {
                diff(&format!("{path}[{i}]"), e, a, out);
            }
        }
        (Value::Array(e), Value::Array(a)) => {
            out.push(format!("{path}: {} items, expected {}", a.len(), e.len()));
            // Compare the common prefix too: the first differing item is the clue.
            for (i, (e, a)) in e.iter().zip(a).enumerate() {
                diff(&format!("{path}[{i}]"), e, a, out);
            }
        }
        _ if expected != actual => out.push(format!("{path}: got {actual}, expected {expected}")),
        _ => {}
    }
}

/// Runs `check` on every fixture and fails once with every mismatch listed.
fn for_every_fixture(check: impl Fn(&Fixture) -> Vec<String>) {
    let fixtures = fixtures();
    assert_eq!(
        fixtures.len(),
        FIXTURE_COUNT,
        "fixture files under {}",
        root().display()
    );
    let failures: Vec<String> = fixtures
        .iter()
        .filter_map(|fixture| {
            let mismatches = check(fixture);
            (!mismatches.is_empty()).then(|| {
                const SHOWN: usize = 20;
                let mut report = format!("{} ({} mismatches):", fixture.name, mismatches.len());
                for line in mismatches.iter().take(SHOWN) {
                    report.push_str("\n    ");
                    report.push_str(line);
                }
                report
            })
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} fixtures differ:\n  {}",
        failures.len(),
        fixtures.len(),
        failures.join("\n  ")
    );
}

#[test]
fn the_corpus_holds_every_indexed_fixture_and_nothing_else() {
    let index = read_json(&root().join("index.json"));
    let indexed: BTreeSet<String> = index["fixtures"]
        .as_array()
        .expect("index.json lists fixtures")
        .iter()
        .map(|f| f["fixture"].as_str().unwrap().to_owned())
        .collect();
    let present: BTreeSet<String> = fixtures().into_iter().map(|f| f.name).collect();
    assert_eq!(present, indexed);
    assert_eq!(present.len(), FIXTURE_COUNT);
}

#[test]
fn every_golden_fixture_converts_to_its_expected_events() {
    for_every_fixture(|fixture| {
        let (actual, _) = converted(fixture);
        let mut mismatches = Vec::new();
        diff(
            "expected",
            &fixture.description["expected"],
            &actual,
            &mut mismatches,
        );
        mismatches
    });
}

#[test]
fn every_golden_fixture_counts_its_drops_by_the_contract_reasons() {
    for_every_fixture(|fixture| {
        let (_, tally) = converted(fixture);
        let mut mismatches = Vec::new();
        diff(
            "drops",
            &fixture.description["drops"],
            &drops_json(&tally),
            &mut mismatches,
        );
        mismatches
    });
}

#[test]
fn one_converter_fed_every_fixture_numbers_events_on_across_payloads() {
    let mut converter = Converter::new();
    let mut next_id = 1;
    for fixture in fixtures() {
        let mut tally = Tally::default();
        let Ok(out) = converter.convert(rank_of(&fixture), &fixture.payload, &mut tally) else {
            continue;
        };
        let first = next_id;
        next_id += tally.total_forwarded() + tally.total_dropped();
        for event in &out.events {
            assert!(
                (first..next_id).contains(&event.event_id),
                "{}: id {} outside {first}..{next_id}",
                fixture.name,
                event.event_id
            );
        }
        let expected: Vec<u64> = fixture.description["expected"]["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["event_id"].as_str().unwrap().parse::<u64>().unwrap() + first - 1)
            .collect();
        let actual: Vec<u64> = out.events.iter().map(|e| e.event_id).collect();
        assert_eq!(actual, expected, "{}", fixture.name);
    }
    assert!(
        next_id > 9000,
        "the three 3000-event batches alone count 9000"
    );
}
