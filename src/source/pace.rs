//! Playing recorded time back: a recording's receive times and a trace's
//! timestamps become waits, scaled by `--replay-speed`, pass after pass.
//!
//! Invariants: each event is due at the pass's start plus its offset from
//! the pass's first event divided by the speed, so waits never accumulate
//! drift; a time earlier than the first (a clock stepped back) is due at
//! once; at `max` nothing waits and the drain's queue paces the source. A
//! pass after the first starts with a resync, an ownerless clear of every
//! rank, as after an engine restart; a loop ends at a pass that played
//! nothing; after the last pass the source holds until kvgate stops,
//! serving the final state (an ended source would fail the gateway).

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{DrainGone, SourceEvent, send};

/// How fast recorded time is played.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Speed {
    /// Recorded time divided by this factor (1 = as recorded).
    Scaled(f64),
    /// As fast as the drain takes events.
    Max,
}

/// The factors `--replay-speed` accepts.
const FACTORS: std::ops::RangeInclusive<f64> = 0.001..=1_000_000.0;

impl FromStr for Speed {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if text.eq_ignore_ascii_case("max") {
            return Ok(Self::Max);
        }
        match text.parse::<f64>() {
            Ok(factor) if FACTORS.contains(&factor) => Ok(Self::Scaled(factor)),
            _ => Err(format!(
                "{text:?} is not a speed: a factor from {} to {} (1 = as recorded, 10 = ten \
                 times faster) or max",
                FACTORS.start(),
                FACTORS.end()
            )),
        }
    }
}

impl fmt::Display for Speed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Scaled(factor) => write!(f, "{factor}x"),
            Self::Max => f.write_str("max speed"),
        }
    }
}

/// Waits until recorded instants are due, one pass at a time.
#[derive(Debug)]
pub struct Pacer {
    speed: Speed,
    /// The pass's first recorded time (µs) and when it was played.
    origin: Option<(u64, Instant)>,
}

impl Pacer {
    /// A pacer at `speed`, its pass not started.
    pub fn new(speed: Speed) -> Self {
        Self {
            speed,
            origin: None,
        }
    }

    /// A new pass: the next time waited for plays at once.
    pub fn restart(&mut self) {
        self.origin = None;
    }

    /// Returns when the event recorded at `micros` is due.
    pub async fn wait_for(&mut self, micros: u64) {
        let Speed::Scaled(factor) = self.speed else {
            return;
        };
        let (first, started) = *self.origin.get_or_insert((micros, Instant::now()));
        let offset = micros.saturating_sub(first) as f64 / 1e6 / factor;
        tokio::time::sleep_until(started + Duration::from_secs_f64(offset)).await;
    }
}

/// What one pass gave the drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Played {
    /// At least one event or load record.
    Something,
    /// Nothing at all (no intact record, no request that stores a block):
    /// the next pass, over the same file, would give nothing either.
    Nothing,
}

/// A source played from its start, pass after pass.
pub(crate) trait Pass {
    /// Plays pass `number` at `pacer`'s pace (restarted for it).
    fn play(
        &mut self,
        number: u64,
        pacer: &mut Pacer,
    ) -> impl Future<Output = Result<Played, DrainGone>> + Send;
}

/// Plays `pass` once, or again and again when `looped`, until `stop` is
/// cancelled or the drain is gone. A loop ends at a pass that gave
/// nothing: playing the file again would only spin a core (and, each pass
/// opening with a resync, clear every rank for nothing).
pub(crate) async fn play_passes(
    speed: Speed,
    looped: bool,
    events: &mpsc::Sender<SourceEvent>,
    ready: &watch::Sender<bool>,
    stop: &CancellationToken,
    mut pass: impl Pass,
) {
    let mut pacer = Pacer::new(speed);
    for number in 0_u64.. {
        if number > 0 && send(events, SourceEvent::Resync).await.is_err() {
            return;
        }
        ready.send_replace(true);
        pacer.restart();
        let played = tokio::select! {
            played = pass.play(number, &mut pacer) => played,
            () = stop.cancelled() => return,
        };
        match played {
            Ok(Played::Something) if looped => {}
            Ok(Played::Nothing) if looped => {
                warn!(
                    pass = number,
                    "the pass played nothing; not playing the file again"
                );
                break;
            }
            _ => break,
        }
    }
    info!("played; serving the final state");
    stop.cancelled().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_speed_is_a_bounded_factor_or_max() {
        assert_eq!("1".parse(), Ok(Speed::Scaled(1.0)));
        assert_eq!("10".parse(), Ok(Speed::Scaled(10.0)));
        assert_eq!("MAX".parse(), Ok(Speed::Max));
        for bad in ["0", "-1", "fast", "1e9", "NaN", "inf"] {
            let error = bad.parse::<Speed>().unwrap_err();
            assert!(error.contains("or max"), "{bad}: {error}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn events_are_due_at_their_recorded_offset_divided_by_the_speed() {
        let mut pacer = Pacer::new(Speed::Scaled(10.0));
        let start = Instant::now();
        pacer.wait_for(5_000_000).await;
        assert_eq!(start.elapsed(), Duration::ZERO, "the first plays at once");
        pacer.wait_for(7_000_000).await;
        assert_eq!(start.elapsed(), Duration::from_millis(200));
        pacer.wait_for(1_000_000).await;
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(200),
            "earlier: at once"
        );
        pacer.restart();
        pacer.wait_for(9_000_000).await;
        assert_eq!(start.elapsed(), Duration::from_millis(200), "a new pass");
    }
}
