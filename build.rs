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

/// The engine RPCs kvgate calls to learn where the engine publishes (not
/// served, so not in the reflection descriptor set); servers are generated
/// for the tests' engines.
const DISCOVERY_PROTOS: &[&str] = &["openengine_control.proto", "sglang_runtime_v1.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rustc-env=KVGATE_GIT_COMMIT={}", git_commit());
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
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(protox::compile(DISCOVERY_PROTOS, ["proto/discovery"])?)?;
    Ok(())
}

/// The commit for `kvgate_build_info`: `KVGATE_GIT_COMMIT` when set (an image
/// build has no `.git`), else `git rev-parse`, else `unknown`.
fn git_commit() -> String {
    println!("cargo:rerun-if-env-changed=KVGATE_GIT_COMMIT");
    if let Ok(commit) = env::var("KVGATE_GIT_COMMIT") {
        return commit;
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|output| output.status.success())
            .and_then(|output| String::from_utf8(output.stdout).ok())
            .map(|text| text.trim().to_owned())
    };
    // Rebuild when HEAD moves: a commit rewrites the branch's ref file, a
    // checkout rewrites HEAD (a worktree keeps both in its own git dir).
    let branch = git(&["rev-parse", "--symbolic-full-name", "HEAD"]);
    for path in ["HEAD"].into_iter().chain(branch.as_deref()) {
        if let Some(file) = git(&["rev-parse", "--git-path", path]) {
            println!("cargo:rerun-if-changed={file}");
        }
    }
    git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into())
}
