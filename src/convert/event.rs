//! Reading one engine event into a typed, borrowed view.
//!
//! Invariant: this file only decides whether an event *can be read*; the only
//! drops it produces are `Malformed` and `UnknownType`. What a readable event
//! means (tiers, groups, the store checks) is `normalize.rs`'s business.
//! Map events and tag-first array events are both reduced to one table of raw
//! field values first, so no rule below depends on the encoding. Any known
//! field that is present and not nil must have its type, or the whole event is
//! malformed; `extra_keys` entries are the one lenient exception (the contract
//! skips odd shapes one by one).

use super::hash::{fold_bytes, fold_int};
use super::msgpack::{self, Item, Reader};
use super::tally::DropReason;
use crate::proto::common::{KvBlockExtraKey, KvMultimodalKey, kv_block_extra_key::Key};

pub(crate) type Decoded<T> = Result<T, DropReason>;

impl From<msgpack::Error> for DropReason {
    // Events are read from spans the envelope scan already walked, so this only
    // fires on a bug; even then the event, not the payload, is what fails.
    fn from(_: msgpack::Error) -> Self {
        DropReason::Malformed
    }
}

/// The fields kvgate reads, under their engine names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    Locality,
    Ownership,
    SessionId,
    CacheSalt,
}

impl Field {
    const COUNT: usize = 15;

    fn from_key(key: &[u8]) -> Option<Field> {
        Some(match key {
            b"block_hashes" => Field::BlockHashes,
            b"parent_block_hash" => Field::ParentBlockHash,
            b"token_ids" => Field::TokenIds,
            b"block_size" => Field::BlockSize,
            b"lora_id" => Field::LoraId,
            b"medium" => Field::Medium,
            b"lora_name" => Field::LoraName,
            b"extra_keys" => Field::ExtraKeys,
            b"group_idx" => Field::GroupIdx,
            b"kv_cache_spec_kind" => Field::SpecKind,
            b"kv_cache_spec_sliding_window" => Field::SlidingWindow,
            b"locality" => Field::Locality,
            b"ownership" => Field::Ownership,
            b"session_id" => Field::SessionId,
            b"cache_salt" => Field::CacheSalt,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Type {
    Stored,
    Removed,
    Cleared,
}

impl Type {
    fn from_tag(tag: &[u8]) -> Option<Type> {
        match tag {
            b"BlockStored" => Some(Type::Stored),
            b"BlockRemoved" => Some(Type::Removed),
            b"AllBlocksCleared" => Some(Type::Cleared),
            _ => None,
        }
    }

    /// The fields after the tag in the array form, in declaration order. The
    /// array form ended with vLLM 0.23 (`engine-wire.md` section 3): older
    /// releases send a prefix of this, newer fields never came as arrays.
    fn array_layout(self) -> &'static [Field] {
        match self {
            Type::Stored => &[
                Field::BlockHashes,
                Field::ParentBlockHash,
                Field::TokenIds,
                Field::BlockSize,
                Field::LoraId,
                Field::Medium,
                Field::LoraName,
                Field::ExtraKeys,
                Field::GroupIdx,
                Field::SpecKind,
                Field::SlidingWindow,
            ],
            Type::Removed => &[Field::BlockHashes, Field::Medium, Field::GroupIdx],
            Type::Cleared => &[],
        }
    }
}

/// Raw encoded value of each field; `None` when the event does not carry it.
struct Fields<'a>([Option<&'a [u8]>; Field::COUNT]);

const NIL: &[u8] = &[0xc0];

impl<'a> Fields<'a> {
    fn read(raw: &'a [u8]) -> Decoded<(Type, Fields<'a>)> {
        let mut fields = Fields([None; Field::COUNT]);
        let mut r = Reader::new(raw);
        let ty = match r.item()? {
            Item::Map(len) => {
                let mut tag = None;
                for _ in 0..len {
                    let key = r.item()?;
                    r.skip_contents(key)?;
                    let value = r.value_bytes()?;
                    match key {
                        Item::Str(b"type") => tag = Some(value),
                        Item::Str(name) => {
                            if let Some(field) = Field::from_key(name) {
                                fields.0[field as usize] = Some(value);
                            }
                        }
                        _ => {}
                    }
                }
                let tag = tag.ok_or(DropReason::Malformed)?;
                match Reader::new(tag).item()? {
                    Item::Str(tag) => Type::from_tag(tag).ok_or(DropReason::UnknownType)?,
                    _ => return Err(DropReason::Malformed),
                }
            }
            Item::Array(len) if len > 0 => {
                let Item::Str(tag) = r.item()? else {
                    return Err(DropReason::Malformed);
                };
                let ty = Type::from_tag(tag).ok_or(DropReason::UnknownType)?;
                for &field in ty.array_layout().iter().take(len as usize - 1) {
                    fields.0[field as usize] = Some(r.value_bytes()?);
                }
                ty
            }
            _ => return Err(DropReason::Malformed),
        };
        Ok((ty, fields))
    }

