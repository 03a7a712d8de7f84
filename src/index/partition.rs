//! One (model, routing group): its tree, its block size and its counters.
//!
//! Invariant: the block size is fixed when the partition is made (by the
//! first registration) and every store is held to it; only the writer
//! takes the tree's write lock, readers take the read lock for one walk.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use serde::{Deserialize, Serialize};

use super::tree::{RankMatch, Tree};

/// What names a partition.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionKey {
    /// The served model.
    pub model_name: String,
    /// Dynamo's routing group (formerly tenant), `default` when unnamed.
    pub routing_group: String,
}

impl std::fmt::Display for PartitionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.model_name, self.routing_group)
    }
}

/// A query naming a partition the index does not hold (Dynamo's words).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no indexer for model={} routing_group={}", .0.model_name, .0.routing_group)]
pub struct UnknownPartition(pub PartitionKey);

/// Why the writer set an event aside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// A store whose blocks are not the partition's block size.
    BlockSizeMismatch,
    /// A store under a parent its rank does not hold.
    UnknownParent,
    /// A store or removal whose medium Dynamo does not spell so.
    UnknownMedium,
}

impl Dropped {
    /// Every reason, in label order.
    pub const ALL: [Dropped; 3] = [
        Dropped::BlockSizeMismatch,
        Dropped::UnknownParent,
        Dropped::UnknownMedium,
    ];

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Dropped::BlockSizeMismatch => "block_size_mismatch",
            Dropped::UnknownParent => "unknown_parent",
            Dropped::UnknownMedium => "unknown_medium",
        }
    }
}

/// One partition.
#[derive(Debug)]
pub struct Partition {
    key: PartitionKey,
    block_size: u32,
    tree: RwLock<Tree>,
    dropped: [AtomicU64; Dropped::ALL.len()],
    events: AtomicU64,
}

impl Partition {
    /// An empty partition for blocks of `block_size` tokens.
    pub fn new(key: PartitionKey, block_size: u32) -> Self {
        Partition {
            key,
            block_size,
            tree: RwLock::new(Tree::new()),
            dropped: Default::default(),
            events: AtomicU64::new(0),
        }
    }

    /// Its name.
    pub fn key(&self) -> &PartitionKey {
        &self.key
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// How far each rank matches `locals`, read under the lock for the walk only.
    pub fn overlap(&self, locals: &[u64]) -> Vec<RankMatch> {
        self.read().overlap(locals)
    }

    /// The tree, for one read.
    pub fn read(&self) -> RwLockReadGuard<'_, Tree> {
        // A writer that panicked left a tree every step of which was whole
        // (each step is one store, removal or clear): keep serving it.
        self.tree
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The tree, for one bounded step of the writer.
    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, Tree> {
        self.tree
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn count_dropped(&self, reason: Dropped) {
        self.dropped[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_event(&self) {
        self.events.fetch_add(1, Ordering::Relaxed);
    }

    /// Events set aside for `reason` so far.
    pub fn dropped(&self, reason: Dropped) -> u64 {
        self.dropped[reason as usize].load(Ordering::Relaxed)
    }

    /// Events applied so far.
    pub fn events(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }
}

/// A partition's figures at one moment, as `/status` reports them and
/// `kvgate status --index` reads them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionStatus {
    /// The served model.
    pub model_name: String,
    /// The routing group.
    pub routing_group: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Live blocks held, over every rank.
    pub blocks: u64,
    /// Distinct prefix blocks in the tree.
    pub nodes: u64,
    /// Converted events applied.
    pub events: u64,
    /// Events set aside, per reason ([`Dropped::as_str`]).
    pub dropped: BTreeMap<String, u64>,
}

impl PartitionStatus {
    /// `partition`'s figures now (its tree read once).
    pub fn of(partition: &Partition) -> Self {
        let (blocks, nodes) = {
            let tree = partition.read();
            (tree.held_blocks(), tree.nodes() as u64)
        };
        PartitionStatus {
            model_name: partition.key.model_name.clone(),
            routing_group: partition.key.routing_group.clone(),
            block_size: partition.block_size,
            blocks,
            nodes,
            events: partition.events(),
            dropped: Dropped::ALL
                .into_iter()
                .map(|reason| (reason.as_str().to_owned(), partition.dropped(reason)))
                .collect(),
        }
    }
}
