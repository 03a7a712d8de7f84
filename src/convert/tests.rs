//! The converter against contract section 2, one rule per test, on payloads
//! built here byte by byte (the golden fixtures are in `tests/golden.rs`).
//! One file over 500 lines on purpose: the rules read in the contract's
//! order, and the payload builders at the top serve every one of them.

use proptest::prelude::*;

use super::hash::fold_bytes;
use super::*;
use crate::proto::common::{
    KvBlock, KvBlockExtraKey, KvBlocksRemoved, KvBlocksStored, KvCacheCleared, KvCacheLocality,
    KvCacheTier, KvMultimodalKey, kv_block_extra_key::Key, kv_cache_event::Data,
};

/// A msgpack value, for building test payloads only.
#[derive(Debug, Clone)]
enum V {
    Nil,
    Bool(bool),
    U(u64),
    I(i64),
    F(f64),
    S(String),
    /// A str whose bytes need not be UTF-8.
    RawStr(Vec<u8>),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
}

fn s(text: &str) -> V {
    V::S(text.to_owned())
}

fn a(items: impl IntoIterator<Item = V>) -> V {
    V::A(items.into_iter().collect())
}

fn m(entries: &[(&str, V)]) -> V {
    V::M(entries.iter().map(|(k, v)| (s(k), v.clone())).collect())
}

fn ints(values: impl IntoIterator<Item = u64>) -> V {
    a(values.into_iter().map(V::U))
}

impl V {
    fn encode(&self, out: &mut Vec<u8>) {
        use rmp::encode::*;
        match self {
            V::Nil => write_nil(out).unwrap(),
            V::Bool(b) => write_bool(out, *b).unwrap(),
            V::U(v) => drop(write_uint(out, *v).unwrap()),
            V::I(v) => drop(write_sint(out, *v).unwrap()),
            V::F(v) => write_f64(out, *v).unwrap(),
            V::S(text) => write_str(out, text).unwrap(),
            V::RawStr(bytes) => {
                write_str_len(out, bytes.len() as u32).unwrap();
                out.extend(bytes);
            }
            V::B(bytes) => write_bin(out, bytes).unwrap(),
            V::A(items) => {
                write_array_len(out, items.len() as u32).unwrap();
                items.iter().for_each(|item| item.encode(out));
            }
            V::M(entries) => {
                write_map_len(out, entries.len() as u32).unwrap();
                for (k, v) in entries {
                    k.encode(out);
                    v.encode(out);
                }
            }
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }
}

/// `[ts, events, 0]`.
fn batch(events: Vec<V>) -> Vec<u8> {
    a([V::F(1.5), V::A(events), V::U(0)]).bytes()
}

/// A map event from `base` fields, with `extra` ones replacing same-named ones.
fn with_fields<'k>(mut fields: Vec<(&'k str, V)>, extra: &[(&'k str, V)]) -> V {
    for (key, value) in extra {
        fields.retain(|(k, _)| k != key);
        fields.push((key, value.clone()));
    }
    m(&fields)
}

/// A valid map-tagged store of `hashes.len()` blocks of 2 tokens.
fn stored(hashes: &[u64], extra: &[(&str, V)]) -> V {
    let tokens = (0..2 * hashes.len() as u64).map(|t| t + 100);
    let base = vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(hashes.iter().copied())),
        ("parent_block_hash", V::Nil),
        ("token_ids", ints(tokens)),
        ("block_size", V::U(2)),
        ("lora_id", V::Nil),
    ];
    with_fields(base, extra)
}

fn removed(hashes: &[u64], extra: &[(&str, V)]) -> V {
    let base = vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", ints(hashes.iter().copied())),
    ];
    with_fields(base, extra)
}

fn convert_with(
    converter: &mut Converter,
    rank: u32,
    events: Vec<V>,
) -> (Vec<KvCacheEvent>, Tally) {
    let mut tally = Tally::default();
    let out = converter
        .convert(rank, &batch(events), &mut tally)
        .expect("payload decodes");
    (out.events, tally)
}

fn convert(events: Vec<V>) -> (Vec<KvCacheEvent>, Tally) {
    convert_with(&mut Converter::new(), 0, events)
}

/// The single event's data, asserting it was forwarded.
fn forwarded(event: V) -> Data {
    let (events, tally) = convert(vec![event]);
    assert_eq!(tally.total_dropped(), 0, "{tally:?}");
    let [
        KvCacheEvent {
            event_id: 1,
            data: Some(data),
        },
    ] = <[_; 1]>::try_from(events).unwrap()
    else {
        panic!("expected one event with id 1");
    };
    data
}

fn forwarded_store(event: V) -> KvBlocksStored {
    match forwarded(event) {
        Data::Stored(stored) => stored,
        other => panic!("expected a store, got {other:?}"),
    }
}

fn forwarded_removal(event: V) -> KvBlocksRemoved {
    match forwarded(event) {
        Data::Removed(removed) => removed,
        other => panic!("expected a removal, got {other:?}"),
    }
}

/// Asserts the single event is dropped for `reason`.
fn assert_dropped(event: V, reason: DropReason) {
    let (events, tally) = convert(vec![event.clone()]);
    assert!(events.is_empty(), "{event:?} was forwarded: {events:?}");
    assert_eq!(
        tally.dropped(reason),
        1,
        "{event:?} → {tally:?}, expected {reason:?}"
    );
    assert_eq!(tally.total_dropped(), 1);
}

// ---- envelope ----

#[test]
fn a_converter_can_move_to_another_thread() {
    fn send<T: Send>(_: T) {}
    send(Converter::new());
}

#[test]
fn a_three_slot_envelope_gives_timestamp_rank_and_events() {
    let payload = a([
        V::F(1767225600.25),
        V::A(vec![m(&[("type", s("AllBlocksCleared"))])]),
        V::U(3),
    ]);
    let mut tally = Tally::default();
    let out = Converter::new()
        .convert(0, &payload.bytes(), &mut tally)
        .unwrap();
    assert_eq!(out.timestamp, 1767225600.25);
    assert_eq!(out.dp_rank, Some(3));
    assert_eq!(
        out.events,
        [KvCacheEvent {
            event_id: 1,
            data: Some(Data::Cleared(KvCacheCleared { ownership: None }))
        }]
    );
    assert_eq!(tally.forwarded(EventKind::Cleared), 1);
}

#[test]
fn two_slots_a_nil_rank_extra_slots_and_an_int_timestamp_are_accepted() {
    let cases = [
        (a([V::F(2.0), V::A(vec![])]), None),
        (a([V::F(2.0), V::A(vec![]), V::Nil]), None),
        (
            a([
                V::U(2),
                V::A(vec![]),
                V::U(7),
                s("extra"),
                m(&[("more", ints([1, 2]))]),
            ]),
            Some(7),
        ),
        (
            a([V::I(2), V::A(vec![]), V::U(u32::MAX.into())]),
            Some(u32::MAX),
        ),
    ];
    for (payload, rank) in cases {
        let out = Converter::new()
            .convert(0, &payload.bytes(), &mut Tally::default())
            .unwrap();
        assert_eq!((out.timestamp, out.dp_rank), (2.0, rank), "{payload:?}");
    }
}

#[test]
fn bytes_after_the_envelope_are_ignored() {
    let mut payload = batch(vec![m(&[("type", s("AllBlocksCleared"))])]);
    payload.extend([0xc1, 0xff, 0x00]);
    let out = Converter::new()
        .convert(0, &payload, &mut Tally::default())
        .unwrap();
    assert_eq!(out.events.len(), 1);
}

#[test]
fn a_payload_that_is_not_a_batch_is_an_error_with_a_reason() {
    let not_batch =
        |payload: V| Converter::new().convert(0, &payload.bytes(), &mut Tally::default());
    let bad = |what| Err(PayloadError::BadEnvelope(what));
    assert_eq!(not_batch(m(&[("ts", V::F(1.0))])), bad("not an array"));
    assert_eq!(not_batch(a([V::F(1.0)])), bad("fewer than 2 slots"));
    assert_eq!(
        not_batch(a([s("now"), V::A(vec![])])),
        bad("ts is not a number")
    );
    assert_eq!(
        not_batch(a([V::F(1.0), m(&[("type", s("AllBlocksCleared"))])])),
        bad("events is not an array")
    );
    assert_eq!(
        not_batch(a([V::F(1.0), V::A(vec![]), V::I(-1)])),
        bad("dp_rank out of range")
    );
    assert_eq!(
        not_batch(a([V::F(1.0), V::A(vec![]), V::U(1 << 32)])),
        bad("dp_rank out of range")
    );
    assert_eq!(
        not_batch(a([V::F(1.0), V::A(vec![]), s("0")])),
        bad("dp_rank is not an int")
    );
    assert_eq!(bad("x").unwrap_err().reason(), "bad_envelope");

    let mut tally = Tally::default();
    let truncated = &batch(vec![stored(&[1], &[])])[..20];
    let error = Converter::new()
        .convert(0, truncated, &mut tally)
        .unwrap_err();
    assert_eq!(error, PayloadError::NotMsgpack("truncated"));
    assert_eq!(error.reason(), "not_msgpack");
    assert_eq!(
        Converter::new().convert(0, &[], &mut tally),
        Err(PayloadError::NotMsgpack("truncated"))
    );
    let reserved = Converter::new().convert(0, &[0x92, 0xc1, 0x90], &mut tally);
    assert_eq!(
        reserved,
        Err(PayloadError::NotMsgpack("reserved marker 0xc1"))
    );
    assert_eq!(tally, Tally::default());
}

/// Converts every cut of `payload` short of its end: each fails, and none
/// counts an event.
fn every_cut_fails_and_counts_nothing(converter: &mut Converter, payload: &[u8]) {
    let mut tally = Tally::default();
    for cut in 0..payload.len() {
        assert!(
            converter.convert(0, &payload[..cut], &mut tally).is_err(),
            "cut at {cut}"
        );
    }
    assert_eq!(tally, Tally::default());
}

