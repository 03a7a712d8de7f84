//! Which event source the flags name: the engine's ZMQ publishers (one per
//! data-parallel rank), a simulated engine started here (`--demo`),
//! another gateway upstream, a recording (`--replay-file`) or a Mooncake
//! trace (`--trace-file`). Flag names live here, not in `source/`.

use std::time::Duration;

use anyhow::Context as _;

use kvgate_endpoint::{RankEndpoints, TcpEndpoint, ZmqEndpoint};
use kvgate_sim::{DemoConfig, DemoEngine, Layout};
use tokio::sync::{mpsc, watch};

use crate::cli::{DemoLayout, ServeArgs};
use crate::client::{Target, TlsFlags, TlsPaths};
use crate::load::push::PushConfig;
use crate::load::{Board, BoardWriter};
use crate::metrics::Metrics;
use crate::pem::FlagFile;
use crate::proto::common::EngineLoad;
use crate::source::SourceEvent;
use crate::source::continuity::ResumePoint;
use crate::source::discovery::{Discovered, Engine};
use crate::source::recorded::{self, LoadSink, RecordedConfig};
use crate::source::replay::{self, FetchBounds};
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
    /// The simulated engine started here (`--demo`), its publishers as it
    /// answered `GET /kv_event_sources`.
    Demo(ZmqSourceConfig, Discovered),
    Upstream(UpstreamConfig),
    /// A recording played (`--replay-file`).
    Recorded(RecordedConfig),
    /// A trace played through a simulated cache (`--trace-file`).
    Trace(TraceConfig),
}

impl SourceConfig {
    /// The ranks served are `0..dp_size`, whatever the source.
    pub(super) fn dp_size(&self) -> u32 {
        match self {
            Self::Zmq(config) | Self::Demo(config, _) => config.dp_size,
            Self::Upstream(config) => config.dp_size,
            Self::Recorded(config) => config.dp_size,
            Self::Trace(config) => config.dp_size,
        }
    }
}

