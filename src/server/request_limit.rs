//! A request body refused once it is larger than its call's request can be.
//!
//! Invariant: no data frame past the limit reaches the gRPC decoder, and the
//! refusal is a `RESOURCE_EXHAUSTED` status (tonic's own size check answers
//! `OUT_OF_RANGE`, which tells a router to drop its index). The message's
//! declared length is checked as soon as its 5-byte prefix is in, so a
//! client claiming a huge message is refused before sending it.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame};
use tonic::Status;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Bytes of the gRPC message prefix: compression flag, then the length.
const PREFIX: usize = 5;

pub struct LimitedRequest<B> {
    inner: B,
    limit: usize,
    prefix: [u8; PREFIX],
    /// Body bytes seen so far.
    seen: usize,
}

impl<B> LimitedRequest<B> {
    /// Refuses a body whose message exceeds `limit` bytes.
    pub fn new(inner: B, limit: usize) -> Self {
        Self {
            inner,
            limit,
            prefix: [0; PREFIX],
            seen: 0,
        }
    }

    /// Takes in `data`; the message's size, once known to be too large.
    fn oversized(&mut self, data: &Bytes) -> Option<usize> {
        if self.seen < PREFIX {
            let take = data.len().min(PREFIX - self.seen);
            self.prefix[self.seen..self.seen + take].copy_from_slice(&data[..take]);
        }
        let before = self.seen;
        self.seen = self.seen.saturating_add(data.len());
        if before < PREFIX && self.seen >= PREFIX {
            let declared = (&self.prefix[1..]).get_u32() as usize;
            if declared > self.limit {
                return Some(declared);
            }
        }
        (self.seen > PREFIX + self.limit).then(|| self.seen - PREFIX)
    }
}

impl<B> Body for LimitedRequest<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(error)) => return Poll::Ready(Some(Err(error.into()))),
            None => return Poll::Ready(None),
        };
        if let Some(data) = frame.data_ref()
            && let Some(size) = self.oversized(data)
        {
            let limit = self.limit;
            let refusal = Status::resource_exhausted(format!(
                "request of {size} bytes or more is over kvgate's limit of {limit} bytes for this call"
            ));
            return Poll::Ready(Some(Err(Box::new(refusal))));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(declared: u32, body: usize) -> Bytes {
        let mut out = vec![0u8];
        out.extend_from_slice(&declared.to_be_bytes());
        out.extend(std::iter::repeat_n(7u8, body));
        out.into()
    }

    #[test]
    fn a_message_within_the_limit_passes_even_split_across_frames() {
        let mut limited = LimitedRequest::new((), 16);
        let whole = message(16, 16);
        assert_eq!(limited.oversized(&whole.slice(..3)), None);
        assert_eq!(limited.oversized(&whole.slice(3..)), None);
    }

    #[test]
    fn a_declared_length_over_the_limit_is_refused_from_its_prefix() {
        let mut limited = LimitedRequest::new((), 16);
        let claim = message(1 << 30, 0);
        assert_eq!(limited.oversized(&claim.slice(..2)), None);
        assert_eq!(limited.oversized(&claim.slice(2..)), Some(1 << 30));
    }

    #[test]
    fn bytes_beyond_the_limit_are_refused_whatever_the_prefix_says() {
        let mut limited = LimitedRequest::new((), 16);
        assert_eq!(limited.oversized(&message(4, 4)), None);
        assert_eq!(limited.oversized(&Bytes::from(vec![0; 13])), Some(17));
    }
}
