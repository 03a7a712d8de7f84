//! Compiles `proto/` without a system `protoc`: `protox` parses the files into
//! a descriptor set, which feeds both the prost/tonic code generator and the
//! server-reflection service (so `grpcurl describe` shows the real schema).

use std::{env, fs, path::PathBuf};

const PROTOS: &[&str] = &[
    "kv_events.proto",
    "kvgate_v1.proto",
    "sglang_grpc_scheduler.proto",
    "vllm_grpc_engine.proto",
    "trtllm.proto",
    "tokenspeed_grpc_scheduler.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(
        out_dir.join("kvgate_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    // Servers are hand-written (they send pre-encoded bytes); clients are
    // generated for `kvgate tail`, the upstream source and the tests.
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
