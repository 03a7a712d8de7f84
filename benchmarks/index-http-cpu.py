#!/usr/bin/env python3
"""kvgate index's CPU per query over HTTP, from /proc, on a vLLM-shaped
fleet: 33 ranks, each fed by its own ZMQ PUB (pyzmq) 125 requests of 64
blocks of 16 tokens sharing an 8-block prefix (231,264 live blocks), then 4
keep-alive connections query stored prompts (each answer names all 33
workers). Needs pyzmq and msgpack:

    python3 benchmarks/index-http-cpu.py target/release/kvgate

Prints the queries, the server's CPU per query, p50/p99 as the Python
client sees them, and the server's RSS after ingest. Set
TOKIO_WORKER_THREADS to pin the runtime's workers."""
import http.client, json, os, socket, struct, subprocess, sys, threading, time
import msgpack, zmq
binary, = sys.argv[1:]
proc = subprocess.Popen(env=dict(os.environ), args=[binary, "index", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
addr = None
for line in proc.stdout:
    if "http://" in line:
        addr = line.strip().rsplit("http://", 1)[1]; break
host, port = addr.rsplit(":", 1); port = int(port)
def post(path, body, conn=None):
    c = conn or http.client.HTTPConnection(host, port)
    c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse(); data = r.read()
    return r.status, data
ctx = zmq.Context()
RANKS, CHAINS, CHAIN, BS = 33, 125, 64, 16
pubs = []
for rank in range(RANKS):
    s = ctx.socket(zmq.PUB); p = s.bind_to_random_port("tcp://127.0.0.1"); pubs.append(s)
    post("/register", {"instance_id": rank, "endpoint": f"tcp://127.0.0.1:{p}", "model_name": "m", "block_size": BS})
time.sleep(2)
def tokens(req):
    return [i if i < 8*BS else (req*2654435761 + i) & 0xffffffff for i in range(CHAIN*BS)]
seq = [0]*RANKS
for rank in range(RANKS):
    for chain in range(CHAINS):
        req = rank*1000+chain
        t = tokens(req)
        hashes = [i if i < 8 else (req << 8 | i) for i in range(CHAIN)]
        ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": t, "block_size": BS, "lora_id": None, "medium": "GPU"}
        pubs[rank].send_multipart([b"", struct.pack(">Q", seq[rank]), msgpack.packb([1.0, [ev], 0])]); seq[rank] += 1
time.sleep(3)
st, body = post("/query", {"token_ids": tokens(5*1000+3), "model_name": "m"})
print("sample answer", st, body[:120])
def cpu():
    f = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
rss = int([l for l in open(f"/proc/{proc.pid}/status") if l.startswith("VmRSS")][0].split()[1])
N = 2000
lat = []
def worker(k):
    c = http.client.HTTPConnection(host, port)
    for q in range(N):
        req = ((q*7919+k) % 33)*1000 + (q % 125)
        t0 = time.perf_counter(); post("/query", {"token_ids": tokens(req), "model_name": "m"}, c); lat.append(time.perf_counter()-t0)
c0 = cpu(); t0 = time.time()
ths = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
[t.start() for t in ths]; [t.join() for t in ths]
c1 = cpu(); el = time.time()-t0
lat.sort()
print(f"queries {4*N} in {el:.1f}s; server CPU per query {1e6*(c1-c0)/(4*N):.1f} us; p50 {1e3*lat[len(lat)//2]:.2f} ms p99 {1e3*lat[int(len(lat)*0.99)]:.2f} ms; RSS {rss} KiB")
proc.kill()
