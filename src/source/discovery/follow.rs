//! Following an engine whose ports move: kvgate asks again while it runs,
//! so an engine restarted on other ports (vLLM's `tcp://*:0`, a pod
//! rescheduled) is found again without a restart of kvgate.
//!
//! Invariant: a rank's target changes only on a usable answer that names
//! another endpoint for it; an engine that answers nothing (it is
//! restarting) or garbage leaves every target where it was, and a rank
//! kvgate does not serve is never followed.

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{Discovered, Engine, RankSource};

/// Where one rank's SUB connects and where its replay requests go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankTarget {
    /// The publisher's connect address.
    pub endpoint: String,
    /// The replay ROUTER's connect address.
    pub replay: Option<String>,
}

impl From<&RankSource> for RankTarget {
    fn from(source: &RankSource) -> Self {
        Self {
            endpoint: source.endpoint.connect_address(),
            replay: source
                .replay_endpoint
                .as_ref()
                .map(|replay| replay.connect_address()),
        }
    }
}

/// Asks `engine` every `interval` until `stop`, moving each rank's target
/// (`targets[r]`) and the report (`learned`) when the answer changes.
pub async fn follow(
    engine: Engine,
    interval: Duration,
    targets: Vec<watch::Sender<RankTarget>>,
    learned: watch::Sender<Discovered>,
    stop: CancellationToken,
) {
    let mut warned_rank_count = false;
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = stop.cancelled() => return,
        }
        let answer = tokio::select! {
            answer = engine.ask() => answer,
            () = stop.cancelled() => return,
        };
        let discovered = match answer {
            Ok(discovered) => discovered,
            Err(error) => {
                debug!(%error, "the engine did not say where it publishes; keeping the last answer");
                continue;
            }
        };
        if discovered.ranks.len() != targets.len() && !warned_rank_count {
            warned_rank_count = true;
            warn!(
                engine_ranks = discovered.ranks.len(),
                served_ranks = targets.len(),
                "the engine now reports another number of ranks; following the ranks served"
            );
        }
        for (rank, (target, source)) in targets.iter().zip(&discovered.ranks).enumerate() {
            let moved = RankTarget::from(source);
            if *target.borrow() != moved {
                info!(rank, endpoint = %moved.endpoint, replay = ?moved.replay, "the engine's publisher moved");
                target.send_replace(moved);
            }
        }
        learned.send_if_modified(|last| {
            let changed = *last != discovered;
            *last = discovered;
            changed
        });
    }
}