    /// A reader on the field's value; `None` when absent or nil.
    fn reader(&self, field: Field) -> Option<Reader<'a>> {
        match self.0[field as usize] {
            None | Some(NIL) => None,
            Some(raw) => Some(Reader::new(raw)),
        }
    }

    fn item(&self, field: Field) -> Decoded<Option<Item<'a>>> {
        self.reader(field)
            .map(|mut r| r.item())
            .transpose()
            .map_err(Into::into)
    }

    /// The element count and a reader on the elements of an array field.
    fn array(&self, field: Field) -> Decoded<Option<(u32, Reader<'a>)>> {
        let Some(mut r) = self.reader(field) else {
            return Ok(None);
        };
        match r.item()? {
            Item::Array(len) => Ok(Some((len, r))),
            _ => Err(DropReason::Malformed),
        }
    }

    fn str(&self, field: Field) -> Decoded<Option<&'a str>> {
        match self.item(field)? {
            None => Ok(None),
            Some(Item::Str(bytes)) => utf8(bytes).map(Some).ok_or(DropReason::Malformed),
            Some(_) => Err(DropReason::Malformed),
        }
    }

    fn int<T: TryFrom<i128>>(&self, field: Field) -> Decoded<Option<T>> {
        match self.item(field)? {
            None => Ok(None),
            Some(Item::Int(v)) => T::try_from(v).map(Some).map_err(|_| DropReason::Malformed),
            Some(_) => Err(DropReason::Malformed),
        }
    }

    fn hash(&self, field: Field) -> Decoded<Option<i64>> {
        self.item(field)?.map(hash).transpose()
    }

    /// Appends the folded hashes of a required hash-list field to `out`.
    fn hashes(&self, field: Field, out: &mut Vec<i64>) -> Decoded<()> {
        let (len, mut r) = self.array(field)?.ok_or(DropReason::Malformed)?;
        // The count is backed by real bytes (one at least per hash).
        out.reserve(len as usize);
        for _ in 0..len {
            out.push(hash(r.item()?)?);
        }
        Ok(())
    }

    /// Replaces `out` with the token ids of a required token field, folding
    /// `[token, next]` cells to `token`.
    fn tokens(&self, field: Field, out: &mut Vec<u32>) -> Decoded<()> {
        let (len, mut r) = self.array(field)?.ok_or(DropReason::Malformed)?;
        out.clear();
        out.reserve(len as usize);
        // All cells must share the first cell's shape.
        let mut pairs = None;
        for _ in 0..len {
            let token = match (r.item()?, pairs) {
                (Item::Int(v), None | Some(false)) => {
                    pairs = Some(false);
                    token(Item::Int(v))?
                }
                (Item::Array(2), None | Some(true)) => {
                    pairs = Some(true);
                    let first = token(r.item()?)?;
                    token(r.item()?)?;
                    first
                }
                _ => return Err(DropReason::Malformed),
            };
            out.push(token);
        }
        Ok(())
    }
}

fn utf8(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes).ok()
}

fn hash(item: Item<'_>) -> Decoded<i64> {
    match item {
        Item::Int(v) => Ok(fold_int(v)),
        Item::Bin(bytes) => Ok(fold_bytes(bytes)),
        _ => Err(DropReason::Malformed),
    }
}

fn token(item: Item<'_>) -> Decoded<u32> {
    match item {
        Item::Int(v) => u32::try_from(v).map_err(|_| DropReason::Malformed),
        _ => Err(DropReason::Malformed),
    }
}

/// Where an event's blocks live and which cache group they belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Placement<'a> {
    pub medium: Option<&'a str>,
    pub group_idx: Option<u32>,
    pub spec_kind: Option<&'a str>,
    pub locality: Option<&'a str>,
    pub ownership: Option<&'a str>,
}

impl<'a> Placement<'a> {
    fn read(fields: &Fields<'a>) -> Decoded<Self> {
        Ok(Placement {
            medium: fields.str(Field::Medium)?,
            group_idx: fields.int(Field::GroupIdx)?,
            spec_kind: fields.str(Field::SpecKind)?,
            locality: fields.str(Field::Locality)?,
            ownership: fields.str(Field::Ownership)?,
        })
    }
}

