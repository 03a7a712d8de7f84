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
