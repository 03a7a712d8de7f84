//! SGLang 0.5.23's load gauge (`LoadStat`), byte for byte.
//!
//! Invariant: [`LoadStat::encode`] writes exactly what SGLang's
//! `SchedulerLoadPublisher` puts in frame 3 of `[b"load", seq, payload]`:
//! a msgspec tagged array (tag first, every field in declaration order, no
//! trailing default omitted) with the smallest int encodings. The fixture
//! test pins this against bytes the real publisher sent.

use rmp::encode::{write_array_len, write_nil, write_sint, write_str};

/// The topic SGLang's load publisher sends under.
pub const LOAD_TOPIC: &str = "load";

/// One scheduler's load, as SGLang's `LoadStat` carries it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadStat {
    pub num_running_reqs: i64,
    pub num_waiting_reqs: i64,
    /// KV tokens in use.
    pub num_tokens: i64,
    /// KV capacity; 0 when unknown.
    pub max_total_num_tokens: i64,
    pub attn_dp_rank: Option<i64>,
    pub num_waiting_uncached_tokens: i64,
    pub num_total_tokens: i64,
    pub max_running_requests: i64,
    pub total_prefill_uncached_tokens: i64,
    pub total_prefill_busy_us: i64,
}

impl LoadStat {
    /// Appends the msgpack of `["LoadStat", fields...]` to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let ints = [
            self.num_running_reqs,
            self.num_waiting_reqs,
            self.num_tokens,
            self.max_total_num_tokens,
        ];
        let rest = [
            self.num_waiting_uncached_tokens,
            self.num_total_tokens,
            self.max_running_requests,
            self.total_prefill_uncached_tokens,
            self.total_prefill_busy_us,
        ];
        let write = |out: &mut Vec<u8>| -> Result<(), rmp::encode::ValueWriteError> {
            write_array_len(out, 11)?;
            write_str(out, "LoadStat")?;
            for value in ints {
                write_sint(out, value)?;
            }
            match self.attn_dp_rank {
                Some(rank) => drop(write_sint(out, rank)?),
                None => write_nil(out).map_err(rmp::encode::ValueWriteError::InvalidMarkerWrite)?,
            }
            for value in rest {
                write_sint(out, value)?;
            }
            Ok(())
        };
        write(out).expect("msgpack writes into a Vec cannot fail");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_is_byte_for_byte_what_sglangs_publisher_sent() {
        let stat = LoadStat {
            num_running_reqs: 3,
            num_waiting_reqs: 2,
            num_tokens: 1200,
            max_total_num_tokens: 4096,
            attn_dp_rank: Some(0),
            num_waiting_uncached_tokens: 800,
            num_total_tokens: 2048,
            max_running_requests: 48,
            total_prefill_uncached_tokens: 123_456,
            total_prefill_busy_us: 987_654,
        };
        let mut out = Vec::new();
        stat.encode(&mut out);
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/load/sglang-0.5.23/load-stat.msgpack");
        let fixture = std::fs::read(fixture).unwrap();
        assert_eq!(out, fixture);
    }
}
