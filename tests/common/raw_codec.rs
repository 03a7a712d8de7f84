//! A gRPC codec whose responses are bytes given as they are, for test
//! servers that must send what no prost message encodes to (a broken
//! upstream's garbage). Requests are decoded with prost.

use std::marker::PhantomData;

use bytes::{BufMut, Bytes};
use tonic::Status;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

/// Decodes requests of type `Request` with prost; sends responses verbatim.
pub struct RawCodec<Request>(PhantomData<Request>);

impl<Request> Default for RawCodec<Request> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<Request: prost::Message + Default + Send + 'static> Codec for RawCodec<Request> {
    type Encode = Bytes;
    type Decode = Request;
    type Encoder = Verbatim;
    type Decoder = ProstDecoder<Request>;

    fn encoder(&mut self) -> Self::Encoder {
        Verbatim
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::default()
    }
}

/// Writes a message's bytes as they are.
pub struct Verbatim;

impl Encoder for Verbatim {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}
