//! Generated protobuf types and clients (see `build.rs`), plus the encoded
//! descriptor set that server reflection serves.
//!
//! Modules nest like the proto packages (the generated code refers to other
//! packages by relative paths); the short names below are what the rest of
//! kvgate uses.

#![allow(clippy::all, missing_docs)]

pub mod smg {
    pub mod grpc {
        /// `smg.grpc.common`: the KV-event messages the router decodes.
        pub mod common {
            tonic::include_proto!("smg.grpc.common");
        }
    }
}

pub mod kvgate {
    /// `kvgate.v1.KvGate`: kvgate's own service name.
    pub mod v1 {
        tonic::include_proto!("kvgate.v1");
    }
}

pub mod sglang {
    pub mod grpc {
        /// `sglang.grpc.scheduler.SglangScheduler`.
        pub mod scheduler {
            tonic::include_proto!("sglang.grpc.scheduler");
        }
    }
}

pub mod vllm {
    pub mod grpc {
        /// `vllm.grpc.engine.VllmEngine`.
        pub mod engine {
            tonic::include_proto!("vllm.grpc.engine");
        }
    }
}

/// `trtllm.TrtllmService`.
pub mod trtllm {
    tonic::include_proto!("trtllm");
}

pub mod tokenspeed {
    pub mod grpc {
        /// `tokenspeed.grpc.scheduler.TokenSpeedScheduler`.
        pub mod scheduler {
            tonic::include_proto!("tokenspeed.grpc.scheduler");
        }
    }
}

/// `openengine.v1.Control`, for `GetKvEventSources` (discovery).
pub mod openengine {
    pub mod v1 {
        tonic::include_proto!("openengine.v1");
    }
}

/// `sglang.runtime.v1.SglangService`, for `GetServerInfo` (discovery).
pub mod sglang_runtime {
    pub mod v1 {
        tonic::include_proto!("sglang.runtime.v1");
    }
}

pub use smg::grpc::common;

/// Every `.proto` of kvgate as an encoded `FileDescriptorSet`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/kvgate_descriptor.bin"));

impl common::KvCacheEvent {
    /// A clear with no owner: every block of the rank is gone, whoever
    /// stored it (contract section 3). kvgate sends one as a resync: first
    /// in each rank's snapshot, and before a rank's next events once its
    /// engine restarted or lost messages it cannot replay.
    pub fn ownerless_clear() -> Self {
        Self {
            event_id: 0,
            data: Some(common::kv_cache_event::Data::Cleared(
                common::KvCacheCleared { ownership: None },
            )),
        }
    }

    /// Whether this is a clear with no owner ([`Self::ownerless_clear`]).
    pub fn is_ownerless_clear(&self) -> bool {
        matches!(
            &self.data,
            Some(common::kv_cache_event::Data::Cleared(cleared)) if cleared.ownership.is_none()
        )
    }
}