impl std::fmt::Display for SourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Zmq(config) => {
                write!(f, "{} ({} rank(s))", config.endpoint, config.dp_size)
            }
            Self::Demo(config, discovered) => write!(
                f,
                "{} ({} rank(s)), learned from {}",
                config.endpoint, config.dp_size, discovered.learned_from
            ),
            Self::Upstream(config) => write!(f, "{} ({})", config.target.uri(), config.service),
            Self::Recorded(config) => {
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
    let replay_bounds = replay_bounds(args)?;
    let zmq = |endpoint, replay_endpoint| ZmqSourceConfig {
        endpoint,
        replay_endpoint,
        replay_timeout: Duration::from_millis(args.zmq_replay_timeout_ms),
        replay_bounds,
        dp_size: args.dp_size,
        topic: args.zmq_topic.clone(),
        bind: args.zmq_bind,
        max_message_bytes: usize::try_from(args.zmq_max_message_bytes).unwrap_or(usize::MAX),
        resume: Default::default(),
        moves: Vec::new(),
        any_topic: false,
        link: None,
        replaying: None,
    };
    if args.demo {
        // With a replay endpoint, like a well-configured engine: kvgate
        // primes from it, so the first steps lost to ZMQ's slow joiner are not.
        let mut config = DemoConfig::new(args.dp_size);
        config.publisher.replay_endpoint = Some("tcp://127.0.0.1:0".into());
        // And pushing its load, as SGLang does with --load-publish-endpoint.
        config.load_endpoint = Some("tcp://127.0.0.1:0".parse()?);
        config.layout = match args.demo_layout {
            DemoLayout::Vllm => Layout::Vllm,
            DemoLayout::TrtllmNative => Layout::TrtllmNative,
        };
        let mut demo = DemoEngine::bind(config).await?;
        // Asked as kvgate asks vLLM (--engine-http), so the demo shows it.
        let url = demo.answer_discovery().await?;
        let engine = Engine {
            http: Some(url.parse()?),
            grpc: None,
        };
        let discovered = engine.ask().await.context("the demo engine")?;
        let endpoint = RankEndpoints::Listed(
            discovered
                .ranks
                .iter()
                .map(|rank| rank.endpoint.clone().into())
                .collect(),
        );
        let replay = discovered
            .ranks
            .iter()
            .map(|rank| rank.replay_endpoint.clone().map(ZmqEndpoint::from))
            .collect::<Option<Vec<_>>>()
            .map(RankEndpoints::Listed);
        return Ok((
            SourceConfig::Demo(zmq(endpoint, replay), discovered),
            Some(demo),
        ));
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
            dp_size: args.dp_size,
            answer_timeout: None,
        };
        return Ok((SourceConfig::Upstream(config), None));
    }
    let endpoint = RankEndpoints::from_flag("--zmq-endpoint", &args.zmq_endpoint, args.dp_size)
        .map_err(|error| UsageError(error.to_string()))?
        .ok_or_else(|| {
            UsageError(
                "no event source: give --engine-http URL (vLLM) or --engine-grpc URI (SGLang, OpenEngine) \
                 to ask the engine where it publishes, --zmq-endpoint tcp://HOST:PORT or ipc://PATH \
                 (the engine's KV-event publisher), --upstream-grpc URI (another SubscribeKvEvents server) or --demo"
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
        let mut config = RecordedConfig {
            files: args.replay_file.clone(),
            speed: args.replay_speed,
            looped: args.replay_loop,
            dp_size: args.dp_size,
        };
        let header = config
            .check()
            .map_err(|error| UsageError(format!("--replay-file: {error}")))?;
        // The recorder's header says how many ranks the engine had.
        config.dp_size = header.dp_size.clamp(1, 1024).max(args.dp_size);
        return Ok(Some(SourceConfig::Recorded(config)));
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

/// The engine's load publishers, as `--zmq-load-endpoint` names them (with
/// `--zmq-bind` and `--zmq-max-message-bytes` as for the KV publishers), or
/// the demo engine's.
pub(super) fn choose_load_push(
    args: &ServeArgs,
    demo: Option<&DemoEngine>,
) -> anyhow::Result<Option<PushConfig>> {
    let config = |endpoint| PushConfig {
        endpoint,
        dp_size: args.dp_size,
        bind: args.zmq_bind && demo.is_none(),
        max_message_bytes: usize::try_from(args.zmq_max_message_bytes).unwrap_or(usize::MAX),
    };
    if let Some(demo) = demo {
        let rank0 = demo.endpoints().into_iter().next();
        let endpoint = rank0.and_then(|rank0| rank0.load_endpoint?.parse().ok());
        return Ok(endpoint.map(RankEndpoints::Offset).map(config));
    }
    let endpoint =
        RankEndpoints::from_flag("--zmq-load-endpoint", &args.zmq_load_endpoint, args.dp_size)
            .map_err(|error| UsageError(error.to_string()))?;
    if let Some(RankEndpoints::Offset(base)) = &endpoint {
        base.for_rank(args.dp_size.saturating_sub(1))
            .map_err(|error| {
                UsageError(format!(
                    "--zmq-load-endpoint with --dp-size {}: {error}",
                    args.dp_size
                ))
            })?;
    }
    Ok(endpoint.map(config))
}

/// What one replay fetch may cost. Its bytes go through the history, so
/// they stay within `--history-bytes`.
fn replay_bounds(args: &ServeArgs) -> Result<FetchBounds, UsageError> {
    let bytes = match args.zmq_replay_max_bytes {
        Some(bytes) if bytes > args.history_bytes => {
            return Err(UsageError(format!(
                "--zmq-replay-max-bytes {bytes} is more than --history-bytes {}: \
                 a fetch must fit the history",
                args.history_bytes
            )));
        }
        Some(bytes) => bytes,
        None => replay::DEFAULT_MAX_BYTES.min(args.history_bytes),
    };
    Ok(FetchBounds {
        messages: args.zmq_replay_max_messages,
        bytes,
        time: Duration::from_millis(args.zmq_replay_fetch_timeout_ms),
    })
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

impl SourceConfig {
    /// Has the engine's publishers followed where the engine says they
    /// moved (`moves[r]` for rank r).
    pub(super) fn follow(
        &mut self,
        moves: Vec<watch::Receiver<crate::source::discovery::RankTarget>>,
    ) {
        if let Self::Zmq(config) = self {
            config.moves = moves;
        }
    }

    /// What the engine said of its publishers, when it was asked here.
    pub(super) fn learned(&self) -> Option<&Discovered> {
        match self {
            Self::Demo(_, discovered) => Some(discovered),
            _ => None,
        }
    }

    /// Has an engine's publishers resumed where an earlier kvgate's record
    /// of each rank ended (sources that keep no such record start over).
    pub(super) fn resume(&mut self, points: std::collections::BTreeMap<u32, ResumePoint>) {
        match self {
            Self::Zmq(config) | Self::Demo(config, _) => config.resume = points,
            Self::Upstream(_) | Self::Recorded(_) | Self::Trace(_) => {}
        }
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
) -> anyhow::Result<Option<watch::Receiver<Board>>> {
    metrics.prepare_ranks(config.dp_size());
    match config {
        SourceConfig::Zmq(config) => {
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
        SourceConfig::Demo(config, _) => {
            config
                .start(events, metrics, ready, supervisor)
                .await
                .context("the demo engine")?;
            Ok(None)
        }
        SourceConfig::Upstream(config) => {
            let stop = supervisor.stopping();
            supervisor.spawn(TaskName::Upstream, async move {
                let mut watcher = upstream::DrainWatcher::new(&config, metrics, ready);
                upstream::run(config, events, &mut watcher, stop).await;
                Ok(())
            });
            Ok(None)
        }
        SourceConfig::Recorded(config) => {
            let (board, feed) = BoardWriter::new(config.dp_size, None);
            let stop = supervisor.stopping();
            supervisor.spawn(TaskName::RecordingReplay, async move {
                recorded::run(config, events, metrics, ready, replayed_loads(board), stop).await;
                Ok(())
            });
            Ok(Some(feed))
        }
        SourceConfig::Trace(config) => {
            let stop = supervisor.stopping();
            supervisor.spawn(TaskName::TraceReplay, async move {
                trace::run(config, events, metrics, ready, stop).await;
                Ok(())
            });
            Ok(None)
        }
    }
}

/// A recording's load records as if the engine pushed them when recorded:
/// a `load_only` record brings every field, an event batch's the routing
/// core, which updates the fields it carries.
fn replayed_loads(board: BoardWriter) -> LoadSink {
    let last = std::sync::Mutex::new(vec![None::<EngineLoad>; board.ranks() as usize]);
    Box::new(move |rank, recorded: &EngineLoad| {
        let Ok(mut last) = last.lock() else { return };
        let Some(slot) = last.get_mut(rank as usize) else {
            return;
        };
        let mut load = match (recorded.load_only, slot.as_ref()) {
            (false, Some(full)) => EngineLoad {
                running_requests: recorded.running_requests,
                waiting_requests: recorded.waiting_requests,
                waiting_uncached_tokens: recorded.waiting_uncached_tokens,
                token_usage: recorded.token_usage,
                active_token_usage: recorded.active_token_usage,
                gen_throughput: recorded.gen_throughput,
                max_running_requests: recorded.max_running_requests,
                ..full.clone()
            },
            _ => recorded.clone(),
        };
        // Stamped again per batch by the drain.
        load.sample = 0;
        load.age_ms = 0;
        load.load_only = false;
        if slot.as_ref() == Some(&load) {
            return;
        }
        *slot = Some(load.clone());
        let taken_at = tokio::time::Instant::now()
            .checked_sub(std::time::Duration::from_millis(u64::from(recorded.age_ms)))
            .unwrap_or_else(tokio::time::Instant::now);
        board.pushed(rank, load, taken_at);
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

    fn serve_args(flags: &[&str]) -> ServeArgs {
        let mut command = vec!["kvgate", "serve", "--zmq-endpoint", "tcp://*:5557"];
        command.extend_from_slice(flags);
        match <crate::cli::Cli as clap::Parser>::parse_from(command).command {
            crate::cli::Command::Serve(args) => *args,
            _ => unreachable!("a serve command"),
        }
    }

    #[test]
    fn the_replay_byte_bound_defaults_to_64_mib_or_the_history_if_smaller_and_never_exceeds_it() {
        let bytes = |flags: &[&str]| replay_bounds(&serve_args(flags)).map(|bounds| bounds.bytes);
        assert_eq!(bytes(&[]).unwrap(), replay::DEFAULT_MAX_BYTES);
        assert_eq!(bytes(&["--history-bytes", "16MiB"]).unwrap(), 16 << 20);
        assert_eq!(
            bytes(&["--history-bytes", "16MiB", "--zmq-replay-max-bytes", "8MiB"]).unwrap(),
            8 << 20
        );
        let error = bytes(&[
            "--history-bytes",
            "16MiB",
            "--zmq-replay-max-bytes",
            "32MiB",
        ])
        .unwrap_err()
        .to_string();
        assert!(error.contains("--history-bytes"), "{error}");
    }
}
