#!/usr/bin/env python3
"""smg 1.13's Rust KV-event relay as a subject for `kvgate-bench --peer`.

Serves `/vllm.grpc.engine.VllmEngine/SubscribeKvEvents` on 127.0.0.1:PORT,
relayed from the ZMQ publisher at ENDPOINT, without an engine: the engine
handshake just stays pending, which the relay does not wait for. Runs until
SIGTERM or SIGINT (kvgate-bench kills it by pid).

Needs `pip install smg==1.13.0 smg-grpc-servicer==0.14.1
smg-grpc-proto==0.4.28` in the Python that runs it, e.g. a venv:

    kvgate-bench --peer '/tmp/venv/bin/python benchmarks/smg-peer.py {port} {zmq}'
"""

import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

# A year: the handshake with the engine that never comes must not time out
# during a run.
NEVER = 365 * 24 * 3600.0


def free_port():
    # The servicer binds a ZMQ socket of its own for the engine's input;
    # nothing connects to it here.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: smg-peer.py PORT ZMQ_ENDPOINT")
    port, endpoint = int(sys.argv[1]), sys.argv[2]
    from smg.servicer import VllmGrpcServer

    work = tempfile.mkdtemp(prefix="smg-peer-")
    server = VllmGrpcServer(
        f"127.0.0.1:{port}",
        f"ipc://{os.path.join(work, 'servicer')}",
        f"tcp://127.0.0.1:{free_port()}",
        "model",
        engine_count=1,
        data_parallel_size=1,
        kv_events_endpoint=endpoint,
        kv_events_replay_endpoint="",
        kv_events_topic="",
        engine_startup_timeout_secs=NEVER,
        engine_startup_ceiling_secs=NEVER,
    )
    # kvgate-bench ends this process with SIGKILL, so nothing would remove
    # the engine-side sockets afterwards; no engine ever connects to them, so
    # they go as soon as the servicer has bound them.
    deadline = time.monotonic() + 10
    while len(os.listdir(work)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(work, ignore_errors=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    print(f"smg-peer: serving gRPC on 127.0.0.1:{port}", flush=True)
    stop.wait()
    server.stop(1.0)

if __name__ == "__main__":
    main()
