#![warn(missing_docs)]
//! kvgate: one drain of an engine's KV-cache events, re-served to many routers.
//!
//! Data flows left to right through the modules:
//! [`source`] (engine sockets) → [`convert`] (msgpack → proto) → [`drain`]
//! (numbering, batching, encoding once with [`wire`]) → [`hub`] (history,
//! live broadcast, subscriptions) and [`state`] (live blocks, snapshots) →
//! [`server`] (gRPC services); with `--state-dir`, the drain also writes
//! every batch and checkpoints of the state into [`store`]. [`load`] polls the engine's `GetLoads` once for
//! every router and hands the drain the records it stamps on batches.
//! [`index`], a stage beside the hub fed by the same sources and converter,
//! keeps the fleet's prefix index that `kvgate index` answers from.
//! [`app`] wires them into a [`app::Gateway`]; [`metrics`], [`client`],
//! [`clock`] and [`proto`] are the foundation every stage may use.
//! `docs/architecture.md` has the picture, the task tree and the import
//! rules. The simulated engine and the load tool are crates of their own
//! (`crates/kvgate-sim`, `crates/kvgate-bench`).

pub mod allocator;
pub mod app;
pub mod cli;
pub mod cli_values;
pub mod client;
pub mod clock;
pub(crate) mod connect_error;
pub mod convert;
pub mod drain;
pub(crate) mod health;
pub mod http_get;
pub mod hub;
pub mod index;
pub mod json;
pub mod load;
pub mod logging;
pub mod metrics;
pub mod pem;
pub mod proto;
pub mod recording;
pub mod regular_file;
pub mod router_rules;
pub mod runtime_thread;
pub mod server;
pub mod source;
pub mod state;
pub mod store;
pub(crate) mod supervisor;
pub(crate) mod token_file;
pub mod tools;
pub mod usage;
pub mod usage_error;
pub mod wire;
