//! A batch as subscribers receive it: encoded once by the drain, shared by
//! reference with every subscriber and the history.

use bytes::Bytes;

/// One encoded `KvEventBatch` and where it stands in the stream.
#[derive(Debug)]
pub struct Batch {
    /// Place in kvgate's single emission order across all ranks (from 1).
    /// Subscribers track this, not sequence numbers, to find gaps and seams.
    pub position: u64,
    pub rank: u32,
    /// The rank's own sequence number as the router sees it.
    pub sequence: u64,
    pub event_count: u32,
    /// The protobuf bytes, sent verbatim to every subscriber.
    pub encoded: Bytes,
}
