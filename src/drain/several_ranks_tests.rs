//! The drain with an engine of several ranks: a rank's restart or own
//! clear reaches routers as removals of its blocks, never as a clear.

use std::collections::HashMap;

use kvgate_sim::SimEvent;

use super::*;
use crate::hub::{HistoryLimits, HubReader, hub};
use crate::proto::common::KvEventBatch;

/// A drain for an engine of `ranks` ranks on a hub of its own.
fn drain_of(ranks: u32) -> (Drain, HubReader) {
    let (writer, reader) = hub(
        64,
        HistoryLimits {
            batches: 100_000,
            bytes: 1 << 30,
        },
    );
    let limits = BatchLimits {
        max_events: 1024,
        max_bytes: 1 << 20,
    };
    let drain = Drain::new(limits, 1, writer, Metrics::default()).with_engine_ranks(ranks);
    (drain, reader)
}

fn stored(hashes: &[u64], parent: Option<u64>) -> SimEvent {
    SimEvent::Stored {
        hashes: hashes.to_vec(),
        parent,
        tokens: vec![7; hashes.len() * 2],
        block_size: 2,
    }
}

/// `events` as one engine payload of `rank`, ingested (not flushed).
fn engine_sends(drain: &mut Drain, rank: u32, engine_sequence: u64, events: &[SimEvent]) {
    let mut payload = Vec::new();
    kvgate_sim::encode_batch(1.0, events, Some(rank), &mut payload);
    drain.ingest(SourceEvent::Message(EngineMessage {
        rank,
        engine_sequence,
        payload: payload.into(),
    }));
}

/// Every batch published so far, in order.
fn published(reader: &HubReader) -> Vec<KvEventBatch> {
    let (oldest, newest) = reader.history().span();
    (oldest..=newest)
        .filter_map(|position| reader.history().get(position))
        .map(|batch| KvEventBatch::decode(batch.encoded.clone()).unwrap())
        .collect()
}

/// What a router holds per rank after `batches`, copies counted; a
/// clear empties the whole worker, as the router's does.
fn router_view(batches: &[KvEventBatch]) -> BTreeMap<i32, HashMap<i64, u32>> {
    let mut view: BTreeMap<i32, HashMap<i64, u32>> = BTreeMap::new();
    for batch in batches {
        let rank = batch.dp_rank.unwrap_or(0);
        for event in &batch.events {
            match &event.data {
                Some(Data::Stored(stored)) => {
                    for block in &stored.blocks {
                        *view
                            .entry(rank)
                            .or_default()
                            .entry(block.block_hash)
                            .or_default() += 1;
                    }
                }
                Some(Data::Removed(removed)) => {
                    let blocks = view.entry(rank).or_default();
                    for hash in &removed.block_hashes {
                        let copies = blocks.get_mut(hash).expect("a removal names a live block");
                        *copies -= 1;
                        if *copies == 0 {
                            blocks.remove(hash);
                        }
                    }
                }
                Some(Data::Cleared(_)) => view.clear(),
                None => {}
            }
        }
    }
    view.retain(|_, blocks| !blocks.is_empty());
    view
}

fn hashes(view: &BTreeMap<i32, HashMap<i64, u32>>, rank: i32) -> Vec<(i64, u32)> {
    let mut held: Vec<(i64, u32)> = view
        .get(&rank)
        .map(|blocks| blocks.iter().map(|(&h, &c)| (h, c)).collect())
        .unwrap_or_default();
    held.sort_unstable();
    held
}

fn clears(batches: &[KvEventBatch]) -> usize {
    batches
        .iter()
        .flat_map(|batch| &batch.events)
        .filter(|event| matches!(event.data, Some(Data::Cleared(_))))
        .count()
}

/// Rank 0 holds 1 and 2; rank 1 holds 10 (two copies), 11 and 12.
fn two_ranks_holding_blocks() -> (Drain, HubReader) {
    let (mut drain, reader) = drain_of(2);
    engine_sends(&mut drain, 0, 1, &[stored(&[1, 2], None)]);
    engine_sends(
        &mut drain,
        1,
        1,
        &[stored(&[10, 11, 12], None), stored(&[10], None)],
    );
    drain.flush();
    (drain, reader)
}

