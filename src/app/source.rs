//! Which event source the flags name: the engine's ZMQ publishers (one per
//! data-parallel rank), a simulated engine started here (`--demo`),
//! another gateway upstream, a recording (`--replay-file`) or a Mooncake
//! trace (`--trace-file`). Flag names live here, not in `source/`.

use std::time::Duration;

use anyhow::Context as _;

use kvgate_endpoint::{RankEndpoints, TcpEndpoint};
use kvgate_sim::{DemoConfig, DemoEngine};
use tokio::sync::{mpsc, watch};

use crate::cli::ServeArgs;
use crate::client::{Target, TlsFlags, TlsPaths};
use crate::load::records::LoadRecords;
use crate::load::{Board, Reading, empty_board};
use crate::metrics::Metrics;
use crate::pem::FlagFile;
use crate::proto::common::EngineLoad;
use crate::source::SourceEvent;
use crate::source::recorded::{self, LoadSink, RecordedConfig};
use crate::source::trace::{self, TraceConfig};
use crate::source::upstream::{self, UpstreamConfig};
use crate::source::zmq::{StartError, ZmqSourceConfig};
use crate::supervisor::{Supervisor, TaskName};
use crate::usage::UsageError;

const UPSTREAM_FLAGS: TlsFlags = TlsFlags {
    uri: "--upstream-grpc",
    ca: "--upstream-tls-ca",
    cert: "--upstream-tls-cert",
    key: "--upstream-tls-key",
};

/// Where events come from, as configured.
pub(super) enum SourceConfig {
    /// The engine's publishers, as the `--zmq-*` flags name them.
    Zmq(ZmqSourceConfig),
    /// The simulated engine started here (`--demo`).
    Demo(ZmqSourceConfig),
    Upstream(UpstreamConfig),
    /// A recording played (`--replay-file`), with the ranks to prepare.
    Recorded(RecordedConfig, u32),
    /// A trace played through a simulated cache (`--trace-file`).
    Trace(TraceConfig),
}

impl std::fmt::Display for SourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Zmq(config) | Self::Demo(config) => {
                write!(f, "{} ({} rank(s))", config.endpoint, config.dp_size)
            }
            Self::Upstream(config) => write!(f, "{} ({})", config.target.uri(), config.service),
            Self::Recorded(config, _) => {
                let files: Vec<String> = config
                    .files
                    .iter()
                    .map(|file| file.display().to_string())
                    .collect();
                write!(f, "recording {} at {}", files.join(","), config.speed)?;
                if config.looped {
                    f.write_str(", looped")?;
                }
                Ok(())
            }
            Self::Trace(config) => {
                write!(
                    f,
                    "trace {} at {}, {} blocks of {} tokens per rank ({} rank(s))",
                    config.file.display(),
                    config.speed,
                    config.cache_blocks,
                    config.block_tokens,
                    config.dp_size
                )?;
                if config.looped {
                    f.write_str(", looped")?;
                }
                Ok(())
            }
        }
    }
}

/// Exactly one of `--zmq-endpoint`, `--demo` (a simulated engine started
/// here), `--upstream-grpc`, `--replay-file` and `--trace-file`.
pub(super) async fn choose_source(
    args: &ServeArgs,
) -> anyhow::Result<(SourceConfig, Option<DemoEngine>)> {
    if let Some(config) = played_source(args)? {
        return Ok((config, None));
    }
    let zmq = |endpoint, replay_endpoint| ZmqSourceConfig {
        endpoint,
        replay_endpoint,
        replay_timeout: Duration::from_millis(args.zmq_replay_timeout_ms),
        dp_size: args.dp_size,
        topic: args.zmq_topic.clone(),
        bind: args.zmq_bind,
        max_message_bytes: usize::try_from(args.zmq_max_message_bytes).unwrap_or(usize::MAX),
    };
    if args.demo {
        // With a replay endpoint, like a well-configured engine: kvgate
        // primes from it, so the first steps lost to ZMQ's slow joiner are not.
        let mut config = DemoConfig::new(args.dp_size);
        config.publisher.replay_endpoint = Some("tcp://127.0.0.1:0".into());
        let demo = DemoEngine::bind(config).await?;
        let endpoint = RankEndpoints::Offset(demo.endpoint().parse()?);
        let replay = demo
            .endpoints()
            .first()
            .and_then(|rank0| rank0.replay_endpoint.as_deref()?.parse().ok())
            .map(RankEndpoints::Offset);
        return Ok((SourceConfig::Demo(zmq(endpoint, replay)), Some(demo)));
    }
    if let Some(uri) = &args.upstream_grpc {
        let tls = TlsPaths {
            ca: args.upstream_tls_ca.clone(),
            cert: args.upstream_tls_cert.clone(),
            key: args.upstream_tls_key.clone(),
        };
        let token = args
            .upstream_token_file
            .as_ref()
            .map(|path| FlagFile::new("--upstream-token-file", path));
        let config = UpstreamConfig {
            target: Target::new(uri, &tls, UPSTREAM_FLAGS, token)?,
            service: args.upstream_service.clone(),
        };
        return Ok((SourceConfig::Upstream(config), None));
    }
    let endpoint = RankEndpoints::from_flag("--zmq-endpoint", &args.zmq_endpoint, args.dp_size)
        .map_err(|error| UsageError(error.to_string()))?
        .ok_or_else(|| {
            UsageError(
                "no event source: give --zmq-endpoint tcp://HOST:PORT (the engine's KV-event publisher), \
                 --upstream-grpc URI (another SubscribeKvEvents server) or --demo"
                    .into(),
            )
        })?;
    let replay = RankEndpoints::from_flag(
        "--zmq-replay-endpoint",
        &args.zmq_replay_endpoint,
        args.dp_size,
    )
    .map_err(|error| UsageError(error.to_string()))?;
    if let RankEndpoints::Offset(publisher) = &endpoint {
        let replay_base = match &replay {
            Some(RankEndpoints::Offset(base)) => Some(base),
            _ => None,
        };
        check_rank_ports(publisher, replay_base, args.dp_size).map_err(UsageError)?;
    }
    Ok((SourceConfig::Zmq(zmq(endpoint, replay)), None))
}

