//! The engine's answer to "where do you publish?" turned into the flags it
//! stands for (`--zmq-endpoint`, `--zmq-replay-endpoint`, `--zmq-topic`,
//! `--dp-size`, `--zmq-load-endpoint`), so the rest of the start reads
//! flags alone.
//!
//! Invariant: flags the user set win. With `--zmq-endpoint` the engine is
//! only asked (with `--engine-http`), in the background, and a disagreement
//! is logged once; an
//! explicit `--dp-size` or `--zmq-topic` is kept over the answer, again
//! logged once when they differ. Without `--zmq-endpoint` an engine that
//! names nothing usable fails the start, naming the flag and every question
//! asked. Flag names live here, not in `source/`.

use std::time::Duration;

use anyhow::Context as _;
use kvgate_endpoint::{RankEndpoints, ZmqEndpoint};
use tokio::sync::watch;
use tracing::warn;

use crate::cli::ServeArgs;
use crate::server::passthrough::PassThrough;
use crate::source::discovery::{Discovered, Engine, RankTarget, follow};
use crate::supervisor::{Supervisor, TaskName};
use crate::usage::UsageError;

/// What the engine was asked, and what came of it.
pub(super) enum EngineSources {
    /// No engine server to ask, or events from elsewhere than its publishers.
    NotAsked,
    /// The flags name the publishers; the engine is asked to compare.
    Checked(Engine),
    /// The engine named the publishers; kvgate follows them.
    Learned {
        engine: Engine,
        discovered: Discovered,
    },
}

/// The flag through which `engine` is reached, for messages.
fn flags_of(args: &ServeArgs) -> String {
    match (&args.engine_http, &args.engine_grpc) {
        (Some(url), _) => format!("--engine-http {url}"),
        (None, Some(uri)) => format!("--engine-grpc {uri}"),
        (None, None) => String::new(),
    }
}

/// Asks the engine where it publishes when no flag says so, and fills
/// `args` from the answer.
pub(super) async fn learn(
    args: &mut ServeArgs,
    pass_through: Option<&PassThrough>,
) -> anyhow::Result<EngineSources> {
    let elsewhere = args.demo
        || args.upstream_grpc.is_some()
        || !args.replay_file.is_empty()
        || args.trace_file.is_some();
    let http = args
        .engine_http
        .as_deref()
        .map(str::parse::<http::Uri>)
        .transpose()
        .map_err(|error| UsageError(format!("--engine-http: {error}")))?;
    let grpc = pass_through.map(PassThrough::engine_transport);
    if elsewhere || (http.is_none() && grpc.is_none()) {
        return Ok(EngineSources::NotAsked);
    }
    if !args.zmq_endpoint.is_empty() {
        // The flags name the publishers. Only an engine named for this
        // question (--engine-http) is asked to compare: --engine-grpc beside
        // --zmq-endpoint is the pass-through's, and gets no call it did not
        // get before.
        return Ok(match http {
            Some(http) => EngineSources::Checked(Engine {
                http: Some(http),
                grpc: None,
            }),
            None => EngineSources::NotAsked,
        });
    }
    let engine = Engine { http, grpc };
    let discovered = engine
        .ask()
        .await
        .with_context(|| format!("{}: asked where the engine publishes", flags_of(args)))?;
    apply(args, &discovered)?;
    Ok(EngineSources::Learned { engine, discovered })
}

/// Sets the flags the user left unset from `discovered`.
fn apply(args: &mut ServeArgs, discovered: &Discovered) -> Result<(), UsageError> {
    let reported = discovered.ranks.len() as u32;
    if args.given.dp_size {
        if args.dp_size > reported {
            return Err(UsageError(format!(
                "--dp-size {} but the engine reports {reported} rank(s) ({})",
                args.dp_size, discovered.learned_from
            )));
        }
        if args.dp_size != reported {
            warn!(
                dp_size = args.dp_size,
                engine_ranks = reported,
                "--dp-size differs from the engine's ranks; serving the first --dp-size ranks"
            );
        }
    } else {
        args.dp_size = reported;
    }
    let ranks = &discovered.ranks[..args.dp_size as usize];
    args.zmq_endpoint = ranks
        .iter()
        .map(|rank| rank.endpoint.clone().into())
        .collect();
    let replays: Vec<ZmqEndpoint> = ranks
        .iter()
        .filter_map(|rank| rank.replay_endpoint.clone().map(ZmqEndpoint::from))
        .collect();
    args.zmq_replay_endpoint = if replays.len() == ranks.len() {
        replays
    } else {
        if !replays.is_empty() {
            warn!("only some ranks have a replay endpoint; replay is not used");
        }
        Vec::new()
    };
    if args.zmq_load_endpoint.is_empty() {
        args.zmq_load_endpoint = discovered
            .load_endpoint
            .iter()
            .cloned()
            .map(ZmqEndpoint::from)
            .collect();
    }
    let topic = &ranks[0].topic;
    if args.given.zmq_topic && args.zmq_topic != *topic {
        warn!(flag = %args.zmq_topic, engine = %topic, "--zmq-topic differs from the engine's topic; the flag wins");
    } else {
        args.zmq_topic = topic.clone();
    }
    Ok(())
}

