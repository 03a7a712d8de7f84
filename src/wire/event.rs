//! Protobuf encoding of events by hand where prost is slow.
//!
//! Invariant: what is written decodes (with prost, or any protobuf decoder)
//! to exactly the event given. Blocks are written here because prost's
//! generic varint writer pushes one byte at a time and block tokens are most
//! of every batch; a removal is written here whole, from the fields the
//! converter read, because a full engine sends one per evicted block and
//! building a `KvCacheEvent` for each cost more than the rest of its way.
//! Everything else is prost's own encoding. Fields may come in another
//! order than prost's (protobuf allows any order); blocks and removals are
//! byte for byte prost's.

use prost::Message;
use prost::encoding::{self, WireType};

use crate::proto::common::{
    KvBlock, KvBlockExtraKey, KvBlocksStored, KvCacheEvent, kv_cache_event::Data,
};

/// `KvCacheEvent.event_id`, `.stored`, `.removed`, and `KvBlocksStored.blocks`.
const EVENT_ID_FIELD: u32 = 1;
pub(crate) const STORED_FIELD: u32 = 2;
const REMOVED_FIELD: u32 = 3;
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
        len + Self::extra_keys_len(self.extra_keys)
    }

    /// What `extra_keys` add to a block's encoded length.
    fn extra_keys_len(extra_keys: &[KvBlockExtraKey]) -> usize {
        encoding::message::encoded_len_repeated(6, extra_keys)
    }

    /// Writes the `KvBlock` body (prost's field order, so byte-identical).
    pub fn encode(&self, buf: &mut Vec<u8>) {
        put_hash_field(self.hash, buf);
        self.encode_after_hash(buf);
    }

    /// Writes the `KvBlock` body's fields after its hash: an
    /// [`EncodedBlock`]'s `rest`.
    pub fn encode_after_hash(&self, buf: &mut Vec<u8>) {
        if !self.tokens.is_empty() {
            let width_guess = length_width_guess(self.tokens.len() * GUESSED_TOKEN_BYTES);
            write_delimited(2, width_guess, buf, |buf| encode_packed(self.tokens, buf));
        }
        // An `int32` is written sign-extended to 64 bits, as prost does.
        if self.block_size != 0 {
            put_varint_field(3, i64::from(self.block_size) as u64, buf);
        }
        if let Some(lora_id) = self.lora_id {
            put_varint_field(4, lora_id as u64, buf);
        }
        if let Some(cache_level) = self.cache_level {
            put_varint_field(5, i64::from(cache_level) as u64, buf);
        }
        encoding::message::encode_repeated(6, self.extra_keys, buf);
    }

    /// Writes the block as one `blocks` entry of a `KvBlocksStored`.
    pub fn encode_entry(&self, buf: &mut Vec<u8>) {
        // The hash and the other fields take about as much as 5 tokens.
        let width_guess = length_width_guess((self.tokens.len() + 5) * GUESSED_TOKEN_BYTES);
        write_delimited(BLOCKS_FIELD, width_guess, buf, |buf| self.encode(buf));
    }
}

/// A block as written, split at its hash: the hash as a number (what the
/// live state looks the block up by) and the bytes of its other fields as
/// [`BlockFields::encode_after_hash`] wrote them. The state keeps a block
/// this way, so a snapshot writes it with one copy of those bytes instead
/// of encoding its tokens again.
#[derive(Clone, Copy, Debug)]
pub struct EncodedBlock<'a> {
    /// `KvBlock.block_hash`.
    pub hash: i64,
    /// The body's bytes after the hash field (the whole body for hash 0,
    /// which is not written).
    pub rest: &'a [u8],
}

impl EncodedBlock<'_> {
    /// The length of the `KvBlock` body.
    pub fn encoded_len(&self) -> usize {
        Self::body_len(self.hash, self.rest.len())
    }

    /// The length of the `KvBlock` body of a block hashed `hash` whose
    /// `rest` takes `rest_len` bytes.
    pub fn body_len(hash: i64, rest_len: usize) -> usize {
        hash_field_len(hash) + rest_len
    }

    /// Writes the `KvBlock` body, byte for byte as [`BlockFields::encode`].
    pub fn encode(&self, buf: &mut Vec<u8>) {
        buf.reserve(1 + WIDEST_VARINT_BYTES + self.rest.len());
        put_hash_field(self.hash, buf);
        buf.extend_from_slice(self.rest);
    }

    /// Writes the block as one `blocks` entry of a `KvBlocksStored`, as
    /// [`BlockFields::encode_entry`] does; `len` is its
    /// [`Self::encoded_len`].
    pub fn encode_entry(&self, len: usize, buf: &mut Vec<u8>) {
        debug_assert_eq!(len, self.encoded_len());
        buf.push(one_byte_key(BLOCKS_FIELD, WireType::LengthDelimited));
        put_varint(len as u64, buf);
        self.encode(buf);
    }

    /// The block, decoded.
    #[cfg(test)]
    pub fn to_block(&self) -> KvBlock {
        let mut encoded = Vec::new();
        self.encode(&mut encoded);
        KvBlock::decode(encoded.as_slice()).expect("a block written here")
    }
}

