//! Hostile peers on kvgate's ZMQ sockets, end to end: raw TCP peers speaking
//! just enough ZMTP 3.0 to reach kvgate's frame decoder announce frames it
//! must not allocate (1 TiB, or more than `--zmq-max-message-bytes` with the
//! body actually sent). The real binary must drop each such connection,
//! count it, stay alive and small, and go on serving a real publisher's
//! events to a real subscriber.

mod common;

use common::zmtp::{COMMAND, LONG, announce, send_greeting, send_ready};
use common::{DEADLINE, Gateway, http_get, subscribe, sync_streams};
use kvgate_sim::{EnginePublisher, PublisherOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SERVICE: &str = "kvgate.v1.KvGate";

/// What the 0.7.0 codec used to reserve at once, aborting kvgate.
const TERABYTE: u64 = 1 << 40;

/// Over the default `--zmq-max-message-bytes` (64 MiB) and small enough
/// for the allocator to grant, so only the limit keeps it out of memory.
const OVER_THE_LIMIT: u64 = 128 << 20;

/// Generous, yet below `OVER_THE_LIMIT`: had kvgate read that body, its
/// resident memory would be past this.
const RSS_BOUND_KIB: u64 = 96 << 10;

/// How a raw peer abuses kvgate's decoder.
#[derive(Clone, Copy, Debug)]
enum Attack {
    /// A READY command announced at 1 TiB, in the middle of the handshake.
    TerabyteReady,
    /// After a complete handshake, a message frame announced at 1 TiB.
    TerabyteFrame,
    /// After a complete handshake, a frame over the limit, body sent in full.
    OversizedBody,
}

/// Runs `attack` on a connection to or from kvgate as a `socket_type`
/// peer, and returns once kvgate closed that connection.
async fn attack(mut stream: TcpStream, socket_type: &str, attack: Attack) {
    send_greeting(&mut stream).await;
    match attack {
        Attack::TerabyteReady => announce(&mut stream, COMMAND | LONG, TERABYTE).await,
        Attack::TerabyteFrame => {
            send_ready(&mut stream, socket_type).await;
            announce(&mut stream, LONG, TERABYTE).await;
        }
        Attack::OversizedBody => {
            send_ready(&mut stream, socket_type).await;
            announce(&mut stream, LONG, OVER_THE_LIMIT).await;
            send_body(&mut stream, OVER_THE_LIMIT).await;
        }
    }
    closed_by_kvgate(stream).await;
}

/// Writes `length` bytes, or as many as kvgate takes before closing.
async fn send_body(stream: &mut TcpStream, length: u64) {
    let chunk = vec![0x5a; 1 << 20];
    let mut sent = 0;
    while sent < length {
        let write = tokio::time::timeout(DEADLINE, stream.write_all(&chunk)).await;
        match write.expect("kvgate neither reads nor closes") {
            Ok(()) => sent += chunk.len() as u64,
            Err(_) => return,
        }
    }
}

/// Reads (and discards what kvgate sends) until kvgate closes the connection.
async fn closed_by_kvgate(mut stream: TcpStream) {
    let mut sink = vec![0u8; 4096];
    let closed = tokio::time::timeout(DEADLINE, async {
        loop {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    closed.await.expect("kvgate closed the connection");
}

fn assert_alive_and_small(gateway: &Gateway) {
    let rss = common::live_rss_kib(gateway.pid());
    assert!(
        rss < RSS_BOUND_KIB,
        "kvgate holds {rss} KiB after the attacks"
    );
}

/// The value of `kvgate_zmq_peers_dropped_total` for `socket` and `reason`.
async fn dropped(gateway: &Gateway, socket: &str, reason: &str) -> u64 {
    let (status, body) = http_get(gateway.admin.expect("admin port"), "/metrics").await;
    assert_eq!(status, 200);
    let series =
        format!("kvgate_zmq_peers_dropped_total{{socket=\"{socket}\",reason=\"{reason}\"}} ");
    body.lines()
        .find_map(|line| line.strip_prefix(&series))
        .unwrap_or_else(|| panic!("{series} is exported"))
        .parse()
        .unwrap()
}

/// Waits (bounded) until kvgate has counted `expected` drops: the count
/// follows the close the attacker saw.
async fn wait_for_dropped(gateway: &Gateway, socket: &str, reason: &str, expected: u64) {
    let series =
        format!("kvgate_zmq_peers_dropped_total{{socket=\"{socket}\",reason=\"{reason}\"}}");
    common::await_metric(gateway.admin.expect("admin port"), &series, expected as f64).await;
}

/// Publishes until the subscriber sees the real publisher's events.
async fn real_events_flow(gateway: &Gateway, publisher: &mut EnginePublisher) {
    let mut streams = vec![
        subscribe(gateway.channel().await, SERVICE, 0)
            .await
            .unwrap(),
    ];
    sync_streams(publisher, 0, &mut streams).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bound_kvgate_drops_peers_announcing_oversized_frames_and_serves_the_real_publisher_after_them()
 {
    let (mut gateway, port) = Gateway::start_on_free_ports(1, |port| {
        vec![
            "--zmq-endpoint".into(),
            format!("tcp://127.0.0.1:{port}"),
            "--zmq-bind".into(),
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
        ]
    });
    let endpoint = format!("tcp://127.0.0.1:{port}");
    for reason in ["message_too_large", "protocol_error", "connection_error"] {
        assert_eq!(dropped(&gateway, "sub", reason).await, 0);
        assert_eq!(dropped(&gateway, "replay", reason).await, 0);
    }

    for each in [
        Attack::TerabyteReady,
        Attack::TerabyteFrame,
        Attack::OversizedBody,
    ] {
        let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        attack(stream, "PUB", each).await;
    }
    wait_for_dropped(&gateway, "sub", "message_too_large", 3).await;
    assert_alive_and_small(&gateway);

    let mut publisher = EnginePublisher::connect(&endpoint, &PublisherOptions::default())
        .await
        .unwrap();
    real_events_flow(&gateway, &mut publisher).await;
    assert_alive_and_small(&gateway);
    assert!(
        gateway.terminate().success(),
        "kvgate exits cleanly on SIGTERM"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_connecting_kvgate_drops_a_publisher_announcing_oversized_frames_and_reconnects_to_the_real_one()
 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let endpoint = format!("tcp://{address}");
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        &endpoint,
        "--metrics-listen",
        "127.0.0.1:0",
    ]);

    // kvgate connects again after each: on its own after a handshake that
    // failed, through the socket's reconnection after one that succeeded.
    for each in [
        Attack::TerabyteReady,
        Attack::TerabyteFrame,
        Attack::OversizedBody,
    ] {
        let (stream, _) = tokio::time::timeout(DEADLINE, listener.accept())
            .await
            .expect("kvgate connects")
            .unwrap();
        attack(stream, "PUB", each).await;
    }
    drop(listener);
    wait_for_dropped(&gateway, "sub", "message_too_large", 3).await;
    assert_alive_and_small(&gateway);

    let mut publisher = EnginePublisher::bind(&endpoint, &PublisherOptions::default())
        .await
        .unwrap();
    real_events_flow(&gateway, &mut publisher).await;
    assert_alive_and_small(&gateway);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_endpoint_announcing_a_terabyte_frame_is_dropped_and_the_live_stream_goes_on() {
    let mut publisher = EnginePublisher::bind("tcp://127.0.0.1:0", &PublisherOptions::default())
        .await
        .unwrap();
    let replay = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let replay_endpoint = format!("tcp://{}", replay.local_addr().unwrap());
    let gateway = Gateway::start(&[
        "--zmq-endpoint",
        publisher.endpoint(),
        "--zmq-replay-endpoint",
        &replay_endpoint,
        "--zmq-replay-timeout-ms",
        "2000",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);

    // Priming asks the replay endpoint first.
    let (stream, _) = tokio::time::timeout(DEADLINE, replay.accept())
        .await
        .expect("kvgate asks for replay")
        .unwrap();
    drop(replay);
    attack(stream, "ROUTER", Attack::TerabyteFrame).await;
    wait_for_dropped(&gateway, "replay", "message_too_large", 1).await;
    assert_alive_and_small(&gateway);

    real_events_flow(&gateway, &mut publisher).await;
    assert_eq!(dropped(&gateway, "sub", "message_too_large").await, 0);
    assert_alive_and_small(&gateway);
}
