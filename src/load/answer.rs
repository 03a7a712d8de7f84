//! Each engine's `GetLoads` answer as `EngineLoad` records, one per rank.
//!
//! Invariant: whatever the engine answers, what comes out is a record per
//! rank kvgate serves, each field either the engine's number or, when that
//! number cannot be right (negative, not finite, a share above 1), clamped
//! with the reason counted; answers for ranks kvgate does not serve, or a
//! second answer for the same rank, are dropped and counted. Fields the
//! engine does not report stay unset.

use crate::proto::common::{
    EngineDisaggregation, EngineLoad, EngineLora, EngineMemory, EngineQueues, EngineSpeculative,
};
use crate::proto::vllm::grpc::engine as vllm;
use crate::proto::{sglang::grpc::scheduler as sglang, tokenspeed::grpc::scheduler as tokenspeed};

/// Why part of an answer was clamped or dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// A count, rate or share below zero: clamped to 0.
    Negative,
    /// NaN or infinite: set to 0.
    NotFinite,
    /// A share (token usage, hit rate) above 1: clamped to 1.
    AboveOne,
    /// A rank kvgate does not serve (or a negative rank): dropped.
    UnknownRank,
    /// A second answer for a rank already answered: dropped.
    DuplicateRank,
    /// A rank kvgate serves that the answer left out: its last reading ages.
    MissingRank,
}

impl Fault {
    pub const ALL: [Self; 6] = [
        Self::Negative,
        Self::NotFinite,
        Self::AboveOne,
        Self::UnknownRank,
        Self::DuplicateRank,
        Self::MissingRank,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Negative => "negative",
            Self::NotFinite => "not_finite",
            Self::AboveOne => "above_one",
            Self::UnknownRank => "unknown_rank",
            Self::DuplicateRank => "duplicate_rank",
            Self::MissingRank => "missing_rank",
        }
    }
}

/// The faults found in one answer.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Faults(Vec<Fault>);

impl Faults {
    pub fn add(&mut self, fault: Fault) {
        self.0.push(fault);
    }

    pub fn iter(&self) -> impl Iterator<Item = Fault> + '_ {
        self.0.iter().copied()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One rank's record as the engine answered it (`dp_rank` still unchecked).
#[derive(Debug, PartialEq)]
pub struct RankLoad {
    pub dp_rank: i32,
    pub load: EngineLoad,
}

/// Numbers made sane, each repair counted.
struct Clamp<'a>(&'a mut Faults);

impl Clamp<'_> {
    fn count(&mut self, value: i32) -> u32 {
        u32::try_from(value).unwrap_or_else(|_| {
            self.0.add(Fault::Negative);
            0
        })
    }

    fn int(&mut self, value: i32) -> i32 {
        self.count(value) as i32
    }

    fn amount(&mut self, value: f64) -> f64 {
        if !value.is_finite() {
            self.0.add(Fault::NotFinite);
            0.0
        } else if value < 0.0 {
            self.0.add(Fault::Negative);
            0.0
        } else {
            value
        }
    }

    fn share(&mut self, value: f64) -> f64 {
        let value = self.amount(value);
        if value > 1.0 {
            self.0.add(Fault::AboveOne);
            1.0
        } else {
            value
        }
    }

    fn memory(&mut self, m: &sglang::MemoryMetrics) -> EngineMemory {
        EngineMemory {
            weight_gb: self.amount(m.weight_gb),
            kv_cache_gb: self.amount(m.kv_cache_gb),
            graph_gb: self.amount(m.graph_gb),
            token_capacity: self.int(m.token_capacity),
        }
    }

    fn queues(&mut self, q: &sglang::QueueMetrics) -> EngineQueues {
        EngineQueues {
            waiting: self.int(q.waiting),
            grammar: self.int(q.grammar),
            paused: self.int(q.paused),
            retracted: self.int(q.retracted),
        }
    }
}

/// The core every engine reports, in the engines' own types.
struct Core {
    running: i32,
    waiting: i32,
    waiting_uncached_tokens: i32,
    token_usage: f64,
    gen_throughput: f64,
    max_running: i32,
    cache_hit_rate: f64,
    used_tokens: i32,
    max_total_tokens: i32,
}

impl Core {
    fn record(self, clamp: &mut Clamp) -> EngineLoad {
        EngineLoad {
            running_requests: clamp.count(self.running),
            waiting_requests: clamp.count(self.waiting),
            waiting_uncached_tokens: Some(clamp.count(self.waiting_uncached_tokens)),
            token_usage: clamp.share(self.token_usage),
            gen_throughput: clamp.amount(self.gen_throughput),
            max_running_requests: clamp.count(self.max_running),
            cache_hit_rate: Some(clamp.share(self.cache_hit_rate)),
            num_used_tokens: Some(clamp.int(self.used_tokens)),
            max_total_num_tokens: Some(clamp.int(self.max_total_tokens)),
            ..EngineLoad::default()
        }
    }
}