/// The blocks of `entries`, a store's `blocks` entries end to end as
/// [`BlockFields::encode_entry`] wrote them for the blocks `hashes`, each
/// split at its hash. The bytes are this process's own, never a peer's.
pub fn split_entries<'a>(
    entries: &'a [u8],
    hashes: &'a [i64],
) -> impl ExactSizeIterator<Item = EncodedBlock<'a>> + 'a {
    let mut unread = entries;
    hashes.iter().map(move |&hash| {
        let key = unread[0];
        debug_assert_eq!(key, one_byte_key(BLOCKS_FIELD, WireType::LengthDelimited));
        unread = &unread[1..];
        let len = encoding::decode_varint(&mut unread).expect("an entry written here") as usize;
        let (body, after) = unread.split_at(len);
        unread = after;
        EncodedBlock {
            hash,
            rest: &body[hash_field_len(hash)..],
        }
    })
}

/// The bytes of a `KvBlock`'s hash field: none for hash 0, the default.
fn hash_field_len(hash: i64) -> usize {
    if hash == 0 {
        0
    } else {
        1 + encoding::encoded_len_varint(hash as u64)
    }
}

fn put_hash_field(hash: i64, buf: &mut Vec<u8>) {
    if hash != 0 {
        put_varint_field(1, hash as u64, buf);
    }
}

/// The fields of one `KvBlocksRemoved`, borrowed from wherever they live
/// (the engine's payload and the converter's scratch, on the hot path).
#[derive(Clone, Copy, Debug)]
pub struct RemovedFields<'a> {
    pub hashes: &'a [i64],
    pub cache_level: Option<i32>,
    pub tier: Option<i32>,
    pub medium: Option<&'a str>,
    pub group_idx: Option<u32>,
    pub locality: Option<i32>,
    pub ownership: Option<&'a str>,
}

impl RemovedFields<'_> {
    /// Appends the removal's fields after its hashes (`cache_level` to
    /// `ownership`) as prost writes them: the bytes every removal placed
    /// alike ends with, whatever its hashes.
    pub fn encode_placement(&self, out: &mut Vec<u8>) {
        // `int32` and enum values are written sign-extended, as prost does.
        if let Some(cache_level) = self.cache_level {
            put_varint_field(2, i64::from(cache_level) as u64, out);
        }
        if let Some(tier) = self.tier {
            put_varint_field(3, i64::from(tier) as u64, out);
        }
        if let Some(medium) = self.medium {
            put_str_field(4, medium, out);
        }
        if let Some(group_idx) = self.group_idx {
            put_varint_field(5, u64::from(group_idx), out);
        }
        if let Some(locality) = self.locality {
            put_varint_field(6, i64::from(locality) as u64, out);
        }
        if let Some(ownership) = self.ownership {
            put_str_field(7, ownership, out);
        }
    }
}

/// Appends the body of the `KvCacheEvent` numbered `event_id` that carries
/// the removal of `hashes` whose other fields `placement` holds as
/// [`RemovedFields::encode_placement`] wrote them, byte for byte as prost
/// writes that event. Its lengths are worked out first: a removal is a few
/// bytes, and it is written with no room left to guess at.
pub fn encode_removal_event(event_id: u64, hashes: &[i64], placement: &[u8], out: &mut Vec<u8>) {
    let packed: usize = hashes
        .iter()
        .map(|&hash| encoding::encoded_len_varint(hash as u64))
        .sum();
    let hashes_field = if hashes.is_empty() {
        0
    } else {
        1 + encoding::encoded_len_varint(packed as u64) + packed
    };
    let body = hashes_field + placement.len();
    out.reserve(2 * WIDEST_VARINT_BYTES + 2 + body);
    if event_id != 0 {
        put_varint_field(EVENT_ID_FIELD, event_id, out);
    }
    out.push(one_byte_key(REMOVED_FIELD, WireType::LengthDelimited));
    put_varint(body as u64, out);
    if !hashes.is_empty() {
        out.push(one_byte_key(1, WireType::LengthDelimited));
        put_varint(packed as u64, out);
        for &hash in hashes {
            put_varint(hash as u64, out);
        }
    }
    out.extend_from_slice(placement);
}