/// A readable `BlockStored`. Hashes and tokens live in the converter's
/// scratch buffers (`'s`), strings in the payload (`'a`).
#[derive(Debug)]
pub(crate) struct Stored<'a, 's> {
    pub placement: Placement<'a>,
    pub hashes: &'s [i64],
    pub parent: Option<i64>,
    pub tokens: &'s [u32],
    /// Any readable integer: range checks are policy (`unaligned_blocks`).
    pub block_size: i128,
    pub lora_id: Option<i64>,
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    pub session_id: Option<&'a str>,
    pub sliding_window: Option<u32>,
    pub extra_keys: ExtraKeys<'a>,
}

#[derive(Debug)]
pub(crate) struct Removed<'a> {
    pub placement: Placement<'a>,
    pub hashes: Vec<i64>,
}

#[derive(Debug)]
pub(crate) enum Event<'a, 's> {
    Stored(Stored<'a, 's>),
    Removed(Removed<'a>),
    Cleared { ownership: Option<&'a str> },
}

/// Buffers reused from event to event, so a store costs no allocation
/// before it is known to be forwarded.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    hashes: Vec<i64>,
    tokens: Vec<u32>,
}

/// Reads one event from its complete encoded value.
pub(crate) fn decode<'a, 's>(raw: &'a [u8], scratch: &'s mut Scratch) -> Decoded<Event<'a, 's>> {
    let (ty, fields) = Fields::read(raw)?;
    Ok(match ty {
        Type::Stored => {
            scratch.hashes.clear();
            fields.hashes(Field::BlockHashes, &mut scratch.hashes)?;
            fields.tokens(Field::TokenIds, &mut scratch.tokens)?;
            Event::Stored(Stored {
                placement: Placement::read(&fields)?,
                hashes: &scratch.hashes,
                parent: fields.hash(Field::ParentBlockHash)?,
                tokens: &scratch.tokens,
                block_size: fields.int(Field::BlockSize)?.ok_or(DropReason::Malformed)?,
                lora_id: fields.int(Field::LoraId)?,
                lora_name: fields.str(Field::LoraName)?,
                cache_salt: fields.str(Field::CacheSalt)?,
                session_id: fields.str(Field::SessionId)?,
                sliding_window: fields.int(Field::SlidingWindow)?,
                extra_keys: ExtraKeys::read(&fields)?,
            })
        }
        Type::Removed => {
            let mut hashes = Vec::new();
            fields.hashes(Field::BlockHashes, &mut hashes)?;
            Event::Removed(Removed {
                placement: Placement::read(&fields)?,
                hashes,
            })
        }
        Type::Cleared => Event::Cleared {
            ownership: fields.str(Field::Ownership)?,
        },
    })
}

/// The per-block `extra_keys` lists of a store, handed out block by block.
#[derive(Debug, Clone)]
pub(crate) struct ExtraKeys<'a> {
    reader: Reader<'a>,
    blocks_left: u32,
}

impl<'a> ExtraKeys<'a> {
    fn read(fields: &Fields<'a>) -> Decoded<Self> {
        let (blocks_left, reader) = fields
            .array(Field::ExtraKeys)?
            .unwrap_or((0, Reader::new(&[])));
        Ok(ExtraKeys {
            reader,
            blocks_left,
        })
    }

    /// The next block's keys: str → text, int → number, bin → blob,
    /// `[str, int]` → multimodal; any other key, and any entry that is not a
    /// list (nil included), contributes nothing. Blocks past the end of the
    /// list have no keys.
    pub(crate) fn next_block(&mut self) -> Vec<KvBlockExtraKey> {
        if self.blocks_left == 0 {
            return Vec::new();
        }
        self.blocks_left -= 1;
        let Ok(entry) = self.reader.value_bytes() else {
            self.blocks_left = 0;
            return Vec::new();
        };
        let mut r = Reader::new(entry);
        match r.item() {
            Ok(Item::Array(len)) => (0..len)
                .map_while(|_| r.value_bytes().ok())
                .filter_map(extra_key)
                .collect(),
            _ => Vec::new(),
        }
    }
}

fn extra_key(raw: &[u8]) -> Option<KvBlockExtraKey> {
    let mut r = Reader::new(raw);
    let key = match r.item().ok()? {
        Item::Str(text) => Key::Text(utf8(text)?.to_owned()),
        Item::Int(number) => Key::Number(i64::try_from(number).ok()?),
        Item::Bin(blob) => Key::Blob(blob.to_vec()),
        Item::Array(2) => match (r.item().ok()?, r.item().ok()?) {
            (Item::Str(identifier), Item::Int(offset)) => Key::Multimodal(KvMultimodalKey {
                identifier: utf8(identifier)?.to_owned(),
                offset: i64::try_from(offset).ok()?,
            }),
            _ => return None,
        },
        _ => return None,
    };
    Some(KvBlockExtraKey { key: Some(key) })
}
