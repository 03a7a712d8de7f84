//! Policy: a readable engine event becomes one proto event, or a counted drop.
//!
//! Invariant: the drop rules run in the contract's order (medium, locality,
//! ownership, cache group, then the store checks: placeholder, alignment,
//! self-reference), so an event breaking several rules is always counted
//! under the same reason; and every forwarded store or removal carries `tier`
//! and `locality`. Nothing here reads msgpack (that is `event.rs`), and
//! nothing here knows other events except through the per-rank group kinds.

use std::borrow::Cow;

use super::distinct_hashes::DistinctHashes;
use super::event::{DigestToken, Event, ExtraKeys, MmKeys, Placement, Stored};
use super::multimodal;
use super::spare_buffers::SpareBuffers;
use super::tally::{DropReason, EventKind};
use crate::proto::common::{
    KvBlock, KvBlockExtraKey, KvBlocksRemoved, KvBlocksStored, KvCacheCleared, KvCacheLocality,
    KvCacheTier, kv_block_extra_key::Key, kv_cache_event::Data,
};
use crate::wire::event::RemovedFields;

/// A forwarded event: built (a clear), or a store or a removal given by its
/// fields, which the caller builds or writes straight into bytes.
#[derive(Debug)]
pub(crate) enum Normalized<'e> {
    Built(Data),
    Stored(StoredFields<'e>),
    Removed(RemovedFields<'e>),
}

/// A store that passed every rule, its fields borrowed from the payload and
/// the converter's scratch: what the forwarded `KvBlocksStored` carries.
/// `tokens` holds `block_size` tokens per hash, in order.
#[derive(Debug)]
pub(crate) struct StoredFields<'e> {
    pub hashes: &'e [i64],
    pub tokens: &'e [u32],
    digest_tokens: &'e [DigestToken],
    /// Positive.
    pub block_size: i32,
    pub lora_id: Option<i64>,
    pub cache_level: Option<i32>,
    extra_keys: ExtraKeys<'e>,
    mm_keys: MmKeys<'e>,
    pub parent: Option<i64>,
    pub tier: KvCacheTier,
    placement: Placement<'e>,
    sliding_window: Option<u32>,
    session_id: Option<&'e str>,
    /// Not empty.
    lora_name: Option<&'e str>,
    /// Not empty; taken from block 0's extra keys when the event has none.
    cache_salt: Option<Cow<'e, str>>,
}

impl<'e> StoredFields<'e> {
    /// The store without its blocks, its texts in spare buffers.
    pub(crate) fn header(&self, spare_buffers: &mut SpareBuffers) -> KvBlocksStored {
        KvBlocksStored {
            blocks: Vec::new(),
            parent_block_hash: self.parent,
            tier: Some(self.tier.into()),
            medium: spare_buffers.text(self.placement.medium),
            group_idx: self.placement.group_idx,
            kv_cache_spec_kind: spare_buffers.text(self.placement.spec_kind),
            kv_cache_spec_sliding_window: self.sliding_window,
            locality: Some(KvCacheLocality::Local.into()),
            ownership: spare_buffers.text(self.placement.ownership),
            session_id: spare_buffers.text(self.session_id),
            lora_name: spare_buffers.text(self.lora_name),
            cache_salt: match &self.cache_salt {
                Some(Cow::Borrowed(salt)) => spare_buffers.text(Some(salt)),
                Some(Cow::Owned(salt)) => Some(salt.clone()),
                None => None,
            },
        }
    }

    /// Hands `each` every block's hash, tokens and extra keys (its
    /// `extra_keys`, then its multimodal keys from `mm_keys` and digest
    /// tokens), in order.
    pub(crate) fn for_each_block(
        mut self,
        mut each: impl FnMut(i64, &'e [u32], Vec<KvBlockExtraKey>),
    ) {
        let block_size = self.block_size as usize;
        let blocks = self.tokens.chunks_exact(block_size);
        // Decided once: almost every store has neither, and its blocks then
        // cost nothing more than their extra keys.
        let multimodal = !self.digest_tokens.is_empty() || !self.mm_keys.is_empty();
        let mut digests = self.digest_tokens;
        for (block, (&hash, tokens)) in self.hashes.iter().zip(blocks).enumerate() {
            let mut keys = self.extra_keys.next_block();
            if multimodal {
                let block_start = block * block_size;
                let in_block = digests
                    .iter()
                    .take_while(|digest| digest.index < block_start + block_size)
                    .count();
                let (here, later) = digests.split_at(in_block);
                digests = later;
                let mm_keys = self.mm_keys.next_block();
                multimodal::append_block_keys(&mut keys, &mm_keys, here, block_start);
            }
            each(hash, tokens, keys);
        }
    }
}

/// A removal as forwarded: its judged `fields` with its `hashes`.
pub(crate) fn forwarded_removal<'e>(
    fields: RemovedFields<'e>,
    hashes: &'e [i64],
) -> (EventKind, Normalized<'e>) {
    (
        EventKind::Removed,
        Normalized::Removed(RemovedFields { hashes, ..fields }),
    )
}

