//! kvgate: one drain of an engine's KV-cache events, re-served to many routers.
//!
//! Data flows left to right through the modules:
//! `source` (engine sockets) → `convert` (msgpack → proto) → `drain`
//! (numbering, batching, encoding once) → `hub` (broadcast, history, state)
//! → `server` (gRPC services).

pub mod proto;
