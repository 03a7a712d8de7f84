//! What an operator watches: every metric the Grafana dashboard and the
//! Prometheus alert rules (`deploy/`) name is exported by a running kvgate,
//! every counter exists from the start at 0 (an alert on a missing series
//! sees no data), and the rules pass `promtool check` and their unit tests.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::{Gateway, subscribe};
use kvgate_sim::EnginePublisher;

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

/// Every `kvgate_…` metric name a file mentions.
fn metric_names_in(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).expect("deploy file");
    let mut names = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(start) = rest.find("kvgate_") {
        let preceded_by_word = rest[..start]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if !preceded_by_word {
            names.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    names
}

/// The sample lines of a Prometheus text exposition: (series name, the
/// whole series with labels, value).
fn samples(exposition: &str) -> Vec<(&str, &str, f64)> {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let name = series.split('{').next()?;
            Some((name, series, value.parse().ok()?))
        })
        .collect()
}

/// Names of the families a `# TYPE` line declares as `kind`.
fn families_of_type<'a>(exposition: &'a str, kind: &str) -> Vec<&'a str> {
    exposition
        .lines()
        .filter_map(|line| {
            let mut words = line.strip_prefix("# TYPE ")?.split(' ');
            let name = words.next()?;
            (words.next()? == kind).then_some(name)
        })
        .collect()
}

/// A gateway with its admin port, fed by a publisher that has published
/// nothing yet.
async fn idle_gateway(extra: &[&str]) -> (Gateway, EnginePublisher, String) {
    let (gateway, publisher) = common::gateway_on_a_publisher(extra).await;
    let (code, exposition) = common::http_get(gateway.admin.expect("admin port"), "/metrics").await;
    assert_eq!(code, 200);
    (gateway, publisher, exposition)
}

