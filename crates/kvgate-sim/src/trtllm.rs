//! TensorRT-LLM's native streaming layout (KV-cache manager V2,
//! `tensorrt_llm/_torch/pyexecutor/kv_cache_events.py`): the envelope and
//! framing of vLLM 0.33, events as msgspec tagged maps of TensorRT-LLM's own
//! structs (fixmap headers: `BlockStored` declares 13 fields), `medium`
//! `"GPU"`, and multimodal items as the V2 manager keys them.
//!
//! The simulator has no images, so it stands one in deterministically: a
//! block whose first token id is a multiple of [`IMAGE_EVERY`] starts an
//! image there. That token is published as the item's digest (hex str) and
//! the block's `mm_keys` entry names it with `start_offset` 0, as an engine
//! started with `mm_token_id_offset` does; the same tokens always give the
//! same digest, so chains and hashes stay the simulator's.

use rmp::encode::{write_array_len, write_map_len, write_str, write_uint};

use super::payload::{SimEvent, WriteResult, len_u32, write_envelope, write_hashes, write_null};

/// One block in this many (by its first token) starts a stand-in image.
pub const IMAGE_EVERY: u32 = 7;

/// Appends the msgpack of `[ts, [events...], dp_rank]` in TensorRT-LLM's
/// layout to `out`.
pub fn encode_batch(ts: f64, events: &[SimEvent], dp_rank: u32, out: &mut Vec<u8>) {
    write_envelope(ts, events, Some(dp_rank), out, write_event)
        .expect("msgpack writes into a Vec cannot fail");
}

/// The digest TensorRT-LLM publishes for the stand-in image starting at
/// `token`.
pub fn image_digest(token: u32) -> String {
    format!(
        "{:064x}",
        u64::from(token).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    )
}

fn write_event(event: &SimEvent, out: &mut Vec<u8>) -> WriteResult {
    match event {
        SimEvent::Stored {
            hashes,
            parent,
            tokens,
            block_size,
        } => {
            let blocks: Vec<&[u32]> = tokens.chunks((*block_size).max(1) as usize).collect();
            let images = blocks
                .iter()
                .any(|block| block.first().is_some_and(|&t| t % IMAGE_EVERY == 0));
            write_map_len(out, if images { 9 } else { 8 })?;
            write_str(out, "type")?;
            write_str(out, "BlockStored")?;
            write_hashes(out, hashes)?;
            write_str(out, "parent_block_hash")?;
            match parent {
                Some(parent) => write_uint(out, *parent).map(drop)?,
                None => write_null(out)?,
            }
            write_str(out, "token_ids")?;
            write_array_len(out, len_u32(tokens.len()))?;
            for block in &blocks {
                for (i, &token) in block.iter().enumerate() {
                    if i == 0 && token % IMAGE_EVERY == 0 {
                        write_str(out, &image_digest(token))?;
                    } else {
                        write_uint(out, token.into())?;
                    }
                }
            }
            write_str(out, "block_size")?;
            write_uint(out, (*block_size).into())?;
            write_str(out, "lora_id")?;
            write_null(out)?;
            write_str(out, "medium")?;
            write_str(out, "GPU")?;
            write_str(out, "lora_name")?;
            write_null(out)?;
            if images {
                write_str(out, "mm_keys")?;
                write_array_len(out, len_u32(blocks.len()))?;
                for block in &blocks {
                    match block.first() {
                        Some(&token) if token % IMAGE_EVERY == 0 => {
                            write_array_len(out, 1)?;
                            write_map_len(out, 3)?;
                            write_str(out, "type")?;
                            write_str(out, "mm_key")?;
                            write_str(out, "hash")?;
                            write_str(out, &image_digest(token))?;
                            write_str(out, "start_offset")?;
                            write_uint(out, 0)?;
                        }
                        _ => write_array_len(out, 0).map(drop)?,
                    }
                }
            }
            Ok(())
        }
        SimEvent::Removed { hashes } => {
            write_map_len(out, 3)?;
            write_str(out, "type")?;
            write_str(out, "BlockRemoved")?;
            write_hashes(out, hashes)?;
            write_str(out, "medium")?;
            write_str(out, "GPU")
        }
        SimEvent::Cleared => {
            write_map_len(out, 1)?;
            write_str(out, "type")?;
            write_str(out, "AllBlocksCleared")
        }
    }
}
