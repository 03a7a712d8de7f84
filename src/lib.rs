//! kvgate: one drain of an engine's KV-cache events, re-served to many routers.
//!
//! Data flows left to right through the modules:
//! `source` (engine sockets) → `convert` (msgpack → proto) → `drain`
//! (numbering, batching, encoding once) → `hub` (broadcast, history, state)
//! → `server` (gRPC services). `sim` is a simulated engine for the demo,
//! the tests and the load tool.

pub mod app;
pub mod cli;
pub mod client;
pub mod convert;
pub mod drain;
pub mod hub;
pub mod json;
pub mod logging;
pub mod metrics;
pub mod pem;
pub mod proto;
pub mod server;
pub mod sim;
pub mod source;
pub mod tools;
