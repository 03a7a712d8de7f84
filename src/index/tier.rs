//! Where a worker holds a block: its device cache or a slower tier.
//!
//! Invariant: every tier the converter stamps on an event maps to exactly
//! one [`Tier`], and a query walks them in [`Tier::WALK`] order: each lower
//! tier continues a worker's match where the tier before it stopped.

use crate::proto::common::KvCacheTier;

/// A cache tier as the index counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// The engine's own cache (GPU, DEVICE).
    Device,
    /// Host memory (CPU, CPU_PINNED, CPU_TIER1).
    Host,
    /// Local storage (CPU_TIER2, DISK, NVME).
    Disk,
    /// A shared or remote store (EXTERNAL): reported with disk.
    External,
}

impl Tier {
    /// The order a query extends a worker's match in.
    pub const WALK: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::External];

    /// The tier the converter stamped; an unset tier is the device's (a
    /// converted event always carries one).
    pub fn from_proto(tier: Option<i32>) -> Tier {
        match tier.and_then(|tier| KvCacheTier::try_from(tier).ok()) {
            Some(KvCacheTier::Host) => Tier::Host,
            Some(KvCacheTier::Disk) => Tier::Disk,
            Some(KvCacheTier::External) => Tier::External,
            Some(KvCacheTier::Device | KvCacheTier::Unspecified) | None => Tier::Device,
        }
    }

    /// This tier's bit in a holder's tier set.
    pub const fn bit(self) -> u8 {
        1 << self as u8
    }

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::External => "external",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_proto_tier_maps_to_the_index_tier_of_its_name() {
        assert_eq!(Tier::from_proto(None), Tier::Device);
        assert_eq!(
            Tier::from_proto(Some(KvCacheTier::Device as i32)),
            Tier::Device
        );
        assert_eq!(Tier::from_proto(Some(KvCacheTier::Host as i32)), Tier::Host);
        assert_eq!(Tier::from_proto(Some(KvCacheTier::Disk as i32)), Tier::Disk);
        assert_eq!(
            Tier::from_proto(Some(KvCacheTier::External as i32)),
            Tier::External
        );
        assert_eq!(Tier::from_proto(Some(99)), Tier::Device);
    }

    #[test]
    fn tier_bits_are_distinct() {
        let bits: Vec<u8> = Tier::WALK.iter().map(|tier| tier.bit()).collect();
        assert_eq!(bits, [1, 2, 4, 8]);
    }
}
