//! The gateway started in-process: a real engine publisher on loopback, real
//! tonic clients, and real tasks of the gateway made to die.

use clap::Parser as _;
use tokio::time::timeout;
use tokio_stream::StreamExt as _;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use super::*;
use crate::cli::{Cli, Command};
use crate::health::Health;
use kvgate_sim::{EnginePublisher, PublisherOptions};

/// Upper bound for anything a test waits on.
const DEADLINE: Duration = Duration::from_secs(20);

fn serve_args(args: &[&str]) -> ServeArgs {
    let fixed = ["kvgate", "serve", "--listen", "127.0.0.1:0"];
    let cli = Cli::parse_from(fixed.iter().chain(args));
    let Command::Serve(args) = cli.command else {
        unreachable!("parsed as serve")
    };
    *args
}

/// A gateway following a real engine publisher.
async fn gateway_with_publisher() -> (Gateway, EnginePublisher) {
    let publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let gateway = Gateway::start(serve_args(&["--zmq-endpoint", publisher.endpoint()]))
        .await
        .unwrap();
    (gateway, publisher)
}

async fn channel(gateway: &Gateway) -> Channel {
    Channel::from_shared(format!("http://{}", gateway.address()))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A health watcher gets the final NOT_SERVING, then its stream ends so it
/// does not hold the shutdown up.
async fn until_final_not_serving(mut watch: tonic::Streaming<HealthCheckResponse>) {
    until_status(&mut watch, ServingStatus::NotServing).await;
    let end = timeout(DEADLINE, watch.next())
        .await
        .expect("the watch ends before the deadline");
    assert!(end.is_none(), "the watch ends, got {end:?}");
}

/// Reads the overall health watch until it reports `wanted`.
async fn until_status(watch: &mut tonic::Streaming<HealthCheckResponse>, wanted: ServingStatus) {
    loop {
        let status = timeout(DEADLINE, watch.next())
            .await
            .expect("a health status before the deadline")
            .expect("an open watch")
            .unwrap();
        if status.status == wanted as i32 {
            return;
        }
    }
}

async fn overall_health_watch(channel: Channel) -> tonic::Streaming<HealthCheckResponse> {
    HealthClient::new(channel)
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// A started gateway whose health reads SERVING, with a publisher feeding
/// it, a health watch and one subscriber stream open.
struct Serving {
    gateway: Gateway,
    _publisher: EnginePublisher,
    health_watch: tonic::Streaming<HealthCheckResponse>,
    stream: tonic::Streaming<crate::proto::common::KvEventBatch>,
}

async fn serving_with_a_subscriber() -> Serving {
    let (gateway, _publisher) = gateway_with_publisher().await;
    let channel = channel(&gateway).await;
    let mut health_watch = overall_health_watch(channel.clone()).await;
    until_status(&mut health_watch, ServingStatus::Serving).await;
    let stream = crate::client::subscribe(channel, "kvgate.v1.KvGate", 0)
        .await
        .unwrap();
    Serving {
        gateway,
        _publisher,
        health_watch,
        stream,
    }
}

// Fault injection exists in debug builds only (`cargo bench` builds the
// unit tests with the release profile).
#[cfg(debug_assertions)]
#[tokio::test(flavor = "multi_thread")]
async fn a_drain_that_panics_turns_health_not_serving_and_fails_the_run_naming_it() {
    let Serving {
        gateway,
        _publisher,
        health_watch,
        mut stream,
    } = serving_with_a_subscriber().await;
    let supervisor = gateway.supervisor().clone();
    let health = gateway.health();
    let run = tokio::spawn(gateway.run(std::future::pending()));

    supervisor.inject_panic(TaskName::Drain);
    until_final_not_serving(health_watch).await;
    let failure = timeout(DEADLINE, run)
        .await
        .expect("the run ends")
        .unwrap()
        .expect_err("a failed run");
    assert_eq!(failure.task, TaskName::Drain);
    assert_eq!(
        failure.end,
        crate::supervisor::UnexpectedEnd::Panicked("a fault injected by a test".into())
    );
    assert_eq!(health.now(), Health::Failed(Arc::clone(&failure)));
    // Nothing flows any more, so the subscriber is not left waiting.
    let end = loop {
        match timeout(DEADLINE, stream.message())
            .await
            .expect("the stream ends")
        {
            Ok(Some(_)) => continue,
            end => break end,
        }
    };
    assert!(!matches!(end, Ok(Some(_))));

    let (code, body) = healthz(health).await;
    assert_eq!(code, http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        body,
        "failed: the drain panicked: a fault injected by a test\n"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_asked_to_stop_ends_every_stream_cleanly_and_reports_no_failure() {
    let Serving {
        gateway,
        _publisher,
        health_watch,
        mut stream,
    } = serving_with_a_subscriber().await;
    let health = gateway.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(gateway.run(async {
        let _ = stopped.await;
    }));

    stop.send(()).unwrap();
    until_final_not_serving(health_watch).await;
    let end = loop {
        match timeout(DEADLINE, stream.message())
            .await
            .expect("the stream ends")
        {
            Ok(Some(_)) => continue,
            end => break end,
        }
    };
    assert!(matches!(end, Ok(None)), "a clean end, got {end:?}");
    timeout(DEADLINE, run)
        .await
        .expect("the run ends")
        .unwrap()
        .expect("no failure");
    assert_eq!(health.now(), Health::Stopping);
    assert_eq!(healthz(health).await.1, "shutting down\n");
}

/// What the admin port's `/healthz` answers with `health`.
async fn healthz(health: HealthWatch) -> (http::StatusCode, String) {
    use tower::ServiceExt as _;
    let (_, hub) = crate::hub::hub(
        1,
        HistoryLimits {
            batches: 1,
            bytes: 1,
        },
    );
    let admin = admin::router(AdminState {
        metrics: Metrics::default(),
        hub,
        health,
        source: "tcp://127.0.0.1:1".into(),
        started: Instant::now(),
        store: None,
        engine_sources: None,
        index: None,
    });
    let request = http::Request::get("/healthz")
        .body(axum::body::Body::empty())
        .unwrap();
    let response = admin.oneshot(request).await.unwrap();
    let code = response.status();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (code, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test]
async fn a_zmq_address_kvgate_cannot_bind_fails_the_start_naming_the_flags_the_address_and_the_cause_once()
 {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", taken.local_addr().unwrap().port());
    let refused = Gateway::start(serve_args(&["--zmq-endpoint", &endpoint, "--zmq-bind"]))
        .await
        .err()
        .expect("the port is taken");
    let message = format!("{refused:#}");
    assert!(
        message.starts_with(&format!(
            "--zmq-endpoint {endpoint} --zmq-bind: cannot bind"
        )),
        "{message}"
    );
    assert_eq!(
        message.matches("Address already in use").count(),
        1,
        "{message}"
    );
}

#[tokio::test]
async fn a_state_directory_in_use_or_beyond_reach_fails_the_start_saying_why_once() {
    let scratch = std::env::temp_dir().join(format!("kvgate-app-state-{}", std::process::id()));
    let held = scratch.join("held");
    let state_dir =
        |dir: &std::path::Path| serve_args(&["--demo", "--state-dir", dir.to_str().unwrap()]);
    let holder = Gateway::start(state_dir(&held)).await.unwrap();
    let file = scratch.join("a-file");
    std::fs::write(&file, b"").unwrap();
    let under_a_file = file.join("state");
    for (dir, why) in [
        (&held, "is in use by another kvgate process"),
        (&under_a_file, "Not a directory"),
    ] {
        let refused = Gateway::start(state_dir(dir))
            .await
            .err()
            .expect("the directory cannot be taken");
        let message = format!("{refused:#}");
        assert!(message.starts_with("--state-dir "), "{message}");
        assert_eq!(message.matches(why).count(), 1, "{message}");
    }
    // Stopped first: a running holder may write into its directory while
    // it is being removed. Its announcement mark in /dev/shm, which
    // outlives a process by design, goes with the directory.
    holder.shutdown().await.unwrap();
    let _ = std::fs::remove_file(crate::store::mark_of(&held).unwrap());
    std::fs::remove_dir_all(&scratch).unwrap();
}
