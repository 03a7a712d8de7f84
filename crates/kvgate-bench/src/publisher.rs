//! The simulated engine of a load run: a real ZMQ PUB publishing the
//! steady-state workload, each payload stamped with its wall-clock publish
//! time, which kvgate passes on as the batch timestamp.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use super::subscriber::Delivery;
use super::worker::Worker;
use super::workload::Workload;
use kvgate::clock::unix_now;
use kvgate_sim::{EnginePublisher, PublisherOptions, encode_batch};

/// Gap between payloads while waiting for kvgate's SUB to join.
const PRIME_EVERY: Duration = Duration::from_millis(10);
/// How often a paced publisher catches up with its schedule.
const PACING_TICK: Duration = Duration::from_millis(1);
/// How far a paced publisher may fall behind its schedule.
const MAX_BEHIND: Duration = Duration::from_millis(100);
/// Most payloads sent in one catch-up, so a rate beyond what the publisher
/// can reach still lets it notice a change of mode.
const MAX_BURST: usize = 1024;
/// At `--rate 0`, most events published and not yet received by every
/// subscriber. A PUB never waits, so without a bound the publisher would
/// outrun kvgate, take a core from it and measure ZMQ's drops. 32 of
/// kvgate's largest batches ride out its brief stalls (with 8, a quarter or
/// more of the throughput was lost); the price is latency, which at this
/// rate is mostly time spent queued inside this window.
const IN_FLIGHT: u64 = 32_768;
/// Fixed, so every run publishes the same traffic.
pub const SEED: u64 = 7;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Nothing published.
    Quiet,
    /// A payload every [`PRIME_EVERY`]: enough to see when kvgate listens.
    Prime,
    /// The run's rate (0: as fast as every subscriber receives).
    Run,
    Stop,
}

impl Mode {
    fn from_u8(value: u8) -> Self {
        [Self::Quiet, Self::Prime, Self::Run, Self::Stop]
            .into_iter()
            .find(|mode| *mode as u8 == value)
            .unwrap_or(Self::Stop)
    }
}

#[derive(Default)]
struct Control {
    mode: AtomicU8,
    /// Events published so far (priming included).
    events: AtomicU64,
}

impl Control {
    fn mode(&self) -> Mode {
        Mode::from_u8(self.mode.load(Ordering::Relaxed))
    }
}

pub struct Publisher {
    worker: Worker,
    control: Arc<Control>,
    task: Option<JoinHandle<anyhow::Result<EnginePublisher>>>,
    /// Kept open after publishing stops: closing the socket discards what
    /// it has queued but not yet sent.
    stopped: Option<EnginePublisher>,
    endpoint: String,
}

impl Publisher {
    /// Binds a PUB on an ephemeral loopback port and waits, quiet.
    pub async fn start(
        workload: Workload,
        rate: u64,
        delivery: Arc<Delivery>,
    ) -> anyhow::Result<Self> {
        let worker = Worker::start("bench-publisher")?;
        // The socket's own tasks run where it is created.
        let socket = worker
            .spawn(async {
                EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default()).await
            })
            .await??;
        let endpoint = socket.endpoint().to_owned();
        let control = Arc::new(Control::default());
        let task = worker.spawn(publish(
            socket,
            workload,
            Arc::clone(&control),
            Pace::new(rate, delivery),
        ));
        Ok(Self {
            worker,
            control,
            task: Some(task),
            stopped: None,
            endpoint,
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn set_mode(&self, mode: Mode) {
        self.control.mode.store(mode as u8, Ordering::Relaxed);
    }

    pub fn published_events(&self) -> u64 {
        self.control.events.load(Ordering::Relaxed)
    }

    pub fn cpu_seconds(&self) -> std::io::Result<f64> {
        self.worker.cpu_seconds()
    }

    /// Stops publishing for good and returns the events published in all;
    /// fails if publishing had failed. The socket closes on drop.
    pub async fn stop(&mut self) -> anyhow::Result<u64> {
        self.set_mode(Mode::Stop);
        if let Some(task) = self.task.take() {
            self.stopped = Some(task.await??);
        }
        Ok(self.published_events())
    }
}

/// When the next payload is due in [`Mode::Run`].
enum Pace {
    /// Events per second on a fixed schedule, from when the run began and
    /// with the events published before it.
    Rate {
        rate: u64,
        schedule: Option<(Instant, u64)>,
    },
    /// Closed loop: at most [`IN_FLIGHT`] events ahead of the slowest
    /// subscriber, counted from when the run began (the pipeline is empty
    /// then).
    Delivered {
        delivery: Arc<Delivery>,
        start: Option<(u64, u64)>,
    },
}

impl Pace {
    fn new(rate: u64, delivery: Arc<Delivery>) -> Self {
        match rate {
            0 => Self::Delivered {
                delivery,
                start: None,
            },
            rate => Self::Rate {
                rate,
                schedule: None,
            },
        }
    }

    /// Whether another payload may go out with `published` events sent.
    fn ready(&mut self, published: u64) -> bool {
        match self {
            Self::Rate { rate, schedule } => {
                let (start, before) = schedule.get_or_insert_with(|| (Instant::now(), published));
                let rate = *rate as f64;
                let behind = start.elapsed().as_secs_f64() - (published - *before) as f64 / rate;
                // A publisher that fell behind catches up, but by no more
                // than MAX_BEHIND: a longer burst would put the hiccup into
                // the measured rate.
                if behind > MAX_BEHIND.as_secs_f64() {
                    *start += Duration::from_secs_f64(behind - MAX_BEHIND.as_secs_f64());
                }
                behind > 0.0
            }
            Self::Delivered { delivery, start } => {
                let slowest = delivery.slowest();
                let (published_before, received_before) =
                    *start.get_or_insert((published, slowest));
                (published - published_before) < (slowest - received_before) + IN_FLIGHT
            }
        }
    }
}

async fn publish(
    mut socket: EnginePublisher,
    mut workload: Workload,
    control: Arc<Control>,
    mut pace: Pace,
) -> anyhow::Result<EnginePublisher> {
    let mut ticks = tokio::time::interval(PACING_TICK);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        match control.mode() {
            Mode::Stop => return Ok(socket),
            Mode::Quiet => tokio::time::sleep(PRIME_EVERY).await,
            Mode::Prime => {
                publish_one(&mut socket, &mut workload, &control).await?;
                tokio::time::sleep(PRIME_EVERY).await;
            }
            Mode::Run => {
                for _ in 0..MAX_BURST {
                    if !pace.ready(control.events.load(Ordering::Relaxed)) {
                        break;
                    }
                    publish_one(&mut socket, &mut workload, &control).await?;
                    // A PUB send only queues: the socket's writer tasks on
                    // this thread run when the publisher yields.
                    tokio::task::yield_now().await;
                }
                ticks.tick().await;
            }
        }
    }
}

async fn publish_one(
    socket: &mut EnginePublisher,
    workload: &mut Workload,
    control: &Control,
) -> anyhow::Result<()> {
    let events = workload.next_events();
    let mut payload = Vec::new();
    // Stamped after the events are generated: the latency a subscriber
    // measures starts where an engine's would, at the publish call.
    encode_batch(unix_now(), &events, Some(0), &mut payload);
    socket.publish(payload.into()).await?;
    control
        .events
        .fetch_add(events.len() as u64, Ordering::Relaxed);
    Ok(())
}
