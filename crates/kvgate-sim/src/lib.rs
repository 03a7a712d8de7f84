//! A simulated vLLM engine that publishes real ZMQ traffic, for
//! `kvgate serve --demo`, for tests that need a real publisher socket, and for
//! load runs.
//!
//! [`payload`] encodes vLLM 0.33 batches ([`trtllm`] the same events in
//! TensorRT-LLM's native layout), [`engine`] simulates the prefix cache
//! whose changes they report, and [`publisher`] sends them the way vLLM's
//! ZMQ publisher does; [`load`] encodes SGLang's load gauge; [`discovery`]
//! answers vLLM's `GET /kv_event_sources` for the ranks.
//! [`DemoEngine`] runs one engine, publisher and load publisher per
//! data-parallel rank on a timer. Invariant: rank `r` listens on rank 0's
//! port plus `r` (replay and load likewise), the layout kvgate's source
//! expects; a base port of 0 picks rank 0's port and the others follow it.

pub mod discovery;
pub mod endless_replay;
pub mod engine;
pub mod load;
pub mod payload;
pub mod publisher;
pub mod trtllm;
pub mod workload;

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use zeromq::ZmqError;

use kvgate_endpoint::{EndpointError, TcpEndpoint};

pub use endless_replay::EndlessReplay;
pub use engine::{ConfigError, SimConfig, SimEngine};
pub use load::{LOAD_TOPIC, LoadStat};
pub use payload::{SimEvent, encode_batch};
pub use publisher::{EnginePublisher, PublisherOptions};
pub use workload::{SteadyState, WorkloadShape};

/// Attempts at finding `dp_ranks` consecutive free ports after an ephemeral
/// rank-0 port, before giving up.
const EPHEMERAL_BIND_ATTEMPTS: usize = 8;

/// What [`DemoEngine::bind`] starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DemoConfig {
    /// Rank 0's PUB endpoint (bound).
    pub endpoint: TcpEndpoint,
    pub dp_ranks: u32,
    /// Topic, rank 0's replay endpoint and the replay ring size.
    pub publisher: PublisherOptions,
    /// Rank `r` runs this config with seed `seed + r`: different traffic over
    /// the same system prompts.
    pub engine: SimConfig,
    /// Time between scheduler steps; every rank publishes one batch per step.
    pub interval: Duration,
    /// Rank 0's load PUB endpoint (bound), SGLang's
    /// `--load-publish-endpoint`; `None` publishes no load.
    pub load_endpoint: Option<TcpEndpoint>,
    /// Whose payload layout the ranks publish.
    pub layout: Layout,
}

/// The engine whose KV-event payload layout the simulator speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// vLLM 0.33 ([`payload`]).
    #[default]
    Vllm,
    /// TensorRT-LLM's native streaming publisher ([`trtllm`]), with
    /// stand-in images as multimodal keys.
    TrtllmNative,
}

impl DemoConfig {
    /// `dp_ranks` ranks on ephemeral loopback ports, a step every 200 ms.
    pub fn new(dp_ranks: u32) -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:0".parse().expect("a valid tcp endpoint"),
            dp_ranks,
            publisher: PublisherOptions::default(),
            engine: SimConfig::default(),
            interval: Duration::from_millis(200),
            load_endpoint: None,
            layout: Layout::Vllm,
        }
    }
}

/// Why a demo engine could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("invalid demo config: {0}")]
    Invalid(&'static str),
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    Zmq(#[from] ZmqError),
}

/// Where one rank's publisher can be reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEndpoints {
    pub dp_rank: u32,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub load_endpoint: Option<String>,
}