#[test]
fn a_payload_cut_anywhere_is_rejected_whole_and_spends_no_event_id() {
    let payload = batch(vec![
        stored(&[1, 2], &[]),
        removed(&[1], &[]),
        m(&[("type", s("AllBlocksCleared"))]),
    ]);
    let mut converter = Converter::new();
    every_cut_fails_and_counts_nothing(&mut converter, &payload);
    let out = converter
        .convert(0, &payload, &mut Tally::default())
        .unwrap();
    assert_eq!(
        out.events.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        [1, 2, 3]
    );
}

#[test]
fn a_header_claiming_2_pow_32_events_in_20_bytes_fails_fast() {
    let mut payload = vec![0x93, 0xcb];
    payload.extend(1.0f64.to_be_bytes());
    payload.extend([0xdd, 0xff, 0xff, 0xff, 0xff, 0x90, 0xc0, 0xc0, 0xc0, 0xc0]);
    assert_eq!(payload.len(), 20);
    let started = std::time::Instant::now();
    let result = Converter::new().convert(0, &payload, &mut Tally::default());
    assert_eq!(result, Err(PayloadError::NotMsgpack("truncated")));
    assert!(started.elapsed() < std::time::Duration::from_millis(100));
}

#[test]
fn a_token_list_claiming_2_pow_32_cells_fails_the_payload_fast() {
    let mut event = stored(&[1], &[]).bytes();
    // Swap the 2-token fixarray for an array32 header claiming u32::MAX cells.
    let at = event
        .windows(3)
        .position(|w| w == [0x92, 100, 101])
        .unwrap();
    event.splice(at..at + 1, [0xdd, 0xff, 0xff, 0xff, 0xff]);
    let mut payload = vec![0x93, 0xcb];
    payload.extend(1.0f64.to_be_bytes());
    payload.push(0x91);
    payload.extend(event);
    payload.push(0x00);
    let result = Converter::new().convert(0, &payload, &mut Tally::default());
    assert_eq!(result, Err(PayloadError::NotMsgpack("truncated")));
}

#[test]
fn deep_nesting_costs_no_stack_anywhere() {
    let depth = 200_000;
    let mut deep = vec![0x91; depth];
    deep.push(0xc0);
    // As the value of an unknown key of a good event: skipped, event forwarded.
    let mut event = vec![0x82, 0xa4];
    event.extend(b"type");
    event.push(0xb0);
    event.extend(b"AllBlocksCleared");
    event.push(0xa4);
    event.extend(b"junk");
    event.extend(&deep);
    // As an event of its own: malformed.
    let mut payload = vec![0x93, 0xcb];
    payload.extend(1.0f64.to_be_bytes());
    payload.push(0x92);
    payload.extend(event);
    payload.extend(&deep);
    payload.push(0x00);
    let mut tally = Tally::default();
    let out = Converter::new().convert(0, &payload, &mut tally).unwrap();
    assert_eq!(out.events.len(), 1);
    assert_eq!(tally.forwarded(EventKind::Cleared), 1);
    assert_eq!(tally.dropped(DropReason::Malformed), 1);
}

// ---- event ids ----

#[test]
fn event_ids_count_every_decoded_event_across_payloads_dropped_ones_included() {
    let mut converter = Converter::new();
    let (first, _) = convert_with(
        &mut converter,
        0,
        vec![
            stored(&[1], &[]),
            V::Nil,
            removed(&[1], &[]),
            m(&[("type", s("BlockPinned"))]),
        ],
    );
    assert_eq!(first.iter().map(|e| e.event_id).collect::<Vec<_>>(), [1, 3]);
    let (second, _) = convert_with(
        &mut converter,
        5,
        vec![removed(&[2], &[]), removed(&[3], &[])],
    );
    assert_eq!(
        second.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        [5, 6]
    );
}

// ---- event encodings ----

#[test]
fn map_keys_may_come_in_any_order_and_unknown_keys_are_ignored() {
    let event = V::M(vec![
        (s("token_ids"), ints([7, 8])),
        (s("lookahead_token_ids"), a([ints([1, 2])])),
        (V::U(5), s("a non-string key")),
        (ints([1]), s("a container key")),
        (s("block_size"), V::U(2)),
        (s("block_hashes"), ints([9])),
        (s("type"), s("BlockStored")),
    ]);
    let store = forwarded_store(event);
    assert_eq!(store.blocks.len(), 1);
    assert_eq!(store.blocks[0].token_ids, [7, 8]);
}

