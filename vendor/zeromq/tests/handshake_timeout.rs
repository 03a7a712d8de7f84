//! `SocketOptions::handshake_timeout` against peers that accept a
//! connection and never complete the ZMTP handshake: a connecting socket
//! gives up on them, a reconnection gives up and tries again, and a bound
//! socket closes them.

#[cfg(test)]
mod test {
    use zeromq::__async_rt as async_rt;
    use zeromq::prelude::*;
    use zeromq::{ZmqError, ZmqMessage};

    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    const HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(300);
    const WAIT: Duration = Duration::from_secs(10);

    fn bounded() -> zeromq::SocketOptions {
        let mut options = zeromq::SocketOptions::default();
        options.handshake_timeout(HANDSHAKE_TIMEOUT);
        options.no_connect_timeout();
        options
    }

    /// Runs `blocking` on a thread of its own (the runtime goes on running
    /// the socket's tasks meanwhile) and returns what it returned.
    async fn on_a_thread<T: Send + 'static>(blocking: impl FnOnce() -> T + Send + 'static) -> T {
        let (done, finished) = futures::channel::oneshot::channel();
        std::thread::spawn(move || {
            let _ = done.send(blocking());
        });
        async_rt::task::timeout(WAIT, finished)
            .await
            .expect("the thread finished in time")
            .expect("the thread ran to its end")
    }

    /// Publishes until `sub` receives one message.
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
    async fn a_connect_to_a_peer_that_never_greets_fails_after_the_handshake_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let mut sub = zeromq::SubSocket::with_options(bounded());
        let started = Instant::now();
        let connected = async_rt::task::timeout(WAIT, sub.connect(&format!("tcp://{address}")))
            .await
            .expect("connect gave up on the silent peer");
        match connected {
            Err(ZmqError::Network(error)) => {
                assert_eq!(error.kind(), std::io::ErrorKind::TimedOut, "{error}")
            }
            other => panic!("expected a timed-out handshake, got {other:?}"),
        }
        assert!(started.elapsed() >= HANDSHAKE_TIMEOUT);
        drop(listener);
    }

    #[async_rt::test]
    async fn without_a_handshake_timeout_a_silent_peer_holds_the_connect() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let mut options = zeromq::SocketOptions::default();
        options.no_connect_timeout();
        let mut sub = zeromq::SubSocket::with_options(options);
        let held = async_rt::task::timeout(
            HANDSHAKE_TIMEOUT * 3,
            sub.connect(&format!("tcp://{address}")),
        )
        .await;
        assert!(held.is_err(), "the default is no limit, as before");
        drop(listener);
    }

    #[cfg(unix)]
    #[async_rt::test]
    async fn a_reconnection_held_by_a_silent_peer_gives_up_and_reaches_the_real_publisher() {
        let dir = std::env::temp_dir().join(format!("zmq-handshake-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pub.sock");
        let endpoint = format!("ipc://{}", path.display());

        let mut publisher = zeromq::PubSocket::new();
        publisher.bind(&endpoint).await.unwrap();
        let mut sub = zeromq::SubSocket::with_options(bounded());
        sub.subscribe("").await.unwrap();
        sub.connect(&endpoint).await.unwrap();
        publish_until_received(&mut publisher, &mut sub).await;

        // The publisher goes; a peer that accepts and says nothing takes
        // the path and holds the reconnection's connection open.
        drop(publisher);
        let deadline = Instant::now() + WAIT;
        while path.exists() {
            assert!(Instant::now() < deadline, "the socket file stayed");
            async_rt::task::sleep(Duration::from_millis(10)).await;
        }
        let silent = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let (accepted, mut held) = futures::channel::oneshot::channel();
        std::thread::spawn(move || {
            let _ = accepted.send(silent.accept().unwrap().0);
        });
        // The socket learns its publisher is gone when it reads.
        let held = async_rt::task::timeout(WAIT, async {
            loop {
                if let Some(stream) = held.try_recv().unwrap() {
                    return stream;
                }
                let _ = async_rt::task::timeout(Duration::from_millis(20), sub.recv()).await;
            }
        })
        .await
        .expect("the reconnection dialled the silent peer");
        std::fs::remove_file(&path).unwrap();

        let mut publisher = zeromq::PubSocket::new();
        publisher.bind(&endpoint).await.unwrap();
        publish_until_received(&mut publisher, &mut sub).await;
        drop(held);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[async_rt::test]
    async fn a_bound_socket_closes_a_connection_that_never_greets() {
        let mut sub = zeromq::SubSocket::with_options(bounded());
        let endpoint = sub.bind("tcp://127.0.0.1:0").await.unwrap();
        let zeromq::Endpoint::Tcp(_, port) = endpoint else {
            panic!("a TCP endpoint");
        };
        let closed = on_a_thread(move || {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
            stream.set_read_timeout(Some(WAIT)).unwrap();
            let mut sink = [0u8; 256];
            loop {
                match stream.read(&mut sink) {
                    Ok(0) => return true,
                    Ok(_) => {}
                    Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {
                        return true
                    }
                    Err(_) => return false,
                }
            }
        });
        assert!(closed.await, "the socket held a silent connection");
        drop(sub);
    }
}