/// The widest varint: 10 bytes for 64 bits.
const WIDEST_VARINT_BYTES: usize = 10;

/// Writes the body of `event` into `out` (cleared first). The blocks of a
/// store are set aside while prost writes the store's other fields, so the
/// event is borrowed mutably but left as it was.
pub fn encode_event(event: &mut KvCacheEvent, out: &mut Vec<u8>) {
    out.clear();
    match event.data.as_mut() {
        Some(Data::Stored(stored)) if !stored.blocks.is_empty() => {
            let blocks = std::mem::take(&mut stored.blocks);
            let blocks_guess = blocks.len() * TYPICAL_ENTRY_BYTES;
            encode_store_event(event.event_id, stored, blocks_guess, out, |out| {
                for block in &blocks {
                    BlockFields::from(block).encode_entry(out);
                }
            });
            stored.blocks = blocks;
        }
        data => {
            if event.event_id != 0 {
                encoding::uint64::encode(EVENT_ID_FIELD, &event.event_id, out);
            }
            if let Some(data) = data {
                data.encode(out);
            }
        }
    }
}

/// Appends the body of the `KvCacheEvent` numbered `event_id` that carries
/// `stored`, whose blocks are not its own but written by `write_blocks` as
/// its `blocks` entries (about `blocks_guess` bytes): the store's other
/// fields first, then the blocks, as [`encode_event`] writes every store.
pub fn encode_store_event(
    event_id: u64,
    stored: &KvBlocksStored,
    blocks_guess: usize,
    out: &mut Vec<u8>,
    write_blocks: impl FnOnce(&mut Vec<u8>),
) {
    debug_assert!(stored.blocks.is_empty(), "the blocks are written apart");
    if event_id != 0 {
        put_varint_field(EVENT_ID_FIELD, event_id, out);
    }
    let width_guess = length_width_guess(blocks_guess + STORE_FIELDS_BYTES);
    write_delimited(STORED_FIELD, width_guess, out, |out| {
        stored.encode_raw(out);
        write_blocks(out);
    });
}

/// The width [`write_delimited`] leaves for the length of a body guessed at
/// `bytes`: a wrong guess costs only a move of the body.
fn length_width_guess(bytes: usize) -> usize {
    encoding::encoded_len_varint(bytes as u64)
}

/// What a packed token is guessed to take: 3 bytes, a vocabulary of up to
/// 2M ids (smaller ids only make the body shorter).
const GUESSED_TOKEN_BYTES: usize = 3;

/// About what one 16-token block's entry takes, to guess a store's length.
const TYPICAL_ENTRY_BYTES: usize = 64;

/// About what a store's fields besides its blocks take (tier, locality, a
/// parent, a short medium name), to guess its length.
const STORE_FIELDS_BYTES: usize = 24;

/// Writes field `field`, length-delimited, with the body `write` appends:
/// room for the length is left at `width_guess` bytes and the body is moved
/// only if its length needs another width, so no body is measured before it
/// is written. The length is a minimal varint, as prost writes it.
fn write_delimited(
    field: u32,
    width_guess: usize,
    buf: &mut Vec<u8>,
    write: impl FnOnce(&mut Vec<u8>),
) {
    buf.push(one_byte_key(field, WireType::LengthDelimited));
    let at = buf.len();
    buf.resize(at + width_guess, 0);
    write(buf);
    let body = buf.len() - at - width_guess;
    let width = encoding::encoded_len_varint(body as u64);
    if width != width_guess {
        buf.resize(buf.len().max(at + width + body), 0);
        buf.copy_within(at + width_guess..at + width_guess + body, at + width);
        buf.truncate(at + width + body);
    }
    let mut length = body as u64;
    for byte in &mut buf[at..at + width] {
        *byte = length as u8 | 0x80;
        length >>= 7;
    }
    buf[at + width - 1] &= 0x7f;
}

/// Writes a varint field of a `KvBlock` straight into the `Vec`. Not
/// prost's writer: that one goes through `BufMut`, a `memcpy` call per byte,
/// and each hash is 9 or 10 bytes.
fn put_varint_field(field: u32, value: u64, buf: &mut Vec<u8>) {
    buf.reserve(11);
    buf.push(one_byte_key(field, WireType::Varint));
    put_varint(value, buf);
}