/// A recording or a trace, checked (a file that cannot be played fails
/// the start naming its flag), or `None` when neither flag is given.
fn played_source(args: &ServeArgs) -> anyhow::Result<Option<SourceConfig>> {
    if !args.replay_file.is_empty() {
        let config = RecordedConfig {
            files: args.replay_file.clone(),
            speed: args.replay_speed,
            looped: args.replay_loop,
        };
        let header = config
            .check()
            .map_err(|error| UsageError(format!("--replay-file: {error}")))?;
        let ranks = header.dp_size.clamp(1, 1024).max(args.dp_size);
        return Ok(Some(SourceConfig::Recorded(config, ranks)));
    }
    let Some(file) = &args.trace_file else {
        return Ok(None);
    };
    let config = TraceConfig {
        file: file.clone(),
        speed: args.replay_speed,
        looped: args.replay_loop,
        cache_blocks: usize::try_from(args.trace_cache_blocks).unwrap_or(usize::MAX),
        block_tokens: args.trace_block_tokens,
        dp_size: args.dp_size,
        max_line_bytes: usize::try_from(args.trace_max_line_bytes).unwrap_or(usize::MAX),
    };
    config.check().map_err(|what| {
        let flag = if what.contains("tokens does not divide") {
            "--trace-block-tokens"
        } else {
            "--trace-file"
        };
        UsageError(format!("{flag}: {what}"))
    })?;
    Ok(Some(SourceConfig::Trace(config)))
}

/// Checks that every rank's publisher (and replay) port exists, and that
/// the publisher and replay port ranges do not overlap: their bases must be
/// at least `dp_size` apart. The message names the flags to change.
fn check_rank_ports(
    publisher: &TcpEndpoint,
    replay: Option<&TcpEndpoint>,
    dp_size: u32,
) -> Result<(), String> {
    let last = dp_size.saturating_sub(1);
    publisher
        .for_rank(last)
        .map_err(|error| format!("--zmq-endpoint with --dp-size {dp_size}: {error}"))?;
    let Some(replay) = replay else {
        return Ok(());
    };
    replay
        .for_rank(last)
        .map_err(|error| format!("--zmq-replay-endpoint with --dp-size {dp_size}: {error}"))?;
    let distance = u32::from(publisher.port().abs_diff(replay.port()));
    if publisher.host() == replay.host() && distance < dp_size {
        return Err(format!(
            "--zmq-endpoint {publisher} and --zmq-replay-endpoint {replay} overlap with \
             --dp-size {dp_size} (rank r uses base port + r): keep the bases at least \
             --dp-size apart, e.g. tcp://*:5557 and tcp://*:{}",
            5557 + dp_size.max(1)
        ));
    }
    Ok(())
}

/// The flags behind a ZMQ start failure, as the user set them.
fn flags_of(config: &ZmqSourceConfig, error: &StartError) -> String {
    let dp_size = config.dp_size;
    match error {
        StartError::PublisherEndpoint { .. } => {
            format!(
                "--zmq-endpoint {} with --dp-size {dp_size}",
                config.endpoint
            )
        }
        StartError::ReplayEndpoint { .. } => match &config.replay_endpoint {
            Some(replay) => format!("--zmq-replay-endpoint {replay} with --dp-size {dp_size}"),
            None => "--zmq-replay-endpoint".to_owned(),
        },
        StartError::Subscribe(_) => format!("--zmq-topic {:?}", config.topic),
        StartError::Bind { .. } => format!("--zmq-endpoint {} --zmq-bind", config.endpoint),
    }
}