/// Medium names (compared ignoring ASCII case) and their tiers.
const MEDIUM_TIERS: [(&str, KvCacheTier); 13] = [
    ("GPU", KvCacheTier::Device),
    ("DEVICE", KvCacheTier::Device),
    ("CPU", KvCacheTier::Host),
    ("CPU_PINNED", KvCacheTier::Host),
    ("CPU_TIER1", KvCacheTier::Host),
    ("CPU_TIER2", KvCacheTier::Disk),
    ("DISK", KvCacheTier::Disk),
    ("NVME", KvCacheTier::Disk),
    ("STORAGE", KvCacheTier::Disk),
    ("EXTERNAL", KvCacheTier::External),
    ("NETWORK", KvCacheTier::External),
    ("REMOTE", KvCacheTier::External),
    ("SHARED", KvCacheTier::External),
];

/// Cache-group kinds whose blocks the router indexes.
const MAIN_ATTENTION_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

/// The tier a medium names; `None` for an unknown medium. No medium means
/// the engine's own device cache.
fn tier_for_medium(medium: Option<&str>) -> Option<KvCacheTier> {
    let Some(medium) = medium else {
        return Some(KvCacheTier::Device);
    };
    MEDIUM_TIERS
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(medium))
        .map(|&(_, tier)| tier)
}

/// The `cache_level` the router expects for a tier (unset on the device).
fn cache_level(tier: KvCacheTier) -> Option<i32> {
    match tier {
        KvCacheTier::Unspecified | KvCacheTier::Device => None,
        KvCacheTier::Host => Some(1),
        KvCacheTier::Disk => Some(2),
        KvCacheTier::External => Some(3),
    }
}

fn is_kvcr(ownership: &str) -> bool {
    ownership.eq_ignore_ascii_case("kvcr")
}

fn non_empty(s: Option<&str>) -> Option<&str> {
    s.filter(|s| !s.is_empty())
}

/// At most this many `(rank, group)` kinds are remembered: engines have a
/// handful of groups, and a stream of made-up group ids must not grow memory
/// without bound. Groups beyond it are judged by their own events' kinds only.
pub(crate) const MAX_REMEMBERED_GROUPS: usize = 1024;

/// Cross-event memory: which cache groups of each rank are main attention,
/// and the token buffers of sent blocks that new blocks refill.
#[derive(Debug, Default)]
pub(crate) struct Normalizer {
    /// `(rank, group_idx)` → whether that group is main attention. Group
    /// ids are the engine's, so the hash is seeded at random (foldhash:
    /// std's SipHash showed in the drain's profile).
    group_is_main: foldhash::HashMap<(u32, u32), bool>,
    /// What the payload being converted changed in `group_is_main`, with the
    /// values before, so a payload that fails can be undone.
    journal: Vec<((u32, u32), Option<bool>)>,
    /// Counts what may have changed `group_is_main` (a kind learned, a
    /// payload undone, a rank forgotten): a judgement made under one count
    /// holds while it stays the same (`removal_memo.rs`).
    groups_changed: u64,
    /// Reused to find repeated hashes without allocating per store.
    distinct_hashes: DistinctHashes,
    /// Token, hash and text buffers of sent events, for the next events.
    pub(crate) spare_buffers: SpareBuffers,
    /// What a store whose tokens do not fill its hashes' blocks exactly becomes.
    pub(crate) alignment: Alignment,
    /// What a kind-less event of a group never named with a kind is.
    pub(crate) unnamed_groups: UnnamedGroups,
}

/// What a kind-less event of a group no event named with a kind is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnnamedGroups {
    /// Main attention (the contract's rule for the stream).
    #[default]
    Main,
    /// Main attention only in group 0 (Dynamo's indexer reads events so).
    MainOnlyGroupZero,
}