#[test]
fn tag_first_arrays_are_read_by_slot_from_every_release() {
    let legacy = a([
        s("BlockStored"),
        ints([1, 2]),
        V::I(-5),
        ints([1, 2, 3, 4]),
        V::U(2),
        V::U(7),
    ]);
    let store = forwarded_store(legacy);
    assert_eq!(
        store
            .blocks
            .iter()
            .map(|b| b.block_hash)
            .collect::<Vec<_>>(),
        [1, 2]
    );
    assert_eq!(store.parent_block_hash, Some(-5));
    assert_eq!(store.blocks[1].lora_id, Some(7));
    assert_eq!(store.medium, None);

    let v023 = a([
        s("BlockStored"),
        ints([1]),
        V::Nil,
        ints([1, 2]),
        V::U(2),
        V::Nil,
        s("CPU"),
        s("lora-a"),
        a([a([s("lora-a"), s("salt")])]),
        V::U(0),
        s("full_attention"),
        V::U(4096),
        s("a slot from a future release"),
    ]);
    let store = forwarded_store(v023);
    assert_eq!(store.medium.as_deref(), Some("CPU"));
    assert_eq!(store.lora_name.as_deref(), Some("lora-a"));
    assert_eq!(store.cache_salt.as_deref(), Some("salt"));
    assert_eq!(store.group_idx, Some(0));
    assert_eq!(store.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    assert_eq!(store.kv_cache_spec_sliding_window, Some(4096));
    assert_eq!(store.blocks[0].cache_level, Some(1));

    let removal = forwarded_removal(a([s("BlockRemoved"), ints([3]), s("GPU"), V::U(2)]));
    assert_eq!(
        (
            removal.block_hashes,
            removal.medium.as_deref(),
            removal.group_idx
        ),
        (vec![3], Some("GPU"), Some(2))
    );
    assert!(matches!(
        forwarded(a([s("AllBlocksCleared"), V::Nil])),
        Data::Cleared(_)
    ));
}

#[test]
fn nil_optional_fields_count_as_absent() {
    let store = forwarded_store(stored(
        &[1],
        &[
            ("medium", V::Nil),
            ("lora_name", V::Nil),
            ("extra_keys", V::Nil),
            ("group_idx", V::Nil),
            ("locality", V::Nil),
            ("ownership", V::Nil),
            ("cache_salt", V::Nil),
        ],
    ));
    assert_eq!(store.tier, Some(KvCacheTier::Device.into()));
    assert_eq!(
        (
            store.medium,
            store.group_idx,
            store.lora_name,
            store.cache_salt
        ),
        (None, None, None, None)
    );
}

// ---- normalization ----

#[test]
fn every_medium_maps_to_its_tier_and_cache_level_on_stores_and_removals() {
    let table = [
        ("GPU", KvCacheTier::Device, None),
        ("device", KvCacheTier::Device, None),
        ("CPU", KvCacheTier::Host, Some(1)),
        ("cpu_pinned", KvCacheTier::Host, Some(1)),
        ("CPU_TIER1", KvCacheTier::Host, Some(1)),
        ("CPU_TIER2", KvCacheTier::Disk, Some(2)),
        ("Disk", KvCacheTier::Disk, Some(2)),
        ("NVME", KvCacheTier::Disk, Some(2)),
        ("STORAGE", KvCacheTier::Disk, Some(2)),
        ("EXTERNAL", KvCacheTier::External, Some(3)),
        ("network", KvCacheTier::External, Some(3)),
        ("REMOTE", KvCacheTier::External, Some(3)),
        ("SHARED", KvCacheTier::External, Some(3)),
    ];
    for (medium, tier, level) in table {
        let store = forwarded_store(stored(&[1, 2], &[("medium", s(medium))]));
        assert_eq!(store.tier, Some(tier.into()), "{medium}");
        assert_eq!(
            store.medium.as_deref(),
            Some(medium),
            "medium is copied as sent"
        );
        assert!(
            store.blocks.iter().all(|b| b.cache_level == level),
            "{medium}"
        );
        assert_eq!(store.locality, Some(KvCacheLocality::Local.into()));

        let removal = forwarded_removal(removed(&[1], &[("medium", s(medium))]));
        assert_eq!(
            (removal.tier, removal.cache_level),
            (Some(tier.into()), level),
            "{medium}"
        );
        assert_eq!(removal.medium.as_deref(), Some(medium));
        assert_eq!(removal.locality, Some(KvCacheLocality::Local.into()));
    }
    let no_medium = forwarded_removal(removed(&[1], &[]));
    assert_eq!(
        (no_medium.tier, no_medium.cache_level, no_medium.medium),
        (Some(KvCacheTier::Device.into()), None, None)
    );
}

#[test]
fn locality_local_in_any_case_is_forwarded_and_ownership_other_than_kvcr_is_copied() {
    let store = forwarded_store(stored(
        &[1],
        &[("locality", s("local")), ("ownership", s("engine"))],
    ));
    assert_eq!(store.locality, Some(KvCacheLocality::Local.into()));
    assert_eq!(store.ownership.as_deref(), Some("engine"));
    let removal = forwarded_removal(removed(
        &[1],
        &[("locality", s("LOCAL")), ("ownership", s("tier-2"))],
    ));
    assert_eq!(removal.ownership.as_deref(), Some("tier-2"));
    let cleared = forwarded(m(&[
        ("type", s("AllBlocksCleared")),
        ("ownership", s("tier-2")),
    ]));
    assert_eq!(
        cleared,
        Data::Cleared(KvCacheCleared {
            ownership: Some("tier-2".into())
        })
    );
}

#[test]
fn each_drop_reason_is_counted_under_its_name() {
    use DropReason::*;
    let cases = [
        (V::Nil, Malformed),
        (s("BlockStored"), Malformed),
        (V::U(16), Malformed),
        (a([]), Malformed),
        (a([V::U(1), V::U(2)]), Malformed),
        (m(&[("block_hashes", ints([1]))]), Malformed),
        (m(&[("type", V::U(1))]), Malformed),
        (m(&[("type", V::Nil)]), Malformed),
        (a([s("BlockStored"), ints([1])]), Malformed),
        (removed(&[], &[("block_hashes", V::Nil)]), Malformed),
        (
            m(&[
                ("type", s("BlockStored")),
                ("token_ids", ints([1])),
                ("block_size", V::U(1)),
            ]),
            Malformed,
        ),
        (
            stored(&[1], &[("block_hashes", a([V::Bool(true)]))]),
            Malformed,
        ),
        (stored(&[1], &[("block_hashes", a([s("12")]))]), Malformed),
        (stored(&[1], &[("block_hashes", V::U(1))]), Malformed),
        (stored(&[1], &[("parent_block_hash", V::F(1.0))]), Malformed),
        (
            stored(&[1], &[("token_ids", a([V::U(1), V::F(2.0)]))]),
            Malformed,
        ),
        (
            stored(&[1], &[("token_ids", a([V::U(1), V::I(-1)]))]),
            Malformed,
        ),
        (
            stored(&[1], &[("token_ids", a([V::U(1), V::U(1 << 32)]))]),
            Malformed,
        ),
        (stored(&[1], &[("token_ids", V::Nil)]), Malformed),
        (stored(&[1], &[("block_size", V::Nil)]), Malformed),
        (stored(&[1], &[("block_size", s("2"))]), Malformed),
        (stored(&[1], &[("lora_id", s("7"))]), Malformed),
        (stored(&[1], &[("lora_id", V::U(u64::MAX))]), Malformed),
        (stored(&[1], &[("medium", V::U(1))]), Malformed),
        (
            stored(&[1], &[("lora_name", V::B(b"x".to_vec()))]),
            Malformed,
        ),
        (
            stored(&[1], &[("medium", V::RawStr(vec![b'G', 0xff]))]),
            Malformed,
        ),
        (stored(&[1], &[("group_idx", V::I(-1))]), Malformed),
        (
            stored(&[1], &[("kv_cache_spec_sliding_window", s("4096"))]),
            Malformed,
        ),
        (stored(&[1], &[("extra_keys", s("salt"))]), Malformed),
        (removed(&[1], &[("locality", V::Bool(true))]), Malformed),
        (
            m(&[("type", s("AllBlocksCleared")), ("ownership", V::U(1))]),
            Malformed,
        ),
        (m(&[("type", s("BlockPinned"))]), UnknownType),
        (m(&[("type", s("blockstored"))]), UnknownType),
        (a([s("BlockPinned"), ints([1])]), UnknownType),
        (stored(&[1], &[("medium", s("HBM"))]), UnknownMedium),
        (removed(&[1], &[("medium", s(""))]), UnknownMedium),
        (stored(&[1], &[("locality", s("REMOTE"))]), NonLocalLocality),
        (removed(&[1], &[("locality", s("peer"))]), NonLocalLocality),
        (
            stored(&[1], &[("ownership", s("KVCR"))]),
            UnsupportedOwnership,
        ),
        (
            removed(&[1], &[("ownership", s("kvcr"))]),
            UnsupportedOwnership,
        ),
        (
            m(&[("type", s("AllBlocksCleared")), ("ownership", s("kvcr"))]),
            UnsupportedOwnership,
        ),
        (
            stored(
                &[1],
                &[
                    ("group_idx", V::U(1)),
                    ("kv_cache_spec_kind", s("sliding_window")),
                ],
            ),
            NonMainAttentionGroup,
        ),
        (
            stored(
                &[1],
                &[("group_idx", V::U(1)), ("kv_cache_spec_kind", s("mamba"))],
            ),
            NonMainAttentionGroup,
        ),
        (
            stored(&[1], &[("kv_cache_spec_kind", s("sliding_window"))]),
            NonMainAttentionGroup,
        ),
        (stored(&[], &[]), Placeholder),
        (
            stored(&[1], &[("token_ids", ints([])), ("block_size", V::U(0))]),
            Placeholder,
        ),
        (
            stored(&[1], &[("token_ids", ints([])), ("block_size", V::U(2))]),
            Placeholder,
        ),
        (stored(&[1], &[("block_size", V::U(0))]), UnalignedBlocks),
        (stored(&[1], &[("block_size", V::I(-2))]), UnalignedBlocks),
        (
            stored(&[1], &[("block_size", V::U(1 << 31))]),
            UnalignedBlocks,
        ),
        (
            stored(&[1], &[("block_size", V::U(u64::MAX))]),
            UnalignedBlocks,
        ),
        (stored(&[1], &[("block_size", V::U(3))]), UnalignedBlocks),
        (stored(&[1, 2], &[("block_size", V::U(1))]), UnalignedBlocks),
        (stored(&[1, 2, 1], &[]), SelfReferencingHashes),
        (
            stored(&[1, 2], &[("parent_block_hash", V::U(2))]),
            SelfReferencingHashes,
        ),
        (
            stored(&[u64::MAX], &[("parent_block_hash", V::I(-1))]),
            SelfReferencingHashes,
        ),
        (
            stored(
                &[1, 2],
                &[(
                    "block_hashes",
                    a([
                        V::U(5),
                        V::B(
                            vec![0xee; 24]
                                .into_iter()
                                .chain(5u64.to_be_bytes())
                                .collect(),
                        ),
                    ]),
                )],
            ),
            SelfReferencingHashes,
        ),
    ];
    let mut seen = std::collections::HashSet::new();
    for (event, reason) in cases {
        assert_dropped(event, reason);
        seen.insert(reason);
    }
    assert_eq!(seen.len(), DropReason::ALL.len(), "every reason has a case");
}

#[test]
fn the_drop_rules_apply_in_the_contract_order() {
    use DropReason::*;
    let everything_wrong = [
        ("medium", s("HBM")),
        ("locality", s("REMOTE")),
        ("ownership", s("kvcr")),
        ("kv_cache_spec_kind", s("sliding_window")),
        ("token_ids", ints([])),
    ];
    for (broken, reason) in [
        (5, UnknownMedium),
        (4, NonLocalLocality),
        (3, UnsupportedOwnership),
        (2, NonMainAttentionGroup),
        (1, Placeholder),
    ] {
        assert_dropped(stored(&[1], &everything_wrong[5 - broken..]), reason);
    }
    assert_dropped(stored(&[1, 1], &[("block_size", V::U(3))]), UnalignedBlocks);
    // A malformed field wins over every policy rule.
    assert_dropped(
        stored(&[1], &[("medium", s("HBM")), ("lora_id", s("x"))]),
        Malformed,
    );
}

#[test]
fn one_block_per_hash_gets_its_token_slice_block_size_lora_id_and_cache_level() {
    let store = forwarded_store(stored(
        &[10, 20, 30],
        &[
            ("token_ids", ints(1..=6)),
            ("block_size", V::U(2)),
            ("lora_id", V::U(7)),
            ("parent_block_hash", V::U(u64::MAX)),
            ("medium", s("DISK")),
            ("group_idx", V::U(0)),
            ("kv_cache_spec_kind", s("mla_attention")),
            ("session_id", s("sess")),
        ],
    ));
    let block = |hash, tokens: [u32; 2]| KvBlock {
        block_hash: hash,
        token_ids: tokens.to_vec(),
        block_size: 2,
        lora_id: Some(7),
        cache_level: Some(2),
        extra_keys: vec![],
    };
    assert_eq!(
        store,
        KvBlocksStored {
            blocks: vec![block(10, [1, 2]), block(20, [3, 4]), block(30, [5, 6])],
            parent_block_hash: Some(-1),
            tier: Some(KvCacheTier::Disk.into()),
            medium: Some("DISK".into()),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("mla_attention".into()),
            kv_cache_spec_sliding_window: None,
            locality: Some(KvCacheLocality::Local.into()),
            ownership: None,
            session_id: Some("sess".into()),
            lora_name: None,
            cache_salt: None,
        }
    );
}

#[test]
fn hashes_fold_from_every_integer_width_and_from_bytes() {
    let digest: Vec<u8> = (0u8..32).collect();
    let store = forwarded_store(stored(
        &[0, 0, 0, 0],
        &[(
            "block_hashes",
            a([
                V::U(1 << 63),
                V::I(-42),
                V::B(digest.clone()),
                V::B(vec![1, 0]),
            ]),
        )],
    ));
    let hashes: Vec<i64> = store.blocks.iter().map(|b| b.block_hash).collect();
    assert_eq!(hashes, [i64::MIN, -42, fold_bytes(&digest), 256]);
    assert_eq!(
        hashes[2],
        i64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31])
    );
    let removal = forwarded_removal(removed(
        &[],
        &[("block_hashes", a([V::U(u64::MAX), V::B(vec![0xff; 32])]))],
    ));
    assert_eq!(removal.block_hashes, [-1, -1]);
}

#[test]
fn bigram_token_cells_fold_to_their_first_token_and_mixing_is_malformed() {
    let pairs = a([ints([5, 6]), ints([7, 8]), ints([9, 10]), ints([11, 12])]);
    let store = forwarded_store(stored(&[1, 2], &[("token_ids", pairs)]));
    assert_eq!(store.blocks[0].token_ids, [5, 7]);
    assert_eq!(store.blocks[1].token_ids, [9, 11]);
    assert_eq!(store.blocks[0].block_size, 2);

    assert_dropped(
        stored(&[1], &[("token_ids", a([V::U(5), ints([7, 8])]))]),
        DropReason::Malformed,
    );
    assert_dropped(
        stored(&[1], &[("token_ids", a([ints([5, 6]), V::U(7)]))]),
        DropReason::Malformed,
    );
    assert_dropped(
        stored(
            &[1],
            &[("token_ids", a([ints([5, 6, 7]), ints([8, 9, 10])]))],
        ),
        DropReason::Malformed,
    );
    assert_dropped(
        stored(
            &[1],
            &[("token_ids", a([ints([5, 6]), a([V::U(8), V::I(-1)])]))],
        ),
        DropReason::Malformed,
    );
}

