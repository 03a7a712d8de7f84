//! The deploy files work as shipped: the sidecar manifest passes a schema
//! check against Kubernetes' published API schemas, publishes only the gRPC
//! port, carries the label the KvgateDown alert selects on, and starts the
//! engine's gRPC server with the flags the engine really has (vLLM 0.33:
//! `vllm serve MODEL --grpc --port N`; `--grpc-port` belongs to its Rust
//! frontend and cannot be combined with `--grpc`).

mod common;

use std::path::{Path, PathBuf};

fn repository() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repository().join(path))
        .unwrap_or_else(|error| panic!("{path}: {error}"))
}

const MANIFEST: &str = "deploy/kubernetes-sidecar.yaml";

/// The manifest's document of `kind`, as text (the facts checked here are
/// lines of it; the schema check parses it).
fn document(kind: &str) -> String {
    read(MANIFEST)
        .split("\n---\n")
        .find(|document| document.contains(&format!("\nkind: {kind}\n")))
        .unwrap_or_else(|| panic!("{MANIFEST} has no {kind}"))
        .to_owned()
}

const INDEX_MANIFEST: &str = "deploy/kubernetes-index.yaml";

/// `manifest` passes kubernetes-validate --strict, each of `kinds` checked.
fn passes_a_strict_schema_check(manifest: &str, kinds: &[&str]) {
    let Some(output) = common::external_tool(
        "kubernetes-validate",
        &["--strict", manifest],
        Path::new(env!("CARGO_MANIFEST_DIR")),
        "pip install kubernetes-validate",
    ) else {
        return;
    };
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{report}");
    for kind in kinds {
        assert!(
            report.contains(&format!("passed for resource {kind}/")),
            "{report}"
        );
    }
}

#[test]
fn the_sidecar_manifest_passes_a_strict_schema_check() {
    passes_a_strict_schema_check(MANIFEST, &["deployment", "service"]);
}

#[test]
fn the_index_manifest_passes_a_strict_schema_check() {
    passes_a_strict_schema_check(
        INDEX_MANIFEST,
        &["deployment", "service", "poddisruptionbudget"],
    );
}

#[test]
fn every_setting_of_the_index_manifest_is_one_kvgate_index_reads() {
    let manifest = read(INDEX_MANIFEST);
    // The subcommand's settings and kvgate's own (logging).
    let help: String = [&["index", "--help"][..], &["--help"][..]]
        .into_iter()
        .map(|args| {
            let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
                .args(args)
                .output()
                .unwrap();
            String::from_utf8_lossy(&output.stdout).into_owned()
        })
        .collect();
    let settings: Vec<&str> = manifest
        .split("name: ")
        .skip(1)
        .filter_map(|rest| rest.split([',', '\n', '}']).next())
        .filter(|name| name.starts_with("KVGATE_"))
        .collect();
    assert!(settings.len() >= 6, "{settings:?}");
    for setting in settings {
        assert!(
            help.contains(&format!("[env: {setting}=")),
            "{setting} is not a setting of kvgate index"
        );
    }
    // The workers it names parse as `--workers` does: one grpcs:// sidecar
    // per engine.
    let workers = manifest
        .split("name: KVGATE_INDEX_WORKERS")
        .nth(1)
        .and_then(|rest| rest.split("value: >-").nth(1))
        .and_then(|rest| rest.split("# ").next())
        .unwrap();
    let workers: String = workers.split_whitespace().collect();
    let parsed = kvgate::cli::parse_index_workers(&workers).unwrap();
    assert_eq!(parsed.0.len(), 4, "{workers}");
    assert!(
        parsed
            .0
            .iter()
            .all(|worker| worker.endpoint.starts_with("grpcs://"))
    );
}

#[test]
fn the_service_publishes_the_grpc_port_and_not_the_metrics_port() {
    let service = document("Service");
    assert!(service.contains("port: 50061"), "{service}");
    assert!(
        !service.contains("9464") && !service.contains("metrics}"),
        "{service}"
    );
}

#[test]
fn kvgate_down_selects_on_a_label_the_manifest_sets_on_the_pod() {
    let rules = read("deploy/prometheus/kvgate-rules.yaml");
    let expr = rules
        .lines()
        .skip_while(|line| !line.contains("- alert: KvgateDown"))
        .find_map(|line| line.trim().strip_prefix("expr: "))
        .expect("KvgateDown has an expr");
    let selector = expr
        .split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'))
        .map(|(selector, _)| selector)
        .expect("KvgateDown selects by label");
    let (name, value) = selector.split_once('=').expect("an equality matcher");
    assert!(
        !value.starts_with('~'),
        "a regular expression on {name} guesses: {expr}"
    );
    let value = value.trim_matches('"');
    let deployment = document("Deployment");
    let pod_labels = deployment
        .split("template:")
        .nth(1)
        .and_then(|template| {
            template
                .lines()
                .find(|line| line.trim().starts_with("labels:"))
        })
        .expect("the pod template has labels");
    assert!(
        pod_labels.contains(&format!("{name}: {value}")),
        "KvgateDown selects {name}={value}, the pod has {pod_labels}"
    );
}

#[test]
fn the_engine_starts_its_grpc_server_with_vllms_real_flags() {
    let deployment = document("Deployment");
    let engine = deployment
        .split("- name: engine")
        .nth(1)
        .and_then(|rest| rest.split("- name: kvgate").next())
        .expect("an engine container");
    // Its lines without the comments.
    let engine: String = engine
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .map(|line| format!("{line}\n"))
        .collect();
    for flag in ["- --grpc\n", "- --port=50051", "- --host=127.0.0.1"] {
        assert!(engine.contains(flag), "engine args lack {flag}: {engine}");
    }
    assert!(!engine.contains("--grpc-port"), "{engine}");
    assert!(deployment.contains("KVGATE_ENGINE_GRPC, value: \"http://127.0.0.1:50051\""));
    // The documented vLLM-with-gRPC example starts the gRPC server it
    // points kvgate at.
    let engines = read("docs/engines.md");
    let example = engines
        .split("**vLLM with its gRPC server**")
        .nth(1)
        .and_then(|rest| rest.split("```").nth(1))
        .expect("docs/engines.md's vLLM-with-gRPC example");
    assert!(
        example.contains("--grpc --host 127.0.0.1 --port 50051")
            && example.contains("--engine-grpc http://127.0.0.1:50051"),
        "{example}"
    );
}
