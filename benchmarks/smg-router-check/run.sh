#!/bin/bash
# The SMG router 1.13 behind kvgate with pushed load (BENCHMARKS.md, "Load pushed end to end").
# Start first, each in the background:
#   python engine.py SMG_PROTO_DIR > engine.log        (prints PORT n)
#   python sglang_load.py SGLANG_WHEEL_DIR             (KV PUB on 25557, load PUB on 25558)
# then: run.sh HEARTBEAT_MS SECONDS ROUTER_METRICS_PORT ROUTER_PORT
# with KVGATE (the binary) and SMG (the venv's smg) set. Prints the router's
# and kvgate's load counters at the start and after SECONDS.
set -e
cd "$(dirname "$0")"
EP=$(grep PORT engine.log | awk '{print $2}')
"$KVGATE" serve --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --zmq-endpoint tcp://127.0.0.1:25557 \
  --zmq-load-endpoint tcp://127.0.0.1:25558 --engine-grpc http://127.0.0.1:$EP --load-heartbeat-ms $1 > kvgate-$1.log 2>&1 &
KV=$!
for i in $(seq 50); do grep -q "serving gRPC" kvgate-$1.log && break; sleep 0.2; done
GRPC=$(grep "serving gRPC on" kvgate-$1.log | sed 's/.*serving gRPC on \([^,]*\),.*/\1/')
ADMIN=$(grep "metrics, /healthz" kvgate-$1.log | sed 's#.*http://##')
"$SMG" launch --host 127.0.0.1 --port $4 --worker-urls grpc://$GRPC --policy cache_aware \
  --load-monitor-interval 1 --disable-tokenizer-autoload --prometheus-port $3 > router-$1.log 2>&1 &
RT=$!
for i in $(seq 100); do curl -s http://127.0.0.1:$3/metrics | grep -q smg_engine_load_polls_total && break; sleep 0.2; done
m() {
  curl -s http://127.0.0.1:$3/metrics | grep -E "^smg_engine_load_polls_total"
  curl -s http://$ADMIN/metrics | grep -E "^kvgate_load_(records_sent|polls_total\{outcome=\"ok|pushes)"
  grep "GetLoads calls" engine.log | tail -1
}
echo "== start (heartbeat $1 ms)"; m
sleep $2
echo "== after $2 s"; m; uptime
kill $RT $KV
