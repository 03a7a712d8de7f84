//! Reading one engine event into a typed, borrowed view.
//!
//! Invariants: reading an event consumes exactly its encoded value from the
//! payload reader, whatever the value holds, so the next event starts in the
//! right place; the only error that escapes is a broken payload
//! (`msgpack::Error`). Whether the event is usable is decided afterwards and
//! only ever yields `Malformed` or `UnknownType`; what a readable event means
//! (tiers, groups, the store checks) is `normalize.rs`'s business.
//!
//! Map events and tag-first array events are both reduced to one table of
//! fields first, so no rule depends on the encoding. Scalar fields are kept
//! as their raw bytes and read on demand; hashes and tokens, the bulk of every
//! payload, are decoded straight into reused buffers on the single pass over
//! the payload. Any known field that is present and not nil must have its
//! type, or the event is malformed; `extra_keys` entries are the one lenient
//! exception (the contract skips odd shapes one by one).

use std::ops::Range;

use super::hash::{fold_bytes, fold_int};
use super::msgpack::{self, Item, Reader};
use super::tally::DropReason;
use crate::proto::common::{KvBlockExtraKey, KvMultimodalKey, kv_block_extra_key::Key};

pub(crate) type Decoded<T> = Result<T, DropReason>;

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
    MmKeys,
}

impl Field {
    const COUNT: usize = 16;

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
            b"mm_keys" => Field::MmKeys,
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

/// Whether a hash or token list was read into the scratch buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum List {
    /// Not in the event, or nil.
    Absent,
    Read,
    Unreadable,
}

impl List {
    /// The list the scratch buffer holds, if the event's list was readable.
    fn require<T>(self, values: &[T]) -> Decoded<&[T]> {
        match self {
            List::Read => Ok(values),
            List::Absent | List::Unreadable => Err(DropReason::Malformed),
        }
    }
}

/// Buffers reused from event to event, so hashes and tokens cost no
/// allocation while they are read and checked.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    hashes: Vec<i64>,
    tokens: Vec<u32>,
    digest_tokens: Vec<DigestToken>,
}

/// A string cell of a store's `token_ids`: TensorRT-LLM's KV-cache manager
/// V2 puts a multimodal item's content digest (hex) in place of the item's
/// first token. Its cell in the token list holds [`DIGEST_TOKEN`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DigestToken {
    /// The cell's index in the event's whole token list.
    pub index: usize,
    pub digest: String,
}

/// The token id a digest cell is forwarded as: no vocabulary and no
/// TensorRT-LLM continuation id (`vocab_size + k`) reaches it.
pub(crate) const DIGEST_TOKEN: u32 = u32::MAX;

/// One event as consumed from the payload, before any judgement.
struct RawEvent<'a> {
    ty: Decoded<Type>,
    fields: Fields<'a>,
    hashes: List,
    tokens: List,
    /// Where the hash list lies in the payload, while only one was read.
    hash_list: HashListsRead,
}

/// How many hash lists an event carried (a map may repeat its key; the
/// last one read counts), and where the only one lies.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HashListsRead {
    None,
    One(Range<usize>),
    More,
}

impl<'a> RawEvent<'a> {
    /// Nothing read yet.
    fn new() -> Self {
        RawEvent {
            ty: Err(DropReason::Malformed),
            fields: Fields([None; Field::COUNT]),
            hashes: List::Absent,
            tokens: List::Absent,
            hash_list: HashListsRead::None,
        }
    }

    /// Reads the event into `self`, which is new. In place, not returned:
    /// its fields are 15 slices, and moving them out through a `Result`
    /// was a copy per event (without it, the drain's evicting ingest was
    /// 3-5% faster, alternating Criterion runs).
    fn read(&mut self, r: &mut Reader<'a>, scratch: &mut Scratch) -> Result<(), msgpack::Error> {
        match r.item()? {
            Item::Map(len) => {
                for _ in 0..len {
                    match r.value_head()? {
                        Item::Str(b"type") => self.ty = type_of(r.value_head()?),
                        Item::Str(name) => match Field::from_key(name) {
                            Some(field) => self.read_field(field, r, scratch)?,
                            None => r.skip_values(1)?,
                        },
                        _ => r.skip_values(1)?,
                    }
                }
            }
            Item::Array(len) if len > 0 => {
                self.ty = type_of(r.value_head()?);
                let mut slots = len - 1;
                if let Ok(ty) = self.ty {
                    for &field in ty.array_layout().iter().take(slots as usize) {
                        self.read_field(field, r, scratch)?;
                        slots -= 1;
                    }
                }
                r.skip_values(slots.into())?;
            }
            other => r.skip_contents(other)?,
        }
        Ok(())
    }

