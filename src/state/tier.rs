//! The tier a block lives on, and figures kept per tier.
//!
//! Invariant: every block has exactly one tier. An event without a tier, or
//! with a value this build does not know, counts as the device tier (the
//! contract's default); `Unspecified` is kept apart, never merged.

use std::ops::{Index, IndexMut};

pub use crate::proto::common::KvCacheTier as Tier;

impl Tier {
    /// Every tier, in wire order.
    pub const ALL: [Tier; 5] = [
        Tier::Unspecified,
        Tier::Device,
        Tier::Host,
        Tier::Disk,
        Tier::External,
    ];

    /// The tiers `/status` and the metrics report, with their labels.
    pub const REPORTED: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::External];

    /// The tier an event's optional `tier` field names.
    pub fn of_event(tier: Option<i32>) -> Tier {
        tier.and_then(|tier| Tier::try_from(tier).ok())
            .unwrap_or(Tier::Device)
    }

    /// The `tier` label of metrics and the key in `/status`.
    pub const fn label(self) -> &'static str {
        match self {
            Tier::Unspecified => "unspecified",
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::External => "external",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// One value per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerTier<T>([T; 5]);

impl<T> Index<Tier> for PerTier<T> {
    type Output = T;

    fn index(&self, tier: Tier) -> &T {
        &self.0[tier.index()]
    }
}

impl<T> IndexMut<Tier> for PerTier<T> {
    fn index_mut(&mut self, tier: Tier) -> &mut T {
        &mut self.0[tier.index()]
    }
}

/// Live blocks per tier, each physical copy counted.
pub type TierCounts = PerTier<u64>;

impl TierCounts {
    /// Every tier's blocks together.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// The reported tiers' labels and counts.
    pub fn reported(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        Tier::REPORTED
            .into_iter()
            .map(|tier| (tier.label(), self[tier]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_without_a_known_tier_counts_as_device() {
        assert_eq!(Tier::of_event(None), Tier::Device);
        assert_eq!(Tier::of_event(Some(99)), Tier::Device);
        assert_eq!(Tier::of_event(Some(-1)), Tier::Device);
        assert_eq!(Tier::of_event(Some(Tier::Host as i32)), Tier::Host);
        assert_eq!(
            Tier::of_event(Some(Tier::Unspecified as i32)),
            Tier::Unspecified
        );
    }

    #[test]
    fn counts_are_kept_per_tier_and_reported_for_the_four_named_tiers() {
        let mut counts = TierCounts::default();
        counts[Tier::Host] += 3;
        counts[Tier::Unspecified] += 1;
        assert_eq!(counts.total(), 4);
        let reported: Vec<_> = counts.reported().collect();
        assert_eq!(
            reported,
            [("device", 0), ("host", 3), ("disk", 0), ("external", 0)]
        );
    }
}