fn text(t: &str) -> KvBlockExtraKey {
    KvBlockExtraKey {
        key: Some(Key::Text(t.into())),
    }
}

#[test]
fn extra_keys_keep_str_int_bytes_and_multimodal_shapes_and_skip_the_rest() {
    let block0 = a([
        s("lora"),
        V::I(-3),
        V::B(vec![1, 2, 3]),
        a([s("img"), V::I(-11)]),
        a([V::U(1), s("img")]),
        a([s("img")]),
        a([s("img"), V::U(1), V::U(2)]),
        a([s("img"), V::U(u64::MAX)]),
        V::U(u64::MAX),
        V::Nil,
        V::Bool(true),
        V::F(1.0),
        m(&[("k", s("v"))]),
        V::S("\u{1F600}".into()),
    ]);
    let store = forwarded_store(stored(
        &[1, 2, 3, 4],
        &[("extra_keys", a([block0, V::Nil, V::U(9), a([V::U(4)])]))],
    ));
    let keys: Vec<_> = store.blocks.iter().map(|b| b.extra_keys.clone()).collect();
    assert_eq!(
        keys[0],
        [
            text("lora"),
            KvBlockExtraKey {
                key: Some(Key::Number(-3))
            },
            KvBlockExtraKey {
                key: Some(Key::Blob(vec![1, 2, 3]))
            },
            KvBlockExtraKey {
                key: Some(Key::Multimodal(KvMultimodalKey {
                    identifier: "img".into(),
                    offset: -11
                }))
            },
            text("\u{1F600}"),
        ]
    );
    assert!(keys[1].is_empty() && keys[2].is_empty());
    assert_eq!(
        keys[3],
        [KvBlockExtraKey {
            key: Some(Key::Number(4))
        }]
    );
}

#[test]
fn extra_key_lists_shorter_or_longer_than_the_blocks_are_tolerated() {
    let short = forwarded_store(stored(&[1, 2], &[("extra_keys", a([a([s("x")])]))]));
    assert_eq!(short.blocks[0].extra_keys, [text("x")]);
    assert!(short.blocks[1].extra_keys.is_empty());
    let long = forwarded_store(stored(
        &[1],
        &[("extra_keys", a([a([s("x")]), a([s("y")])]))],
    ));
    assert_eq!(long.blocks[0].extra_keys, [text("x")]);
}

// ---- TensorRT-LLM's multimodal keys (contract: kvgate's additions) ----

fn multimodal(identifier: &str, offset: i64) -> KvBlockExtraKey {
    KvBlockExtraKey {
        key: Some(Key::Multimodal(KvMultimodalKey {
            identifier: identifier.into(),
            offset,
        })),
    }
}

fn mm_key(hash: &str, start_offset: u64) -> V {
    m(&[
        ("type", s("mm_key")),
        ("hash", s(hash)),
        ("start_offset", V::U(start_offset)),
    ])
}

/// A store of blocks of 4 tokens as TensorRT-LLM's V2 manager publishes it.
fn trtllm_store(hashes: &[u64], tokens: Vec<V>, mm_keys: Option<V>) -> V {
    let mut fields = vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(hashes.iter().copied())),
        ("parent_block_hash", V::Nil),
        ("token_ids", V::A(tokens)),
        ("block_size", V::U(4)),
        ("lora_id", V::Nil),
        ("medium", s("GPU")),
        ("lora_name", V::Nil),
    ];
    fields.extend(mm_keys.map(|keys| ("mm_keys", keys)));
    m(&fields)
}

#[test]
fn a_digest_token_is_forwarded_as_u32_max_with_a_multimodal_key_at_its_position() {
    let tokens = vec![
        V::U(7),
        V::U(8),
        s("ab12"),
        V::U(1001),
        V::U(1002),
        V::U(9),
        V::U(10),
        V::U(11),
    ];
    let store = forwarded_store(trtllm_store(&[1, 2], tokens, None));
    assert_eq!(store.blocks[0].token_ids, [7, 8, u32::MAX, 1001]);
    assert_eq!(store.blocks[0].extra_keys, [multimodal("ab12", 2)]);
    assert_eq!(store.blocks[1].token_ids, [1002, 9, 10, 11]);
    assert!(store.blocks[1].extra_keys.is_empty());
}

#[test]
fn mm_keys_give_vllm_s_offsets_negative_for_an_item_begun_in_an_earlier_block() {
    let tokens = vec![
        V::U(7),
        s("ab12"),
        V::U(1001),
        V::U(1002),
        V::U(1003),
        V::U(1004),
        V::U(9),
        V::U(10),
    ];
    let keys = a([a([mm_key("ab12", 0)]), a([mm_key("ab12", 3)])]);
    let store = forwarded_store(trtllm_store(&[1, 2], tokens, Some(keys)));
    assert_eq!(store.blocks[0].extra_keys, [multimodal("ab12", 1)]);
    assert_eq!(store.blocks[1].extra_keys, [multimodal("ab12", -3)]);
}

#[test]
fn an_item_named_by_mm_keys_whose_digest_is_not_in_the_block_starts_at_offset_0() {
    let tokens = (0..4).map(V::U).collect();
    let store = forwarded_store(trtllm_store(
        &[1],
        tokens,
        Some(a([a([mm_key("ab12", 0)])])),
    ));
    assert_eq!(store.blocks[0].extra_keys, [multimodal("ab12", 0)]);
}

#[test]
fn odd_mm_keys_entries_are_skipped_one_by_one_and_a_digest_no_entry_names_still_gets_its_key() {
    let tokens = vec![
        s("cd34"),
        V::U(1),
        V::U(2),
        V::U(3),
        V::U(4),
        V::U(5),
        V::U(6),
        V::U(7),
    ];
    let block0 = a([
        m(&[("hash", s("ef56"))]),
        m(&[("hash", s("ef56")), ("start_offset", V::I(-1))]),
        m(&[("hash", V::U(1)), ("start_offset", V::U(0))]),
        s("ef56"),
        a([s("ef56"), V::U(0)]),
        mm_key("ef56", 2),
    ]);
    let store = forwarded_store(trtllm_store(&[1, 2], tokens, Some(a([block0, s("junk")]))));
    assert_eq!(
        store.blocks[0].extra_keys,
        [multimodal("ef56", -2), multimodal("cd34", 0)]
    );
    assert!(store.blocks[1].extra_keys.is_empty());
}

#[test]
fn mm_keys_follow_a_block_s_extra_keys_and_lists_of_any_length_are_tolerated() {
    let tokens = (0..8).map(V::U).collect();
    let mut event = trtllm_store(
        &[1, 2],
        tokens,
        Some(a([a([mm_key("ab", 1)]), a([]), a([mm_key("x", 0)])])),
    );
    if let V::M(fields) = &mut event {
        fields.push((s("extra_keys"), a([a([s("salt")])])));
    }
    let store = forwarded_store(event);
    assert_eq!(
        store.blocks[0].extra_keys,
        [text("salt"), multimodal("ab", -1)]
    );
    assert!(store.blocks[1].extra_keys.is_empty());
    assert_dropped(
        trtllm_store(&[1], (0..4).map(V::U).collect(), Some(s("not a list"))),
        DropReason::Malformed,
    );
}

#[test]
fn a_digest_token_among_bigram_pairs_is_malformed() {
    let tokens = vec![
        a([V::U(1), V::U(2)]),
        s("ab"),
        a([V::U(3), V::U(4)]),
        a([V::U(5), V::U(6)]),
    ];
    assert_dropped(trtllm_store(&[1], tokens, None), DropReason::Malformed);
    let tokens = vec![s("ab"), a([V::U(3), V::U(4)]), V::U(5), V::U(6)];
    assert_dropped(trtllm_store(&[1], tokens, None), DropReason::Malformed);
}

/// A store's blocks and multimodal items, to publish the vLLM way and the
/// TensorRT-LLM way.
#[derive(Debug, Clone)]
struct MultimodalStore {
    hashes: Vec<u64>,
    parent: Option<u64>,
    block_size: usize,
    tokens: Vec<u32>,
    /// `(start, len, digest)`, in token order, not overlapping.
    items: Vec<(usize, usize, String)>,
    with_mm_keys: bool,
}

impl MultimodalStore {
    /// The items overlapping block `b`: digest, start relative to the block.
    fn items_of_block(&self, b: usize) -> Vec<(String, i64)> {
        let (start, end) = (b * self.block_size, (b + 1) * self.block_size);
        self.items
            .iter()
            .filter(|(at, len, _)| *at < end && at + len > start)
            .map(|(at, _, digest)| (digest.clone(), *at as i64 - start as i64))
            .collect()
    }

    fn item_at(&self, t: usize) -> Option<(usize, &str)> {
        self.items
            .iter()
            .find(|(at, len, _)| (*at..at + len).contains(&t))
            .map(|(at, _, digest)| (t - at, digest.as_str()))
    }

    fn common(&self, tokens: V) -> Vec<(&'static str, V)> {
        vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(self.hashes.iter().copied())),
            ("parent_block_hash", self.parent.map_or(V::Nil, V::U)),
            ("token_ids", tokens),
            ("block_size", V::U(self.block_size as u64)),
            ("lora_id", V::Nil),
            ("medium", s("GPU")),
        ]
    }

    /// vLLM: image tokens are the placeholder id, items in `extra_keys`.
    fn vllm(&self) -> V {
        let tokens = (0..self.tokens.len())
            .map(|t| V::U(self.item_at(t).map_or(self.tokens[t], |_| 151_655).into()));
        let mut fields = self.common(a(tokens));
        let keys = (0..self.hashes.len()).map(|b| {
            a(self
                .items_of_block(b)
                .into_iter()
                .map(|(digest, offset)| a([s(&digest), V::I(offset)])))
        });
        fields.push(("extra_keys", a(keys)));
        m(&fields)
    }

    /// TensorRT-LLM: the digest in place of an item's first token, then
    /// `VOCAB + k`; `mm_keys` when the engine has `mm_token_id_offset`.
    fn trtllm(&self) -> V {
        let tokens = (0..self.tokens.len()).map(|t| match self.item_at(t) {
            Some((0, digest)) => s(digest),
            Some((k, _)) => V::U(151_936 + k as u64),
            None => V::U(self.tokens[t].into()),
        });
        let mut fields = self.common(a(tokens));
        fields.push(("lora_name", V::Nil));
        if self.with_mm_keys {
            let keys = (0..self.hashes.len()).map(|b| {
                a(self.items_of_block(b).into_iter().map(|(digest, offset)| {
                    m(&[
                        ("type", s("mm_key")),
                        ("hash", s(&digest)),
                        ("start_offset", V::U((-offset).max(0) as u64)),
                        ("uuid", V::Nil),
                    ])
                }))
            });
            fields.push(("mm_keys", a(keys)));
        }
        m(&fields)
    }
}

