#!/bin/sh
# A flame graph of the kvgate process (not the load tool) while
# `kvgate-bench` feeds it SUBSCRIBERS subscribers at 20k events/s: perf
# samples every CPU for 5 s in the middle of the measured window and the
# graph keeps kvgate's samples. The warm-up lets kvgate's history fill
# (--history-batches batches, about 13 s at 20k events/s and one
# subscriber; longer where kvgate sends fewer, larger batches), so the
# graph is of its steady state, not of it taking memory; the load tool's
# note, printed below the table, says when it still was. (Sampling kvgate's
# threads alone, `-p`, makes perf switch its counters in and out with
# every context switch: on this VM that put 26% of kvgate's samples on
# the switch itself, against 3% sampled system-wide.)
# Needs perf and inferno (`cargo install inferno`); writes OUT.svg.
#
#   benchmarks/flamegraph.sh target/release/kvgate-bench 8 benchmarks/fan-out-8x20k
#
# The kvgate measured is the one beside the load tool.
set -eu
bench_tool=$(realpath "$1")
kvgate=$(dirname "$bench_tool")/kvgate
subscribers=$2
out=$3
work=$(mktemp -d)
"$bench_tool" --subscribers "$subscribers" --rate 20000 --warmup 15 --duration 8 \
    > "$work/bench.txt" 2>&1 &
bench=$!
pid=
for _ in $(seq 100); do
    pid=$(pgrep -f -n "^$kvgate serve" || true)
    [ -n "$pid" ] && break
    sleep 0.1
done
[ -n "$pid" ] || { echo "kvgate did not start" >&2; exit 1; }
sleep 16
perf record -F 999 -a -g --call-graph dwarf,16384 -o "$work/perf.data" -- sleep 5 \
    > /dev/null 2>&1
wait "$bench"
grep -A2 '^relay ' "$work/bench.txt"
grep 'RSS still grew' "$work/bench.txt" || true
perf script -i "$work/perf.data" --pid "$pid" 2> /dev/null | inferno-collapse-perf > "$work/folded"
inferno-flamegraph --minwidth 0.2 \
    --title "kvgate, $subscribers subscribers x 20k events/s" < "$work/folded" > "$out.svg"
rm -rf "$work"
