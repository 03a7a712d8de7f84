//! The embedded demo: `kvgate serve --demo` streams live events and its
//! engine's pushed load with no engine.

mod common;

use common::{Gateway, is_load_only, next_batch, subscribe};

#[tokio::test]
async fn the_demo_gateway_streams_live_converted_events() {
    let gateway = Gateway::start(&["--demo"]);
    let mut stream = subscribe(gateway.channel().await, "kvgate.v1.KvGate", 0)
        .await
        .expect("subscribed");
    let mut previous: Option<u64> = None;
    let mut events = 0;
    let mut load_records = 0;
    while events < 50 || load_records == 0 {
        let batch = next_batch(&mut stream).await;
        assert_eq!(batch.dp_rank, Some(0));
        assert!(batch.events.len() <= 1024);
        // The demo engine pushes its load too; a load-only batch repeats
        // the last sequence number and moves no cursor.
        if batch.load.is_some() {
            load_records += 1;
        }
        if is_load_only(&batch) {
            continue;
        }
        if let Some(previous) = previous {
            assert_eq!(batch.sequence_number, previous + 1);
        }
        previous = Some(batch.sequence_number);
        events += batch.events.len();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_demo_speaks_tensorrt_llm_s_layout_and_is_found_by_asking_it() {
    use kvgate::proto::common::{kv_block_extra_key::Key, kv_cache_event::Data};
    let gateway = Gateway::start(&[
        "--demo",
        "--demo-layout",
        "trtllm-native",
        "--dp-size",
        "2",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let mut stream = subscribe(gateway.channel().await, "trtllm.TrtllmService", 0)
        .await
        .expect("subscribed");
    let mut images = 0;
    let mut stores = 0;
    while images == 0 || stores < 20 {
        let batch = next_batch(&mut stream).await;
        for event in &batch.events {
            let Some(Data::Stored(stored)) = &event.data else {
                continue;
            };
            stores += 1;
            for block in &stored.blocks {
                let keys: Vec<_> = block
                    .extra_keys
                    .iter()
                    .filter_map(|key| match &key.key {
                        Some(Key::Multimodal(image)) => Some(image),
                        _ => None,
                    })
                    .collect();
                if let Some(image) = keys.first() {
                    images += 1;
                    assert_eq!(image.offset, 0, "a stand-in image starts its block");
                    assert_eq!(image.identifier.len(), 64);
                    assert_eq!(block.token_ids[0], u32::MAX, "its digest token");
                }
            }
        }
    }
    let (code, body) = common::http_get(gateway.admin.unwrap(), "/status").await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    let sources = status["sources"].as_array().unwrap();
    assert_eq!(sources.len(), 2, "{status}");
    let learned_from = sources[1]["learned_from"].as_str().unwrap();
    assert!(
        learned_from.starts_with("GET http://127.0.0.1:")
            && learned_from.ends_with("/kv_event_sources"),
        "{status}"
    );
}