/// The key of a field numbered below 16, the one byte prost writes for it.
fn one_byte_key(field: u32, wire_type: WireType) -> u8 {
    assert!(field < 16, "field {field} needs a longer key");
    (field << 3 | wire_type as u32) as u8
}

/// Writes a string field: its key, its length and its bytes.
fn put_str_field(field: u32, text: &str, buf: &mut Vec<u8>) {
    buf.push(one_byte_key(field, WireType::LengthDelimited));
    put_varint(text.len() as u64, buf);
    buf.extend_from_slice(text.as_bytes());
}

/// Writes `value` as a varint. One byte (a length, a block size) is pushed
/// as it is; a wider one (a hash: 9 or 10 bytes) is built without a branch
/// on its width, where a byte-per-turn loop mispredicts its exit once per
/// hash: the seven-bit groups are spread with shifts and masks, the
/// continuation bits cut to the width, and all 10 bytes copied at once and
/// cut back.
fn put_varint(value: u64, buf: &mut Vec<u8>) {
    if value < 0x80 {
        buf.push(value as u8);
        return;
    }
    let (low, high, width) = varint_of_u64(value);
    let mut staged = [0u8; WIDEST_VARINT_BYTES];
    staged[..8].copy_from_slice(&low.to_le_bytes());
    staged[8..].copy_from_slice(&high.to_le_bytes());
    let start = buf.len();
    buf.extend_from_slice(&staged);
    buf.truncate(start + width);
}

/// `value` as a varint: its first 8 bytes in a little-endian `u64`, the
/// other 2 (zero unless it is that wide) in a `u16`, and its width in
/// bytes (1 to 10), as [`varint_of`] gives a token's.
fn varint_of_u64(value: u64) -> (u64, u16, usize) {
    let low = (value & 0x7f)
        | (value & 0x3f80) << 1
        | (value & 0x1f_c000) << 2
        | (value & 0xfe0_0000) << 3
        | (value & 0x7_f000_0000) << 4
        | (value & 0x3f8_0000_0000) << 5
        | (value & 0x1_fc00_0000_0000) << 6
        | (value & 0xfe_0000_0000_0000) << 7;
    let top = (value >> 56) as u16;
    let high = (top & 0x7f) | (top & 0x80) << 1;
    // 1 byte per started 7 bits, as `encoded_len_varint` counts.
    let width = ((63 - (value | 1).leading_zeros()) * 9 + 73) as usize / 64;
    // Every byte but the last has its continuation bit: the first
    // `width - 1` of the low 8, and the 9th when there is a 10th.
    let continued = (width - 1).min(8) as u32;
    let low_continuation =
        0x8080_8080_8080_8080 & u64::MAX.checked_shr(64 - 8 * continued).unwrap_or(0);
    let high_continuation = u16::from(width == 10) << 7;
    (low | low_continuation, high | high_continuation, width)
}

/// Bytes of `tokens` as packed varints.
fn packed_len(tokens: &[u32]) -> usize {
    tokens.iter().map(|&token| varint_of(token).1).sum()
}

/// Writes `tokens` as packed varints. Token widths follow no pattern, so
/// each varint is built without a branch on its width and stored as 8 bytes
/// into a staging array, where the next one overwrites what it did not use;
/// the array goes into `buf` once per 16 tokens.
fn encode_packed(tokens: &[u32], buf: &mut Vec<u8>) {
    const TOKENS_STAGED: usize = 16;
    for chunk in tokens.chunks(TOKENS_STAGED) {
        let mut staged = [0u8; TOKENS_STAGED * 5 + 8];
        let mut len = 0;
        for &token in chunk {
            let (varint, width) = varint_of(token);
            staged[len..len + 8].copy_from_slice(&varint.to_le_bytes());
            len += width;
        }
        buf.extend_from_slice(&staged[..len]);
    }
}