/// Bound publishers that have not started publishing: learn their endpoints
/// with [`Self::endpoint`] or [`Self::endpoints`], then [`Self::run`].
pub struct DemoEngine {
    ranks: Vec<DemoRank>,
    interval: Duration,
    layout: Layout,
    topic: String,
    buffer_steps: usize,
    /// The `GET /kv_event_sources` server, once started; stopped on drop.
    discovery: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for DemoEngine {
    fn drop(&mut self) {
        if let Some(discovery) = self.discovery.take() {
            discovery.abort();
        }
    }
}

struct DemoRank {
    dp_rank: u32,
    engine: SimEngine,
    publisher: EnginePublisher,
    load: Option<DemoLoad>,
}

/// A rank's load publisher, sending like SGLang's: a changed stat at once,
/// an unchanged one at most once a second.
struct DemoLoad {
    publisher: EnginePublisher,
    last: Option<(LoadStat, std::time::Instant)>,
}

/// SGLang's `LOAD_PUBLISH_HEARTBEAT_S`.
const LOAD_HEARTBEAT: Duration = Duration::from_secs(1);

impl DemoEngine {
    pub async fn bind(config: DemoConfig) -> Result<Self, DemoError> {
        if config.dp_ranks == 0 {
            return Err(DemoError::Invalid("dp_ranks must be positive"));
        }
        if config.interval.is_zero() {
            return Err(DemoError::Invalid("the step interval must be positive"));
        }
        let engines = (0..config.dp_ranks)
            .map(|dp_rank| {
                SimEngine::new(SimConfig {
                    seed: config.engine.seed.wrapping_add(dp_rank.into()),
                    ..config.engine.clone()
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let publishers = bind_publishers_retrying(&config).await?;
        let mut loads: Vec<Option<DemoLoad>> = match &config.load_endpoint {
            Some(endpoint) => {
                let load = DemoConfig {
                    endpoint: endpoint.clone(),
                    publisher: PublisherOptions {
                        topic: LOAD_TOPIC.to_owned(),
                        replay_endpoint: None,
                        ..PublisherOptions::default()
                    },
                    ..config.clone()
                };
                let publishers = bind_publishers_retrying(&load).await?;
                publishers
                    .into_iter()
                    .map(|publisher| {
                        Some(DemoLoad {
                            publisher,
                            last: None,
                        })
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        loads.resize_with(config.dp_ranks as usize, || None);
        let ranks = (0..)
            .zip(engines.into_iter().zip(publishers).zip(loads))
            .map(|(dp_rank, ((engine, publisher), load))| DemoRank {
                dp_rank,
                engine,
                publisher,
                load,
            })
            .collect();
        let demo = Self {
            ranks,
            interval: config.interval,
            layout: config.layout,
            topic: config.publisher.topic.clone(),
            buffer_steps: config.publisher.buffer_steps,
            discovery: None,
        };
        for rank in demo.endpoints() {
            match &rank.replay_endpoint {
                Some(replay_endpoint) => tracing::info!(
                    dp_rank = rank.dp_rank,
                    endpoint = %rank.endpoint,
                    %replay_endpoint,
                    "simulated engine rank bound"
                ),
                None => tracing::info!(
                    dp_rank = rank.dp_rank,
                    endpoint = %rank.endpoint,
                    "simulated engine rank bound"
                ),
            }
        }
        Ok(demo)
    }

    /// Rank 0's resolved endpoint; rank `r` is on its port + `r`.
    pub fn endpoint(&self) -> &str {
        self.ranks[0].publisher.endpoint()
    }

    /// Every rank's resolved endpoints, in rank order.
    pub fn endpoints(&self) -> Vec<RankEndpoints> {
        self.ranks
            .iter()
            .map(|rank| RankEndpoints {
                dp_rank: rank.dp_rank,
                endpoint: rank.publisher.endpoint().to_owned(),
                replay_endpoint: rank.publisher.replay_endpoint().map(str::to_owned),
                load_endpoint: rank
                    .load
                    .as_ref()
                    .map(|load| load.publisher.endpoint().to_owned()),
            })
            .collect()
    }

    /// Answers vLLM's `GET /kv_event_sources` for the ranks from now until
    /// the engine is dropped; the server's base URL (`http://127.0.0.1:PORT`).
    pub async fn answer_discovery(&mut self) -> std::io::Result<String> {
        let answer = discovery::kv_event_sources(&self.endpoints(), &self.topic, self.buffer_steps);
        let (address, task) = discovery::serve(answer).await?;
        if let Some(previous) = self.discovery.replace(task) {
            previous.abort();
        }
        Ok(format!("http://{address}"))
    }

    /// Publishes one step per rank every interval until `shutdown` completes.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Result<(), DemoError> {
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                _ = ticks.tick() => self.publish_step().await?,
            }
        }
    }

    async fn publish_step(&mut self) -> Result<(), ZmqError> {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        for rank in &mut self.ranks {
            let events = rank.engine.step();
            let mut payload = Vec::new();
            match self.layout {
                Layout::Vllm => encode_batch(ts, &events, Some(rank.dp_rank), &mut payload),
                Layout::TrtllmNative => {
                    trtllm::encode_batch(ts, &events, rank.dp_rank, &mut payload);
                }
            }
            let seq = rank.publisher.publish(payload.into()).await?;
            tracing::debug!(
                dp_rank = rank.dp_rank,
                seq,
                events = events.len(),
                "simulated step published"
            );
            if let Some(load) = &mut rank.load {
                let stat = rank.engine.load_stat(rank.dp_rank, events.len());
                load.publish(stat).await?;
            }
        }
        Ok(())
    }
}

impl DemoLoad {
    async fn publish(&mut self, stat: LoadStat) -> Result<(), ZmqError> {
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|(last, at)| last == stat && now.duration_since(at) < LOAD_HEARTBEAT)
        {
            return Ok(());
        }
        let mut payload = Vec::new();
        stat.encode(&mut payload);
        self.publisher.publish(payload.into()).await?;
        self.last = Some((stat, now));
        Ok(())
    }
}

/// [`bind_publishers`], trying again while another process takes a port
/// next to an ephemeral rank-0 port.
async fn bind_publishers_retrying(config: &DemoConfig) -> Result<Vec<EnginePublisher>, DemoError> {
    let ephemeral = config.endpoint.port() == 0;
    let mut attempt = 1;
    loop {
        match bind_publishers(config).await {
            Err(DemoError::Zmq(error)) if ephemeral && attempt < EPHEMERAL_BIND_ATTEMPTS => {
                tracing::debug!(%error, attempt, "consecutive demo ports taken; retrying");
                attempt += 1;
            }
            bound => return bound,
        }
    }
}

/// Binds rank 0 first, so that an ephemeral port is known before the other
/// ranks take the ports after it.
async fn bind_publishers(config: &DemoConfig) -> Result<Vec<EnginePublisher>, DemoError> {
    let mut base = config.endpoint.clone();
    let mut replay_base = config
        .publisher
        .replay_endpoint
        .as_deref()
        .map(str::parse::<TcpEndpoint>)
        .transpose()?;
    let mut publishers = Vec::new();
    for dp_rank in 0..config.dp_ranks {
        let options = PublisherOptions {
            replay_endpoint: replay_base
                .as_ref()
                .map(|replay| replay.for_rank(dp_rank).map(|replay| replay.to_string()))
                .transpose()?,
            ..config.publisher.clone()
        };
        let publisher =
            EnginePublisher::bind(&base.for_rank(dp_rank)?.to_string(), &options).await?;
        if dp_rank == 0 {
            base = publisher.endpoint().parse()?;
            replay_base = publisher.replay_endpoint().map(str::parse).transpose()?;
        }
        publishers.push(publisher);
    }
    Ok(publishers)
}

#[cfg(test)]
fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/wire/vllm-0.33.0")
        .join(name)
}

#[cfg(test)]
mod tests {
    use zeromq::{Socket, SocketRecv, SubSocket};

    use super::*;

    fn port(endpoint: &str) -> u16 {
        endpoint.parse::<TcpEndpoint>().unwrap().port()
    }

    #[tokio::test]
    async fn demo_ranks_publish_their_own_batches_on_consecutive_ports() {
        let config = DemoConfig {
            interval: Duration::from_millis(5),
            publisher: PublisherOptions {
                replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
                ..PublisherOptions::default()
            },
            ..DemoConfig::new(3)
        };
        let demo = DemoEngine::bind(config).await.unwrap();
        let endpoints = demo.endpoints();
        assert_eq!(demo.endpoint(), endpoints[0].endpoint);
        let (base, replay_base) = (
            port(&endpoints[0].endpoint),
            port(endpoints[0].replay_endpoint.as_deref().unwrap()),
        );
        for (rank, endpoints) in (0..).zip(&endpoints) {
            assert_eq!(endpoints.dp_rank, u32::from(rank));
            assert_eq!(port(&endpoints.endpoint), base + rank);
            assert_eq!(
                port(endpoints.replay_endpoint.as_deref().unwrap()),
                replay_base + rank
            );
        }

        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(demo.run(async {
            let _ = stopped.await;
        }));
        for endpoints in &endpoints {
            let mut sub = SubSocket::new();
            sub.connect(&endpoints.endpoint).await.unwrap();
            sub.subscribe("").await.unwrap();
            // The demo keeps publishing, so the first batch after the
            // subscription arrives is only an interval away.
            let frames = tokio::time::timeout(Duration::from_secs(10), sub.recv())
                .await
                .expect("no batch in time")
                .unwrap()
                .into_vec();
            let payload = &frames[2];
            assert_eq!(frames[0], b"".as_slice());
            assert_eq!(payload[0], 0x93, "a 3-item envelope");
            // A rank below 128 is a positive fixint: the last byte.
            assert_eq!(u32::from(payload[payload.len() - 1]), endpoints.dp_rank);
        }
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), running)
            .await
            .expect("the demo did not stop")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn demo_configs_that_cannot_run_are_refused() {
        let refused = [
            DemoConfig::new(0),
            DemoConfig {
                interval: Duration::ZERO,
                ..DemoConfig::new(1)
            },
            DemoConfig {
                engine: SimConfig {
                    block_size: 0,
                    ..SimConfig::default()
                },
                ..DemoConfig::new(1)
            },
        ];
        for config in refused {
            assert!(
                DemoEngine::bind(config.clone()).await.is_err(),
                "{config:?}"
            );
        }
    }
}
