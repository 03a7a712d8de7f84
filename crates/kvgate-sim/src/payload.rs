//! vLLM 0.33 KV-event payloads, byte for byte.
//!
//! Invariant: [`encode_batch`] writes exactly what vLLM 0.33's
//! `ZmqEventPublisher` puts in frame 3 for a default engine (int block hashes,
//! GPU block pool, one full-attention KV-cache group, no LoRA, no multimodal
//! or salt keys): the msgspec key order, the smallest int encodings
//! (`cf` uint64 for hashes ≥ 2^63) and msgspec's `map16` header for
//! `BlockStored`. The fixture tests pin this against bytes a real engine sent.

use rmp::encode::{ValueWriteError, write_array_len, write_f64, write_nil, write_str, write_uint};

/// One KV-cache event as the vLLM block pool reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimEvent {
    /// Blocks a request newly filled, in chain order; `tokens` holds
    /// `hashes.len() * block_size` ids.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u32,
    },
    /// Evicted blocks (the block pool sends one hash per event).
    Removed { hashes: Vec<u64> },
    /// The whole prefix cache was reset.
    Cleared,
}

/// Appends the msgpack of `[ts, [events...], dp_rank]` to `out`.
pub fn encode_batch(ts: f64, events: &[SimEvent], dp_rank: Option<u32>, out: &mut Vec<u8>) {
    write_batch(ts, events, dp_rank, out).expect("msgpack writes into a Vec cannot fail");
}

pub(crate) type WriteResult = Result<(), ValueWriteError>;

fn write_batch(
    ts: f64,
    events: &[SimEvent],
    dp_rank: Option<u32>,
    out: &mut Vec<u8>,
) -> WriteResult {
    write_envelope(ts, events, dp_rank, out, write_event)
}

/// The positional envelope every engine shares, `[ts, [events...],
/// dp_rank]`, each event written by `write_event`.
pub(crate) fn write_envelope(
    ts: f64,
    events: &[SimEvent],
    dp_rank: Option<u32>,
    out: &mut Vec<u8>,
    write_event: fn(&SimEvent, &mut Vec<u8>) -> WriteResult,
) -> WriteResult {
    write_array_len(out, 3)?;
    write_f64(out, ts)?;
    write_array_len(out, len_u32(events.len()))?;
    for event in events {
        write_event(event, out)?;
    }
    write_opt_uint(out, dp_rank.map(u64::from))
}

fn write_event(event: &SimEvent, out: &mut Vec<u8>) -> WriteResult {
    match event {
        SimEvent::Stored {
            hashes,
            parent,
            tokens,
            block_size,
        } => {
            // msgspec sizes a struct's map header by its declared field count,
            // not by the keys it writes: BlockStored declares more than 15
            // fields, so even 11 keys get `map16`.
            out.extend_from_slice(&[0xde, 0x00, 11]);
            write_str(out, "type")?;
            write_str(out, "BlockStored")?;
            write_hashes(out, hashes)?;
            write_str(out, "parent_block_hash")?;
            write_opt_uint(out, *parent)?;
            write_str(out, "token_ids")?;
            write_array_len(out, len_u32(tokens.len()))?;
            for &token in tokens {
                write_uint(out, token.into())?;
            }
            write_str(out, "block_size")?;
            write_uint(out, (*block_size).into())?;
            write_str(out, "lora_id")?;
            write_null(out)?;
            write_medium(out)?;
            write_str(out, "lora_name")?;
            write_null(out)?;
            // The block pool attaches one (empty) extra-keys slot per block
            // even when no LoRA, multimodal input or salt went into the hash.
            write_str(out, "extra_keys")?;
            write_array_len(out, len_u32(hashes.len()))?;
            for _ in hashes {
                write_null(out)?;
            }
            write_group(out)?;
            write_str(out, "kv_cache_spec_kind")?;
            write_str(out, "full_attention")
        }
        SimEvent::Removed { hashes } => {
            write_map_header(out, 4)?;
            write_str(out, "type")?;
            write_str(out, "BlockRemoved")?;
            write_hashes(out, hashes)?;
            write_medium(out)?;
            write_group(out)
        }
        SimEvent::Cleared => {
            write_map_header(out, 1)?;
            write_str(out, "type")?;
            write_str(out, "AllBlocksCleared")
        }
    }
}

