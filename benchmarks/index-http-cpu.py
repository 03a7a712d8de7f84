#!/usr/bin/env python3
"""kvgate index's CPU per query over HTTP, from /proc, on a vLLM-shaped
fleet: 33 ranks, each fed by its own ZMQ PUB (pyzmq) 125 requests of 64
blocks of 16 tokens sharing an 8-block prefix (231,264 live blocks), then 4
keep-alive connections query stored prompts (each answer names all 33
workers). Needs pyzmq and msgpack (and grpcio with `grpc`):

    python3 benchmarks/index-http-cpu.py target/release/kvgate [grpc]

Prints the queries, the server's CPU per query, p50/p99 as the Python
client sees them, and the server's RSS after ingest. With `grpc`, rounds of
`/query` over HTTP and of `kvgate.v1.KvIndex/Match` over gRPC (4 channels,
the same prompts, on the same port) alternate, three of each. Set
TOKIO_WORKER_THREADS to pin the runtime's workers."""
import http.client, json, os, socket, struct, subprocess, sys, threading, time
import msgpack, zmq
binary, *modes = sys.argv[1:]
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
N = int(os.environ.get("QUERIES", "2000"))
def varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7f; n >>= 7
        if n: out.append(byte | 0x80)
        else: out.append(byte); return bytes(out)
def field(number, payload):
    return varint(number << 3 | 2) + varint(len(payload)) + payload
def match_request(token_ids):
    # MatchRequest{token_ids: TokenIds{ids (packed)}, model_name: "m"}
    packed = b"".join(varint(t) for t in token_ids)
    return field(1, field(1, packed)) + field(3, b"m")
def workers_in(answer):
    # MatchResponse's field 2 (WorkerMatch), counted at the top level.
    at, count = 0, 0
    while at < len(answer):
        key = 0; shift = 0
        while True:
            byte = answer[at]; at += 1; key |= (byte & 0x7f) << shift; shift += 7
            if byte < 0x80: break
        if key & 7 == 0:
            while answer[at] >= 0x80: at += 1
            at += 1; continue
        length = 0; shift = 0
        while True:
            byte = answer[at]; at += 1; length |= (byte & 0x7f) << shift; shift += 7
            if byte < 0x80: break
        count += key >> 3 == 2; at += length
    return count
def http_worker(k, lat):
    c = http.client.HTTPConnection(host, port)
    for q in range(N):
        req = ((q*7919+k) % 33)*1000 + (q % 125)
        t0 = time.perf_counter(); post("/query", {"token_ids": tokens(req), "model_name": "m"}, c); lat.append(time.perf_counter()-t0)
def grpc_worker(k, lat):
    import grpc
    channel = grpc.insecure_channel(f"{host}:{port}")
    call = channel.unary_unary("/kvgate.v1.KvIndex/Match")
    for q in range(N):
        req = ((q*7919+k) % 33)*1000 + (q % 125)
        body = match_request(tokens(req))
        t0 = time.perf_counter(); call(body); lat.append(time.perf_counter()-t0)
    channel.close()
def rounds(name, worker):
    lat = []
    c0 = cpu(); t0 = time.time()
    ths = [threading.Thread(target=worker, args=(k, lat)) for k in range(4)]
    [t.start() for t in ths]; [t.join() for t in ths]
    c1 = cpu(); el = time.time()-t0
    lat.sort()
    print(f"{name}: queries {4*N} in {el:.1f}s; server CPU per query {1e6*(c1-c0)/(4*N):.1f} us; p50 {1e3*lat[len(lat)//2]:.2f} ms p99 {1e3*lat[int(len(lat)*0.99)]:.2f} ms; RSS {rss} KiB", flush=True)
if "grpc" in modes:
    import grpc
    sample = grpc.insecure_channel(f"{host}:{port}").unary_unary("/kvgate.v1.KvIndex/Match")(match_request(tokens(5*1000+3)))
    print("sample Match answer: workers", workers_in(sample), "bytes", len(sample))
    for _ in range(3):
        rounds("/query over HTTP", http_worker)
        rounds("Match over gRPC", grpc_worker)
else:
    rounds("/query over HTTP", http_worker)
proc.kill()
