//! The fleet's prefix index: a stage of its own beside the hub.
//!
//! Fed by the same sources and converter as the drain, the index keeps one
//! [`tree::Tree`] per (model, routing group) and answers which worker ranks
//! hold how much of a request's prefix, per tier, in Dynamo's terms.
//!
//! Invariants:
//! - Blocks are matched by Dynamo's local block hash ([`block_hash`]), never
//!   by an engine's own hash: an engine hash only names, per rank, which node
//!   a removal or a child's parent refers to.
//! - Each partition's tree has one writer ([`writer`]): it applies events in
//!   each rank's order, one bounded step (at most
//!   256 blocks of a store, a removal or a
//!   clear) per hold of the tree's lock.
//!   A query holds the read lock only for its walk, never while its answer
//!   is written to a client, so ingest never waits on a slow client and a
//!   query waits at most one step of ingest.
//! - A store whose block size differs from the partition's is dropped and
//!   counted, as is a store under a parent its rank does not hold.
//!
//! Files: `tier.rs` (tiers from the event's medium), `block_hash.rs` (the
//! local hash), `nodes.rs` (where a tree's nodes live and who holds each),
//! `children.rs` (a child found among its siblings), `rank_blocks.rs` (a
//! rank's engine hashes and their nodes), `tree.rs` (one partition),
//! `partition.rs` (a tree, its block size and its counters), `writer.rs`
//! (the one writer), `ingest_thread.rs` (the feeds' and the writer's
//! thread, below the queries'), `registry.rs` (workers and partitions), `feed/` (a
//! worker's source: `zmq.rs` one rank's ZMQ source and converter,
//! `ipc_path.rs` what is at an `ipc://` path, `sidecar.rs` every rank of a
//! kvgate sidecar), `overlap.rs` (a query's answer per worker and rank).

pub mod block_hash;
mod children;
pub(crate) mod feed;
pub(crate) mod ingest_thread;
mod nodes;
pub mod overlap;
pub mod partition;
mod rank_blocks;
pub(crate) mod registry;
mod spilling_table;
#[cfg(test)]
mod tests;
pub mod tier;
pub mod tree;
pub(crate) mod writer;