/// The fields every engine's per-rank load message shares, by the names
/// all three generated types give them.
macro_rules! core_of {
    ($load:expr) => {
        Core {
            running: $load.num_running_reqs,
            waiting: $load.num_waiting_reqs,
            waiting_uncached_tokens: $load.num_waiting_uncached_tokens,
            token_usage: $load.token_usage,
            gen_throughput: $load.gen_throughput,
            max_running: $load.max_running_requests,
            cache_hit_rate: $load.cache_hit_rate,
            used_tokens: $load.num_used_tokens,
            max_total_tokens: $load.max_total_num_tokens,
        }
    };
}

pub fn from_sglang(answer: sglang::GetLoadsResponse, faults: &mut Faults) -> Vec<RankLoad> {
    let clamp = &mut Clamp(faults);
    answer
        .loads
        .into_iter()
        .map(|l| {
            let mut load = core_of!(l).record(clamp);
            load.memory = l.memory.as_ref().map(|m| clamp.memory(m));
            load.queues = l.queues.as_ref().map(|q| clamp.queues(q));
            load.speculative = l.speculative.map(|s| EngineSpeculative {
                accept_length: clamp.amount(s.accept_length),
                accept_rate: clamp.share(s.accept_rate),
            });
            load.lora = l.lora.map(|lora| EngineLora {
                slots_used: clamp.int(lora.slots_used),
                slots_total: clamp.int(lora.slots_total),
                utilization: clamp.share(lora.utilization),
            });
            load.disaggregation = l.disaggregation.map(|d| EngineDisaggregation {
                mode: d.mode,
                prefill_prealloc_queue_reqs: clamp.int(d.prefill_prealloc_queue_reqs),
                prefill_inflight_queue_reqs: clamp.int(d.prefill_inflight_queue_reqs),
                decode_prealloc_queue_reqs: clamp.int(d.decode_prealloc_queue_reqs),
                decode_transfer_queue_reqs: clamp.int(d.decode_transfer_queue_reqs),
                decode_retracted_queue_reqs: clamp.int(d.decode_retracted_queue_reqs),
                kv_transfer_speed_gb_s: clamp.amount(d.kv_transfer_speed_gb_s),
                kv_transfer_latency_ms: clamp.amount(d.kv_transfer_latency_ms),
            });
            RankLoad {
                dp_rank: l.dp_rank,
                load,
            }
        })
        .collect()
}

pub fn from_vllm(answer: vllm::GetLoadsResponse, faults: &mut Faults) -> Vec<RankLoad> {
    let clamp = &mut Clamp(faults);
    answer
        .loads
        .into_iter()
        .map(|l| RankLoad {
            dp_rank: l.dp_rank,
            load: core_of!(l).record(clamp),
        })
        .collect()
}

pub fn from_tokenspeed(answer: tokenspeed::GetLoadsResponse, faults: &mut Faults) -> Vec<RankLoad> {
    let clamp = &mut Clamp(faults);
    answer
        .loads
        .into_iter()
        .map(|l| {
            let mut load = core_of!(l).record(clamp);
            load.active_token_usage = l.active_token_usage.map(|share| clamp.share(share));
            // TokenSpeed's sections have SGLang's shape, field for field.
            load.memory = l.memory.map(|m| {
                clamp.memory(&sglang::MemoryMetrics {
                    weight_gb: m.weight_gb,
                    kv_cache_gb: m.kv_cache_gb,
                    graph_gb: m.graph_gb,
                    token_capacity: m.token_capacity,
                })
            });
            load.queues = l.queues.map(|q| {
                clamp.queues(&sglang::QueueMetrics {
                    waiting: q.waiting,
                    grammar: q.grammar,
                    paused: q.paused,
                    retracted: q.retracted,
                })
            });
            RankLoad {
                dp_rank: l.dp_rank,
                load,
            }
        })
        .collect()
}

