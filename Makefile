# The two set-up commands of the README, plus the checks run before a commit.

.PHONY: run test lint fuzz bench load fan-out peer index-peer flamegraphs benchmarks image release

# A gateway fed by the built-in simulated engine (no GPU, no engine needed),
# on loopback only: a demo faces no network.
run:
	cargo run --release -- serve --demo --demo-layout trtllm-native --listen 127.0.0.1:50061

# Every test of every crate: unit, golden fixtures, end to end with the real
# binary.
test:
	cargo test --workspace --locked

lint:
	cargo fmt --all -- --check
	cargo clippy --locked --workspace --all-targets -- -D warnings

# Criterion benchmarks of every hot-path stage (see BENCHMARKS.md).
bench:
	cargo bench --bench pipeline
	cargo bench --bench memory
	cargo bench --bench passthrough
	cargo bench --bench zmq_ingest
	cargo bench --bench loopback_write
	cargo bench --bench load_push

# The load sweep of BENCHMARKS.md: a release kvgate under 1, 8, 32 and 64
# real subscribers, at 20k events/s and at full speed; tables on stdout,
# JSON and charts in benchmarks/. The load tool is its own binary
# (crates/kvgate-bench), never part of the sidecar.
load:
	cargo build --release --locked --workspace --bins
	mkdir -p benchmarks
	target/release/kvgate-bench --subscribers 1,8,32,64 --rate 20000 \
		--json benchmarks/load.json --svg benchmarks/load.svg
	target/release/kvgate-bench --subscribers 1,8,32,64 --rate 0 \
		--json benchmarks/load-max.json --svg benchmarks/load-max.svg

# The fan-out figures: CPU per batch delivered at 1, 8 and 64 subscribers
# (20k events/s), ingest, snapshot encode and memory (BENCHMARKS.md).
fan-out:
	cargo build --release --locked --workspace --bins
	target/release/kvgate-bench --subscribers 1,8,64 --rate 20000 \
		--json benchmarks/fan-out.json
	cargo bench --locked --bench pipeline -- 'ingest/|state/|snapshot-1M|convert/steady|fan-out'
	cargo bench --locked --bench memory
	cargo bench --locked --bench zmq_ingest
	cargo bench --locked --bench loopback_write

# The release binary as the image ships it: optimized with a profile of its
# own hot path (PGO), in target/pgo/kvgate; see deploy/pgo/build.sh (about
# 18 minutes from scratch on two cores).
release:
	deploy/pgo/build.sh

# kvgate as shipped (`make release`) against smg 1.13's Rust
# relay, alternating run by run, the libzmq floor beside kvgate's cost per
# subscriber, and the floor relay (a relay that does nothing but relay)
# beside kvgate's CPU per event. PEER_PYTHON is a Python with smg, pyzmq,
# msgpack and grpcio (see benchmarks/smg-peer.py).
PEER_PYTHON ?= python3
PEER = --peer '$(PEER_PYTHON) benchmarks/smg-peer.py {port} {zmq}' --peer-name smg
SHIPPED = target/pgo/kvgate
peer: release
	target/release/kvgate-bench --kvgate $(SHIPPED) --subscribers 1,8 --rate 20000 --rounds 2 \
		$(PEER) --json benchmarks/peer.json
	target/release/kvgate-bench --kvgate $(SHIPPED) --subscribers 32 --rate 5000 --rounds 2 \
		$(PEER) --json benchmarks/peer-32x5k.json
	$(PEER_PYTHON) benchmarks/floor.py --kvgate $(SHIPPED) --counts 1,8,64
	$(PEER_PYTHON) benchmarks/floor.py --kvgate $(SHIPPED) --counts 8,64 --processes 1
	$(PEER_PYTHON) benchmarks/floor.py --kvgate $(SHIPPED) --counts 8,64 --rounds 2 \
		--rust-receivers target/release/kvgate-bench
	$(PEER_PYTHON) benchmarks/floor.py --kvgate $(SHIPPED) --relay --counts 1,8 \
		--rounds 2 --rust-receivers target/release/kvgate-bench
	$(PEER_PYTHON) benchmarks/floor.py --kvgate $(SHIPPED) --relay --counts 32 \
		--rate 312.5 --rounds 2 --rust-receivers target/release/kvgate-bench

# `kvgate index` against Dynamo's standalone indexer 1.6.1, alternating run
# by run on one simulated fleet: the 33-rank fleet and the fleet scale, then
# the fleet scale against the floor, an index that indexes nothing
# (benchmarks/dynamo-index/README.md). DYNAMO_PYTHON is the Python of a venv
# holding ai-dynamo-runtime 1.6.1 (the install is in that README).
DYNAMO_PYTHON ?= /work/dynamo-venv/bin/python
DYNAMO = --peer '$(DYNAMO_PYTHON) benchmarks/dynamo-index/peer.py serve --port {port}'
index-peer:
	cargo build --release --locked -p kvgate -p kvgate-bench
	target/release/kvgate-bench index --rounds 3 $(DYNAMO) --json benchmarks/index-vs-dynamo.json
	target/release/kvgate-bench index --rounds 2 --ranks 256 --ranks-per-worker 1 --blocks-per-rank 32768 \
		--queries 4000 --steady 20 $(DYNAMO) --json benchmarks/index-fleet-vs-dynamo.json
	target/release/kvgate-bench index --rounds 2 --ranks 256 --ranks-per-worker 1 --blocks-per-rank 32768 \
		--queries 0 --steady 20 --peer 'target/release/kvgate-bench index-floor --port {port}' \
		--peer-name floor --json benchmarks/index-fleet-vs-floor.json

# The fan-out flame graphs (needs perf and `cargo install inferno`).
flamegraphs:
	cargo build --release --locked --workspace --bins
	benchmarks/flamegraph.sh target/release/kvgate-bench 8 benchmarks/flame-fan-out-8x20k
	benchmarks/flamegraph.sh target/release/kvgate-bench 64 benchmarks/flame-fan-out-64x20k

# Every benchmark of BENCHMARKS.md in one command.
benchmarks: bench load

# The decoder + batcher fuzz target (proptest) for longer than `make test`
# runs it: 20k cases of each property, bounded (a few minutes in release).
fuzz:
	PROPTEST_CASES=20000 cargo test --release --locked --test fuzz

# The container image, built with buildah and checked in a chroot (see the
# docs/deploy.md).
image:
	deploy/image/build.sh
