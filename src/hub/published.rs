//! A batch as the hub holds it: framed once for gRPC, for every subscriber.
//!
//! Invariant: `framed` is the batch's bytes behind gRPC's 5-byte message
//! prefix (not compressed, then the length, big-endian), and the batch's
//! `encoded` is the slice of the same allocation after that prefix. A
//! subscriber's HTTP/2 stream sends `framed` as it is, so delivering a batch
//! to N subscribers copies nothing: the one copy is a [`FramedBatch`],
//! made once per batch when the drain numbers it, out of the builder's
//! reused buffer. Whatever reads a batch's message (the state directory, a
//! resume, the tests) reads `encoded`, as before.

use std::ops::Deref;

use bytes::{BufMut, Bytes, BytesMut};
use memmap2::MmapMut;

use crate::wire::Batch;
use crate::wire::batch::OWN_MAPPING_MIN_BYTES;

/// gRPC's length-prefixed message header: a compressed flag and a `u32`.
pub const PREFIX_BYTES: usize = 5;

/// A published batch and its bytes as one gRPC message.
#[derive(Debug)]
pub struct Published {
    batch: Batch,
    framed: Bytes,
}

impl Published {
    /// The batch `framed` at `position` (no copy).
    pub fn new(position: u64, rank: u32, sequence: u64, framed: FramedBatch) -> Self {
        Self {
            batch: Batch {
                position,
                rank,
                sequence,
                encoded: framed.0.slice(PREFIX_BYTES..),
            },
            framed: framed.0,
        }
    }

    /// The batch as one gRPC message: prefix and bytes.
    pub fn framed(&self) -> &Bytes {
        &self.framed
    }
}

/// A `KvEventBatch` as one gRPC message, in an allocation the hub can hold
/// as it is. The drain frames each batch once, as it numbers it; the state
/// directory's log writes its message, and the hub then holds it.
#[derive(Clone, Debug)]
pub struct FramedBatch(Bytes);

impl FramedBatch {
    /// `message` framed: the one copy of a batch's bytes.
    pub fn new(message: &[u8]) -> Self {
        Self(held(message))
    }

    /// The `KvEventBatch` bytes, without the prefix.
    pub fn message(&self) -> &[u8] {
        &self.0[PREFIX_BYTES..]
    }
}

impl Deref for Published {
    type Target = Batch;

    fn deref(&self) -> &Batch {
        &self.batch
    }
}

/// `message` as one gRPC message, in a fresh allocation (on the heap).
pub fn frame(message: &[u8]) -> Bytes {
    let mut framed = BytesMut::with_capacity(PREFIX_BYTES + message.len());
    put_prefix(&mut framed, message.len());
    framed.put_slice(message);
    framed.freeze()
}

/// `message` framed in an allocation of its own size, a memory mapping of
/// its own when large: the history frees batches in age order, and large
/// ones on the heap would leave it fragmented (see `OWN_MAPPING_MIN_BYTES`,
/// whose rule `Batch::retained_bytes` charges; the prefix is within the
/// per-batch overhead it adds).
fn held(message: &[u8]) -> Bytes {
    if message.len() >= OWN_MAPPING_MIN_BYTES
        && let Ok(mut mapping) = MmapMut::map_anon(PREFIX_BYTES + message.len())
    {
        let (mut prefix, rest) = mapping.split_at_mut(PREFIX_BYTES);
        put_prefix(&mut prefix, message.len());
        rest.copy_from_slice(message);
        return Bytes::from_owner(mapping);
    }
    frame(message)
}

fn put_prefix(into: &mut impl BufMut, len: usize) {
    // The router's limit (`ROUTER_MAX_MESSAGE_BYTES`) keeps every message
    // far below `u32::MAX`.
    let len = u32::try_from(len).expect("a batch is smaller than 4 GiB");
    into.put_u8(0);
    into.put_u32(len);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_batch_is_its_bytes_behind_the_grpc_prefix_in_one_allocation() {
        for len in [0, 3, 300, OWN_MAPPING_MIN_BYTES + 7] {
            let message: Vec<u8> = (0..len).map(|index| index as u8).collect();
            let published = Published::new(9, 2, 40, FramedBatch::new(&message));
            let framed = published.framed();
            assert_eq!(framed[0], 0, "not compressed");
            assert_eq!(&framed[1..5], &(len as u32).to_be_bytes());
            assert_eq!(&framed[PREFIX_BYTES..], &message[..]);
            assert_eq!(published.encoded, message);
            assert_eq!(
                published.encoded.as_ptr(),
                framed[PREFIX_BYTES..].as_ptr(),
                "the message is a slice of the framed bytes"
            );
            assert_eq!(
                (published.position, published.rank, published.sequence),
                (9, 2, 40)
            );
        }
    }
}