    fn read_field(
        &mut self,
        field: Field,
        r: &mut Reader<'a>,
        scratch: &mut Scratch,
    ) -> Result<(), msgpack::Error> {
        match field {
            Field::BlockHashes => {
                let start = r.position();
                self.hashes = read_hashes(r, scratch)?;
                self.hash_list = match self.hash_list {
                    HashListsRead::None => HashListsRead::One(start..r.position()),
                    HashListsRead::One(_) | HashListsRead::More => HashListsRead::More,
                };
            }
            Field::TokenIds if r.u32_array(&mut scratch.tokens).is_some() => {
                scratch.digest_tokens.clear();
                self.tokens = List::Read;
            }
            Field::TokenIds => {
                // All cells must share the first cell's shape.
                let mut pairs = None;
                let mut index = 0;
                let digests = &mut scratch.digest_tokens;
                digests.clear();
                self.tokens = read_list(r, &mut scratch.tokens, |r, cell| {
                    index += 1;
                    token_cell(r, cell, &mut pairs, |digest| {
                        digests.push(DigestToken {
                            index: index - 1,
                            digest: digest.to_owned(),
                        })
                    })
                })?;
            }
            _ => self.fields.0[field as usize] = Some(r.value_bytes()?),
        }
        Ok(())
    }
}

/// Reads a `block_hashes` value into the scratch's hash buffer.
fn read_hashes(r: &mut Reader<'_>, scratch: &mut Scratch) -> Result<List, msgpack::Error> {
    read_list(r, &mut scratch.hashes, |r, cell| {
        r.skip_contents(cell)?;
        Ok(hash(cell))
    })
}

/// Reads a `block_hashes` value as [`read`] reads it in an event, into
/// `scratch`: the hashes when the value is a list of them; `None` for
/// anything else (nil, another type, a cell that is no hash), which the
/// reader may have been moved past.
pub(crate) fn read_hash_list<'s>(
    r: &mut Reader<'_>,
    scratch: &'s mut Scratch,
) -> Result<Option<&'s [i64]>, msgpack::Error> {
    Ok(match read_hashes(r, scratch)? {
        List::Read => Some(&scratch.hashes),
        List::Absent | List::Unreadable => None,
    })
}

fn type_of(tag: Item<'_>) -> Decoded<Type> {
    match tag {
        Item::Str(tag) => Type::from_tag(tag).ok_or(DropReason::UnknownType),
        _ => Err(DropReason::Malformed),
    }
}

/// Reads a list into `out` with `cell`, which gets each element's head and
/// must consume the rest of it. Consumes the whole value in every case.
fn read_list<'a, T>(
    r: &mut Reader<'a>,
    out: &mut Vec<T>,
    mut cell: impl FnMut(&mut Reader<'a>, Item<'a>) -> Result<Option<T>, msgpack::Error>,
) -> Result<List, msgpack::Error> {
    out.clear();
    let len = match r.item()? {
        Item::Nil => return Ok(List::Absent),
        Item::Array(len) => len,
        other => {
            r.skip_contents(other)?;
            return Ok(List::Unreadable);
        }
    };
    out.reserve(r.room_for(len, 1));
    let mut list = List::Read;
    for _ in 0..len {
        let head = r.item()?;
        match cell(r, head)? {
            Some(value) if list == List::Read => out.push(value),
            Some(_) => {}
            None => list = List::Unreadable,
        }
    }
    Ok(list)
}

/// A token cell: a u32, or a `[token, next]` pair (speculative decoding)
/// folded to `token`, or a digest string (a multimodal item's first token,
/// handed to `digest` and read as [`DIGEST_TOKEN`]), which shares the plain
/// cells' shape; `pairs` holds the shape of the list's first cell.
fn token_cell<'a>(
    r: &mut Reader<'a>,
    cell: Item<'a>,
    pairs: &mut Option<bool>,
    digest: impl FnOnce(&str),
) -> Result<Option<u32>, msgpack::Error> {
    Ok(match (cell, *pairs) {
        (Item::Int(_), None | Some(false)) => {
            *pairs = Some(false);
            token(cell)
        }
        (Item::Str(text), None | Some(false)) => {
            *pairs = Some(false);
            utf8(text).map(|text| {
                digest(text);
                DIGEST_TOKEN
            })
        }
        (Item::Array(2), None | Some(true)) => {
            *pairs = Some(true);
            let first = r.value_head()?;
            let next = r.value_head()?;
            token(first).filter(|_| token(next).is_some())
        }
        _ => {
            r.skip_contents(cell)?;
            None
        }
    })
}

fn utf8(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes).ok()
}

