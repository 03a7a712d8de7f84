//! SGLang's `LoadStat` (frame 3 of its load publisher's messages) as an
//! `EngineLoad` record.
//!
//! The wire shape (sglang 0.5.23, `load_publisher.py`) is a tagged msgpack
//! array `["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens,
//! max_total_num_tokens, attn_dp_rank, num_waiting_uncached_tokens,
//! num_total_tokens, max_running_requests, total_prefill_uncached_tokens,
//! total_prefill_busy_us]`; the first five positions are required, the
//! rest may be missing (an older engine), and positions past the last one
//! known here are ignored (a newer one). Invariant: whatever the bytes, what
//! comes out is either a record whose every number makes sense (a negative
//! or absurd one clamped, with the reason counted) or a refusal saying why;
//! fields the stat does not carry stay unset.

use crate::proto::common::EngineLoad;

/// Why part of a pushed stat was clamped, or the whole message skipped:
/// the `reason` label of `kvgate_load_push_faults_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushFault {
    /// Not the three frames `[topic, sequence, payload]`.
    WrongFrameCount,
    /// A sequence frame that is not 8 bytes.
    BadSequenceFrame,
    /// A topic other than `load`.
    TopicMismatch,
    /// Not msgpack, or not a `LoadStat` (tag, shape or a field's type).
    NotLoadStat,
    /// A count below zero: clamped to 0.
    Negative,
    /// A number no engine reports (past what the record's field holds):
    /// clamped to the field's maximum.
    TooLarge,
    /// More tokens in use than the engine's capacity: usage clamped to 1.
    AboveOne,
    /// The stat names a rank kvgate does not serve: skipped.
    UnknownRank,
    /// The publisher's counter jumped: readings were lost (normal when its
    /// high-water mark sheds; the next one supersedes them).
    SequenceGap,
    /// The publisher's counter went back: the engine restarted.
    SequenceBack,
}

impl PushFault {
    pub const ALL: [Self; 10] = [
        Self::WrongFrameCount,
        Self::BadSequenceFrame,
        Self::TopicMismatch,
        Self::NotLoadStat,
        Self::Negative,
        Self::TooLarge,
        Self::AboveOne,
        Self::UnknownRank,
        Self::SequenceGap,
        Self::SequenceBack,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::WrongFrameCount => "wrong_frame_count",
            Self::BadSequenceFrame => "bad_sequence_frame",
            Self::TopicMismatch => "topic_mismatch",
            Self::NotLoadStat => "not_load_stat",
            Self::Negative => "negative",
            Self::TooLarge => "too_large",
            Self::AboveOne => "above_one",
            Self::UnknownRank => "unknown_rank",
            Self::SequenceGap => "sequence_gap",
            Self::SequenceBack => "sequence_back",
        }
    }
}

/// The tag SGLang's `LoadStat` struct is encoded with.
const TAG: &str = "LoadStat";

/// A decoded stat: the record, and the rank the stat claims (informational
/// in SGLang: each rank publishes on its own port).
#[derive(Debug, PartialEq)]
pub struct Stat {
    pub load: EngineLoad,
    pub claimed_rank: Option<i128>,
}

/// Decodes `payload`, pushing onto `faults` every number it had to clamp.
pub fn decode(payload: &[u8], faults: &mut Vec<PushFault>) -> Result<Stat, PushFault> {
    let mut rd = payload;
    let len = rmp::decode::read_array_len(&mut rd).map_err(|_| PushFault::NotLoadStat)?;
    let (tag, rest) = rmp::decode::read_str_from_slice(rd).map_err(|_| PushFault::NotLoadStat)?;
    rd = rest;
    if tag != TAG || len < 5 {
        return Err(PushFault::NotLoadStat);
    }
    // Every position after the tag, as far as this reader knows them.
    let mut fields = [None::<i128>; 10];
    for (index, field) in fields.iter_mut().enumerate().take(len as usize - 1) {
        // attn_dp_rank (index 4) is optional: nil when unset.
        if index == 4 && rd.first() == Some(&0xc0) {
            rd = &rd[1..];
            continue;
        }
        *field = Some(rmp::decode::read_int(&mut rd).map_err(|_| PushFault::NotLoadStat)?);
    }
    let [
        running,
        waiting,
        used,
        total,
        claimed_rank,
        uncached,
        _total_tokens,
        max_running,
        ..,
    ] = fields;
    let mut clamp = Clamp(faults);
    let used = clamp.int(used.unwrap_or(0));
    let total = clamp.int(total.unwrap_or(0));
    // SGLang sends 0 for a capacity it does not know.
    let token_usage = if total > 0 {
        f64::from(used) / f64::from(total)
    } else {
        0.0
    };
    let load = EngineLoad {
        running_requests: clamp.count(running.unwrap_or(0)),
        waiting_requests: clamp.count(waiting.unwrap_or(0)),
        waiting_uncached_tokens: uncached.map(|tokens| clamp.count(tokens)),
        token_usage: if token_usage > 1.0 {
            clamp.0.push(PushFault::AboveOne);
            1.0
        } else {
            token_usage
        },
        max_running_requests: max_running.map_or(0, |max| clamp.count(max)),
        num_used_tokens: Some(used),
        max_total_num_tokens: (total > 0).then_some(total),
        ..EngineLoad::default()
    };
    Ok(Stat { load, claimed_rank })
}

