//! What happened to each decoded engine event: forwarded (by kind) or dropped
//! (by reason).
//!
//! Invariant: every event of a payload that decodes is counted exactly once,
//! either as forwarded or as dropped; the label strings are the contract's
//! names, so they can be used as metric labels as they are.

/// Why an engine event was not forwarded (contract section 2, "Normalization").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Not a map or array, no readable type, or a field present but unreadable
    /// (a required one missing counts too).
    Malformed,
    /// A type tag other than `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.
    UnknownType,
    /// A `medium` outside the tier table.
    UnknownMedium,
    /// A `locality` other than `LOCAL`.
    NonLocalLocality,
    /// Ownership `kvcr`.
    UnsupportedOwnership,
    /// A cache group whose kind is not full / MLA / sink-full attention.
    NonMainAttentionGroup,
    /// A store with no hashes or no tokens (offloading metadata).
    Placeholder,
    /// A store whose tokens do not split into `block_size`-token blocks.
    UnalignedBlocks,
    /// A store repeating a hash, or naming one of its own hashes as parent.
    SelfReferencingHashes,
}

impl DropReason {
    /// Every reason, in label order.
    pub const ALL: [DropReason; 9] = [
        DropReason::Malformed,
        DropReason::UnknownType,
        DropReason::UnknownMedium,
        DropReason::NonLocalLocality,
        DropReason::UnsupportedOwnership,
        DropReason::NonMainAttentionGroup,
        DropReason::Placeholder,
        DropReason::UnalignedBlocks,
        DropReason::SelfReferencingHashes,
    ];

    /// The contract's snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Malformed => "malformed",
            DropReason::UnknownType => "unknown_type",
            DropReason::UnknownMedium => "unknown_medium",
            DropReason::NonLocalLocality => "non_local_locality",
            DropReason::UnsupportedOwnership => "unsupported_ownership",
            DropReason::NonMainAttentionGroup => "non_main_attention_group",
            DropReason::Placeholder => "placeholder",
            DropReason::UnalignedBlocks => "unaligned_blocks",
            DropReason::SelfReferencingHashes => "self_referencing_hashes",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The kind of a forwarded event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// Blocks stored.
    Stored,
    /// Blocks removed.
    Removed,
    /// Every block of a rank (or of an owner) cleared.
    Cleared,
}

impl EventKind {
    /// Every kind, in label order.
    pub const ALL: [EventKind; 3] = [EventKind::Stored, EventKind::Removed, EventKind::Cleared];

    /// The `type` label.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Stored => "stored",
            EventKind::Removed => "removed",
            EventKind::Cleared => "cleared",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Counts of forwarded events per kind and dropped events per reason.
#[derive(Default, Debug, Clone, PartialEq)]
pub struct Tally {
    forwarded: [u64; EventKind::ALL.len()],
    dropped: [u64; DropReason::ALL.len()],
}

impl Tally {
    /// Events of `kind` forwarded.
    pub fn forwarded(&self, kind: EventKind) -> u64 {
        self.forwarded[kind.index()]
    }

    /// Events dropped for `reason`.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()]
    }

    /// Events forwarded, every kind.
    pub fn total_forwarded(&self) -> u64 {
        self.forwarded.iter().sum()
    }

    /// Events dropped, every reason.
    pub fn total_dropped(&self) -> u64 {
        self.dropped.iter().sum()
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Tally) {
        for (mine, theirs) in self.forwarded.iter_mut().zip(other.forwarded) {
            *mine += theirs;
        }
        for (mine, theirs) in self.dropped.iter_mut().zip(other.dropped) {
            *mine += theirs;
        }
    }

    pub(crate) fn count_forwarded(&mut self, kind: EventKind) {
        self.forwarded[kind.index()] += 1;
    }

    pub(crate) fn count_dropped(&mut self, reason: DropReason) {
        self.dropped[reason.index()] += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_reasons_carry_the_contract_names_in_order() {
        let names: Vec<_> = DropReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            names,
            [
                "malformed",
                "unknown_type",
                "unknown_medium",
                "non_local_locality",
                "unsupported_ownership",
                "non_main_attention_group",
                "placeholder",
                "unaligned_blocks",
                "self_referencing_hashes",
            ]
        );
        for (i, reason) in DropReason::ALL.iter().enumerate() {
            assert_eq!(reason.index(), i);
        }
        for (i, kind) in EventKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }

    #[test]
    fn tallies_count_and_merge_per_label() {
        let mut a = Tally::default();
        a.count_forwarded(EventKind::Stored);
        a.count_dropped(DropReason::Placeholder);
        let mut b = Tally::default();
        b.count_forwarded(EventKind::Stored);
        b.count_forwarded(EventKind::Cleared);
        b.count_dropped(DropReason::SelfReferencingHashes);
        a.add(&b);
        assert_eq!(a.forwarded(EventKind::Stored), 2);
        assert_eq!(a.forwarded(EventKind::Removed), 0);
        assert_eq!(a.forwarded(EventKind::Cleared), 1);
        assert_eq!(a.dropped(DropReason::Placeholder), 1);
        assert_eq!(a.dropped(DropReason::SelfReferencingHashes), 1);
        assert_eq!(a.total_forwarded(), 3);
        assert_eq!(a.total_dropped(), 2);
    }
}