fn hash(item: Item<'_>) -> Option<i64> {
    match item {
        Item::Int(v) => Some(fold_int(v)),
        Item::Bin(bytes) => Some(fold_bytes(bytes)),
        _ => None,
    }
}

fn token(item: Item<'_>) -> Option<u32> {
    match item {
        Item::Int(v) => u32::try_from(v).ok(),
        _ => None,
    }
}

/// Raw encoded value of each scalar field (and `extra_keys`); `None` when
/// the event does not carry it.
struct Fields<'a>([Option<&'a [u8]>; Field::COUNT]);

const NIL: &[u8] = &[0xc0];

impl<'a> Fields<'a> {
    /// A reader on the field's value; `None` when absent or nil.
    fn reader(&self, field: Field) -> Option<Reader<'a>> {
        match self.0[field as usize] {
            None | Some(NIL) => None,
            Some(raw) => Some(Reader::new(raw)),
        }
    }

    /// The field's first item. Fields hold complete values, so reading one
    /// cannot fail; were it to, the event would be malformed, not the payload.
    fn item(&self, field: Field) -> Decoded<Option<Item<'a>>> {
        self.reader(field)
            .map(|mut r| r.item())
            .transpose()
            .map_err(|_| DropReason::Malformed)
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
        self.item(field)?
            .map(|item| hash(item).ok_or(DropReason::Malformed))
            .transpose()
    }
}

/// Where an event's blocks live and which cache group they belong to.
#[derive(Debug, Clone, Copy)]
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
    /// The digest cells among `tokens`, in order.
    pub digest_tokens: &'s [DigestToken],
    /// Any readable integer: range checks are policy (`unaligned_blocks`).
    pub block_size: i128,
    pub lora_id: Option<i64>,
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    pub session_id: Option<&'a str>,
    pub sliding_window: Option<u32>,
    pub extra_keys: ExtraKeys<'a>,
    pub mm_keys: MmKeys<'a>,
}

#[derive(Debug)]
pub(crate) struct Removed<'a, 's> {
    pub placement: Placement<'a>,
    pub hashes: &'s [i64],
}

#[derive(Debug)]
pub(crate) enum Event<'a, 's> {
    Stored(Stored<'a, 's>),
    Removed(Removed<'a, 's>),
    Cleared { ownership: Option<&'a str> },
}

/// One event as read: what it is, and where a removal's hash list lies.
pub(crate) struct ReadEvent<'a, 's> {
    /// The event, or why it is dropped.
    pub event: Decoded<Event<'a, 's>>,
    /// For a `BlockRemoved` with one `block_hashes` value that is a list of
    /// hashes (whether or not the rest of it is readable): where that value
    /// lies in the payload. Reading is a function of the event's bytes
    /// alone, so an event whose bytes match these around its own hash list
    /// reads as this one with its own hashes.
    pub removal_hash_list: Option<Range<usize>>,
}

/// Reads one event from the payload, consuming exactly its value: the outer
/// error is a broken payload, the inner one a dropped event.
pub(crate) fn read<'a, 's>(
    r: &mut Reader<'a>,
    scratch: &'s mut Scratch,
) -> Result<ReadEvent<'a, 's>, msgpack::Error> {
    let mut raw = RawEvent::new();
    raw.read(r, scratch)?;
    let RawEvent {
        ty,
        fields,
        hashes,
        tokens,
        hash_list,
    } = &raw;
    let removal_hash_list = match (ty, hashes, hash_list) {
        (Ok(Type::Removed), List::Read, HashListsRead::One(at)) => Some(at.clone()),
        _ => None,
    };
    let scratch: &'s Scratch = scratch;
    let event = ty.and_then(|ty| {
        Ok(match ty {
            Type::Stored => Event::Stored(Stored {
                placement: Placement::read(fields)?,
                hashes: hashes.require(&scratch.hashes)?,
                parent: fields.hash(Field::ParentBlockHash)?,
                tokens: tokens.require(&scratch.tokens)?,
                digest_tokens: &scratch.digest_tokens,
                block_size: fields.int(Field::BlockSize)?.ok_or(DropReason::Malformed)?,
                lora_id: fields.int(Field::LoraId)?,
                lora_name: fields.str(Field::LoraName)?,
                cache_salt: fields.str(Field::CacheSalt)?,
                session_id: fields.str(Field::SessionId)?,
                sliding_window: fields.int(Field::SlidingWindow)?,
                extra_keys: ExtraKeys::read(fields)?,
                mm_keys: MmKeys::read(fields)?,
            }),
            Type::Removed => Event::Removed(Removed {
                placement: Placement::read(fields)?,
                hashes: hashes.require(&scratch.hashes)?,
            }),
            Type::Cleared => Event::Cleared {
                ownership: fields.str(Field::Ownership)?,
            },
        })
    });
    Ok(ReadEvent {
        event,
        removal_hash_list,
    })
}

/// A store field holding one list (or nil) per block, aligned with
/// `block_hashes` (`extra_keys`, `mm_keys`), handed out block by block.
#[derive(Debug, Clone)]
struct BlockLists<'a> {
    reader: Reader<'a>,
    blocks_left: u32,
}