/// Places each rank's record on a board of `ranks` ranks; `None` where the
/// answer had nothing usable for the rank.
pub fn by_rank(answer: Vec<RankLoad>, ranks: u32, faults: &mut Faults) -> Vec<Option<EngineLoad>> {
    let mut placed: Vec<Option<EngineLoad>> = vec![None; ranks as usize];
    for RankLoad { dp_rank, load } in answer {
        match usize::try_from(dp_rank)
            .ok()
            .and_then(|r| placed.get_mut(r))
        {
            None => faults.add(Fault::UnknownRank),
            Some(Some(_)) => faults.add(Fault::DuplicateRank),
            Some(slot) => *slot = Some(load),
        }
    }
    for _ in placed.iter().filter(|slot| slot.is_none()) {
        faults.add(Fault::MissingRank);
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sglang_load(rank: i32) -> sglang::SchedulerLoad {
        sglang::SchedulerLoad {
            dp_rank: rank,
            num_running_reqs: 3,
            num_waiting_reqs: 2,
            num_waiting_uncached_tokens: 900,
            token_usage: 0.25,
            gen_throughput: 120.5,
            max_running_requests: 64,
            cache_hit_rate: 0.5,
            num_used_tokens: 1000,
            max_total_num_tokens: 4000,
            ..Default::default()
        }
    }

    #[test]
    fn every_field_sglang_reports_is_carried_and_absent_sections_stay_unset() {
        let mut faults = Faults::default();
        let mut with_queues = sglang_load(1);
        with_queues.queues = Some(sglang::QueueMetrics {
            waiting: 2,
            grammar: 1,
            paused: 0,
            retracted: 0,
        });
        let answer = sglang::GetLoadsResponse {
            loads: vec![sglang_load(0), with_queues],
            ..Default::default()
        };
        let loads = from_sglang(answer, &mut faults);
        assert!(faults.is_empty());
        let load = &loads[0].load;
        assert_eq!(
            (
                load.running_requests,
                load.waiting_requests,
                load.max_running_requests
            ),
            (3, 2, 64)
        );
        assert_eq!(load.waiting_uncached_tokens, Some(900));
        assert_eq!((load.token_usage, load.gen_throughput), (0.25, 120.5));
        assert_eq!(load.num_used_tokens, Some(1000));
        assert_eq!(load.max_total_num_tokens, Some(4000));
        assert_eq!(load.memory, None);
        assert_eq!(load.queues, None);
        assert_eq!(load.active_token_usage, None, "SGLang does not report it");
        assert_eq!(loads[1].load.queues.as_ref().unwrap().grammar, 1);
    }

    #[test]
    fn negative_and_non_finite_numbers_are_clamped_and_counted() {
        let mut faults = Faults::default();
        let answer = vllm::GetLoadsResponse {
            loads: vec![vllm::SchedulerLoad {
                num_running_reqs: -5,
                token_usage: 7.0,
                gen_throughput: f64::NAN,
                cache_hit_rate: -0.1,
                ..Default::default()
            }],
            ..Default::default()
        };
        let load = &from_vllm(answer, &mut faults)[0].load;
        assert_eq!(load.running_requests, 0);
        assert_eq!(load.token_usage, 1.0);
        assert_eq!(load.gen_throughput, 0.0);
        assert_eq!(load.cache_hit_rate, Some(0.0));
        assert_eq!(
            faults.iter().collect::<Vec<_>>(),
            vec![
                Fault::Negative,
                Fault::AboveOne,
                Fault::NotFinite,
                Fault::Negative
            ]
        );
    }

    #[test]
    fn tokenspeed_reports_active_usage_and_its_sections_in_sglangs_shape() {
        let mut faults = Faults::default();
        let answer = tokenspeed::GetLoadsResponse {
            loads: vec![tokenspeed::SchedulerLoad {
                max_running_requests: 8,
                active_token_usage: Some(0.125),
                memory: Some(tokenspeed::MemoryMetrics {
                    token_capacity: 77,
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let load = &from_tokenspeed(answer, &mut faults)[0].load;
        assert_eq!(load.max_running_requests, 8);
        assert_eq!(load.active_token_usage, Some(0.125));
        assert_eq!(load.memory.as_ref().unwrap().token_capacity, 77);
        assert!(faults.is_empty());
    }

    #[test]
    fn ranks_kvgate_does_not_serve_and_repeated_ranks_are_dropped_and_missing_ranks_counted() {
        let mut faults = Faults::default();
        let answer = [0, 7, -1, 0]
            .into_iter()
            .map(|dp_rank| RankLoad {
                dp_rank,
                load: EngineLoad::default(),
            })
            .collect();
        let placed = by_rank(answer, 2, &mut faults);
        assert_eq!(placed.len(), 2);
        assert!(placed[0].is_some());
        assert!(placed[1].is_none());
        assert_eq!(
            faults.iter().collect::<Vec<_>>(),
            vec![
                Fault::UnknownRank,
                Fault::UnknownRank,
                Fault::DuplicateRank,
                Fault::MissingRank
            ]
        );
    }
}