/// Numbers made to fit their fields, each repair counted.
struct Clamp<'a>(&'a mut Vec<PushFault>);

impl Clamp<'_> {
    fn count(&mut self, value: i128) -> u32 {
        self.fit(value, u32::MAX)
    }

    fn int(&mut self, value: i128) -> i32 {
        self.fit(value, i32::MAX)
    }

    fn fit<T: TryFrom<i128> + Default>(&mut self, value: i128, max: T) -> T {
        if value < 0 {
            self.0.push(PushFault::Negative);
            return T::default();
        }
        T::try_from(value).unwrap_or_else(|_| {
            self.0.push(PushFault::TooLarge);
            max
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/tests/fixtures/load/sglang-0.5.23/{name}.msgpack",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(path).unwrap()
    }

    /// `["LoadStat", fields...]` as msgspec encodes it.
    fn stat(fields: &[Option<i64>]) -> Vec<u8> {
        let mut out = Vec::new();
        rmp::encode::write_array_len(&mut out, fields.len() as u32 + 1).unwrap();
        rmp::encode::write_str(&mut out, TAG).unwrap();
        for field in fields {
            match field {
                Some(value) => rmp::encode::write_sint(&mut out, *value).map(drop).unwrap(),
                None => rmp::encode::write_nil(&mut out).unwrap(),
            }
        }
        out
    }

    #[test]
    fn sglangs_own_stat_maps_every_field_the_record_has() {
        let mut faults = Vec::new();
        let stat = decode(&fixture("load-stat"), &mut faults).unwrap();
        assert!(faults.is_empty());
        assert_eq!(stat.claimed_rank, Some(0));
        let load = stat.load;
        assert_eq!((load.running_requests, load.waiting_requests), (3, 2));
        assert_eq!(load.num_used_tokens, Some(1200));
        assert_eq!(load.max_total_num_tokens, Some(4096));
        assert_eq!(load.token_usage, 1200.0 / 4096.0);
        assert_eq!(load.waiting_uncached_tokens, Some(800));
        assert_eq!(load.max_running_requests, 48);
        assert_eq!(load.cache_hit_rate, None, "a stat does not carry it");
        assert_eq!(load.active_token_usage, None);
        let rank2 = decode(&fixture("load-stat-rank-2"), &mut faults).unwrap();
        assert_eq!(rank2.claimed_rank, Some(2));
    }

    #[test]
    fn the_six_position_prefix_leaves_the_later_fields_unset_and_appended_ones_are_ignored() {
        let mut faults = Vec::new();
        let prefix = decode(
            &stat(&[Some(1), Some(0), Some(10), Some(0), None]),
            &mut faults,
        )
        .unwrap();
        assert_eq!(prefix.load.waiting_uncached_tokens, None);
        assert_eq!(prefix.load.max_running_requests, 0);
        assert_eq!(prefix.load.max_total_num_tokens, None, "0 means unknown");
        assert_eq!(prefix.load.token_usage, 0.0);
        assert_eq!(prefix.claimed_rank, None);
        let mut longer: Vec<Option<i64>> = (1..=10).map(Some).collect();
        longer.extend([Some(99), Some(-7)]);
        let appended = decode(&stat(&longer), &mut faults).unwrap();
        assert_eq!(appended.load.max_running_requests, 8);
        assert!(faults.is_empty());
    }

    #[test]
    fn negative_and_absurd_numbers_are_clamped_and_counted() {
        let mut faults = Vec::new();
        let stat = decode(
            &stat(&[
                Some(-1),
                Some(i64::MAX),
                Some(500),
                Some(100),
                Some(0),
                Some(3),
            ]),
            &mut faults,
        )
        .unwrap();
        assert_eq!(stat.load.running_requests, 0);
        assert_eq!(stat.load.waiting_requests, u32::MAX);
        assert_eq!(stat.load.token_usage, 1.0);
        assert_eq!(
            faults,
            [
                PushFault::Negative,
                PushFault::TooLarge,
                PushFault::AboveOne
            ]
        );
    }

    #[test]
    fn anything_but_a_load_stat_is_refused() {
        let mut other_tag = Vec::new();
        rmp::encode::write_array_len(&mut other_tag, 5).unwrap();
        rmp::encode::write_str(&mut other_tag, "KVEventBatch").unwrap();
        let mut float = Vec::new();
        rmp::encode::write_array_len(&mut float, 5).unwrap();
        rmp::encode::write_str(&mut float, TAG).unwrap();
        rmp::encode::write_sint(&mut float, 1).unwrap();
        rmp::encode::write_sint(&mut float, 1).unwrap();
        rmp::encode::write_f64(&mut float, 0.5).unwrap();
        rmp::encode::write_sint(&mut float, 0).unwrap();
        let garbage: &[&[u8]] = &[
            b"",
            b"\xc1",
            b"not msgpack at all",
            &other_tag,
            &stat(&[Some(1), Some(2), Some(3)]),
            &float,
            &fixture("load-stat")[..20],
        ];
        for payload in garbage {
            assert_eq!(
                decode(payload, &mut Vec::new()),
                Err(PushFault::NotLoadStat),
                "{payload:?}"
            );
        }
    }
}