fn any_multimodal_store() -> impl Strategy<Value = MultimodalStore> {
    (1usize..5, 1usize..9, any::<bool>(), any::<bool>())
        .prop_flat_map(|(blocks, block_size, with_parent, with_mm_keys)| {
            let len = blocks * block_size;
            (
                proptest::collection::hash_set(1u64..u64::MAX, blocks + 1),
                proptest::collection::vec(0u32..150_000, len),
                proptest::collection::vec((0..len, 1usize..12), 0..4),
                Just((block_size, with_parent, with_mm_keys)),
            )
        })
        .prop_map(
            |(hashes, tokens, spans, (block_size, with_parent, with_mm_keys))| {
                let mut hashes: Vec<u64> = hashes.into_iter().collect();
                let parent = hashes.pop().filter(|_| with_parent);
                let mut items = Vec::new();
                let mut free_from = 0;
                let mut spans = spans;
                spans.sort();
                for (n, (start, len)) in spans.into_iter().enumerate() {
                    if start >= free_from {
                        let len = len.min(tokens.len() - start);
                        items.push((start, len, format!("{n:x}{start:x}{}", "0f".repeat(31))));
                        free_from = start + len;
                    }
                }
                MultimodalStore {
                    hashes,
                    parent,
                    block_size,
                    tokens,
                    items,
                    with_mm_keys,
                }
            },
        )
}

