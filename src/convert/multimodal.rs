//! TensorRT-LLM's multimodal block keys, read the way routers already read
//! vLLM's (`docs/contract.md`, "kvgate's additions").
//!
//! Invariant: a block whose tokens hold a multimodal item carries a
//! `multimodal` extra key naming that item, whether the engine published
//! `mm_keys` or only the item's digest token, and every key's offset means
//! what vLLM's means: where the item starts relative to the block's first
//! token (negative when it began in an earlier block). Two items with the
//! same placeholder tokens and different contents therefore never look like
//! one prefix.

use super::event::{DigestToken, MmKey};
use crate::proto::common::{KvBlockExtraKey, KvMultimodalKey, kv_block_extra_key::Key};

/// Appends to `keys` one multimodal key per `mm_keys` entry of the block,
/// then one per digest token of the block that no entry names. `digests`
/// holds the block's digest tokens, their indexes counted from the start of
/// the event's token list, where the block starts at `block_start`.
pub(crate) fn append_block_keys(
    keys: &mut Vec<KvBlockExtraKey>,
    mm_keys: &[MmKey],
    digests: &[DigestToken],
    block_start: usize,
) {
    let position = |digest: &DigestToken| (digest.index - block_start) as i64;
    for MmKey { hash, start_offset } in mm_keys {
        let offset = if *start_offset > 0 {
            -start_offset
        } else {
            digests
                .iter()
                .find(|digest| digest.digest == *hash)
                .map_or(0, position)
        };
        keys.push(multimodal(hash.clone(), offset));
    }
    for digest in digests {
        if !mm_keys.iter().any(|key| key.hash == digest.digest) {
            keys.push(multimodal(digest.digest.clone(), position(digest)));
        }
    }
}

fn multimodal(identifier: String, offset: i64) -> KvBlockExtraKey {
    KvBlockExtraKey {
        key: Some(Key::Multimodal(KvMultimodalKey { identifier, offset })),
    }
}
