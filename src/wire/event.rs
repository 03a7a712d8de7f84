//! Protobuf encoding of events by hand where prost is slow.
//!
//! Invariant: what is written decodes (with prost, or any protobuf decoder)
//! to exactly the event given. Blocks are written here because prost's
//! generic varint writer pushes one byte at a time and block tokens are most
//! of every batch; everything else is prost's own encoding. Fields may come
//! in another order than prost's (protobuf allows any order).

use prost::Message;
use prost::encoding::{self, WireType};

use crate::proto::common::{KvBlock, KvBlockExtraKey, KvCacheEvent, kv_cache_event::Data};

/// `KvCacheEvent.event_id`, `.stored`, and `KvBlocksStored.blocks`.
const EVENT_ID_FIELD: u32 = 1;
pub(crate) const STORED_FIELD: u32 = 2;
pub(crate) const BLOCKS_FIELD: u32 = 1;

/// The fields of one `KvBlock`, wherever they live.
pub struct BlockFields<'a> {
    pub hash: i64,
    pub tokens: &'a [u32],
    pub block_size: i32,
    pub lora_id: Option<i64>,
    pub cache_level: Option<i32>,
    pub extra_keys: &'a [KvBlockExtraKey],
}

impl<'a> From<&'a KvBlock> for BlockFields<'a> {
    fn from(block: &'a KvBlock) -> Self {
        Self {
            hash: block.block_hash,
            tokens: &block.token_ids,
            block_size: block.block_size,
            lora_id: block.lora_id,
            cache_level: block.cache_level,
            extra_keys: &block.extra_keys,
        }
    }
}

impl BlockFields<'_> {
    pub fn encoded_len(&self) -> usize {
        let mut len = 0;
        if self.hash != 0 {
            len += encoding::int64::encoded_len(1, &self.hash);
        }
        if !self.tokens.is_empty() {
            let packed = packed_len(self.tokens);
            len += encoding::key_len(2) + encoding::encoded_len_varint(packed as u64) + packed;
        }
        if self.block_size != 0 {
            len += encoding::int32::encoded_len(3, &self.block_size);
        }
        if let Some(lora_id) = &self.lora_id {
            len += encoding::int64::encoded_len(4, lora_id);
        }
        if let Some(cache_level) = &self.cache_level {
            len += encoding::int32::encoded_len(5, cache_level);
        }
        len + encoding::message::encoded_len_repeated(6, self.extra_keys)
    }

    /// Writes the `KvBlock` body (prost's field order, so byte-identical).
    pub fn encode(&self, buf: &mut Vec<u8>) {
        if self.hash != 0 {
            encoding::int64::encode(1, &self.hash, buf);
        }
        if !self.tokens.is_empty() {
            encoding::encode_key(2, WireType::LengthDelimited, buf);
            encoding::encode_varint(packed_len(self.tokens) as u64, buf);
            encode_packed(self.tokens, buf);
        }
        if self.block_size != 0 {
            encoding::int32::encode(3, &self.block_size, buf);
        }
        if let Some(lora_id) = &self.lora_id {
            encoding::int64::encode(4, lora_id, buf);
        }
        if let Some(cache_level) = &self.cache_level {
            encoding::int32::encode(5, cache_level, buf);
        }
        encoding::message::encode_repeated(6, self.extra_keys, buf);
    }

    /// Writes the block as one `blocks` entry of a `KvBlocksStored`.
    pub fn encode_entry(&self, buf: &mut Vec<u8>) {
        encoding::encode_key(BLOCKS_FIELD, WireType::LengthDelimited, buf);
        encoding::encode_varint(self.encoded_len() as u64, buf);
        self.encode(buf);
    }
}

/// Writes the body of `event` into `out` (cleared first). The blocks of a
/// store are set aside while prost writes the store's other fields, so the
/// event is borrowed mutably but left as it was.
pub fn encode_event(event: &mut KvCacheEvent, out: &mut Vec<u8>, scratch: &mut Vec<u8>) {
    out.clear();
    if event.event_id != 0 {
        encoding::uint64::encode(EVENT_ID_FIELD, &event.event_id, out);
    }
    match event.data.as_mut() {
        Some(Data::Stored(stored)) if !stored.blocks.is_empty() => {
            let blocks = std::mem::take(&mut stored.blocks);
            scratch.clear();
            stored.encode_raw(scratch);
            for block in &blocks {
                BlockFields::from(block).encode_entry(scratch);
            }
            stored.blocks = blocks;
            encoding::encode_key(STORED_FIELD, WireType::LengthDelimited, out);
            encoding::encode_varint(scratch.len() as u64, out);
            out.extend_from_slice(scratch);
        }
        Some(data) => data.encode(out),
        None => {}
    }
}