#[test]
fn a_ranks_own_clear_goes_out_as_removals_of_its_blocks_and_what_follows_it_after_them() {
    let (mut drain, reader) = two_ranks_holding_blocks();
    engine_sends(
        &mut drain,
        1,
        2,
        &[
            stored(&[13], Some(12)),
            SimEvent::Cleared,
            stored(&[20], None),
        ],
    );
    drain.flush();
    let batches = published(&reader);
    assert_eq!(clears(&batches), 0, "no clear reaches the router");
    let view = router_view(&batches);
    assert_eq!(hashes(&view, 0), [(1, 1), (2, 1)], "rank 0 untouched");
    assert_eq!(
        hashes(&view, 1),
        [(20, 1)],
        "rank 1 holds what followed the clear"
    );
    let cut = drain.cut();
    assert_eq!(cut.state[&1].counts().total(), 1);
    assert_eq!(cut.state[&0].counts().total(), 2);
}

#[test]
fn a_ranks_restart_goes_out_as_removals_of_every_copy_it_held_in_its_own_numbering() {
    let (mut drain, reader) = two_ranks_holding_blocks();
    let before = published(&reader).len();
    let rank1_last = drain.sequencer.last(1);
    drain.ingest(SourceEvent::PublisherRestarted { rank: 1 });
    engine_sends(&mut drain, 1, 1, &[stored(&[30], None)]);
    drain.flush();
    let batches = published(&reader);
    assert_eq!(clears(&batches), 0);
    let view = router_view(&batches);
    assert_eq!(hashes(&view, 0), [(1, 1), (2, 1)]);
    assert_eq!(hashes(&view, 1), [(30, 1)]);
    let rank1: Vec<&KvEventBatch> = batches[before..]
        .iter()
        .filter(|batch| batch.dp_rank == Some(1))
        .collect();
    assert_eq!(
        rank1[0].sequence_number,
        rank1_last + 1,
        "its numbering goes on"
    );
    let removed: usize = rank1
        .iter()
        .flat_map(|batch| &batch.events)
        .filter_map(|event| match &event.data {
            Some(Data::Removed(removed)) => Some(removed.block_hashes.len()),
            _ => None,
        })
        .sum();
    assert_eq!(removed, 4, "three blocks, one with a second copy");
}

#[test]
fn a_large_ranks_removals_go_out_over_several_cycles_and_its_next_store_waits_behind_them() {
    let (mut drain, reader) = drain_of(2);
    let blocks: Vec<u64> = (1..=150_000).collect();
    for (sequence, chunk) in (1..).zip(blocks.chunks(10_000)) {
        engine_sends(&mut drain, 1, sequence, &[stored(chunk, None)]);
    }
    engine_sends(&mut drain, 0, 1, &[stored(&[1], None)]);
    drain.flush();
    engine_sends(&mut drain, 1, 100, &[SimEvent::Cleared, stored(&[5], None)]);
    drain.end_cycle();
    let mut steps = 0;
    while drain.catching_up() {
        // Another engine message meanwhile waits too.
        if steps == 1 {
            engine_sends(&mut drain, 1, 101, &[stored(&[6], Some(5))]);
        }
        drain.catch_up_step();
        drain.end_cycle();
        steps += 1;
        assert!(steps < 100, "the removals end");
    }
    assert!(steps >= 3, "150k copies in {steps} cycles of 65,536");
    let batches = published(&reader);
    assert_eq!(clears(&batches), 0);
    let view = router_view(&batches);
    assert_eq!(hashes(&view, 1), [(5, 1), (6, 1)]);
    assert_eq!(hashes(&view, 0), [(1, 1)]);
    assert!(batches.iter().all(|batch| batch.events.len() <= 1024));
}

#[test]
fn with_one_rank_a_restart_and_a_clear_still_go_out_as_a_clear() {
    let (mut drain, reader) = drain_of(1);
    engine_sends(&mut drain, 0, 1, &[stored(&[1, 2], None)]);
    engine_sends(&mut drain, 0, 2, &[SimEvent::Cleared, stored(&[3], None)]);
    drain.ingest(SourceEvent::PublisherRestarted { rank: 0 });
    drain.flush();
    let batches = published(&reader);
    assert_eq!(clears(&batches), 2);
    assert!(router_view(&batches).is_empty());
}

