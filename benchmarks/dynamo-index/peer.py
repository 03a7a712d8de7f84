#!/usr/bin/env python3
"""Dynamo's standalone KV indexer as the peer of `kvgate index`'s benchmarks.

Two commands, both run with the interpreter of the venv that holds
ai-dynamo-runtime 1.6.1 (see record.py for the install):

  peer.py serve --port PORT [--workers "1=tcp://127.0.0.1:5557,1:1=..."]
                [--block-size 16] [--model-name M] [--threads 4]
      Runs `python -m dynamo.indexer` on PORT with those workers until
      SIGTERM/SIGINT, then kills it by its pid. Prints one JSON line
      {"pid": DYNAMO_PID, "url": "http://127.0.0.1:PORT"} once /health
      answers, so a load tool can query it and sample /proc/PID itself.
      Dynamo binds 0.0.0.0: send it loopback traffic only.

  peer.py measure [--ranks 33] [--ranks-per-worker 4] [--blocks-per-rank 8000]
                  [--block-size 16]
                  [--chain 32] [--shared 0.5] [--chains-per-batch 8]
                  [--queries 20000] [--connections 4] [--json OUT]
      The whole measurement on its own: starts Dynamo, binds one ZMQ PUB per
      rank on 127.0.0.1, registers them, publishes vLLM 0.33-shaped stores
      (chains of --chain blocks; the first --shared of each chain is a prefix
      shared by every rank, as a system prompt is), waits until the last
      store of every rank answers and Dynamo counts every store applied,
      then sends --queries /query requests (whole stored
      chains, partially matching) over --connections keep-alive connections.
      Reports, from /proc/PID of Dynamo's process:
        - CPU per ingested block (utime+stime over the ingest, / blocks);
        - memory per live block (RSS after ingest - RSS before, / blocks);
        - CPU per query (utime+stime over the query phase, / queries);
      and the client-side latency p50/p99 of the queries.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import BATCH_TS, Dynamo, block_stored, engine_hash  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def stores_applied(dynamo: Dynamo) -> int:
    _, _, text = dynamo.request("GET", "/metrics")
    for line in text.decode().splitlines():
        if line.startswith('dynamo_kvrouter_kv_cache_events_applied{event_type="stored",status="ok"}'):
            return int(float(line.split()[-1]))
    return 0


class Connection:
    """One keep-alive HTTP/1.1 connection with a minimal client: the load
    side stays light next to the server measured on the same 2 cores."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")
        self.sock.sendall(head.encode() + body)
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(65536)
        header, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status = int(header.split(b" ", 2)[1])
        length = 0
        for line in header.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(self.buf) < length:
            self.buf += self.sock.recv(65536)
        answer, self.buf = self.buf[:length], self.buf[length:]
        return status, answer


def chain_tokens(rank: int, chain: int, length: int, shared: int, bs: int) -> list[int]:
    """Chain `chain`'s tokens on `rank`: its first `shared` blocks are the
    same on every rank, the rest the rank's own."""
    out = []
    for b in range(length):
        owner = 0 if b < shared else rank + 1
        base = ((owner * 100_003 + chain) * 64 + b) * bs
        out.extend((base + k) % 4_000_000_000 for k in range(bs))
    return out