/// Bytes of `tokens` as packed varints.
fn packed_len(tokens: &[u32]) -> usize {
    tokens
        .iter()
        // 1 byte per started 7 bits, as `encoded_len_varint` counts.
        .map(|&token| ((31 - (token | 1).leading_zeros()) * 9 + 73) as usize / 64)
        .sum()
}

/// Writes `tokens` as packed varints, each in one store.
fn encode_packed(tokens: &[u32], buf: &mut Vec<u8>) {
    buf.reserve(tokens.len() * 5);
    for &token in tokens {
        let low = token as u8;
        match token {
            0..0x80 => buf.push(low),
            0x80..0x4000 => buf.extend_from_slice(&[low | 0x80, (token >> 7) as u8]),
            0x4000..0x20_0000 => {
                buf.extend_from_slice(&[low | 0x80, (token >> 7) as u8 | 0x80, (token >> 14) as u8])
            }
            0x20_0000..0x1000_0000 => buf.extend_from_slice(&[
                low | 0x80,
                (token >> 7) as u8 | 0x80,
                (token >> 14) as u8 | 0x80,
                (token >> 21) as u8,
            ]),
            _ => buf.extend_from_slice(&[
                low | 0x80,
                (token >> 7) as u8 | 0x80,
                (token >> 14) as u8 | 0x80,
                (token >> 21) as u8 | 0x80,
                (token >> 28) as u8,
            ]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::{Converter, Tally};
    use crate::proto::common::{KvBlocksStored, kv_block_extra_key::Key};

    const EDGE_TOKENS: [u32; 11] = [
        0,
        127,
        128,
        16_383,
        16_384,
        300_000,
        0x1f_ffff,
        0x20_0000,
        0xfff_ffff,
        0x1000_0000,
        u32::MAX,
    ];

    fn roundtrip(mut event: KvCacheEvent) {
        let original = event.clone();
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        encode_event(&mut event, &mut out, &mut scratch);
        assert_eq!(event, original, "the event is left as it was");
        assert_eq!(KvCacheEvent::decode(out.as_slice()).unwrap(), original);
        assert_eq!(out.len(), original.encoded_len(), "same size as prost's");
    }

    #[test]
    fn a_block_encodes_byte_for_byte_as_prost_does() {
        let block = KvBlock {
            block_hash: -7,
            token_ids: EDGE_TOKENS.to_vec(),
            block_size: 11,
            lora_id: Some(-1),
            cache_level: Some(2),
            extra_keys: vec![KvBlockExtraKey {
                key: Some(Key::Text("img".into())),
            }],
        };
        let mut encoded = Vec::new();
        BlockFields::from(&block).encode(&mut encoded);
        assert_eq!(encoded, block.encode_to_vec());
        assert_eq!(BlockFields::from(&block).encoded_len(), encoded.len());
        let empty = KvBlock::default();
        let mut encoded = Vec::new();
        BlockFields::from(&empty).encode(&mut encoded);
        assert!(encoded.is_empty());
    }

    #[test]
    fn every_golden_event_decodes_back_to_itself() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/wire");
        let mut events = 0;
        let engines = std::fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().path());
        for engine in engines.filter(|path| path.is_dir()) {
            for file in std::fs::read_dir(engine).unwrap() {
                let path = file.unwrap().path();
                if path.extension().is_some_and(|ext| ext == "msgpack") {
                    let payload = std::fs::read(&path).unwrap();
                    if let Ok(converted) =
                        Converter::new().convert(0, &payload, &mut Tally::default())
                    {
                        for event in converted.events {
                            events += 1;
                            roundtrip(event);
                        }
                    }
                }
            }
        }
        assert!(events > 9000, "read {events} events");
    }

    #[test]
    fn a_store_with_every_field_and_edge_tokens_decodes_back_to_itself() {
        roundtrip(KvCacheEvent {
            event_id: u64::MAX,
            data: Some(Data::Stored(KvBlocksStored {
                blocks: vec![
                    KvBlock {
                        block_hash: i64::MIN,
                        token_ids: EDGE_TOKENS.to_vec(),
                        block_size: 11,
                        ..Default::default()
                    },
                    KvBlock::default(),
                ],
                parent_block_hash: Some(0),
                tier: Some(2),
                medium: Some("CPU".into()),
                group_idx: Some(0),
                lora_name: Some("a".into()),
                cache_salt: Some(String::new()),
                ..Default::default()
            })),
        });
        roundtrip(KvCacheEvent::default());
    }
}
