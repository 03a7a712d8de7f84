//! Events no batch can hold, end to end with the real binary: each goes out
//! alone while the router accepts its size, or is dropped and counted
//! (`oversized_event`); either way the events after it reach a stock
//! subscriber (4 MiB message limit, as the router's), `/metrics` answers and
//! SIGTERM is honoured.

mod common;

use common::{
    Gateway, carries_fence, fence_payload, http_get, next_batch, subscribe, sync_streams,
};
use kvgate::proto::common::{KvEventBatch, kv_cache_event::Data};
use kvgate::server::SUBSCRIBE_SERVICES;
use kvgate_sim::{EnginePublisher, PublisherOptions};
use prost::Message;

/// The fence published after the oversized events.
const AFTER: u64 = 1_000_001;

/// `[ts, [BlockStored{one block}], 0]` in vLLM's map form.
fn one_block_store(hash: u64, tokens: &[u32], cache_salt: Option<&str>) -> bytes::Bytes {
    let mut out = Vec::new();
    rmp::encode::write_array_len(&mut out, 3).unwrap();
    rmp::encode::write_f64(&mut out, 1.0).unwrap();
    rmp::encode::write_array_len(&mut out, 1).unwrap();
    rmp::encode::write_map_len(&mut out, 5 + u32::from(cache_salt.is_some())).unwrap();
    rmp::encode::write_str(&mut out, "type").unwrap();
    rmp::encode::write_str(&mut out, "BlockStored").unwrap();
    rmp::encode::write_str(&mut out, "block_hashes").unwrap();
    rmp::encode::write_array_len(&mut out, 1).unwrap();
    rmp::encode::write_uint(&mut out, hash).unwrap();
    rmp::encode::write_str(&mut out, "parent_block_hash").unwrap();
    rmp::encode::write_nil(&mut out).unwrap();
    rmp::encode::write_str(&mut out, "token_ids").unwrap();
    rmp::encode::write_array_len(&mut out, tokens.len() as u32).unwrap();
    for &token in tokens {
        rmp::encode::write_uint(&mut out, token.into()).unwrap();
    }
    rmp::encode::write_str(&mut out, "block_size").unwrap();
    rmp::encode::write_uint(&mut out, tokens.len() as u64).unwrap();
    if let Some(salt) = cache_salt {
        rmp::encode::write_str(&mut out, "cache_salt").unwrap();
        rmp::encode::write_str(&mut out, salt).unwrap();
    }
    rmp::encode::write_uint(&mut out, 0).unwrap();
    out.into()
}

/// `count` token ids that each take `varint_bytes` bytes in protobuf.
fn tokens(count: usize, varint_bytes: u32) -> Vec<u32> {
    let base = 1u32 << (7 * (varint_bytes - 1));
    (0..count as u32).map(|i| base + i % 1000).collect()
}

/// What a subscriber received of one stored block.
struct Received {
    /// Events in the batch that carried it.
    batch_events: usize,
    batch_bytes: usize,
    tokens: usize,
    salt_len: usize,
}

/// Publishes `payloads` then a fence on a gateway started with `args`, and
/// returns what one subscriber received of each stored block (by hash)
/// before the fence, plus the gateway's `oversized_event` count. The
/// gateway is then stopped with SIGTERM and must exit 0.
async fn publish_through_gateway(
    args: &[&str],
    payloads: Vec<bytes::Bytes>,
) -> (std::collections::BTreeMap<i64, Received>, u64) {
    let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .expect("publisher binds");
    let mut all_args = vec![
        "--zmq-endpoint",
        publisher.endpoint(),
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    all_args.extend_from_slice(args);
    let mut gateway = Gateway::start(&all_args);
    let stream = subscribe(gateway.channel().await, SUBSCRIBE_SERVICES[0], 0)
        .await
        .expect("subscribed");
    let mut streams = [stream];
    sync_streams(&mut publisher, 0, &mut streams).await;
    for payload in payloads {
        publisher.publish(payload).await.unwrap();
    }
    publisher.publish(fence_payload(AFTER, 0)).await.unwrap();

    let mut received = std::collections::BTreeMap::new();
    loop {
        let batch: KvEventBatch = next_batch(&mut streams[0]).await;
        for event in &batch.events {
            if let Some(Data::Stored(stored)) = &event.data {
                for block in &stored.blocks {
                    received.insert(
                        block.block_hash,
                        Received {
                            batch_events: batch.events.len(),
                            batch_bytes: batch.encoded_len(),
                            tokens: block.token_ids.len(),
                            salt_len: stored.cache_salt.as_ref().map_or(0, String::len),
                        },
                    );
                }
            }
        }
        if carries_fence(&batch, AFTER) {
            break;
        }
    }
    let (status, metrics) = http_get(gateway.admin.expect("admin port"), "/metrics").await;
    assert_eq!(status, 200);
    let oversized = metrics
        .lines()
        .find_map(|line| {
            line.strip_prefix("kvgate_events_dropped_total{reason=\"oversized_event\"} ")
        })
        .expect("the oversized_event counter is exported")
        .parse()
        .unwrap();
    let exit = gateway.terminate();
    assert!(exit.success(), "kvgate exited with {exit}");
    (received, oversized)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_with_a_salt_larger_than_a_batch_goes_out_alone_and_later_events_follow() {
    let salt = "s".repeat((11 << 20) / 10); // 1.1 MiB
    let payload = one_block_store(7, &tokens(16, 1), Some(&salt));
    let (received, oversized) = publish_through_gateway(&[], vec![payload]).await;
    let block = received.get(&7).expect("the salted block was delivered");
    assert_eq!(block.salt_len, salt.len());
    assert_eq!(block.batch_events, 1, "alone in its batch");
    assert_eq!(oversized, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_block_of_1_2m_tokens_goes_alone_under_4_mib_and_is_dropped_and_counted_above() {
    // 3 bytes a token: 3.6 MB, a message the router accepts.
    let fits = one_block_store(8, &tokens(1_200_000, 3), None);
    // 4 bytes a token: 4.8 MB, more than any message the router accepts.
    let too_large = one_block_store(9, &tokens(1_200_000, 4), None);
    let after = one_block_store(10, &tokens(16, 1), None);
    let (received, oversized) = publish_through_gateway(&[], vec![fits, too_large, after]).await;
    let block = received.get(&8).expect("the 3.6 MB block was delivered");
    assert_eq!(block.tokens, 1_200_000);
    assert_eq!(block.batch_events, 1);
    assert!(block.batch_bytes <= 4 << 20);
    assert!(!received.contains_key(&9), "the 4.8 MB block is not sent");
    assert!(received.contains_key(&10), "the store after it is");
    assert_eq!(oversized, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_4096_byte_batch_limit_an_ordinary_1024_token_block_goes_alone() {
    let before = one_block_store(20, &tokens(16, 1), None);
    // 4 bytes a token: 4 KiB of tokens, over the 4096-byte limit.
    let large = one_block_store(21, &tokens(1024, 4), None);
    let after = one_block_store(22, &tokens(16, 1), None);
    let (received, oversized) =
        publish_through_gateway(&["--max-batch-bytes", "4096"], vec![before, large, after]).await;
    let block = received.get(&21).expect("the block was delivered");
    assert_eq!(block.tokens, 1024);
    assert_eq!(block.batch_events, 1);
    assert!(block.batch_bytes > 4096);
    assert!(received.contains_key(&20) && received.contains_key(&22));
    assert_eq!(oversized, 0);
}