impl<'a> BlockLists<'a> {
    /// Absent or nil: no block has entries; another value than a list
    /// makes the event malformed.
    fn read(fields: &Fields<'a>, field: Field) -> Decoded<Self> {
        let Some(mut reader) = fields.reader(field) else {
            return Ok(BlockLists {
                reader: Reader::new(&[]),
                blocks_left: 0,
            });
        };
        match reader.item() {
            Ok(Item::Array(blocks_left)) => Ok(BlockLists {
                reader,
                blocks_left,
            }),
            _ => Err(DropReason::Malformed),
        }
    }

    /// The next block's entries that `entry` reads; a block whose value is
    /// not a list (nil included), and blocks past the end, have none.
    fn next_block<T>(&mut self, entry: impl FnMut(&'a [u8]) -> Option<T>) -> Vec<T> {
        if self.blocks_left == 0 {
            return Vec::new();
        }
        self.blocks_left -= 1;
        // vLLM's block pool gives every block a slot, nil when nothing
        // went into its hash beside the tokens: most blocks' entry.
        if self.reader.eat(NIL) {
            return Vec::new();
        }
        let Ok(value) = self.reader.value_bytes() else {
            self.blocks_left = 0;
            return Vec::new();
        };
        let mut r = Reader::new(value);
        match r.item() {
            Ok(Item::Array(len)) => (0..len)
                .map_while(|_| r.value_bytes().ok())
                .filter_map(entry)
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// The per-block `extra_keys` lists of a store, handed out block by block.
#[derive(Debug, Clone)]
pub(crate) struct ExtraKeys<'a>(BlockLists<'a>);

impl<'a> ExtraKeys<'a> {
    fn read(fields: &Fields<'a>) -> Decoded<Self> {
        BlockLists::read(fields, Field::ExtraKeys).map(ExtraKeys)
    }

    /// The next block's keys: str → text, int → number, bin → blob,
    /// `[str, int]` → multimodal; any other key contributes nothing.
    pub(crate) fn next_block(&mut self) -> Vec<KvBlockExtraKey> {
        self.0.next_block(extra_key)
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

/// One `mm_keys` entry of TensorRT-LLM's native stream: a multimodal item
/// some of whose tokens lie in the block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MmKey {
    /// Hex of the item's content digest.
    pub hash: String,
    /// How far into the item the block starts: 0 when the item starts
    /// inside the block (TensorRT-LLM's `mmStartInBlock`).
    pub start_offset: i64,
}

/// The per-block `mm_keys` lists of a store (TensorRT-LLM), handed out
/// block by block as [`ExtraKeys`] are.
#[derive(Debug, Clone)]
pub(crate) struct MmKeys<'a>(BlockLists<'a>);

impl<'a> MmKeys<'a> {
    fn read(fields: &Fields<'a>) -> Decoded<Self> {
        BlockLists::read(fields, Field::MmKeys).map(MmKeys)
    }

    /// The next block's keys; an entry that is not a map with a str `hash`
    /// and an int `start_offset` of at least 0 is skipped.
    pub(crate) fn next_block(&mut self) -> Vec<MmKey> {
        self.0.next_block(mm_key)
    }

    /// No block has keys left (the store has no `mm_keys`, or an empty one).
    pub(crate) fn is_empty(&self) -> bool {
        self.0.blocks_left == 0
    }
}

fn mm_key(raw: &[u8]) -> Option<MmKey> {
    let mut r = Reader::new(raw);
    let Ok(Item::Map(len)) = r.item() else {
        return None;
    };
    let (mut hash, mut start_offset) = (None, None);
    for _ in 0..len {
        match (r.value_head().ok()?, r.item().ok()?) {
            (Item::Str(b"hash"), Item::Str(text)) => hash = Some(utf8(text)?),
            (Item::Str(b"start_offset"), Item::Int(offset)) => {
                start_offset = Some(i64::try_from(offset).ok().filter(|&o| o >= 0)?)
            }
            (_, value) => r.skip_contents(value).ok()?,
        }
    }
    Some(MmKey {
        hash: hash?.to_owned(),
        start_offset: start_offset?,
    })
}