#[tokio::test(flavor = "multi_thread")]
async fn every_counter_is_exported_from_the_start_at_zero_with_every_closed_label_value() {
    let (_gateway, _publisher, exposition) = idle_gateway(&["--dp-size", "2"]).await;
    let samples = samples(&exposition);
    let counters = families_of_type(&exposition, "counter");
    assert!(counters.len() >= 10, "{exposition}");
    for family in &counters {
        let total = format!("{family}_total");
        let values: Vec<f64> = samples
            .iter()
            .filter(|(name, _, _)| *name == total)
            .map(|(_, _, value)| *value)
            .collect();
        assert!(!values.is_empty(), "{family} has no series: {exposition}");
        if *family != "kvgate_process_cpu_seconds" {
            assert!(values.iter().all(|v| *v == 0.0), "{family}: {exposition}");
        }
    }
    let has = |series: &str| samples.iter().any(|(_, s, _)| *s == series);
    for reason in kvgate::convert::DropReason::ALL {
        let series = format!(
            "kvgate_events_dropped_total{{reason=\"{}\"}}",
            reason.as_str()
        );
        assert!(has(&series), "{series} missing: {exposition}");
    }
    let labels = kvgate::app::metric_labels::closed_labels();
    for reason in labels.bad_messages {
        let series = format!("kvgate_bad_messages_total{{reason=\"{reason}\"}}");
        assert!(has(&series), "{series} missing: {exposition}");
    }
    for reason in labels.load_push_faults {
        let series = format!("kvgate_load_push_faults_total{{reason=\"{reason}\"}}");
        assert!(has(&series), "{series} missing: {exposition}");
    }
    for source in labels.load_record_sources {
        let series = format!("kvgate_load_records_sent_total{{source=\"{source}\"}}");
        assert!(has(&series), "{series} missing: {exposition}");
    }
    for bound in labels.replay_bounds {
        let series = format!("kvgate_replay_fetches_bounded_total{{bound=\"{bound}\"}}");
        assert!(has(&series), "{series} missing: {exposition}");
    }
    for reason in labels.state_damaged {
        let series = format!("kvgate_state_damaged_total{{reason=\"{reason}\"}}");
        assert!(has(&series), "{series} missing: {exposition}");
    }
    for rank in 0..2 {
        let series = format!("kvgate_engine_messages_total{{rank=\"{rank}\"}}");
        assert!(has(&series), "{series} missing: {exposition}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn build_info_names_the_version_and_commit_and_process_metrics_describe_the_process() {
    let (gateway, _publisher, exposition) = idle_gateway(&[]).await;
    let samples = samples(&exposition);
    let build = samples
        .iter()
        .find(|(name, _, _)| *name == "kvgate_build_info")
        .expect("kvgate_build_info");
    assert!(
        build
            .1
            .contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{build:?}"
    );
    assert!(
        build
            .1
            .contains(&format!("commit=\"{}\"", kvgate::metrics::GIT_COMMIT)),
        "{build:?}"
    );
    assert_eq!(build.2, 1.0);
    let value = |wanted: &str| {
        samples
            .iter()
            .find(|(name, _, _)| *name == wanted)
            .map(|(_, _, value)| *value)
    };
    #[cfg(target_os = "linux")]
    {
        let vm_rss_kib = common::live_rss_kib(gateway.pid()) as f64;
        let rss = value("kvgate_process_resident_memory_bytes").expect("RSS exported");
        // Same process, read a moment apart: the same order of magnitude.
        assert!(
            rss > vm_rss_kib * 1024.0 / 4.0 && rss < vm_rss_kib * 1024.0 * 4.0,
            "{rss} vs VmRSS {vm_rss_kib} KiB"
        );
        let fds = std::fs::read_dir(format!("/proc/{}/fd", gateway.pid()))
            .unwrap()
            .count() as f64;
        let open = value("kvgate_process_open_fds").expect("open fds exported");
        assert!(open >= 3.0 && open <= fds * 2.0, "{open} vs {fds}");
        assert!(value("kvgate_process_max_fds").is_some_and(|max| max >= open));
        assert!(value("kvgate_process_cpu_seconds_total").is_some_and(|s| s >= 0.0));
        assert!(value("kvgate_process_start_time_seconds").is_some_and(|s| s > 1e9));
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (gateway, value);
}

#[tokio::test(flavor = "multi_thread")]
async fn every_metric_the_dashboard_and_alert_rules_name_is_exported_by_a_running_kvgate() {
    // An engine gRPC address nothing listens on: the pass-through call below
    // fails with UNAVAILABLE, which is still a counted call.
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let engine = format!("http://{closed_port}");
    let (gateway, mut publisher, _) = idle_gateway(&["--engine-grpc", &engine]).await;
    let channel = gateway.channel().await;
    // A subscriber that has been handed batches, for the per-subscriber lag.
    let mut streams = vec![
        subscribe(channel.clone(), "kvgate.v1.KvGate", 0)
            .await
            .unwrap(),
    ];
    common::sync_streams(&mut publisher, 0, &mut streams).await;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let passed_through = grpc
        .unary(
            tonic::Request::new(()),
            "/vllm.grpc.engine.VllmEngine/GetModelInfo".parse().unwrap(),
            tonic_prost::ProstCodec::<(), ()>::default(),
        )
        .await;
    assert!(passed_through.is_err(), "no engine behind kvgate");

    let (_, exposition) = common::http_get(gateway.admin.unwrap(), "/metrics").await;
    let exported: BTreeSet<&str> = samples(&exposition)
        .into_iter()
        .map(|(name, _, _)| name)
        .collect();
    let mut named = BTreeSet::new();
    for file in ["grafana/kvgate.json", "prometheus/kvgate-rules.yaml"] {
        let names = metric_names_in(&deploy(file));
        assert!(!names.is_empty(), "{file} names no kvgate metric");
        named.extend(names);
    }
    let missing: Vec<&String> = named
        .iter()
        .filter(|name| !exported.contains(name.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "named in deploy/ but not exported: {missing:?}; exported: {exported:?}"
    );
}

/// Runs `promtool ARGS` in `deploy/prometheus`; `None` when promtool is not
/// installed and this is not CI (where a missing promtool fails the test).
fn promtool(args: &[&str]) -> Option<std::process::Output> {
    common::external_tool(
        "promtool",
        args,
        &deploy("prometheus"),
        "apt-get install prometheus",
    )
}

#[test]
fn the_alert_rules_pass_promtool_check_and_fire_in_their_unit_tests() {
    for args in [
        ["check", "rules", "kvgate-rules.yaml"],
        ["test", "rules", "kvgate-rules.test.yaml"],
    ] {
        let Some(output) = promtool(&args) else {
            return;
        };
        assert!(
            output.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[test]
fn every_alert_of_the_rules_has_a_unit_test() {
    let rules = std::fs::read_to_string(deploy("prometheus/kvgate-rules.yaml")).unwrap();
    let tests = std::fs::read_to_string(deploy("prometheus/kvgate-rules.test.yaml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 5, "{alerts:?}");
    for alert in alerts {
        assert!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - exp_labels"
            )),
            "{alert} has no unit test expecting it to fire"
        );
    }
}