#[test]
fn a_resync_of_every_rank_is_one_clear_of_the_whole_worker() {
    let (mut drain, reader) = two_ranks_holding_blocks();
    drain.ingest(SourceEvent::Resync);
    drain.ingest(SourceEvent::Events {
        rank: 1,
        timestamp: 1.0,
        events: vec![crate::state::stored_event(
            None,
            &[40],
            crate::proto::common::KvCacheTier::Device,
            2,
        )],
    });
    drain.flush();
    let batches = published(&reader);
    assert_eq!(clears(&batches), 1);
    let view = router_view(&batches);
    assert_eq!(hashes(&view, 1), [(40, 1)]);
    assert!(hashes(&view, 0).is_empty());
    assert!(!drain.cut().state.contains_key(&0));
}

#[test]
fn a_clear_from_a_router_side_source_empties_every_rank_as_the_router_does() {
    let (mut drain, reader) = two_ranks_holding_blocks();
    drain.ingest(SourceEvent::Events {
        rank: 1,
        timestamp: 1.0,
        events: vec![KvCacheEvent::ownerless_clear()],
    });
    drain.flush();
    assert!(router_view(&published(&reader)).is_empty());
    assert!(drain.cut().state.is_empty(), "kvgate's state agrees");
}

/// A rank-1 store of `hash`, as a router-side source sends it.
fn upstream_store(rank: u32, hash: i64) -> SourceEvent {
    SourceEvent::Events {
        rank,
        timestamp: 1.0,
        events: vec![crate::state::stored_event(
            None,
            &[hash],
            crate::proto::common::KvCacheTier::Device,
            2,
        )],
    }
}

#[test]
fn after_a_resync_the_clear_reaches_routers_before_any_ranks_next_events_in_the_same_cycle() {
    let (mut drain, reader) = two_ranks_holding_blocks();
    drain.ingest(SourceEvent::Resync);
    drain.ingest(upstream_store(1, 40));
    drain.ingest(upstream_store(0, 50));
    drain.flush();
    let view = router_view(&published(&reader));
    assert_eq!(drain.cut().state[&0].counts().total(), 1);
    assert_eq!(hashes(&view, 0), [(50, 1)]);
    assert_eq!(hashes(&view, 1), [(40, 1)]);
}

#[test]
fn a_router_side_clear_reaches_routers_before_another_ranks_next_events_in_the_same_cycle() {
    let (mut drain, reader) = two_ranks_holding_blocks();
    drain.ingest(SourceEvent::Events {
        rank: 1,
        timestamp: 1.0,
        events: vec![KvCacheEvent::ownerless_clear()],
    });
    drain.ingest(upstream_store(0, 50));
    drain.flush();
    let view = router_view(&published(&reader));
    assert_eq!(drain.cut().state[&0].counts().total(), 1);
    assert_eq!(hashes(&view, 0), [(50, 1)]);
}

#[test]
fn a_snapshot_asked_for_while_a_ranks_removals_go_out_is_cut_once_they_are_out() {
    let (mut drain, reader) = two_ranks_holding_blocks();
    drain.ingest(SourceEvent::PublisherRestarted { rank: 1 });
    drain.end_cycle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let cut = runtime.block_on(async {
        let asked = reader.cut();
        tokio::pin!(asked);
        let request = tokio::select! {
            biased;
            _ = &mut asked => unreachable!("nobody answered yet"),
            request = drain.hub.next_cut_request() => request,
        };
        drain.answer(request);
        assert!(
            drain.waiting_cut.is_some(),
            "not cut while the removals go out"
        );
        while drain.catching_up() {
            drain.catch_up_step();
            drain.end_cycle();
            drain.answer_waiting_cut();
        }
        asked.await.expect("answered")
    });
    // The cut holds exactly what the stream through its position leaves.
    let through_cut: Vec<KvEventBatch> = published(&reader)
        .into_iter()
        .take(usize::try_from(cut.position).unwrap())
        .collect();
    let view = router_view(&through_cut);
    assert!(hashes(&view, 1).is_empty());
    assert!(!cut.state.contains_key(&1));
    assert_eq!(cut.state[&0].counts().total(), 2);
}

