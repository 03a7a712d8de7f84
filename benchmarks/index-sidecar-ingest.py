#!/usr/bin/env python3
"""kvgate index's CPU per block taken in from a kvgate sidecar (a grpc://
worker: one snapshot of every rank) beside the same blocks taken from the
engine's ZMQ publishers directly (one registration per rank), from /proc.

One engine of 8 ranks, each a ZMQ PUB (pyzmq) publishing 250 requests of
64 blocks of 16 tokens sharing an 8-block prefix (112,064 live blocks);
one `kvgate serve` sidecar on the 8 publishers; index A follows the
publishers, and once it holds every block index B starts with the sidecar
as its one worker and takes its snapshot. Needs pyzmq and msgpack:

    python3 benchmarks/index-sidecar-ingest.py target/release/kvgate

Prints, for each index, the CPU seconds it spent from its start until it
held every block, per block, and its RSS then; for B also the wall time
from its start to the last block."""
import json, os, struct, subprocess, sys, time, urllib.request
import msgpack, zmq

binary, = sys.argv[1:]
RANKS, CHAINS, CHAIN, BS = 8, 250, 64, 16
# Each rank holds the shared prefix once and every request's own blocks.
BLOCKS = RANKS * (8 + CHAINS * (CHAIN - 8))


def start(args, banner):
    proc = subprocess.Popen([binary, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if banner in line:
            return proc, line.strip().rsplit(banner, 1)[1].split(",")[0].strip()
    sys.exit(f"{args[0]} did not start")


def cpu(proc):
    fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(proc):
    line = [l for l in open(f"/proc/{proc.pid}/status") if l.startswith("VmRSS")][0]
    return int(line.split()[1]) / 1024


def blocks(address):
    text = urllib.request.urlopen(f"http://{address}/metrics").read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith("kvgate_index_blocks{"))


def post(address, body):
    request = urllib.request.Request(f"http://{address}/register", json.dumps(body).encode(), {"content-type": "application/json"})
    urllib.request.urlopen(request).read()


def await_blocks(address, deadline=300):
    started = time.time()
    while blocks(address) < BLOCKS:
        if time.time() - started > deadline:
            sys.exit(f"{address} holds {blocks(address)} of {BLOCKS} blocks")
        time.sleep(0.01)
    return time.time()


context = zmq.Context()
publishers, ports = [], []
for _ in range(RANKS):
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.SNDHWM, 0)
    ports.append(socket.bind_to_random_port("tcp://127.0.0.1"))
    publishers.append(socket)
sidecar_args = ["serve", "--log-format", "text", "--listen", "127.0.0.1:0", "--dp-size", str(RANKS)]
for port in ports:
    sidecar_args += ["--zmq-endpoint", f"tcp://127.0.0.1:{port}"]
sidecar, sidecar_address = start(sidecar_args, "kvgate: serving gRPC on ")
index_a, a = start(["index", "--log-format", "text", "--listen", "127.0.0.1:0"], "http://")
for rank, port in enumerate(ports):
    post(a, {"instance_id": 1, "dp_rank": rank, "endpoint": f"tcp://127.0.0.1:{port}", "model_name": "m", "block_size": BS})
time.sleep(2)  # ZMQ's slow joiner: both subscribers connected before the first message
a_cpu0 = cpu(index_a)
for rank in range(RANKS):
    for chain in range(CHAINS):
        request = rank * 1000 + chain
        tokens = [i if i < 8 * BS else (request * 2654435761 + i) & 0xFFFFFFFF for i in range(CHAIN * BS)]
        hashes = [i if i < 8 else (request << 8 | i) for i in range(CHAIN)]
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
                 "block_size": BS, "lora_id": None, "medium": "GPU"}
        publishers[rank].send_multipart([b"", struct.pack(">Q", chain), msgpack.packb([1.0, [event], rank])])
        time.sleep(0.002)  # paced: no subscriber's queue overflows (there is no replay to fill a gap)
await_blocks(a)
a_cpu = cpu(index_a) - a_cpu0
time.sleep(1)
started = time.time()
index_b, b = start(["index", "--log-format", "text", "--listen", "127.0.0.1:0", "--model-name", "m", "--block-size", str(BS),
                    "--workers", f"2=grpc://{sidecar_address}"], "http://")
b_cpu0 = cpu(index_b)
done = await_blocks(b)
b_cpu = cpu(index_b) - b_cpu0
print(f"{BLOCKS} blocks, {RANKS} ranks")
print(f"A, ZMQ ranks:     {a_cpu:.2f} s CPU, {a_cpu / BLOCKS * 1e6:.2f} us/block, RSS {rss_mib(index_a):.0f} MiB")
print(f"B, one sidecar:   {b_cpu:.2f} s CPU, {b_cpu / BLOCKS * 1e6:.2f} us/block, RSS {rss_mib(index_b):.0f} MiB, "
      f"{done - started:.2f} s from start to the last block")
for proc in (index_a, index_b, sidecar):
    proc.kill()
    proc.wait()