fn multimodal_keys(block: &KvBlock) -> Vec<(String, i64)> {
    block
        .extra_keys
        .iter()
        .filter_map(|key| match &key.key {
            Some(Key::Multimodal(k)) => Some((k.identifier.clone(), k.offset)),
            _ => None,
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn a_trtllm_store_converts_as_the_same_vllm_store_in_every_field_they_share(
        store in any_multimodal_store(),
    ) {
        let vllm = forwarded_store(store.vllm());
        let trtllm = forwarded_store(store.trtllm());
        prop_assert_eq!(trtllm.parent_block_hash, vllm.parent_block_hash);
        prop_assert_eq!((trtllm.tier, &trtllm.medium, trtllm.locality), (vllm.tier, &vllm.medium, vllm.locality));
        prop_assert_eq!(trtllm.blocks.len(), vllm.blocks.len());
        for (b, (t, v)) in trtllm.blocks.iter().zip(&vllm.blocks).enumerate() {
            prop_assert_eq!((t.block_hash, t.block_size, t.cache_level), (v.block_hash, v.block_size, v.cache_level));
            for (i, (&tt, &vt)) in t.token_ids.iter().zip(&v.token_ids).enumerate() {
                match store.item_at(b * store.block_size + i) {
                    None => prop_assert_eq!(tt, vt),
                    Some((0, _)) => prop_assert_eq!(tt, u32::MAX),
                    Some((k, _)) => prop_assert_eq!(tt, 151_936 + k as u32),
                }
            }
            let expected = if store.with_mm_keys {
                multimodal_keys(v)
            } else {
                // Without mm_keys only an item's first block names it.
                multimodal_keys(v).into_iter().filter(|(_, offset)| *offset >= 0).collect()
            };
            prop_assert_eq!(multimodal_keys(t), expected, "block {}", b);
        }
    }
}

#[test]
fn a_missing_salt_is_block_0s_first_text_key_that_is_not_the_lora_name() {
    let keys = |block0: V, block1: V| ("extra_keys", a([block0, block1]));
    let salt = |fields: &[(&str, V)]| forwarded_store(stored(&[1, 2], fields)).cache_salt;

    assert_eq!(
        salt(&[keys(a([a([s("img"), V::U(0)]), s("tenant")]), V::Nil)]),
        Some("tenant".into())
    );
    assert_eq!(
        salt(&[
            ("lora_name", s("sql")),
            keys(a([s("sql"), s("tenant")]), V::Nil)
        ]),
        Some("tenant".into())
    );
    assert_eq!(
        salt(&[("lora_name", s("sql")), keys(a([s("sql")]), a([s("sql")]))]),
        None
    );
    assert_eq!(
        salt(&[keys(a([s(""), s("tenant")]), V::Nil)]),
        Some("tenant".into())
    );
    assert_eq!(salt(&[keys(V::Nil, a([s("block-1-only")]))]), None);
    assert_eq!(
        salt(&[("cache_salt", s("given")), keys(a([s("tenant")]), V::Nil)]),
        Some("given".into())
    );
    assert_eq!(
        salt(&[("cache_salt", s("")), keys(a([s("tenant")]), V::Nil)]),
        Some("tenant".into())
    );
    // An empty lora_name is absent, so a key equal to "" is not excluded by it.
    let store = forwarded_store(stored(
        &[1],
        &[("lora_name", s("")), ("extra_keys", a([a([s("sql")])]))],
    ));
    assert_eq!(
        (store.lora_name, store.cache_salt),
        (None, Some("sql".into()))
    );
}

#[test]
fn group_kinds_are_remembered_per_rank_and_followed_by_kindless_events() {
    let sliding = [
        ("group_idx", V::U(1)),
        ("kv_cache_spec_kind", s("sliding_window")),
    ];
    let full = [
        ("group_idx", V::U(1)),
        ("kv_cache_spec_kind", s("full_attention")),
    ];
    let kindless_store = stored(&[1], &[("group_idx", V::U(1))]);
    let kindless_removal = removed(&[1], &[("group_idx", V::U(1))]);
    let mut converter = Converter::new();
    let mut run = |rank, events| {
        let (out, tally) = convert_with(&mut converter, rank, events);
        (
            out.len() as u64,
            tally.dropped(DropReason::NonMainAttentionGroup),
        )
    };

    // An unknown group counts as main; rank 0 then learns group 1 is sliding.
    assert_eq!(
        run(
            0,
            vec![
                kindless_removal.clone(),
                stored(&[1], &sliding),
                kindless_store.clone(),
                kindless_removal.clone()
            ]
        ),
        (1, 3)
    );
    // Rank 1 has not learned anything about its group 1.
    assert_eq!(
        run(1, vec![kindless_store.clone(), kindless_removal.clone()]),
        (2, 0)
    );
    // The kind is learned even from an event dropped for another reason.
    assert_eq!(
        run(
            1,
            vec![
                stored(
                    &[1],
                    &[sliding[0].clone(), sliding[1].clone(), ("medium", s("HBM"))]
                ),
                kindless_removal.clone()
            ]
        ),
        (0, 1)
    );
    // A new kind replaces the remembered one.
    assert_eq!(
        run(0, vec![stored(&[1], &full), kindless_removal.clone()]),
        (2, 0)
    );
    assert_eq!(run(0, vec![stored(&[1], &sliding)]), (0, 1));
    // Forgetting a rank (engine restart) forgets only that rank.
    converter.forget_rank(0);
    let mut run = |rank, events| convert_with(&mut converter, rank, events).0.len();
    assert_eq!(run(0, vec![kindless_removal.clone()]), 1);
    assert_eq!(run(1, vec![kindless_removal]), 0);
}

#[test]
fn a_payload_that_fails_teaches_no_group_kind() {
    let sliding = stored(
        &[1],
        &[
            ("group_idx", V::U(1)),
            ("kv_cache_spec_kind", s("sliding_window")),
        ],
    );
    let full = stored(
        &[1],
        &[
            ("group_idx", V::U(1)),
            ("kv_cache_spec_kind", s("full_attention")),
        ],
    );
    let kindless_removal = removed(&[1], &[("group_idx", V::U(1))]);
    let mut converter = Converter::new();
    for before in [None, Some(full)] {
        if let Some(full) = before {
            convert_with(&mut converter, 0, vec![full]);
        }
        let broken = batch(vec![sliding.clone(), sliding.clone()]);
        let mut tally = Tally::default();
        assert!(
            converter
                .convert(0, &broken[..broken.len() - 2], &mut tally)
                .is_err()
        );
        let (out, _) = convert_with(&mut converter, 0, vec![kindless_removal.clone()]);
        assert_eq!(out.len(), 1, "group 1 still counts as main");
    }
}

#[test]
fn remembered_group_kinds_are_capped() {
    let sliding = |group| {
        stored(
            &[1],
            &[
                ("group_idx", V::U(group)),
                ("kv_cache_spec_kind", s("sliding_window")),
            ],
        )
    };
    let kindless = |group| removed(&[1], &[("group_idx", V::U(group))]);
    let mut converter = Converter::new();
    let groups = normalize::MAX_REMEMBERED_GROUPS as u64;
    let (_, tally) = convert_with(&mut converter, 0, (0..=groups).map(sliding).collect());
    assert_eq!(
        tally.dropped(DropReason::NonMainAttentionGroup),
        groups + 1,
        "kinds still apply to their own events"
    );
    let (out, _) = convert_with(
        &mut converter,
        0,
        vec![kindless(0), kindless(groups - 1), kindless(groups)],
    );
    assert_eq!(
        out.len(),
        1,
        "only the group past the cap was not remembered"
    );
}

#[test]
fn an_unreadable_event_of_any_shape_leaves_the_next_one_intact() {
    let junk_tokens = a([
        V::U(1),
        m(&[("a", ints([1, 2, 3]))]),
        a([ints([4]), V::U(5)]),
        V::U(2),
    ]);
    let junk_hashes = a([V::U(1), a([a([V::U(1)]), m(&[("x", V::Nil)])]), V::U(2)]);
    let junk = [
        stored(&[1], &[("token_ids", junk_tokens)]),
        stored(&[1], &[("block_hashes", junk_hashes)]),
        stored(
            &[1],
            &[("token_ids", a([a([ints([1]), V::U(2)]), ints([3, 4])]))],
        ),
        stored(&[1], &[("token_ids", m(&[("k", ints([1, 2]))]))]),
        stored(&[1], &[("block_hashes", m(&[("k", ints([1, 2]))]))]),
        a([
            s("BlockPinned"),
            ints([1, 2]),
            m(&[("k", a([V::Nil]))]),
            ints([3]),
        ]),
        a([a([s("BlockStored")]), ints([1])]),
        V::M(vec![
            (ints([1, 2]), ints([3])),
            (m(&[("type", s("BlockStored"))]), V::Nil),
        ]),
        m(&[("type", a([s("BlockStored")]))]),
        m(&[("type", s("BlockStored")), ("type", s("BlockPinned"))]),
    ];
    for event in junk {
        let (out, tally) = convert(vec![event.clone(), removed(&[7], &[])]);
        assert_eq!(tally.total_dropped(), 1, "{event:?}");
        assert_eq!(out.len(), 1, "{event:?}");
        assert_eq!(out[0].event_id, 2);
    }
}

#[test]
fn cleared_events_forward_with_ownership_and_ignore_other_fields() {
    let cleared = forwarded(m(&[
        ("type", s("AllBlocksCleared")),
        ("medium", s("HBM")),
        ("block_hashes", s("?")),
    ]));
    assert_eq!(cleared, Data::Cleared(KvCacheCleared { ownership: None }));
}

#[test]
fn removals_ignore_store_only_fields() {
    let removal = forwarded_removal(removed(
        &[4],
        &[
            ("token_ids", s("?")),
            ("block_size", s("?")),
            ("lora_id", s("?")),
        ],
    ));
    assert_eq!(removal.block_hashes, [4]);
}

// ---- robustness ----

fn fixture_payloads() -> Vec<Vec<u8>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wire");
    let mut payloads = Vec::new();
    for dir in std::fs::read_dir(root).unwrap() {
        let dir = dir.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(dir).unwrap() {
            let path = file.unwrap().path();
            // The 3000-event files would only slow the shrinker down.
            if path.extension().is_some_and(|e| e == "msgpack")
                && std::fs::metadata(&path).unwrap().len() < 4096
            {
                payloads.push(std::fs::read(path).unwrap());
            }
        }
    }
    assert!(payloads.len() > 40, "fixtures found: {}", payloads.len());
    payloads
}

/// Converting must never panic, and must keep its bookkeeping whole: every
/// event of a good payload is forwarded or dropped, never both or neither.
fn check_total(payload: &[u8]) {
    let mut converter = Converter::new();
    let mut tally = Tally::default();
    match converter.convert(0, payload, &mut tally) {
        Ok(out) => {
            assert_eq!(out.events.len() as u64, tally.total_forwarded());
            let decoded = tally.total_forwarded() + tally.total_dropped();
            assert_eq!(converter.next_event_id, 1 + decoded);
        }
        Err(_) => {
            assert_eq!(tally, Tally::default());
            assert_eq!(converter.next_event_id, 1);
        }
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    Set(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(payload in proptest::collection::vec(any::<u8>(), 0..256)) {
        check_total(&payload);
    }

    #[test]
    fn arbitrary_bytes_inside_a_batch_envelope_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256), count in 0u8..16) {
        let mut payload = vec![0x93, 0xcb];
        payload.extend(1.0f64.to_be_bytes());
        payload.push(0x90 | count);
        payload.extend(body);
        check_total(&payload);
    }

    #[test]
    fn mutated_fixtures_never_panic(
        pick in any::<proptest::sample::Index>(),
        mutations in proptest::collection::vec(
            prop_oneof![
                (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Set(at, b)),
                (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Insert(at, b)),
                any::<usize>().prop_map(Mutation::Remove),
                any::<usize>().prop_map(Mutation::Truncate),
            ],
            1..6,
        ),
    ) {
        thread_local!(static FIXTURES: Vec<Vec<u8>> = fixture_payloads());
        let mut payload = FIXTURES.with(|f| pick.get(f).clone());
        for mutation in mutations {
            let len = payload.len().max(1);
            match mutation {
                Mutation::Set(at, b) if !payload.is_empty() => payload[at % len] = b,
                Mutation::Insert(at, b) => payload.insert(at % (payload.len() + 1), b),
                Mutation::Remove(at) if !payload.is_empty() => { payload.remove(at % len); }
                Mutation::Truncate(at) => payload.truncate(at % len),
                _ => {}
            }
        }
        check_total(&payload);
    }
}

// ---- transcoding: the drain's path gives the bytes of the built events ----

/// Converts `payloads` in order both ways, each with its own converter:
/// every removal `transcode` wrote is, byte for byte, prost's encoding of
/// the event `convert` built (with that event's tier and hashes), every
/// store is that event (see `transcoded_store_as_built`), every other event
/// is the same, and so are the tallies. Returns the removals compared.
fn transcoded_as_built(payloads: &[Vec<u8>]) -> usize {
    transcoded_as_built_counted(payloads).removals
}

/// What [`transcoded_as_built_counted`] compared.
struct Compared {
    removals: usize,
    stores: usize,
    blocks: usize,
}

fn transcoded_as_built_counted(payloads: &[Vec<u8>]) -> Compared {
    use prost::Message;
    let (mut building, mut transcoding) = (Converter::new(), Converter::new());
    let mut out = TranscodedPayload::default();
    let mut compared = Compared {
        removals: 0,
        stores: 0,
        blocks: 0,
    };
    for payload in payloads {
        let (mut built_tally, mut transcoded_tally) = (Tally::default(), Tally::default());
        let built = building.convert(0, payload, &mut built_tally);
        let transcoded = transcoding.transcode(0, payload, &mut transcoded_tally, &mut out);
        assert_eq!(built_tally, transcoded_tally);
        let Ok(built) = built else {
            assert_eq!(transcoded.unwrap_err(), built.unwrap_err());
            out.drain(|event| panic!("a failed payload left {event:?}"));
            continue;
        };
        transcoded.expect("transcoded as it converts");
        assert_eq!(out.timestamp.to_bits(), built.timestamp.to_bits());
        assert_eq!(out.dp_rank, built.dp_rank);
        let mut expected = built.events.into_iter();
        out.drain(|event| {
            let built = expected.next().expect("no more events than built");
            match event {
                Forwarded::Event(event) => assert_eq!(event, built),
                Forwarded::Store { event, blocks } => {
                    compared.stores += 1;
                    compared.blocks += transcoded_store_as_built(event, blocks, built);
                }
                Forwarded::Removal { body, tier, hashes } => {
                    compared.removals += 1;
                    assert!(body == built.encode_to_vec(), "{built:?}");
                    let Some(Data::Removed(removed)) = &built.data else {
                        panic!("written as a removal: {built:?}");
                    };
                    assert_eq!(tier, removed.tier);
                    assert_eq!(hashes, removed.block_hashes);
                }
            }
        });
        assert!(expected.next().is_none(), "as many events as built");
    }
    compared
}

/// A transcoded store against the store `convert` built: its fields are
/// that store's but for the blocks, its blocks' fields are those blocks',
/// and its bytes are, byte for byte, those the drain writes for the built
/// store (`wire::event::encode_event`: the store's other fields, then
/// prost's bytes of each block), as long as prost's and decoding to it.
/// Returns the blocks compared.
fn transcoded_store_as_built(
    event: KvCacheEvent,
    blocks: StoredBlocks<'_>,
    mut built: KvCacheEvent,
) -> usize {
    use prost::Message;
    let (Some(Data::Stored(header)), Some(Data::Stored(built_store))) = (&event.data, &built.data)
    else {
        panic!("written as a store: {built:?}");
    };
    assert_eq!(event.event_id, built.event_id);
    assert_eq!(
        header,
        &KvBlocksStored {
            blocks: Vec::new(),
            ..built_store.clone()
        }
    );
    let as_blocks: Vec<KvBlock> = blocks.iter().map(|block| block.to_block()).collect();
    assert!(as_blocks.iter().all(|block| {
        (block.lora_id, block.cache_level) == (blocks.lora_id, blocks.cache_level)
    }));
    assert_eq!(as_blocks, built_store.blocks);
    let mut written = Vec::new();
    blocks.encode_event(event.event_id, header, &mut written);
    let mut expected = Vec::new();
    crate::wire::event::encode_event(&mut built, &mut expected);
    assert!(written == expected, "{built:?}");
    assert_eq!(written.len(), built.encoded_len(), "as long as prost's");
    assert_eq!(KvCacheEvent::decode(written.as_slice()).unwrap(), built);
    as_blocks.len()
}

#[test]
fn every_golden_payload_transcodes_to_the_bytes_of_the_events_it_converts_to() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wire");
    let mut payloads = Vec::new();
    for dir in std::fs::read_dir(root).unwrap() {
        let dir = dir.unwrap().path();
        if dir.is_dir() {
            for file in std::fs::read_dir(dir).unwrap() {
                let path = file.unwrap().path();
                if path.extension().is_some_and(|e| e == "msgpack") {
                    payloads.push(std::fs::read(path).unwrap());
                }
            }
        }
    }
    assert!(payloads.len() > 40, "fixtures found: {}", payloads.len());
    let compared = transcoded_as_built_counted(&payloads);
    let removals = compared.removals;
    assert!(removals > 1000, "{removals} removals compared");
    assert!(compared.stores > 100, "{} stores compared", compared.stores);
    assert!(compared.blocks > compared.stores);
}

