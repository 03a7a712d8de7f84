//! The index runs' HTTP/1.1 client: one keep-alive connection per
//! [`Connection`], hyper's client without its pool, so a query costs the
//! tool one request's framing and nothing more (its CPU is reported beside
//! the subject's).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::task::JoinHandle;

/// One keep-alive connection to `address`; its driver runs on the runtime
/// that opened it.
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    driver: JoinHandle<()>,
    host: String,
}

/// A request's status and body.
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

impl Connection {
    pub async fn open(address: &str) -> anyhow::Result<Self> {
        let stream = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|error| anyhow::anyhow!("cannot connect to {address}: {error}"))?;
        stream.set_nodelay(true)?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|error| anyhow::anyhow!("HTTP handshake with {address}: {error}"))?;
        let driver = tokio::spawn(async move {
            // The connection ends when the sender is dropped or the peer
            // closes; a request in flight then fails and says so.
            let _ = connection.await;
        });
        Ok(Self {
            sender,
            driver,
            host: address.to_owned(),
        })
    }

    /// `POST path` with a JSON body.
    pub async fn post(&mut self, path: &str, body: Bytes) -> anyhow::Result<Answer> {
        self.send(Method::POST, path, body).await
    }

    pub async fn get(&mut self, path: &str) -> anyhow::Result<Answer> {
        self.send(Method::GET, path, Bytes::new()).await
    }

    async fn send(&mut self, method: Method, path: &str, body: Bytes) -> anyhow::Result<Answer> {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, &self.host);
        if !body.is_empty() {
            request = request.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let request = request.body(Full::new(body))?;
        self.sender.ready().await.map_err(|error| {
            anyhow::anyhow!("{path}: connection to {} lost: {error}", self.host)
        })?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(|error| anyhow::anyhow!("{path} at {}: {error}", self.host))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|error| {
                anyhow::anyhow!("{path} at {}: reading the answer: {error}", self.host)
            })?
            .to_bytes();
        Ok(Answer { status, body })
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.driver.abort();
    }
}
