//! `SocketOptions::max_message_size` against raw ZMTP peers that announce a
//! frame far larger than the limit (2^40 bytes): the socket must refuse it
//! without reserving it, drop that peer and keep serving others.

#[cfg(test)]
mod test {
    use zeromq::__async_rt as async_rt;
    use zeromq::prelude::*;
    use zeromq::{CodecError, ZmqError, ZmqMessage};

    use futures::channel::oneshot;

    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    const MAX_MESSAGE_SIZE: usize = 1024 * 1024;
    const HUGE_FRAME: u64 = 1 << 40;
    const WAIT: Duration = Duration::from_secs(10);

    fn limited() -> zeromq::SocketOptions {
        let mut options = zeromq::SocketOptions::default();
        options.max_message_size(MAX_MESSAGE_SIZE);
        options
    }

    /// Speaks ZMTP 3.0 as `socket_type` just far enough to reach the
    /// peer's frame decoder, announces a huge frame, then reads until the
    /// peer closes the connection. Returns once it did.
    fn announce_huge_frame(mut stream: TcpStream, socket_type: &str) {
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        stream.write_all(&greeting).unwrap();

        let mut ready = vec![5];
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        ready.extend_from_slice(socket_type.as_bytes());
        stream.write_all(&[0b0000_0100, ready.len() as u8]).unwrap();
        stream.write_all(&ready).unwrap();

        stream.write_all(&[0b0000_0010]).unwrap();
        stream.write_all(&HUGE_FRAME.to_be_bytes()).unwrap();

        let mut sink = [0u8; 256];
        loop {
            match stream.read(&mut sink) {
                Ok(0) => return,
                Ok(_) => {}
                Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => return,
                Err(error) => panic!("the peer kept the connection open: {error}"),
            }
        }
    }

    /// Runs `attack` on its own thread; the receiver resolves once it
    /// returned (awaited, so the runtime keeps running the socket's tasks).
    fn spawn_attacker(attack: impl FnOnce() + Send + 'static) -> oneshot::Receiver<()> {
        let (done, finished) = oneshot::channel();
        std::thread::spawn(move || {
            attack();
            let _ = done.send(());
        });
        finished
    }

    async fn connection_closed(attacker: oneshot::Receiver<()>) {
        async_rt::task::timeout(WAIT, attacker)
            .await
            .expect("the socket closed the connection in time")
            .expect("the attacker ran to its end");
    }

    fn assert_too_large(result: zeromq::ZmqResult<ZmqMessage>) {
        match result {
            Err(ZmqError::Codec(CodecError::MessageTooLarge { max, size })) => {
                assert_eq!(max, MAX_MESSAGE_SIZE);
                assert!(size as u64 >= HUGE_FRAME);
            }
            other => panic!("expected MessageTooLarge, got {other:?}"),
        }
    }

    /// Publishes until `sub` receives one message (a new subscription
    /// reaches the publisher some time after the connection).
    async fn publish_until_received(
        publisher: &mut zeromq::PubSocket,
        sub: &mut zeromq::SubSocket,
    ) {
        let received = async_rt::task::timeout(WAIT, async {
            loop {
                publisher.send(ZmqMessage::from("hello")).await.unwrap();
                if let Ok(received) =
                    async_rt::task::timeout(Duration::from_millis(50), sub.recv()).await
                {
                    return received.unwrap();
                }
            }
        })
        .await
        .expect("a message from the real publisher");
        assert_eq!(received.get(0).unwrap().as_ref(), b"hello");
    }

    #[async_rt::test]
    async fn a_bound_sub_drops_a_peer_announcing_an_oversized_frame_and_serves_the_next() {
        let mut sub = zeromq::SubSocket::with_options(limited());
        sub.subscribe("").await.unwrap();
        let endpoint = sub.bind("tcp://127.0.0.1:0").await.unwrap();
        let zeromq::Endpoint::Tcp(_, port) = endpoint else {
            panic!("a TCP endpoint");
        };

        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let attacker = spawn_attacker(move || announce_huge_frame(stream, "PUB"));
        assert_too_large(async_rt::task::timeout(WAIT, sub.recv()).await.unwrap());
        connection_closed(attacker).await;

        let mut publisher = zeromq::PubSocket::new();
        publisher.connect(&endpoint.to_string()).await.unwrap();
        publish_until_received(&mut publisher, &mut sub).await;
    }

    #[async_rt::test]
    async fn a_connected_sub_reconnects_after_its_publisher_announced_an_oversized_frame() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let attacker = spawn_attacker(move || {
            let (stream, _) = listener.accept().unwrap();
            // The listener closes here: reconnects are refused until the
            // real publisher binds the same port.
            drop(listener);
            announce_huge_frame(stream, "PUB");
        });

        let mut sub = zeromq::SubSocket::with_options(limited());
        sub.subscribe("").await.unwrap();
        sub.connect(&format!("tcp://{address}")).await.unwrap();
        assert_too_large(async_rt::task::timeout(WAIT, sub.recv()).await.unwrap());
        connection_closed(attacker).await;

        let mut publisher = zeromq::PubSocket::new();
        publisher.bind(&format!("tcp://{address}")).await.unwrap();
        publish_until_received(&mut publisher, &mut sub).await;
    }

    #[async_rt::test]
    async fn a_dealer_drops_a_peer_announcing_an_oversized_frame() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let attacker = spawn_attacker(move || {
            let (stream, _) = listener.accept().unwrap();
            announce_huge_frame(stream, "ROUTER");
        });

        let mut dealer = zeromq::DealerSocket::with_options(limited());
        dealer.connect(&format!("tcp://{address}")).await.unwrap();
        assert_too_large(async_rt::task::timeout(WAIT, dealer.recv()).await.unwrap());
        connection_closed(attacker).await;
    }
}