#[test]
fn a_store_with_every_field_extra_keys_and_a_salt_from_them_transcodes_to_the_drain_s_bytes() {
    let extra_keys = a([
        a([
            s("sql-lora"),
            s("tenant-a"),
            V::U(7),
            V::B(vec![1, 2]),
            a([s("img"), V::U(3)]),
        ]),
        V::Nil,
        a([V::I(-4), V::F(0.5)]),
    ]);
    let wide = stored(
        &[u64::MAX, 0, 1 << 63],
        &[
            ("parent_block_hash", V::B(vec![9; 40])),
            (
                "token_ids",
                ints([0, 127, 128, 16_383, 16_384, u64::from(u32::MAX)]),
            ),
            ("lora_id", V::I(-1)),
            ("medium", s("cpu_tier2")),
            ("lora_name", s("sql-lora")),
            ("extra_keys", extra_keys),
            ("group_idx", V::U(u64::from(u32::MAX))),
            ("kv_cache_spec_kind", s("full_attention")),
            ("kv_cache_spec_sliding_window", V::U(4096)),
            ("locality", s("local")),
            ("ownership", s(&"o".repeat(200))),
            ("session_id", s("s-1")),
        ],
    );
    let salted = stored(&[5], &[("cache_salt", s("given")), ("lora_name", s(""))]);
    let array = a([
        s("BlockStored"),
        ints([3, 4]),
        V::U(2),
        ints([1, 2, 3, 4]),
        V::U(2),
        V::Nil,
        s("GPU"),
    ]);
    let payloads = [batch(vec![wide, salted, array])];
    let compared = transcoded_as_built_counted(&payloads);
    assert_eq!((compared.stores, compared.blocks), (3, 6));
}

#[test]
fn a_removal_with_every_field_at_its_widest_transcodes_to_prost_s_bytes() {
    let wide = removed(
        &[u64::MAX, 0, 1 << 63, 127, 128],
        &[
            ("medium", s("CPU_TIER2")),
            ("group_idx", V::U(u64::from(u32::MAX))),
            ("kv_cache_spec_kind", s("full_attention")),
            ("locality", s("local")),
            ("ownership", s(&"o".repeat(200))),
        ],
    );
    let many: Vec<u64> = (0..300u64)
        .map(|i| i.wrapping_mul(0x0123_4567_89ab_cdef))
        .collect();
    let payloads = [
        batch(vec![wide]),
        batch(vec![removed(&many, &[("medium", s("gpu"))])]),
        batch(vec![a([s("BlockRemoved"), ints([3]), s("NVME"), V::U(2)])]),
    ];
    assert_eq!(transcoded_as_built(&payloads), 3);
    // Cut after its first removal: the payload fails whole, both ways.
    let whole = batch(vec![removed(&[1], &[]), removed(&[2], &[])]);
    assert_eq!(transcoded_as_built(&[whole[..whole.len() - 4].to_vec()]), 0);
}