/// `token` as a varint in the low bytes of a little-endian `u64`, and its
/// width in bytes (1 to 5).
fn varint_of(token: u32) -> (u64, usize) {
    let value = u64::from(token);
    let spread = (value & 0x7f)
        | (value & 0x3f80) << 1
        | (value & 0x1f_c000) << 2
        | (value & 0xfe0_0000) << 3
        | (value & 0xf000_0000) << 4;
    // 1 byte per started 7 bits, as `encoded_len_varint` counts.
    let width = ((31 - (token | 1).leading_zeros()) * 9 + 73) as usize / 64;
    // Every byte but the last has its continuation bit.
    let continuation = 0x80_8080_8080 & ((1u64 << (8 * (width - 1))) - 1);
    (spread | continuation, width)
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
        let mut out = Vec::new();
        encode_event(&mut event, &mut out);
        assert_eq!(event, original, "the event is left as it was");
        assert_eq!(KvCacheEvent::decode(out.as_slice()).unwrap(), original);
        assert_eq!(out.len(), original.encoded_len(), "same size as prost's");
    }

    #[test]
    fn a_block_encodes_byte_for_byte_as_prost_does() {
        let block = KvBlock {
            block_hash: -7,
            token_ids: EDGE_TOKENS.to_vec(),
            block_size: -11,
            lora_id: Some(-1),
            cache_level: Some(-2),
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
    fn blocks_split_at_their_hashes_from_a_store_s_entries_write_back_byte_for_byte() {
        let blocks: Vec<KvBlock> = [0, -1, 1, i64::MIN, i64::MAX]
            .into_iter()
            .enumerate()
            .map(|(at, block_hash)| KvBlock {
                block_hash,
                token_ids: EDGE_TOKENS[..at * 2].to_vec(),
                block_size: at as i32 - 1,
                lora_id: (at % 2 == 0).then_some(-1),
                cache_level: (at == 3).then_some(2),
                extra_keys: (at == 4)
                    .then(|| KvBlockExtraKey {
                        key: Some(Key::Text("img".into())),
                    })
                    .into_iter()
                    .collect(),
            })
            .collect();
        let mut entries = Vec::new();
        for block in &blocks {
            BlockFields::from(block).encode_entry(&mut entries);
        }
        let hashes: Vec<i64> = blocks.iter().map(|block| block.block_hash).collect();
        let split: Vec<EncodedBlock<'_>> = split_entries(&entries, &hashes).collect();
        assert_eq!(split.len(), blocks.len());
        for (block, split) in blocks.iter().zip(split) {
            let mut written = Vec::new();
            split.encode(&mut written);
            assert_eq!(written, block.encode_to_vec());
            assert_eq!(split.encoded_len(), written.len());
        }
    }

    #[test]
    fn every_varint_width_writes_as_prost_writes_it() {
        let mut values = vec![0, u64::MAX, i64::MIN as u64, -1_i64 as u64];
        for bit in 0..64 {
            values.extend([1u64 << bit, (1u64 << bit) - 1, (1u64 << bit) + 1]);
        }
        for value in values {
            let mut expected = Vec::new();
            encoding::encode_varint(value, &mut expected);
            let mut written = vec![7];
            put_varint(value, &mut written);
            assert_eq!(written[1..], expected, "{value:#x}");
            assert_eq!(written[0], 7, "what came before is left as it was");
        }
    }

    proptest::proptest! {
        /// Any value, shifted so every width is as likely as any other.
        #[test]
        fn any_varint_writes_as_prost_writes_it(bits: u64, shift in 0u32..64) {
            let value = bits >> shift;
            let mut expected = Vec::new();
            encoding::encode_varint(value, &mut expected);
            let mut written = Vec::new();
            put_varint(value, &mut written);
            proptest::prop_assert_eq!(written, expected);
        }
    }

    #[test]
    fn every_token_width_packs_as_prost_packs_it() {
        let mut tokens: Vec<u32> = EDGE_TOKENS.to_vec();
        tokens.extend((0..32).map(|bit| 1u32 << bit));
        tokens.extend((0..32).map(|bit| u32::MAX >> bit));
        for tokens in [&[][..], &tokens[..1], &tokens[..16], &tokens[..17], &tokens] {
            let mut expected = Vec::new();
            encoding::uint32::encode_packed(1, tokens, &mut expected);
            let mut packed = Vec::new();
            encode_packed(tokens, &mut packed);
            assert_eq!(packed.len(), packed_len(tokens));
            let mut field = Vec::new();
            if !tokens.is_empty() {
                encoding::encode_key(1, WireType::LengthDelimited, &mut field);
                encoding::encode_varint(packed.len() as u64, &mut field);
            }
            field.extend_from_slice(&packed);
            assert!(field == expected, "{} tokens", tokens.len());
        }
    }

    #[test]
    fn a_delimited_field_is_written_as_prost_writes_it_whatever_width_was_guessed() {
        for body_len in [0, 1, 127, 128, 16_383, 16_384, 2_097_152] {
            let body = vec![7u8; body_len];
            let mut expected = vec![9];
            encoding::bytes::encode(5, &body, &mut expected);
            for width_guess in 1..=4 {
                let mut written = vec![9];
                write_delimited(5, width_guess, &mut written, |buf| {
                    buf.extend_from_slice(&body)
                });
                assert!(
                    written == expected,
                    "{body_len} bytes, guessed {width_guess}"
                );
            }
        }
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