/// Starts what follows from the engine's answer: following its ports
/// (returns each rank's target, for the sockets) or comparing it with the
/// flags once. The report of what the engine said, for `/status`.
pub(super) fn start(
    sources: EngineSources,
    args: &ServeArgs,
    supervisor: &Supervisor,
) -> (
    Vec<watch::Receiver<RankTarget>>,
    Option<watch::Receiver<Discovered>>,
) {
    match sources {
        EngineSources::NotAsked => (Vec::new(), None),
        EngineSources::Checked(engine) => {
            let flags = FlagSources::of(args);
            let stop = supervisor.stopping();
            // A supervised task that ends is a failure: this one compares
            // once, then waits for the shutdown.
            supervisor.spawn(TaskName::EngineDiscovery, async move {
                tokio::select! {
                    answer = engine.ask() => {
                        if let Ok(discovered) = answer {
                            flags.compare(&discovered);
                        }
                        stop.cancelled().await;
                    }
                    () = stop.cancelled() => {}
                }
                Ok(())
            });
            (Vec::new(), None)
        }
        EngineSources::Learned { engine, discovered } => {
            let (senders, receivers): (Vec<_>, Vec<_>) = discovered.ranks[..args.dp_size as usize]
                .iter()
                .map(|rank| watch::channel(RankTarget::from(rank)))
                .unzip();
            let (learned, report) = watch::channel(discovered);
            let interval = Duration::from_millis(args.engine_discovery_ms);
            let stop = supervisor.stopping();
            supervisor.spawn(TaskName::EngineDiscovery, async move {
                follow(engine, interval, senders, learned, stop).await;
                Ok(())
            });
            (receivers, Some(report))
        }
    }
}

/// What the flags say of each rank, to compare with the engine's answer.
struct FlagSources {
    endpoint: Option<RankEndpoints>,
    replay: Option<RankEndpoints>,
    topic: String,
    dp_size: u32,
}

impl FlagSources {
    fn of(args: &ServeArgs) -> Self {
        let flag = |name, given: &[ZmqEndpoint]| {
            RankEndpoints::from_flag(name, given, args.dp_size)
                .ok()
                .flatten()
        };
        Self {
            endpoint: flag("--zmq-endpoint", &args.zmq_endpoint),
            replay: flag("--zmq-replay-endpoint", &args.zmq_replay_endpoint),
            topic: args.zmq_topic.clone(),
            dp_size: args.dp_size,
        }
    }

    /// Logs, once, every way the engine's answer differs from the flags.
    fn compare(&self, discovered: &Discovered) {
        let mut differences = Vec::new();
        if discovered.ranks.len() != self.dp_size as usize {
            differences.push(format!(
                "--dp-size {} but the engine reports {} rank(s)",
                self.dp_size,
                discovered.ranks.len()
            ));
        }
        let address = |endpoints: &Option<RankEndpoints>, rank: u32| {
            endpoints
                .as_ref()
                .and_then(|endpoints| endpoints.for_rank(rank).ok())
                .map(|endpoint| endpoint.connect_address())
        };
        for (rank, source) in (0..self.dp_size).zip(&discovered.ranks) {
            let engine = RankTarget::from(source);
            if address(&self.endpoint, rank).as_ref() != Some(&engine.endpoint) {
                differences.push(format!(
                    "rank {rank}: --zmq-endpoint gives {}, the engine {}",
                    address(&self.endpoint, rank).unwrap_or_default(),
                    engine.endpoint
                ));
            }
            if address(&self.replay, rank) != engine.replay {
                differences.push(format!(
                    "rank {rank}: --zmq-replay-endpoint gives {:?}, the engine {:?}",
                    address(&self.replay, rank),
                    engine.replay
                ));
            }
            if source.topic != self.topic {
                differences.push(format!(
                    "rank {rank}: --zmq-topic is {:?}, the engine's {:?}",
                    self.topic, source.topic
                ));
            }
        }
        if !differences.is_empty() {
            warn!(
                engine = %discovered.learned_from,
                "the flags and the engine disagree; the flags win: {}",
                differences.join("; ")
            );
        }
    }
}