/// A removal (or now and then a store or a clear) with any mix of the
/// fields a removal may carry, valid or not.
fn any_event() -> impl Strategy<Value = V> {
    let hash = prop_oneof![
        any::<u64>().prop_map(V::U),
        any::<i64>().prop_map(V::I),
        proptest::collection::vec(any::<u8>(), 0..33).prop_map(V::B),
    ];
    let text = |names: &'static [&'static str]| {
        prop_oneof![
            Just(V::Nil),
            proptest::sample::select(names).prop_map(s),
            any::<u8>().prop_map(|n| V::U(n.into())),
        ]
    };
    (
        proptest::collection::vec(hash, 0..5),
        text(&[
            "GPU",
            "cpu",
            "Cpu_Pinned",
            "disk",
            "NVME",
            "remote",
            "tape",
            "",
        ]),
        prop_oneof![Just(V::Nil), (0u64..4).prop_map(V::U), Just(V::I(-1))],
        text(&["full_attention", "sliding_window", "MLA_ATTENTION"]),
        text(&["LOCAL", "local", "peer"]),
        text(&["kvcr", "engine", "a-long-owner-name-of-some-length"]),
        0u8..10,
    )
        .prop_map(|(hashes, medium, group, kind, locality, ownership, pick)| {
            let fields = [
                ("medium", medium),
                ("group_idx", group),
                ("kv_cache_spec_kind", kind),
                ("locality", locality),
                ("ownership", ownership),
            ];
            match pick {
                0 => stored(&[1, 2], &fields[..2]),
                1 => m(&[("type", s("AllBlocksCleared")), fields[4].clone()]),
                _ => {
                    let mut event = vec![("type", s("BlockRemoved")), ("block_hashes", a(hashes))];
                    event.extend(fields);
                    V::M(event.into_iter().map(|(k, v)| (s(k), v)).collect())
                }
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn any_payload_transcodes_to_the_bytes_of_the_events_it_converts_to(
        payloads in proptest::collection::vec(proptest::collection::vec(any_event(), 0..20), 1..4),
    ) {
        let payloads: Vec<Vec<u8>> = payloads.into_iter().map(batch).collect();
        transcoded_as_built(&payloads);
    }

    #[test]
    fn any_store_transcodes_to_the_bytes_of_the_store_it_converts_to(
        payloads in proptest::collection::vec(proptest::collection::vec(any_store(), 0..8), 1..4),
    ) {
        let payloads: Vec<Vec<u8>> = payloads.into_iter().map(batch).collect();
        transcoded_as_built(&payloads);
    }
}

/// A store (or now and then a removal or a clear) with any mix of the
/// fields a store may carry, valid or not: hashes of every form, blocks of
/// 1 to 3 tokens or a misaligned list, a parent, LoRA, salt and session,
/// extra keys of every shape, TensorRT-LLM's digest tokens and `mm_keys`,
/// in the map form or vLLM's tag-first array.
fn any_store() -> impl Strategy<Value = V> {
    let hash = prop_oneof![
        4 => (0u64..64).prop_map(V::U),
        2 => any::<u64>().prop_map(V::U),
        1 => any::<i64>().prop_map(V::I),
        1 => proptest::collection::vec(any::<u8>(), 0..33).prop_map(V::B),
    ];
    let token = prop_oneof![
        16 => (0u64..200).prop_map(V::U),
        8 => any::<u32>().prop_map(|t| V::U(t.into())),
        1 => Just(V::I(-1)),
        1 => proptest::sample::select(&["d1", "d2"][..]).prop_map(s),
    ];
    let text = |names: &'static [&'static str]| {
        prop_oneof![
            3 => Just(V::Nil),
            12 => proptest::sample::select(names).prop_map(s),
            1 => any::<u8>().prop_map(|n| V::U(n.into())),
        ]
    };
    let key = prop_oneof![
        proptest::sample::select(&["sql-lora", "tenant-a", "", "img"][..]).prop_map(s),
        any::<i64>().prop_map(V::I),
        proptest::collection::vec(any::<u8>(), 0..4).prop_map(V::B),
        (0u64..100).prop_map(|offset| a([s("img"), V::U(offset)])),
        Just(V::F(0.5)),
        Just(V::Nil),
    ];
    let block_keys = prop_oneof![
        4 => proptest::collection::vec(key, 0..4).prop_map(V::A),
        1 => Just(V::Nil),
        1 => Just(V::U(3)),
    ];
    let extra_keys = prop_oneof![
        3 => Just(V::Nil),
        2 => proptest::collection::vec(block_keys, 0..5).prop_map(V::A),
        1 => Just(s("not a list")),
    ];
    let mm_key = prop_oneof![
        4 => (proptest::sample::select(&["d1", "d2", "d3"][..]), 0u64..20)
            .prop_map(|(hash, offset)| m(&[("type", s("mm_key")), ("hash", s(hash)), ("start_offset", V::U(offset))])),
        1 => Just(m(&[("hash", s("d1")), ("start_offset", V::I(-2))])),
        1 => Just(s("d1")),
    ];
    let mm_keys = prop_oneof![
        3 => Just(V::Nil),
        2 => proptest::collection::vec(
            prop_oneof![4 => proptest::collection::vec(mm_key, 0..3).prop_map(V::A), 1 => Just(V::Nil)],
            0..5,
        )
        .prop_map(V::A),
    ];
    let lists = (
        proptest::collection::vec(hash.clone(), 0..6),
        1u64..4,
        0usize..4,
    )
        .prop_flat_map(move |(hashes, block_size, misaligned)| {
            let tokens = hashes.len() * block_size as usize + misaligned / 3;
            (
                Just(V::A(hashes)),
                Just(V::U(block_size)),
                proptest::collection::vec(token.clone(), tokens).prop_map(V::A),
            )
        });
    let placement = (
        prop_oneof![Just(V::Nil), (0u64..4).prop_map(V::U)],
        text(&["full_attention", "full_attention", "sliding_window"]),
        prop_oneof![Just(V::Nil), (0u64..5000).prop_map(V::U)],
        text(&["LOCAL", "local", "LOCAL", "peer"]),
    );
    (
        lists,
        prop_oneof![2 => Just(V::Nil), 2 => hash, 1 => Just(V::U(0))],
        prop_oneof![Just(V::Nil), any::<i64>().prop_map(V::I)],
        text(&["GPU", "cpu", "DISK", "CPU_TIER1", "remote", "tape"]),
        text(&["sql-lora", ""]),
        text(&["tenant-a", ""]),
        text(&["s-1"]),
        (extra_keys, mm_keys),
        placement,
        0u8..12,
    )
        .prop_map(
            |(
                (hashes, block_size, tokens),
                parent,
                lora_id,
                medium,
                lora_name,
                cache_salt,
                session_id,
                (extra_keys, mm_keys),
                (group, kind, window, locality),
                pick,
            )| match pick {
                0 => removed(&[1, 2], &[("medium", medium)]),
                1 => m(&[("type", s("AllBlocksCleared"))]),
                2 => a([
                    s("BlockStored"),
                    hashes,
                    parent,
                    tokens,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                ]),
                _ => m(&[
                    ("type", s("BlockStored")),
                    ("block_hashes", hashes),
                    ("parent_block_hash", parent),
                    ("token_ids", tokens),
                    ("block_size", block_size),
                    ("lora_id", lora_id),
                    ("medium", medium),
                    ("lora_name", lora_name),
                    ("cache_salt", cache_salt),
                    ("session_id", session_id),
                    ("extra_keys", extra_keys),
                    ("mm_keys", mm_keys),
                    ("group_idx", group),
                    ("kv_cache_spec_kind", kind),
                    ("kv_cache_spec_sliding_window", window),
                    ("locality", locality),
                ]),
            },
        )
}

// ---- removals alike but for their hashes, judged once (`removal_memo.rs`) ----

/// Converts `events` as one payload and, with a converter of its own, each
/// event alone in a payload of its own, where no removal can take another's
/// verdict: the same events, ids included, and the same tallies.
fn converts_as_each_alone(rank: u32, events: &[V]) -> Vec<KvCacheEvent> {
    let (mut whole, mut alone) = (Converter::new(), Converter::new());
    let (together, together_tally) = convert_with(&mut whole, rank, events.to_vec());
    let (mut one_by_one, mut one_by_one_tally) = (Vec::new(), Tally::default());
    for event in events {
        let (out, tally) = convert_with(&mut alone, rank, vec![event.clone()]);
        one_by_one.extend(out);
        one_by_one_tally.add(&tally);
    }
    assert_eq!(together, one_by_one);
    assert_eq!(together_tally, one_by_one_tally);
    together
}

/// vLLM's removal: `{type, block_hashes, medium, group_idx}`.
fn vllm_removal(hashes: V) -> V {
    m(&[
        ("type", s("BlockRemoved")),
        ("block_hashes", hashes),
        ("medium", s("GPU")),
        ("group_idx", V::U(0)),
    ])
}

#[test]
fn removals_alike_but_for_their_hashes_are_each_forwarded_with_their_own_hashes() {
    let events = [
        vllm_removal(ints([u64::MAX])),
        vllm_removal(ints([1])),
        vllm_removal(ints([])),
        vllm_removal(a([V::I(-2), V::B(vec![7; 20]), V::U(300)])),
    ];
    let out = converts_as_each_alone(0, &events);
    let hashes: Vec<(u64, Vec<i64>)> = out
        .into_iter()
        .map(|event| match event.data {
            Some(Data::Removed(removed)) => (event.event_id, removed.block_hashes),
            other => panic!("expected a removal, got {other:?}"),
        })
        .collect();
    assert_eq!(
        hashes,
        [
            (1, vec![-1]),
            (2, vec![1]),
            (3, vec![]),
            (4, vec![-2, fold_bytes(&[7; 20]), 300])
        ]
    );
}

#[test]
fn a_removal_alike_but_for_a_list_that_holds_no_hashes_is_malformed_as_it_would_be_alone() {
    let events = [
        vllm_removal(ints([1])),
        vllm_removal(a([V::U(2), s("not a hash")])),
        vllm_removal(V::Nil),
        vllm_removal(s("not a list")),
        vllm_removal(ints([3])),
    ];
    converts_as_each_alone(0, &events);
    let (out, tally) = convert(events.to_vec());
    assert_eq!(out.iter().map(|e| e.event_id).collect::<Vec<_>>(), [1, 5]);
    assert_eq!(tally.dropped(DropReason::Malformed), 3);
}

#[test]
fn a_payload_of_alike_removals_cut_anywhere_is_rejected_whole_and_teaches_no_group_kind() {
    let sliding = stored(
        &[9],
        &[
            ("group_idx", V::U(0)),
            ("kv_cache_spec_kind", s("sliding_window")),
        ],
    );
    let payload = batch(vec![
        sliding,
        vllm_removal(ints([1])),
        vllm_removal(ints([2])),
        vllm_removal(ints([u64::MAX])),
    ]);
    let mut converter = Converter::new();
    every_cut_fails_and_counts_nothing(&mut converter, &payload);
    // Group 0 was never learned as sliding: a removal in it is forwarded,
    // with the first event id.
    let (out, _) = convert_with(&mut converter, 0, vec![vllm_removal(ints([3]))]);
    assert_eq!(out.iter().map(|e| e.event_id).collect::<Vec<_>>(), [1]);
}

#[test]
fn a_group_kind_learned_between_alike_removals_judges_the_ones_after_it() {
    let kindless = |hash| {
        m(&[
            ("type", s("BlockRemoved")),
            ("block_hashes", ints([hash])),
            ("group_idx", V::U(1)),
        ])
    };
    let kind = |kind| {
        stored(
            &[9],
            &[("group_idx", V::U(1)), ("kv_cache_spec_kind", s(kind))],
        )
    };
    let events = [
        kindless(1),
        kindless(2),
        kind("sliding_window"),
        kindless(3),
        kindless(4),
        kind("full_attention"),
        kindless(5),
    ];
    let out = converts_as_each_alone(0, &events);
    assert_eq!(
        out.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        [1, 2, 6, 7]
    );
}

/// Payloads of removals alike but for their hashes: each event takes one
/// of two removal shapes (any medium, group, kind, locality and ownership a removal may carry,
/// the map form or vLLM's tag-first array, its hash list now and then
/// repeated) with hashes of its own, now and then a list that holds no
/// hashes; or it is a store teaching group 1's kind.
fn alike_removals() -> impl Strategy<Value = Vec<V>> {
    let hash = prop_oneof![
        6 => any::<u64>().prop_map(V::U),
        2 => (0u64..128).prop_map(V::U),
        2 => any::<i64>().prop_map(V::I),
        1 => proptest::collection::vec(any::<u8>(), 0..9).prop_map(V::B),
        1 => Just(s("not a hash")),
    ];
    let hashes = prop_oneof![
        12 => proptest::collection::vec(hash, 0..4).prop_map(V::A),
        1 => Just(V::Nil),
        1 => Just(V::U(7)),
    ];
    let shape = (
        prop_oneof![
            Just(V::Nil),
            proptest::sample::select(&["GPU", "cpu", "tape"][..]).prop_map(s),
            Just(V::U(1)),
        ],
        prop_oneof![Just(V::Nil), (0u64..3).prop_map(V::U)],
        prop_oneof![
            3 => Just(None),
            1 => proptest::sample::select(&["full_attention", "sliding_window"][..]).prop_map(Some),
        ],
        prop_oneof![
            3 => Just(None),
            1 => proptest::sample::select(&["LOCAL", "peer", "kvcr", "engine"][..]).prop_map(Some),
        ],
        any::<bool>(),
        prop_oneof![5 => Just(false), 1 => Just(true)],
    );
    (
        proptest::collection::vec(shape, 2),
        proptest::collection::vec((0u8..12, hashes), 0..24),
    )
        .prop_map(|(shapes, picks)| {
            picks
                .into_iter()
                .map(|(pick, hashes)| {
                    let (medium, group, kind, locality_or_ownership, array_form, repeated) =
                        shapes[usize::from(pick % 2)].clone();
                    match pick {
                        0 => stored(
                            &[1],
                            &[
                                ("group_idx", V::U(1)),
                                ("kv_cache_spec_kind", s("sliding_window")),
                            ],
                        ),
                        1 => stored(
                            &[1],
                            &[
                                ("group_idx", V::U(1)),
                                ("kv_cache_spec_kind", s("full_attention")),
                            ],
                        ),
                        _ if array_form => a([s("BlockRemoved"), hashes, medium, group]),
                        _ => {
                            let mut fields = vec![("type", s("BlockRemoved"))];
                            if repeated {
                                fields.push(("block_hashes", ints([5])));
                            }
                            fields.extend([
                                ("block_hashes", hashes),
                                ("medium", medium),
                                ("group_idx", group),
                            ]);
                            fields.extend(kind.map(|kind| ("kv_cache_spec_kind", s(kind))));
                            fields.extend(locality_or_ownership.map(|value| match value {
                                "LOCAL" | "peer" => ("locality", s(value)),
                                _ => ("ownership", s(value)),
                            }));
                            V::M(fields.into_iter().map(|(k, v)| (s(k), v)).collect())
                        }
                    }
                })
                .collect()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn removals_alike_but_for_their_hashes_convert_and_transcode_as_each_would_alone(
        events in alike_removals(),
        rank in 0u32..2,
    ) {
        converts_as_each_alone(rank, &events);
        transcoded_as_built(&[batch(events)]);
    }
}

#[test]
fn leading_full_blocks_pair_hashes_with_whole_blocks_and_drop_what_has_none() {
    let mut converter = Converter::with_alignment(super::Alignment::LeadingFullBlocks);
    // 3 hashes, 5 tokens of block size 2: two whole blocks.
    let short = stored(&[1, 2, 3], &[("token_ids", ints(100..105))]);
    // 1 hash, 6 tokens: one block, the rest ignored.
    let long = stored(&[4], &[("token_ids", ints(200..206))]);
    // 2 hashes, 1 token: no whole block.
    let none = stored(&[5, 6], &[("token_ids", ints(300..301))]);
    let (events, tally) = convert_with(&mut converter, 0, vec![short, long, none]);
    let blocks: Vec<(i64, Vec<u32>)> = events
        .iter()
        .flat_map(|event| match &event.data {
            Some(Data::Stored(stored)) => stored.blocks.clone(),
            _ => Vec::new(),
        })
        .map(|block| (block.block_hash, block.token_ids))
        .collect();
    assert_eq!(
        blocks,
        [
            (1, vec![100, 101]),
            (2, vec![102, 103]),
            (4, vec![200, 201])
        ]
    );
    assert_eq!(tally.dropped(DropReason::UnalignedBlocks), 1);
    // The stream's converter keeps the contract's rule.
    let (_, tally) = convert(vec![stored(&[1, 2, 3], &[("token_ids", ints(100..105))])]);
    assert_eq!(tally.dropped(DropReason::UnalignedBlocks), 1);
}

#[test]
fn a_kindless_event_of_an_unnamed_group_is_main_only_in_group_zero_when_asked() {
    let events = || {
        vec![
            stored(&[1], &[("group_idx", V::U(0))]),
            stored(&[2], &[("group_idx", V::U(20))]),
        ]
    };
    let mut dynamo = Converter::new().with_unnamed_groups(super::UnnamedGroups::MainOnlyGroupZero);
    let (forwarded, tally) = convert_with(&mut dynamo, 0, events());
    assert_eq!(forwarded.len(), 1);
    assert_eq!(tally.dropped(DropReason::NonMainAttentionGroup), 1);
    // The stream's converter keeps the contract's rule: both are main.
    assert_eq!(convert(events()).0.len(), 2);
}
