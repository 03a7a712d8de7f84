#!/usr/bin/env bash
# `make release`: kvgate's release binary, optimized with a profile of its
# own hot path (profile-guided optimization, PGO) -> target/pgo/kvgate.
#
# 1. builds kvgate instrumented (`-Cprofile-generate`), and the load tool;
# 2. runs the load tool against it on loopback: its simulated engine at
#    20k events/s to 1, 8 and 64 subscribers, then at full speed to 8, in a
#    shape the benchmarks do not measure (64-block stores, not 16);
# 3. merges the profiles every instrumented kvgate wrote as it exited;
# 4. builds kvgate again with them (`-Cprofile-use`).
#
# The result spends 15% less CPU per event than `cargo build --release` at
# one subscriber × 20k events/s, 9% at 8 (BENCHMARKS.md, "The shipped
# build: optimized with a profile of its hot path"). Both builds go to their own target directories under
# target/pgo, so the plain release and test builds stay cached; about 18
# minutes from scratch on two cores, 5 once the instrumented build is
# cached.
#
# Needs llvm-profdata of the toolchain's own LLVM: rustup's `llvm-tools`
# component, added here when missing.
set -euo pipefail
cd "$(dirname "$0")/../.."

out=target/pgo
host=$(rustc -vV | sed -n 's/^host: //p')
profdata=$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata
if [[ ! -x $profdata ]]; then
	rustup component add llvm-tools
fi

# `--target` keeps the flags off build scripts and proc macros: they run
# during the build and would write profiles of their own. The binary and
# every crate in it are instrumented.
raw=$PWD/$out/raw
rm -rf "$raw"
mkdir -p "$raw"
RUSTFLAGS="-Cprofile-generate=$raw" \
	cargo build --release --locked --bin kvgate --target "$host" --target-dir "$out/generate"
cargo build --release --locked -p kvgate-bench

# The load tool stops kvgate with SIGTERM after each run; an instrumented
# process writes its profile as it exits.
train() {
	LLVM_PROFILE_FILE="$raw/kvgate-%p-%m.profraw" target/release/kvgate-bench \
		--kvgate "$out/generate/$host/release/kvgate" --blocks-per-store 64 \
		--warmup 2 --duration 5 "$@"
}
train --subscribers 1,8,64 --rate 20000
train --subscribers 8 --rate 0
shopt -s nullglob
profiles=("$raw"/*.profraw)
((${#profiles[@]} > 0)) || {
	echo "no profile was written: did the instrumented kvgate exit cleanly?" >&2
	exit 1
}
"$profdata" merge -o "$out/kvgate.profdata" "${profiles[@]}"

# A new profile changes every crate's code: all are built afresh.
rm -rf "$out/use"
RUSTFLAGS="-Cprofile-use=$PWD/$out/kvgate.profdata" \
	cargo build --release --locked --bin kvgate --target "$host" --target-dir "$out/use"
cp "$out/use/$host/release/kvgate" "$out/kvgate"
echo "kvgate, optimized with ${#profiles[@]} profiles: $out/kvgate"