/// A drain for an engine of `ranks` ranks keeping its state in `dir`.
fn drain_on_state_dir(dir: &std::path::Path, ranks: u32) -> Drain {
    let history = HistoryLimits {
        batches: 100_000,
        bytes: 1 << 30,
    };
    let config = crate::store::StoreConfig {
        dir: dir.to_path_buf(),
        sync_interval: std::time::Duration::from_secs(3600),
        io_timeout: std::time::Duration::from_secs(60),
        limits: crate::store::StoreLimits {
            segment_bytes: 64 << 20,
            checkpoint_bytes: 1 << 40,
        },
        history,
    };
    let opened = crate::store::open(config, &Metrics::default(), 1).unwrap();
    let (writer, _reader) = hub(64, history);
    let limits = BatchLimits {
        max_events: 1024,
        max_bytes: 1 << 20,
    };
    Drain::new(limits, opened.seed(), writer, Metrics::default())
        .with_engine_ranks(ranks)
        .with_state_dir(opened)
}

/// What a kvgate started on `dir` would restore.
fn restored(dir: &std::path::Path) -> crate::store::restore::Restored {
    let history = HistoryLimits {
        batches: 100_000,
        bytes: 1 << 30,
    };
    // No announcement mark: the numbering is not what these tests read.
    crate::store::restore::restore(dir, None, history, &mut |_, _| {}).unwrap()
}

/// A scratch state directory, removed when dropped.
struct ScratchDir(std::path::PathBuf);

impl ScratchDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kvgate-several-ranks-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for ScratchDir {
    /// The directory goes, and the announcement mark the store kept for it
    /// in `/dev/shm`, which outlives the process by design.
    fn drop(&mut self) {
        if let Ok(mark) = crate::store::mark_of(&self.0) {
            let _ = std::fs::remove_file(mark);
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Rank 0 holds one block, rank 1 150,000 on a state directory.
fn large_rank_on_state_dir(dir: &std::path::Path) -> Drain {
    let mut drain = drain_on_state_dir(dir, 2);
    engine_sends(&mut drain, 0, 1, &[stored(&[1], None)]);
    let blocks: Vec<u64> = (100..=150_099).collect();
    for (sequence, chunk) in (1..).zip(blocks.chunks(10_000)) {
        engine_sends(&mut drain, 1, sequence, &[stored(chunk, None)]);
    }
    drain.flush();
    drain.settle();
    drain
}

/// Stops `drain` after one step of removals, as a kill would.
fn stop_midway(mut drain: Drain) {
    drain.end_cycle();
    drain.catch_up_step();
    drain.end_cycle();
    drain.settle();
    assert!(drain.catching_up(), "stopped midway");
    drain.store.take().unwrap().close();
}

#[test]
fn a_clear_read_back_from_a_state_directory_empties_every_rank_as_it_did_live() {
    let scratch = ScratchDir::new("clear");
    let mut drain = drain_on_state_dir(&scratch.0, 2);
    drain.ingest(upstream_store(0, 1));
    drain.ingest(upstream_store(1, 10));
    drain.flush();
    drain.ingest(SourceEvent::Events {
        rank: 1,
        timestamp: 1.0,
        events: vec![KvCacheEvent::ownerless_clear()],
    });
    drain.flush();
    drain.settle();
    assert!(drain.cut().state.is_empty());
    drain.store.take().unwrap().close();
    assert_eq!(restored(&scratch.0).state.ranks().count(), 0);
}

#[test]
fn a_kvgate_stopped_while_a_restarted_ranks_removals_go_out_keeps_the_old_publishers_mark() {
    let scratch = ScratchDir::new("restart");
    let mut drain = large_rank_on_state_dir(&scratch.0);
    drain.ingest(SourceEvent::PublisherRestarted { rank: 1 });
    stop_midway(drain);
    let restored = restored(&scratch.0);
    let left = restored
        .state
        .rank(1)
        .map_or(0, |blocks| blocks.counts().total());
    assert!(left > 0, "stopped with removals still to send");
    assert!(
        restored.marks.contains_key(&1),
        "the mark that shows the restart again"
    );
}

#[test]
fn a_kvgate_stopped_while_a_ranks_own_clear_goes_out_keeps_the_mark_before_the_clear() {
    let scratch = ScratchDir::new("own-clear");
    let mut drain = large_rank_on_state_dir(&scratch.0);
    engine_sends(&mut drain, 1, 100, &[SimEvent::Cleared, stored(&[5], None)]);
    stop_midway(drain);
    let restored = restored(&scratch.0);
    let mark = restored.marks.get(&1).map(|mark| mark.resume.last);
    assert_eq!(
        mark,
        Some(15),
        "the message before the clear, to be read again"
    );
}
