//! A gRPC codec whose responses are bytes encoded beforehand.
//!
//! Every subscriber receives the `Bytes` the drain encoded once; writing them
//! into tonic's frame buffer is a copy, never a protobuf encode. Requests are
//! decoded normally.

use std::marker::PhantomData;

use bytes::{BufMut, Bytes};
use tonic::Status;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

/// Decodes requests of type `Request` with prost; encodes pre-encoded responses.
pub struct PreEncodedCodec<Request>(PhantomData<Request>);

impl<Request> Default for PreEncodedCodec<Request> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<Request: prost::Message + Default + Send + 'static> Codec for PreEncodedCodec<Request> {
    type Encode = Bytes;
    type Decode = Request;
    type Encoder = PreEncoded;
    type Decoder = ProstDecoder<Request>;

    fn encoder(&mut self) -> Self::Encoder {
        PreEncoded
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::default()
    }
}

/// Writes a message's encoded bytes as they are.
pub struct PreEncoded;

impl Encoder for PreEncoded {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}