/// What a store whose token count is not its hashes × its block size becomes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Alignment {
    /// Dropped as `unaligned_blocks` (the contract's rule for the stream).
    #[default]
    Exact,
    /// Its hashes paired with full blocks of tokens while both last, the rest
    /// ignored (Dynamo's indexer reads a store so); dropped only when not
    /// even one block is full.
    LeadingFullBlocks,
}

impl Normalizer {
    pub(crate) fn forget_rank(&mut self, rank: u32) {
        self.group_is_main.retain(|&(r, _), _| r != rank);
        self.groups_changed += 1;
    }

    /// Changes whenever the cache groups' kinds may have changed.
    pub(crate) fn groups_stamp(&self) -> u64 {
        self.groups_changed
    }

    /// Keeps what the current payload taught.
    pub(crate) fn commit(&mut self) {
        self.journal.clear();
    }

    /// Forgets what the current payload taught.
    pub(crate) fn roll_back(&mut self) {
        self.groups_changed += 1;
        for (group, before) in self.journal.drain(..).rev() {
            match before {
                Some(main) => self.group_is_main.insert(group, main),
                None => self.group_is_main.remove(&group),
            };
        }
    }

    pub(crate) fn normalize<'e>(
        &mut self,
        rank: u32,
        event: Event<'e, 'e>,
    ) -> Result<(EventKind, Normalized<'e>), DropReason> {
        match event {
            Event::Stored(stored) => {
                let tier = self.admit(rank, &stored.placement)?;
                self.stored(stored, tier)
                    .map(|fields| (EventKind::Stored, Normalized::Stored(fields)))
            }
            Event::Removed(removed) => self
                .removed(rank, &removed.placement)
                .map(|fields| forwarded_removal(fields, removed.hashes)),
            Event::Cleared { ownership } => {
                if ownership.is_some_and(is_kvcr) {
                    return Err(DropReason::UnsupportedOwnership);
                }
                let cleared = KvCacheCleared {
                    ownership: ownership.map(str::to_owned),
                };
                Ok((
                    EventKind::Cleared,
                    Normalized::Built(Data::Cleared(cleared)),
                ))
            }
        }
    }

    /// Judges a removal placed at `placement`: the fields it is forwarded
    /// with, its hashes left empty (they play no part), or why it is dropped.
    pub(crate) fn removed<'a>(
        &mut self,
        rank: u32,
        placement: &Placement<'a>,
    ) -> Result<RemovedFields<'a>, DropReason> {
        let tier = self.admit(rank, placement)?;
        Ok(RemovedFields {
            hashes: &[],
            cache_level: cache_level(tier),
            tier: Some(tier.into()),
            medium: placement.medium,
            group_idx: placement.group_idx,
            locality: Some(KvCacheLocality::Local.into()),
            ownership: placement.ownership,
        })
    }

    /// Learns the event's group kind, then applies the rules every store and
    /// removal shares; returns the tier to stamp.
    fn admit(&mut self, rank: u32, placement: &Placement<'_>) -> Result<KvCacheTier, DropReason> {
        // Learned before any rule can drop the event: a group's kind is a fact
        // about the engine, whatever happens to this particular event.
        let main = self.is_main(rank, placement.group_idx, placement.spec_kind);
        let tier = tier_for_medium(placement.medium).ok_or(DropReason::UnknownMedium)?;
        if placement
            .locality
            .is_some_and(|l| !l.eq_ignore_ascii_case("LOCAL"))
        {
            return Err(DropReason::NonLocalLocality);
        }
        if placement.ownership.is_some_and(is_kvcr) {
            return Err(DropReason::UnsupportedOwnership);
        }
        if !main {
            return Err(DropReason::NonMainAttentionGroup);
        }
        Ok(tier)
    }

    /// A kind names the event's own group (and is remembered for it); a
    /// kind-less event follows what its group was last seen as; a group never
    /// seen counts as `unnamed_groups` says, and no group at all as main
    /// attention.
    fn is_main(&mut self, rank: u32, group_idx: Option<u32>, kind: Option<&str>) -> bool {
        let kind_is_main = kind.map(|kind| {
            MAIN_ATTENTION_KINDS
                .iter()
                .any(|main| main.eq_ignore_ascii_case(kind))
        });
        match (group_idx, kind_is_main) {
            (Some(group), Some(main)) => {
                let key = (rank, group);
                let before = self.group_is_main.get(&key).copied();
                let room = before.is_some() || self.group_is_main.len() < MAX_REMEMBERED_GROUPS;
                if before != Some(main) && room {
                    self.group_is_main.insert(key, main);
                    self.journal.push((key, before));
                    self.groups_changed += 1;
                }
                main
            }
            (Some(group), None) => self.group_is_main.get(&(rank, group)).copied().unwrap_or(
                match self.unnamed_groups {
                    UnnamedGroups::Main => true,
                    UnnamedGroups::MainOnlyGroupZero => group == 0,
                },
            ),
            (None, kind_is_main) => kind_is_main.unwrap_or(true),
        }
    }

    /// Applies the store checks; the store's fields as they are forwarded.
    fn stored<'e>(
        &mut self,
        stored: Stored<'e, 'e>,
        tier: KvCacheTier,
    ) -> Result<StoredFields<'e>, DropReason> {
        let Stored {
            placement,
            hashes,
            parent,
            tokens,
            digest_tokens,
            block_size,
            lora_id,
            lora_name,
            cache_salt,
            session_id,
            sliding_window,
            extra_keys,
            mm_keys,
        } = stored;
        if hashes.is_empty() || tokens.is_empty() {
            return Err(DropReason::Placeholder);
        }
        let block_size = i32::try_from(block_size)
            .ok()
            .filter(|&size| size > 0)
            .ok_or(DropReason::UnalignedBlocks)?;
        let (hashes, tokens) = match self.alignment {
            _ if hashes.len().checked_mul(block_size as usize) == Some(tokens.len()) => {
                (hashes, tokens)
            }
            Alignment::Exact => return Err(DropReason::UnalignedBlocks),
            Alignment::LeadingFullBlocks => {
                let blocks = hashes.len().min(tokens.len() / block_size as usize);
                if blocks == 0 {
                    return Err(DropReason::UnalignedBlocks);
                }
                (&hashes[..blocks], &tokens[..blocks * block_size as usize])
            }
        };
        if !self.distinct_hashes.all_distinct(hashes, parent) {
            return Err(DropReason::SelfReferencingHashes);
        }
        let lora_name = non_empty(lora_name);
        let cache_salt = match non_empty(cache_salt) {
            Some(salt) => Some(Cow::Borrowed(salt)),
            None => {
                salt_from_extra_keys(extra_keys.clone().next_block(), lora_name).map(Cow::Owned)
            }
        };
        Ok(StoredFields {
            hashes,
            tokens,
            digest_tokens,
            block_size,
            lora_id,
            cache_level: cache_level(tier),
            extra_keys,
            mm_keys,
            parent,
            tier,
            placement,
            sliding_window,
            session_id,
            lora_name,
            cache_salt,
        })
    }

    /// Builds a store as a proto event, in spare buffers.
    pub(crate) fn stored_data(&mut self, stored: StoredFields<'_>) -> Data {
        let spare_buffers = &mut self.spare_buffers;
        let mut built = stored.header(spare_buffers);
        let (block_size, lora_id, cache_level) =
            (stored.block_size, stored.lora_id, stored.cache_level);
        built.blocks.reserve_exact(stored.hashes.len());
        stored.for_each_block(|block_hash, token_ids, extra_keys| {
            built.blocks.push(KvBlock {
                block_hash,
                token_ids: spare_buffers.tokens(token_ids),
                block_size,
                lora_id,
                cache_level,
                extra_keys,
            });
        });
        Data::Stored(built)
    }

    /// Builds a removal as a proto event, in spare buffers.
    pub(crate) fn removed_data(&mut self, removed: &RemovedFields<'_>) -> Data {
        let spare_buffers = &mut self.spare_buffers;
        Data::Removed(KvBlocksRemoved {
            block_hashes: spare_buffers.hashes(removed.hashes),
            cache_level: removed.cache_level,
            tier: removed.tier,
            medium: spare_buffers.text(removed.medium),
            group_idx: removed.group_idx,
            locality: removed.locality,
            ownership: spare_buffers.text(removed.ownership),
        })
    }
}

/// What a forwarded removal carries: its blocks' tier (and the matching
/// `cache_level`), local, and the engine's medium, group and owner.
/// vLLM puts the cache salt among block 0's extra keys, after the LoRA name;
/// it is the first text key there that is not that name.
fn salt_from_extra_keys(block_0: Vec<KvBlockExtraKey>, lora_name: Option<&str>) -> Option<String> {
    block_0.into_iter().find_map(|key| match key.key {
        Some(Key::Text(text)) if !text.is_empty() && Some(text.as_str()) != lora_name => Some(text),
        _ => None,
    })
}