/// Starts the configured source's tasks; a recording's load records come
/// back for the drain to stamp.
pub(super) async fn start_source(
    config: SourceConfig,
    events: mpsc::Sender<SourceEvent>,
    metrics: Metrics,
    ready: watch::Sender<bool>,
    supervisor: &Supervisor,
) -> anyhow::Result<Option<LoadRecords>> {
    match config {
        SourceConfig::Zmq(config) => {
            metrics.prepare_ranks(config.dp_size);
            let flags = config.clone();
            config
                .start(events, metrics, ready, supervisor)
                .await
                .map_err(|error| {
                    let context = flags_of(&flags, &error);
                    anyhow::Error::new(error).context(context)
                })?;
            Ok(None)
        }
        SourceConfig::Demo(config) => {
            metrics.prepare_ranks(config.dp_size);
            config
                .start(events, metrics, ready, supervisor)
                .await
                .context("the demo engine")?;
            Ok(None)
        }
        SourceConfig::Upstream(config) => {
            let stop = supervisor.stopping();
            supervisor.spawn(TaskName::Upstream, async move {
                upstream::run(config, events, metrics, ready, stop).await;
                Ok(())
            });
            Ok(None)
        }
        SourceConfig::Recorded(config, ranks) => {
            metrics.prepare_ranks(ranks);
            let (board, feed) = watch::channel(empty_board(ranks));
            let stop = supervisor.stopping();
            supervisor.spawn(TaskName::RecordingReplay, async move {
                recorded::run(config, events, metrics, ready, replayed_loads(board), stop).await;
                Ok(())
            });
            Ok(Some(LoadRecords::new(feed)))
        }
        SourceConfig::Trace(config) => {
            metrics.prepare_ranks(config.dp_size);
            let stop = supervisor.stopping();
            supervisor.spawn(TaskName::TraceReplay, async move {
                trace::run(config, events, metrics, ready, stop).await;
                Ok(())
            });
            Ok(None)
        }
    }
}

/// A recording's load records as readings on `board`, as if polled when
/// recorded: a `load_only` record brings every field, an event batch's the
/// routing core, which updates the fields it carries.
fn replayed_loads(board: watch::Sender<Board>) -> LoadSink {
    Box::new(move |rank, recorded: &EngineLoad| {
        board.send_if_modified(|board| {
            let Some(slot) = board.get(rank as usize) else {
                return false;
            };
            let mut load = match (recorded.load_only, slot) {
                (false, Some(reading)) => EngineLoad {
                    running_requests: recorded.running_requests,
                    waiting_requests: recorded.waiting_requests,
                    waiting_uncached_tokens: recorded.waiting_uncached_tokens,
                    token_usage: recorded.token_usage,
                    active_token_usage: recorded.active_token_usage,
                    gen_throughput: recorded.gen_throughput,
                    max_running_requests: recorded.max_running_requests,
                    ..reading.load.clone()
                },
                _ => recorded.clone(),
            };
            // Stamped again per batch by the drain.
            load.sample = 0;
            load.age_ms = 0;
            load.load_only = false;
            if slot.as_ref().is_some_and(|reading| reading.load == load) {
                return false;
            }
            let polled_at = tokio::time::Instant::now()
                .checked_sub(std::time::Duration::from_millis(u64::from(recorded.age_ms)))
                .unwrap_or_else(tokio::time::Instant::now);
            let mut readings = board.as_ref().clone();
            readings[rank as usize] = Some(Reading { load, polled_at });
            *board = std::sync::Arc::new(readings);
            true
        });
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publisher_and_replay_bases_closer_than_dp_size_are_refused() {
        let publisher: TcpEndpoint = "tcp://*:5557".parse().unwrap();
        let close: TcpEndpoint = "tcp://*:5558".parse().unwrap();
        let apart: TcpEndpoint = "tcp://*:5559".parse().unwrap();
        assert!(check_rank_ports(&publisher, Some(&close), 1).is_ok());
        let error = check_rank_ports(&publisher, Some(&close), 2).unwrap_err();
        assert!(error.contains("at least --dp-size apart"), "{error}");
        assert!(check_rank_ports(&publisher, Some(&apart), 2).is_ok());
        let last: TcpEndpoint = "tcp://*:65535".parse().unwrap();
        let error = check_rank_ports(&last, None, 2).unwrap_err();
        assert!(
            error.starts_with("--zmq-endpoint with --dp-size 2"),
            "{error}"
        );
    }
}
