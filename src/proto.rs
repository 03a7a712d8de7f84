//! Generated protobuf types and clients (see `build.rs`), plus the encoded
//! descriptor set that server reflection serves.

#![allow(clippy::all, missing_docs)]

/// `smg.grpc.common`: the KV-event messages the router decodes.
pub mod common {
    tonic::include_proto!("smg.grpc.common");
}

/// `kvgate.v1.KvGate`: kvgate's own service name.
pub mod kvgate {
    tonic::include_proto!("kvgate.v1");
}

/// `sglang.grpc.scheduler.SglangScheduler`.
pub mod sglang {
    tonic::include_proto!("sglang.grpc.scheduler");
}

/// `vllm.grpc.engine.VllmEngine`.
pub mod vllm {
    tonic::include_proto!("vllm.grpc.engine");
}

/// `trtllm.TrtllmService`.
pub mod trtllm {
    tonic::include_proto!("trtllm");
}

/// `tokenspeed.grpc.scheduler.TokenSpeedScheduler`.
pub mod tokenspeed {
    tonic::include_proto!("tokenspeed.grpc.scheduler");
}

/// Every `.proto` of kvgate as an encoded `FileDescriptorSet`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/kvgate_descriptor.bin"));