fn write_map_header(out: &mut Vec<u8>, len: u32) -> WriteResult {
    rmp::encode::write_map_len(out, len).map(drop)
}

pub(crate) fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) -> WriteResult {
    write_str(out, "block_hashes")?;
    write_array_len(out, len_u32(hashes.len()))?;
    for &hash in hashes {
        write_uint(out, hash)?;
    }
    Ok(())
}

fn write_medium(out: &mut Vec<u8>) -> WriteResult {
    write_str(out, "medium")?;
    write_str(out, "GPU")
}

fn write_group(out: &mut Vec<u8>) -> WriteResult {
    write_str(out, "group_idx")?;
    write_uint(out, 0).map(drop)
}

fn write_opt_uint(out: &mut Vec<u8>, value: Option<u64>) -> WriteResult {
    match value {
        Some(value) => write_uint(out, value).map(drop),
        None => write_null(out),
    }
}

pub(crate) fn write_null(out: &mut Vec<u8>) -> WriteResult {
    write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)
}

pub(crate) fn len_u32(len: usize) -> u32 {
    u32::try_from(len).expect("msgpack arrays hold at most 2^32 - 1 items")
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    fn hash(value: &Value) -> u64 {
        value
            .as_str()
            .expect("fixture hashes are decimal strings")
            .parse()
            .unwrap()
    }

    fn hashes(event: &Value) -> Vec<u64> {
        event["block_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(hash)
            .collect()
    }

    /// The fields the simulator models; the bytes comparison checks the rest.
    fn sim_event(event: &Value) -> SimEvent {
        match event["type"].as_str().unwrap() {
            "BlockStored" => SimEvent::Stored {
                hashes: hashes(event),
                parent: Some(&event["parent_block_hash"])
                    .filter(|parent| !parent.is_null())
                    .map(hash),
                tokens: event["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|token| u32::try_from(token.as_u64().unwrap()).unwrap())
                    .collect(),
                block_size: u32::try_from(event["block_size"].as_u64().unwrap()).unwrap(),
            },
            "BlockRemoved" => SimEvent::Removed {
                hashes: hashes(event),
            },
            "AllBlocksCleared" => SimEvent::Cleared,
            other => panic!("unexpected event type {other}"),
        }
    }

    #[test]
    fn batches_encode_to_the_exact_bytes_vllm_0_33_sent() {
        let fixtures = [
            "cleared",
            "removed",
            "stored-int-root",
            "stored-int-parent",
            "stored-u64-high",
            "dp-rank-3",
            "empty-events",
            "envelope-rank-nil",
        ];
        for name in fixtures {
            let json = std::fs::read(super::super::fixture(&format!("{name}.json"))).unwrap();
            let json: Value = serde_json::from_slice(&json).unwrap();
            let sent = std::fs::read(super::super::fixture(&format!("{name}.msgpack"))).unwrap();
            let input = &json["input"];
            let events: Vec<SimEvent> = input["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(sim_event)
                .collect();
            let dp_rank = input["dp_rank"]
                .as_u64()
                .map(|rank| u32::try_from(rank).unwrap());

            let mut encoded = Vec::new();
            encode_batch(
                input["ts"].as_f64().unwrap(),
                &events,
                dp_rank,
                &mut encoded,
            );

            assert_eq!(encoded, sent, "{name}");
        }
    }

    #[test]
    fn encoding_appends_to_what_the_buffer_already_holds() {
        let mut out = vec![0xaa];
        encode_batch(0.5, &[SimEvent::Cleared], Some(0), &mut out);
        let mut alone = Vec::new();
        encode_batch(0.5, &[SimEvent::Cleared], Some(0), &mut alone);
        assert_eq!(out[0], 0xaa);
        assert_eq!(out[1..], alone[..]);
    }
}
