# The two set-up commands of the README, plus the checks run before a commit.

.PHONY: run test lint bench

# A gateway fed by the built-in simulated engine (no GPU, no engine needed).
run:
	cargo run --release -- serve --demo

# Every test: unit, golden fixtures, end to end with the real binary.
test:
	cargo test --locked

lint:
	cargo fmt --all -- --check
	cargo clippy --locked --all-targets -- -D warnings

# Criterion benchmarks of every hot-path stage (see BENCHMARKS.md).
bench:
	cargo bench --bench pipeline