def measure(args) -> dict:
    dynamo = Dynamo(args.python or sys.executable, args.threads)
    pid = dynamo.proc.pid
    ctx = zmq.Context.instance()
    try:
        bs, length = args.block_size, args.chain
        shared = int(length * args.shared)
        rpw = args.ranks_per_worker
        chains = args.blocks_per_rank // length
        time.sleep(0.5)
        cpu0, rss0 = cpu_seconds(pid), rss_bytes(pid)
        socks = []
        for r in range(args.ranks):
            sock = ctx.socket(zmq.XPUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.bind("tcp://127.0.0.1:0")
            body = {"instance_id": r // rpw + 1, "dp_rank": r % rpw, "model_name": "m",
                    "block_size": bs, "endpoint": sock.getsockopt_string(zmq.LAST_ENDPOINT)}
            status, _, answer = dynamo.request("POST", "/register", body)
            assert status == 201, answer
            assert sock.poll(20_000), "no subscriber"
            sock.recv()
            socks.append(sock)
        # --chains-per-batch stores (one scheduler step's worth) per batch,
        # encoded as they are sent (a fleet's worth does not fit in memory
        # at once); Dynamo's own CPU is what is measured.
        step = args.chains_per_batch

        def batch(rank, index):
            events = []
            for c in range(index * step, min((index + 1) * step, chains)):
                tokens = chain_tokens(rank, c, length, shared, bs)
                hashes, parent = [], None
                for b in range(length):
                    parent = engine_hash(parent, tokens[b * bs:(b + 1) * bs])
                    hashes.append(parent)
                events.append(block_stored(hashes, None, tokens, bs))
            return msgpack.packb([BATCH_TS, events, rank % rpw], use_bin_type=True)

        blocks = args.ranks * chains * length
        cpu1 = cpu_seconds(pid)
        for i in range((chains + step - 1) // step):
            for r, sock in enumerate(socks):
                sock.send_multipart([b"", i.to_bytes(8, "big"), batch(r, i)])
        # Applied when every rank's last chain answers at full depth.
        deadline = time.monotonic() + 600
        for r in range(args.ranks):
            tokens = chain_tokens(r, chains - 1, length, shared, bs)
            body = {"token_ids": tokens, "model_name": "m"}
            while True:
                status, _, raw = dynamo.request("POST", "/query", body)
                scores = json.loads(raw).get("scores", {})
                if scores.get(str(r // rpw + 1), {}).get(str(r % rpw)) == length * bs:
                    break
                assert time.monotonic() < deadline, "ingest did not finish"
                time.sleep(0.05)
        cpu2, rss2 = cpu_seconds(pid), rss_bytes(pid)
        applied = stores_applied(dynamo)
        assert applied >= args.ranks * chains, f"only {applied} stores applied"
        # Queries: whole chains of random ranks (full matches on that rank,
        # the shared half on every other).
        rng = random.Random(7)
        bodies = [json.dumps({"token_ids": chain_tokens(rng.randrange(args.ranks),
                                                        rng.randrange(chains), length,
                                                        shared, bs),
                              "model_name": "m"}).encode() for _ in range(256)]
        latencies: list[list[float]] = [[] for _ in range(args.connections)]
        per_conn = args.queries // args.connections

        def client(i):
            conn = Connection(dynamo.port)
            for q in range(per_conn):
                start = time.perf_counter()
                status, _ = conn.post("/query", bodies[(i * 7919 + q) % len(bodies)])
                latencies[i].append(time.perf_counter() - start)
                assert status == 200

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.connections)]
        cpu3, wall3 = cpu_seconds(pid), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu4, wall4 = cpu_seconds(pid), time.perf_counter()
        all_lat = sorted(x for lat in latencies for x in lat)
        queries = len(all_lat)
        return {
            "peer": "ai-dynamo-runtime 1.6.1, python -m dynamo.indexer --threads %d" % args.threads,
            "ranks": args.ranks, "block_size": bs, "chain_blocks": length,
            "shared_blocks_per_chain": shared, "chains_per_batch": args.chains_per_batch,
            "stores_applied": applied,
            "live_blocks": blocks,
            "ingest_cpu_us_per_block": round((cpu2 - cpu1) / blocks * 1e6, 2),
            "registration_cpu_s": round(cpu1 - cpu0, 3),
            "rss_before_bytes": rss0, "rss_after_ingest_bytes": rss2,
            "memory_bytes_per_live_block": round((rss2 - rss0) / blocks, 1),
            "queries": queries, "connections": args.connections,
            "query_cpu_us": round((cpu4 - cpu3) / queries * 1e6, 1),
            "queries_per_s": round(queries / (wall4 - wall3)),
            "latency_p50_ms": round(all_lat[queries // 2] * 1e3, 3),
            "latency_p99_ms": round(all_lat[int(queries * 0.99)] * 1e3, 3),
        }
    finally:
        dynamo.stop()


def serve(args):
    cmd = [args.python or sys.executable, "-m", "dynamo.indexer", "--port", str(args.port),
           "--threads", str(args.threads)]
    if args.workers:
        cmd += ["--workers", args.workers, "--block-size", str(args.block_size),
                "--model-name", args.model_name]
    proc = subprocess.Popen(cmd)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", args.port), timeout=1) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                    if s.recv(64).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("dynamo.indexer did not start")
            time.sleep(0.05)
        print(json.dumps({"pid": proc.pid, "url": f"http://127.0.0.1:{args.port}"}), flush=True)
        while not stop.is_set() and proc.poll() is None:
            stop.wait(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the venv's interpreter (default: this one)")
    parser.add_argument("--threads", type=int, default=4)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--workers")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--model-name", default="default")
    m = sub.add_parser("measure")
    m.add_argument("--ranks", type=int, default=33)
    m.add_argument("--ranks-per-worker", type=int, default=4)
    m.add_argument("--blocks-per-rank", type=int, default=8000)
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--chain", type=int, default=32)
    m.add_argument("--shared", type=float, default=0.5,
                   help="fraction of each chain every rank shares (a system prompt)")
    m.add_argument("--chains-per-batch", type=int, default=8)
    m.add_argument("--queries", type=int, default=20000)
    m.add_argument("--connections", type=int, default=4)
    m.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "serve":
        serve(args)
        return
    result = measure(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
