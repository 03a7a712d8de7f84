#!/usr/bin/env python3
"""Record Dynamo's standalone KV indexer answering scripted event streams.

The answers are the golden fixtures `kvgate index` is checked against in
`make test` (tests/fixtures/dynamo-index/<scenario>.json): CI cannot run
Dynamo, so its answers are recorded here, once, with this script.

How to run (Dynamo lives outside the repository; nothing of it is committed):

    python3 -m venv /work/dynamo-venv
    /work/dynamo-venv/bin/pip install --no-deps ai-dynamo-runtime==1.6.1
    /work/dynamo-venv/bin/pip install 'pydantic>=2.10.6,<=2.13.5' uvloop pyzmq msgpack xxhash
    /work/dynamo-venv/bin/python benchmarks/dynamo-index/record.py \
        [--out tests/fixtures/dynamo-index] [--only SCENARIO ...]

The script starts `python -m dynamo.indexer --port P --threads 4` on a free
port (it binds 0.0.0.0; only loopback traffic is ever sent to it), binds one
ZMQ XPUB socket per worker rank on 127.0.0.1 ephemeral ports, registers the
workers, publishes vLLM 0.33-shaped msgpack batches, waits until Dynamo has
applied them, queries, and writes every exchange. One Dynamo process serves
one scenario; it is killed by its pid afterwards.

Fixture format (what a replayer implements):

    {"reference": "ai-dynamo-runtime 1.6.1 (python -m dynamo.indexer)",
     "reference_command": "python -m dynamo.indexer --port P --threads 4",
     "recorded_with": "benchmarks/dynamo-index/record.py",
     "scenario": "<name>", "description": "<what the stream exercises>",
     "sockets": [{"name": "w1r0"}, ...],
     "steps": [ ... ],
     "volatile": ["steps[7].response_text", ...],     # optional
     "unordered": ["steps[3].response", ...]}         # optional

`sockets`: the ZMQ PUB sockets the replayer binds on 127.0.0.1 ephemeral
ports (XPUB here, so a subscriber's arrival is visible). Wherever a request
body holds the string `{socket:NAME}`, the replayer substitutes that socket's
`tcp://127.0.0.1:PORT`; answers naming a socket's endpoint were recorded
with the same placeholder (substitute before comparing).

Steps, in order:
  {"http": {"method": M, "path": P, "body": JSON} | {..., "body_raw": "text",
            "content_type": "..."}, "status": N,
   "response": JSON | "response_text": "..."}
      Send the request; the answer must have this status and this body
      (JSON compared as values; `response_text` compared as text). A step
      answered with an error text holds the exact `body_raw` that was sent:
      serde's messages quote line and column of it.
      A body is sent with `content-type: application/json` unless
      `content_type` says otherwise (null: no content-type header).
  {"await_subscriber": {"socket": NAME}}
      Wait (bounded) until the indexer's SUB socket has subscribed to NAME
      (an XPUB with XPUB_VERBOSE sees every subscription message, also a
      repeated one); PUB drops whatever is sent before that (slow joiner).
  {"publish": {"socket": NAME, "topic": "", "seq": N, "payload_b64": B64}}
      Send the three frames [topic, seq as 8-byte big-endian, payload].
  {"settle": {"http": {...}, "status": N, "response": JSON}}
      Poll the request (bounded) until it answers exactly this; this is how
      both sides know the events published so far were applied. Each settle
      query asks for a sentinel block (tokens 7_000_000 and up) stored last
      on every socket published to since the previous settle, one per tier
      those batches touched (Dynamo applies the device tier and the lower
      tiers on separate paths, so a device sentinel proves nothing about a
      CPU store): ordering per socket and tier proves everything before it
      was applied.

A `/dump` step also carries `dump_blocks`: the answer flattened to one row
per stored block, [partition, worker_id, dp_rank, storage_tier, parent_hash,
block_hash, tokens_hash] (a block's parent is the event's `parent_hash` for
its first block, the previous block for the others), sorted by the rows'
JSON text. Compare that, not the raw `response`: the grouping of blocks into
events and the event ids differ even between Dynamo's own index
implementations (`--threads 1` and `--threads 4` agree on the rows).

Replay (a worker registered with a `replay_endpoint`): a socket listed with
`"kind": "router"` is a ROUTER the replayer binds instead of an XPUB.
  {"replay_request": {"socket": NAME, "start_seq": N}}
      Wait (bounded) for the indexer's request on that ROUTER: frames
      [identity, "", N as 8-byte big-endian] (it connects a DEALER).
  {"replay_reply": {"socket": NAME, "messages_b64": [[frame, ...], ...]}}
      Send each message to the identity of the last request, as vLLM 0.33's
      publisher answers: ["", topic, seq, payload] per batch, then the END
      marker ["", "", ff x 8, ""].
  {"publish_raw": {"socket": NAME, "frames_b64": [frame, ...]}}
      Send these frames as they are (malformed input: wrong frame count,
      short sequence frame, undecodable payload).

The files are written with sorted keys, and the arrays listed in
`unordered` sorted too, so a recording that changed nothing diffs empty.

`volatile` lists fields whose values are not deterministic (timings,
ports); a replayer checks they exist but not their values. Paths are
`steps[i]` then `.key` per object level (keys hold no dots). `unordered`
lists JSON arrays whose order Dynamo does not define (it iterates hash
maps): compare them as multisets.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import zmq

REFERENCE = "ai-dynamo-runtime 1.6.1 (python -m dynamo.indexer)"
# Each fixture also names the command line: `--threads` picks Dynamo's index
# implementation (1: a single-threaded radix tree; more: a thread pool).
RECORDED_WITH = "benchmarks/dynamo-index/record.py"
# Batches carry a fixed timestamp so the recorded payloads are reproducible.
BATCH_TS = 1767225600.25
SENTINEL_BASE = 7_000_000
SENTINEL_MEDIUM = {"device": "GPU", "host": "CPU_TIER1", "disk": "DISK",
                   "external": "EXTERNAL"}
LOWER_TIER = {"CPU": "host", "CPU_PINNED": "host", "CPU_TIER1": "host",
              "CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk", "STORAGE": "disk",
              "EXTERNAL": "external", "NETWORK": "external", "REMOTE": "external",
              "SHARED": "external"}


def tiers_touched(events) -> set[str]:
    """The lower tiers a batch's events name (map or array form); a clear
    touches them all."""
    touched = set()
    for event in events if isinstance(events, list) else []:
        if isinstance(event, dict):
            kind, medium = event.get("type"), event.get("medium")
        elif isinstance(event, list) and event:
            kind = event[0]
            slot = 6 if kind == "BlockStored" else 2
            medium = event[slot] if len(event) > slot else None
        else:
            continue
        if kind == "AllBlocksCleared":
            touched |= set(LOWER_TIER.values())
        elif isinstance(medium, str) and medium in LOWER_TIER:
            touched.add(LOWER_TIER[medium])
    return touched
POLL_DEADLINE_S = 20.0


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_hash(parent, tokens, extra=None) -> int:
    """A stand-in for an engine's block hash: like vLLM's, a 64-bit digest of
    (parent hash, the block's tokens, its extra keys), so every worker of a
    model publishes the same hash for the same block, and hashes >= 2^63
    (msgpack uint64) are common."""
    digest = hashlib.sha256(repr((parent, list(tokens), extra)).encode()).digest()
    return int.from_bytes(digest[-8:], "big")


def block_stored(hashes, parent, tokens, block_size, *, medium="GPU",
                 lora_name=None, extra_keys=None, lora_id=None, **extra):
    """A vLLM 0.33 `BlockStored` as its msgspec encoder writes it: fields
    without a default always present (maybe nil), optional ones only when
    set."""
    event = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
    }
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    event["group_idx"] = 0
    event["kv_cache_spec_kind"] = "full_attention"
    event.update(extra)
    return event


def block_removed(hashes, *, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def all_cleared():
    return {"type": "AllBlocksCleared"}


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True)


def dump_event_order(entry) -> str:
    """Dump events by what they hold, their ids last (the ids vary)."""
    event = entry["event"]
    return canonical([entry["worker_id"], event["dp_rank"], entry["storage_tier"],
                      event["data"], event["event_id"]])


def replace_strings(value, pairs):
    """`value` (JSON) with every string's occurrences of each pair's first
    part replaced by its second."""
    if isinstance(value, str):
        for old, new in pairs:
            value = value.replace(old, new)
        return value
    if isinstance(value, dict):
        return {k: replace_strings(v, pairs) for k, v in value.items()}
    if isinstance(value, list):
        return [replace_strings(v, pairs) for v in value]
    return value


def dump_blocks(dump: dict) -> list:
    """`/dump` flattened to one row per stored block:
    [partition, worker_id, dp_rank, storage_tier, parent_hash, block_hash,
    tokens_hash], sorted. How blocks are grouped into events, and the
    event ids, belong to the implementation (Dynamo's own two index
    implementations group them differently); these rows do not."""
    rows = []
    for partition, body in dump.items():
        for entry in body.get("events", []):
            event = entry["event"]
            stored = event["data"]["stored"]
            parent = stored["parent_hash"]
            for block in stored["blocks"]:
                rows.append([partition, entry["worker_id"], event["dp_rank"],
                             entry["storage_tier"], parent, block["block_hash"],
                             block["tokens_hash"]])
                parent = block["block_hash"]
    return sorted(rows, key=canonical)


class Dynamo:
    """One `python -m dynamo.indexer` process on a free port."""

    def __init__(self, python: str, threads: int = 4):
        self.port = free_loopback_port()
        self.threads = threads
        self.log = open(f"/tmp/dynamo-indexer-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [python, "-m", "dynamo.indexer", "--port", str(self.port),
             "--threads", str(threads)],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + POLL_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited: {self.proc.returncode}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("dynamo.indexer did not answer /health")

    def request(self, method, path, body=None, body_raw=None,
                content_type="application/json"):
        data = None
        if body is not None:
            data = json.dumps(body).encode()
        elif body_raw is not None:
            data = body_raw.encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None and content_type is not None:
            req.add_header("content-type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.headers.get("content-type"), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("content-type"), err.read()

    def stop(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.log.close()


class Scenario:
    """Drives Dynamo through one scripted stream and records every step."""

    def __init__(self, name: str, description: str, python: str, threads: int = 4):
        self.name = name
        self.description = description
        self.dynamo = Dynamo(python, threads)
        self.ctx = zmq.Context.instance()
        self.sockets: dict[str, dict] = {}
        self.steps: list[dict] = []
        self.volatile: list[str] = []
        self.unordered: list[str] = []
        # Socket -> the tiers its batches touched since the last settle.
        self.dirty: dict[str, set[str]] = {}
        self.sentinels = 0

    # -- sockets and registration ------------------------------------------
    def socket(self, name, *, instance_id, dp_rank=0, model="m", block_size=4,
               routing_group=None):
        sock = self.ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        # Every subscription, also a repeated one: a worker registered again
        # subscribes while its old SUB may not have left yet.
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        sock.bind("tcp://127.0.0.1:0")
        self.sockets[name] = {
            "sock": sock, "endpoint": sock.getsockopt_string(zmq.LAST_ENDPOINT),
            "seq": 0, "instance_id": instance_id, "dp_rank": dp_rank,
            "model": model, "routing_group": routing_group,
            "block_size": block_size, "subscribed": False, "kind": "pub",
        }
        return name

    def replay_socket(self, name):
        """A ROUTER socket standing in for an engine's replay endpoint."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
        self.sockets[name] = {"sock": sock, "kind": "router", "identity": None,
                              "endpoint": sock.getsockopt_string(zmq.LAST_ENDPOINT)}
        return name

    def expect_replay_request(self, name, start_seq):
        s = self.sockets[name]
        if not s["sock"].poll(int(POLL_DEADLINE_S * 1000)):
            raise AssertionError(f"{self.name}: no replay request on {name}")
        identity, delimiter, start = s["sock"].recv_multipart()
        assert delimiter == b"" and int.from_bytes(start, "big") == start_seq, (delimiter, start)
        s["identity"] = identity
        self.steps.append({"replay_request": {"socket": name, "start_seq": start_seq}})

    def replay_reply(self, name, batches, topic=b""):
        """Answer the last request as vLLM 0.33 does: every batch as
        ["", topic, seq, payload], then END ["", "", ff x 8, ""]."""
        s = self.sockets[name]
        messages = [[b"", topic, seq.to_bytes(8, "big"),
                     msgpack.packb([BATCH_TS, events, rank], use_bin_type=True)]
                    for seq, events, rank in batches]
        messages.append([b"", b"", b"\xff" * 8, b""])
        for frames in messages:
            s["sock"].send_multipart([s["identity"], *frames])
        self.steps.append({"replay_reply": {"socket": name, "messages_b64": [
            [base64.b64encode(f).decode() for f in frames] for frames in messages]}})

    def publish_raw(self, name, frames):
        """Frames that are not a well-formed batch (malformed input)."""
        self.sockets[name]["sock"].send_multipart(frames)
        self.steps.append({"publish_raw": {"socket": name, "frames_b64": [
            base64.b64encode(f).decode() for f in frames]}})

    def _substitute(self, value):
        return replace_strings(value, [("{socket:%s}" % name, s["endpoint"])
                                       for name, s in self.sockets.items()])

    def _unsubstitute(self, value):
        """Answers name a socket as `{socket:NAME}`, as requests do."""
        # Longest first: one endpoint may be a prefix of another.
        pairs = [(s["endpoint"], "{socket:%s}" % name) for name, s in self.sockets.items()]
        return replace_strings(value, sorted(pairs, key=lambda p: -len(p[0])))

    def worker(self, name, **kw):
        """A PUB socket for one worker rank, registered."""
        self.socket(name, **kw)
        return self.register(name)

    def register(self, name, *, expect=201, **overrides):
        s = self.sockets[name]
        body = {"instance_id": s["instance_id"], "endpoint": "{socket:%s}" % name,
                "model_name": s["model"], "block_size": s["block_size"],
                "dp_rank": s["dp_rank"]}
        if s["routing_group"] is not None:
            body["routing_group"] = s["routing_group"]
        body.update(overrides)
        status, resp = self.http("POST", "/register", body)
        if status != expect:
            raise AssertionError(f"{self.name}: register {name}: {status} {resp}")
        if status == 201 and body["endpoint"] == "{socket:%s}" % name:
            self.await_subscriber(name)
        return status, resp

    def await_subscriber(self, name):
        s = self.sockets[name]
        sock = s["sock"]
        deadline = time.monotonic() + POLL_DEADLINE_S
        while time.monotonic() < deadline:
            if sock.poll(100, zmq.POLLIN):
                msg = sock.recv()
                if msg[:1] == b"\x01":
                    s["subscribed"] = True
                    self.steps.append({"await_subscriber": {"socket": name}})
                    return
        raise AssertionError(f"{self.name}: no subscriber on {name}")

    # -- HTTP ---------------------------------------------------------------
    def http(self, method, path, body=None, *, body_raw=None,
             content_type="application/json", volatile=False):
        if body is not None:
            # The exact text is sent (and kept when the answer quotes a
            # column of it); `{socket:NAME}` placeholders are plain strings.
            body_raw = json.dumps(body)
        status, ctype, raw = self.dynamo.request(
            method, path, None, self._substitute(body_raw), content_type)
        step = {"http": {"method": method, "path": path}}
        text_answer = not (ctype and ctype.startswith("application/json"))
        if body is not None and not (text_answer and status >= 400):
            step["http"]["body"] = body
        elif body_raw is not None:
            step["http"]["body_raw"] = body_raw
        if body_raw is not None and content_type != "application/json":
            step["http"]["content_type"] = content_type
        step["status"] = status
        parsed = None
        if text_answer:
            step["response_text"] = self._unsubstitute(raw.decode())
        else:
            parsed = self._unsubstitute(json.loads(raw))
            if path == "/dump" and status == 200:
                step["dump_blocks"] = dump_blocks(parsed)
                for body_of_partition in parsed.values():
                    body_of_partition.get("events", []).sort(key=dump_event_order)
            step["response"] = parsed
        index = len(self.steps)
        self.steps.append(step)
        if volatile:
            self.volatile.append(f"steps[{index}].{'response' if parsed is not None else 'response_text'}")
        return status, parsed if parsed is not None else raw.decode()

    def query(self, tokens, *, model="m", routing_group=None, lora_name=None,
              cache_salt=None, **extra):
        body = {"token_ids": list(tokens), "model_name": model}
        if routing_group is not None:
            body["routing_group"] = routing_group
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        body.update(extra)
        return self.http("POST", "/query", body)

    def query_each_block(self, first_block, n_blocks):
        """One query per block first_block.., each that block alone."""
        for block in range(first_block, first_block + n_blocks):
            self.query(toks(block, 1))

    def query_by_hash(self, hashes, *, model="m", routing_group=None, **extra):
        body = {"block_hashes": list(hashes), "model_name": model}
        if routing_group is not None:
            body["routing_group"] = routing_group
        body.update(extra)
        return self.http("POST", "/query_by_hash", body)

    def workers(self, query=""):
        index = len(self.steps)
        status, answer = self.http("GET", "/workers" + query)
        # In no defined order: kept sorted, so recordings compare as text.
        answer.sort(key=canonical)
        self.unordered.append(f"steps[{index}].response")
        return status, answer

    # -- ZMQ ----------------------------------------------------------------
    def publish(self, name, events, *, dp_rank="socket", topic=b""):
        s = self.sockets[name]
        assert s["subscribed"], f"{name} has no subscriber yet"
        rank = s["dp_rank"] if dp_rank == "socket" else dp_rank
        payload = msgpack.packb([BATCH_TS, events, rank], use_bin_type=True)
        seq = s["seq"]
        s["seq"] += 1
        s["sock"].send_multipart([topic, seq.to_bytes(8, "big"), payload])
        self.steps.append({"publish": {
            "socket": name, "topic": topic.decode(), "seq": seq,
            "payload_b64": base64.b64encode(payload).decode()}})
        self.dirty.setdefault(name, set()).update(tiers_touched(events))

    def publish_payload(self, name, payload: bytes):
        """A payload as an engine wrote it (tests/fixtures/wire)."""
        s = self.sockets[name]
        seq = s["seq"]
        s["seq"] += 1
        s["sock"].send_multipart([b"", seq.to_bytes(8, "big"), payload])
        self.steps.append({"publish": {
            "socket": name, "topic": "", "seq": seq,
            "payload_b64": base64.b64encode(payload).decode()}})
        try:
            events = msgpack.unpackb(payload, strict_map_key=False)[1]
        except Exception:  # a malformed payload: it touches no tier
            events = []
        self.dirty.setdefault(name, set()).update(tiers_touched(events))

    def settle(self):
        """Store a sentinel block last, on every tier published to since the
        previous settle (the device tier always), on every socket published
        to, then poll one query per partition and tier until every sentinel
        shows: everything published before it on that tier was applied
        (Dynamo applies device and lower tiers on separate paths)."""
        by_partition: dict[tuple, list[str]] = {}
        for name in sorted(self.dirty):
            by_partition.setdefault(
                (self.sockets[name]["model"], self.sockets[name]["routing_group"]),
                []).append(name)
        tiers_of = {name: self.dirty[name] | {"device"} for name in self.dirty}
        self.dirty.clear()
        for (model, group), names in by_partition.items():
            bs = self.sockets[names[0]]["block_size"]
            for tier, medium in SENTINEL_MEDIUM.items():
                on = [n for n in names if tier in tiers_of[n]]
                if on:
                    self._settle_tier(model, group, bs, on, medium)
        self.dirty.clear()

    def _settle_tier(self, model, group, bs, names, medium):
        base = SENTINEL_BASE + self.sentinels * bs
        self.sentinels += 1
        tokens = [base + i for i in range(bs)]
        for name in names:
            self.publish(name, [block_stored([engine_hash(None, tokens)], None, tokens, bs,
                                             medium=medium)])
        body = {"token_ids": tokens, "model_name": model}
        if group is not None:
            body["routing_group"] = group
        want = {(str(self.sockets[n]["instance_id"]), str(self.sockets[n]["dp_rank"]))
                for n in names}
        deadline = time.monotonic() + POLL_DEADLINE_S
        while True:
            status, ctype, raw = self.dynamo.request("POST", "/query", body)
            resp = json.loads(raw) if status == 200 else None
            if resp is not None:
                # A rank is listed in its worker's `dp` once it matches on
                # any tier; on the device tier, `scores` says so too.
                seen = {(w, r) for w, inst in resp.get("instances", {}).items()
                        for r in inst["dp"]}
                if want <= seen:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: settle timed out: {status} {raw!r}")
            time.sleep(0.02)
        self.steps.append({"settle": {
            "http": {"method": "POST", "path": "/query", "body": body},
            "status": status, "response": resp}})

    def wait_until(self, method, path, body, predicate):
        """Poll until `predicate(status, json)` holds; record it as a settle
        (for effects of HTTP calls that Dynamo applies asynchronously)."""
        deadline = time.monotonic() + POLL_DEADLINE_S
        while True:
            status, ctype, raw = self.dynamo.request(method, path, self._substitute(body))
            resp = json.loads(raw) if ctype and ctype.startswith("application/json") else raw.decode()
            if predicate(status, resp):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: wait timed out: {status} {raw!r}")
            time.sleep(0.02)
        step = {"http": {"method": method, "path": path}}
        if body is not None:
            step["http"]["body"] = body
        self.steps.append({"settle": {**step, "status": status, "response": resp}})
        return status, resp

    def finish(self, out_dir: Path):
        self.dynamo.stop()
        for s in self.sockets.values():
            s["sock"].close()
        doc = {"reference": REFERENCE,
               "reference_command": f"python -m dynamo.indexer --port P --threads {self.dynamo.threads}",
               "recorded_with": RECORDED_WITH,
               "scenario": self.name, "description": self.description,
               "sockets": [{"name": n} if s["kind"] == "pub" else {"name": n, "kind": "router"}
                           for n, s in self.sockets.items()],
               "steps": self.steps}
        if self.volatile:
            doc["volatile"] = self.volatile
        if self.unordered:
            doc["unordered"] = self.unordered
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.name}.json"
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        return path


# ---------------------------------------------------------------------------
# Scenarios. Block i of a chain holds tokens i*100+1 .. i*100+bs, so a reader
# can follow the tree in a fixture; engine hashes come from `engine_hash`, the
# same for every worker, as one model's engines publish them.


def toks(first_block: int, n_blocks: int, bs: int = 4) -> list[int]:
    out = []
    for b in range(first_block, first_block + n_blocks):
        out.extend(b * 100 + k for k in range(1, bs + 1))
    return out


def hashes(first_block: int, n_blocks: int, parent=None, bs: int = 4, extra=None):
    out = []
    for b in range(first_block, first_block + n_blocks):
        parent = engine_hash(parent, toks(b, 1, bs), extra)
        out.append(parent)
    return out


def stored(first_block, n_blocks, parent=None, bs=4, extra=None, **kw):
    """A BlockStored of blocks first_block.. under `parent` (an engine hash)."""
    return block_stored(hashes(first_block, n_blocks, parent, bs, extra), parent,
                        toks(first_block, n_blocks, bs), bs, **kw)


def h(first_block, n_blocks=1, parent=None, bs=4, extra=None):
    """The engine hash of the last block of that run."""
    return hashes(first_block, n_blocks, parent, bs, extra)[-1]


def scenario_single_worker_prefix_chains(sc: Scenario):
    sc.worker("w1r0", instance_id=1)
    # One event storing blocks 1-3, block 4 under 3 in a second event, a
    # branch of blocks 5-6 under block 2.
    sc.publish("w1r0", [stored(1, 3)])
    sc.publish("w1r0", [stored(4, 1, h(1, 3))])
    sc.publish("w1r0", [stored(5, 2, h(1, 2))])
    sc.settle()
    sc.query(toks(1, 4))                      # the full chain
    sc.query(toks(1, 2))                      # a prefix of it
    sc.query(toks(1, 2) + toks(5, 2))         # the branch
    sc.query(toks(1, 2) + toks(5, 1) + toks(4, 1))  # leaves the branch
    sc.query(toks(1, 1) + toks(3, 2))         # diverges at block 1
    # Blocks that exist at the queried depth, but under another parent.
    sc.query(toks(1, 3) + toks(6, 1))
    sc.query(toks(1, 2) + toks(9, 1) + toks(4, 1))
    sc.query(toks(2, 3))                      # no match at the root
    sc.query(toks(1, 3) + [401, 402, 403])    # partial last block ignored
    sc.query([101, 102, 103])                 # shorter than one block
    sc.query([])                              # no tokens
    sc.query(toks(1, 4) + toks(9, 3))         # longer than anything stored
    # The same block stored twice (a second physical copy), one copy removed.
    sc.publish("w1r0", [stored(4, 1, h(1, 3))])
    sc.publish("w1r0", [block_removed([h(4, 1, h(1, 3))])])
    sc.settle()
    sc.query(toks(1, 4))
    # A store whose parent the index never saw.
    sc.publish("w1r0", [stored(8, 2, parent=123456789)])
    sc.settle()
    sc.query(toks(8, 2))
    sc.query(toks(1, 4) + toks(8, 2))


def scenario_two_workers_shared_divergent(sc: Scenario):
    for w in (1, 2):
        sc.worker(f"w{w}r0", instance_id=w)
    # Both cache blocks 1-2, then diverge: worker 1 with 3-4, worker 2 with 7;
    # worker 2 also caches a root (block 8) worker 1 does not.
    sc.publish("w1r0", [stored(1, 2)])
    sc.publish("w1r0", [stored(3, 2, h(1, 2))])
    sc.publish("w2r0", [stored(1, 2)])
    sc.publish("w2r0", [stored(7, 1, h(1, 2))])
    sc.publish("w2r0", [stored(8, 1)])
    sc.settle()
    sc.query(toks(1, 2))                      # shared prefix: both
    sc.query(toks(1, 4))                      # worker 1 deeper
    sc.query(toks(1, 2) + toks(7, 1))         # worker 2 deeper
    sc.query(toks(1, 1) + toks(9, 1))         # both one block
    sc.query(toks(8, 1))                      # worker 2 alone
    # Worker 2 evicts the shared block 2 (and so its child 7): worker 1 keeps it.
    sc.publish("w2r0", [block_removed([h(7, 1, h(1, 2))]), block_removed([h(1, 2)])])
    sc.settle()
    sc.query(toks(1, 2) + toks(7, 1))
    sc.workers()


def scenario_dp_ranks(sc: Scenario):
    for r in range(2):
        sc.worker(f"w1r{r}", instance_id=1, dp_rank=r)
    for r in range(4):
        sc.worker(f"w2r{r}", instance_id=2, dp_rank=r)
    # Rank r of each worker caches r+1 blocks of one prefix.
    for w, ranks in ((1, 2), (2, 4)):
        for r in range(ranks):
            sc.publish(f"w{w}r{r}", [stored(1, r + 1)])
    # Rank 1 of worker 1 also holds a child of block 2 on CPU; rank 0 of
    # worker 2 the same child on GPU, without block 2.
    sc.publish("w1r1", [stored(6, 1, h(1, 2), medium="CPU_TIER1")])
    sc.settle()
    sc.query(toks(1, 4))
    sc.query(toks(1, 2))
    sc.query(toks(1, 2) + toks(6, 1))
    sc.workers()
    # One rank unregistered: its blocks leave the answers.
    sc.http("POST", "/unregister", {"instance_id": 2, "model_name": "m",
                                    "routing_group": "default", "dp_rank": 3})
    sc.wait_until("POST", "/query", {"token_ids": toks(1, 4), "model_name": "m"},
                  lambda st, r: st == 200 and "3" not in r["scores"].get("2", {}))
    sc.workers()
    # A clear on one rank leaves the other ranks of the worker alone.
    sc.publish("w2r2", [all_cleared()])
    sc.settle()
    sc.query(toks(1, 4))


def scenario_dp_rank_envelope(sc: Scenario):
    sc.worker("w1r0", instance_id=1)
    sc.worker("w1r1", instance_id=1, dp_rank=1)
    # The envelope's rank disagrees with the registration's, or is nil.
    sc.publish("w1r0", [stored(1, 1)], dp_rank=5)
    sc.publish("w1r1", [stored(2, 1)], dp_rank=None)
    sc.publish("w1r1", [stored(3, 1)], dp_rank=0)
    sc.settle()
    sc.query(toks(1, 1))
    sc.query(toks(2, 1))
    sc.query(toks(3, 1))
    # A removal whose envelope names the rank the store went to.
    sc.publish("w1r1", [block_removed([h(1)])], dp_rank=5)
    sc.settle()
    sc.query(toks(1, 1))


def scenario_removals_and_clear(sc: Scenario):
    sc.worker("w1r0", instance_id=1)
    sc.worker("w2r0", instance_id=2)
    sc.publish("w1r0", [stored(1, 5)])
    sc.publish("w2r0", [stored(1, 3)])
    sc.settle()
    sc.query(toks(1, 5))
    # Leaf first: the deepest block goes.
    sc.publish("w1r0", [block_removed([h(1, 5)])])
    sc.settle()
    sc.query(toks(1, 5))
    # From the middle: block 2 goes while 3 and 4 were stored under it.
    sc.publish("w1r0", [block_removed([h(1, 2)])])
    sc.settle()
    sc.query(toks(1, 5))
    sc.query(toks(1, 1))
    # Block 2 stored again under its old hash: do 3 and 4 count again?
    sc.publish("w1r0", [stored(2, 1, h(1, 1))])
    sc.settle()
    sc.query(toks(1, 5))
    # Blocks 3 and 4 stored again too.
    sc.publish("w1r0", [stored(3, 2, h(1, 2))])
    sc.settle()
    sc.query(toks(1, 5))
    # Removing an unknown hash, one hash twice in one event, and a removal
    # naming a block of the other worker only.
    sc.publish("w1r0", [block_removed([999999])])
    sc.publish("w1r0", [block_removed([h(1, 4), h(1, 4)])])
    sc.settle()
    sc.query(toks(1, 5))
    # Several events in one batch; a root removed while its child stays.
    sc.publish("w2r0", [block_removed([h(1, 3)]), block_removed([h(1, 1)])])
    sc.settle()
    sc.query(toks(1, 5))
    # AllBlocksCleared: worker 1 holds nothing (but its sentinels) after it.
    sc.publish("w1r0", [all_cleared()])
    sc.settle()
    sc.query(toks(1, 5))
    sc.http("GET", "/dump")
    # Stored again after the clear; a removal of a block cleared before.
    sc.publish("w1r0", [stored(1, 2), block_removed([h(1, 4)])])
    sc.settle()
    sc.query(toks(1, 5))


MEDIUMS = ["GPU", "DEVICE", "CPU", "CPU_PINNED", "CPU_TIER1", "CPU_TIER2", "DISK",
           "NVME", "STORAGE", "EXTERNAL", "NETWORK", "REMOTE", "SHARED", None, "gpu",
           "UNKNOWN"]


def scenario_tiers(sc: Scenario):
    sc.worker("w1r0", instance_id=1)
    sc.worker("w2r0", instance_id=2)
    # Which tier each `medium` spelling lands in: one root block per medium.
    for i, medium in enumerate(MEDIUMS):
        sc.publish("w1r0", [stored(30 + i, 1, medium=medium)])
    # The same, with the medium key absent altogether.
    event = stored(29, 1)
    del event["medium"]
    sc.publish("w1r0", [event])
    # Worker 1: GPU for 2 blocks, then CPU, disk, external continuing the chain.
    sc.publish("w1r0", [stored(1, 2, medium="GPU")])
    sc.publish("w1r0", [stored(3, 1, h(1, 2), medium="CPU_TIER1")])
    sc.publish("w1r0", [stored(4, 1, h(1, 3), medium="DISK")])
    sc.publish("w1r0", [stored(5, 1, h(1, 4), medium="EXTERNAL")])
    # Worker 2: the same prefix offloaded: 1 block on GPU, 4 on CPU (the GPU
    # block also on CPU), 5 on disk, and on disk a child of a block it holds
    # nowhere else.
    sc.publish("w2r0", [stored(1, 1, medium="GPU")])
    sc.publish("w2r0", [stored(1, 4, medium="CPU_PINNED")])
    sc.publish("w2r0", [stored(1, 5, medium="NVME")])
    sc.publish("w2r0", [stored(9, 1, h(1, 5), medium="CPU_TIER2")])
    # Worker 3: tiers interleaved along one chain: block 1 on GPU, 2 on CPU
    # only, 3 on GPU again, 4 on disk. Worker 2's rank 1 holds another copy.
    sc.worker("w3r0", instance_id=3)
    sc.worker("w3r1", instance_id=3, dp_rank=1)
    sc.publish("w3r0", [stored(1, 1, medium="GPU")])
    sc.publish("w3r0", [stored(2, 1, h(1), medium="CPU_TIER1")])
    sc.publish("w3r0", [stored(3, 1, h(1, 2), medium="GPU")])
    sc.publish("w3r0", [stored(4, 1, h(1, 3), medium="DISK")])
    sc.publish("w3r1", [stored(1, 3, medium="CPU_TIER1")])
    sc.publish("w3r1", [stored(20, 1)])
    sc.settle()
    sc.query_each_block(30, len(MEDIUMS))
    sc.query(toks(29, 1))
    sc.query(toks(1, 5))
    sc.query(toks(1, 3))
    sc.query(toks(1, 6))
    sc.query(toks(1, 5) + toks(9, 1))
    # The GPU copy evicted on worker 2, the CPU copy of block 3 removed.
    sc.publish("w2r0", [block_removed([h(1, 1)], medium="GPU")])
    sc.publish("w2r0", [block_removed([h(1, 3)], medium="CPU_PINNED")])
    sc.settle()
    sc.query(toks(1, 5))
    # A removal without a medium (nil) of worker 1's CPU block, and one
    # naming the wrong tier for its disk block.
    sc.publish("w1r0", [block_removed([h(1, 3)], medium=None)])
    sc.publish("w1r0", [block_removed([h(1, 4)], medium="GPU")])
    sc.settle()
    sc.query(toks(1, 5))
    sc.http("GET", "/dump")
    # A clear: every tier of the worker.
    sc.publish("w2r0", [all_cleared()])
    sc.settle()
    sc.query(toks(1, 5))


SALT_TAG = "dynamo-cache-salt:"


def scenario_lora_and_salt(sc: Scenario):
    sc.worker("w1r0", instance_id=1)
    # As vLLM 0.33 sends them: the LoRA name in `lora_name` and first in
    # every block's extra keys; a salt as the first block's last extra key
    # (the engine's hash covers them, so the engine hashes differ too).
    sc.publish("w1r0", [stored(1, 2, extra="lora", lora_id=7, lora_name="sql-adapter",
                               extra_keys=[["sql-adapter"], ["sql-adapter"]])])
    sc.publish("w1r0", [stored(1, 2, extra="a", extra_keys=[["tenant-a"], None])])
    sc.publish("w1r0", [stored(1, 2, extra="b", extra_keys=[[SALT_TAG + "tenant-b"], None])])
    sc.publish("w1r0", [stored(1, 2, extra="c", lora_id=7, lora_name="sql-adapter",
                               extra_keys=[["sql-adapter", SALT_TAG + "tenant-c"],
                                           ["sql-adapter"]])])
    # SGLang's spelling: a top-level `cache_salt`.
    sc.publish("w1r0", [stored(1, 2, extra="d", cache_salt="tenant-d")])
    sc.publish("w1r0", [stored(1, 1, extra="d-other", lora_name="other-adapter",
                               cache_salt="tenant-d")])
    # An empty LoRA name and an empty salt.
    sc.publish("w1r0", [stored(3, 1, extra="empty", lora_name="", cache_salt="")])
    # A salt key on the second block only (vLLM never sends this).
    sc.publish("w1r0", [stored(5, 2, extra="e", extra_keys=[None, [SALT_TAG + "tenant-e"]])])
    sc.settle()
    for kw in [{}, {"lora_name": "sql-adapter"}, {"lora_name": "other-adapter"},
               {"lora_name": ""}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"},
               {"cache_salt": SALT_TAG + "tenant-b"},
               {"cache_salt": "tenant-c"}, {"cache_salt": "tenant-c", "lora_name": "sql-adapter"},
               {"cache_salt": "tenant-d"}, {"cache_salt": "tenant-d", "lora_name": "other-adapter"},
               {"cache_salt": ""}, {"cache_salt": "tenant-x"}, {"lora_name": None, "cache_salt": None}]:
        sc.query(toks(1, 2), **kw)
    sc.query(toks(3, 1))
    sc.query(toks(5, 2))
    sc.query(toks(5, 2), cache_salt="tenant-e")
    sc.query(toks(5, 1) + toks(6, 1), lora_name="sql-adapter")
    # The LoRA blocks removed by their engine hashes.
    sc.publish("w1r0", [block_removed(hashes(1, 2, extra="lora"))])
    sc.settle()
    sc.query(toks(1, 2), lora_name="sql-adapter")
    sc.http("GET", "/dump")


def scenario_block_size_mismatch(sc: Scenario):
    sc.worker("w1r0", instance_id=1)
    # A store announcing block_size 8 into a partition registered with 4.
    sc.publish("w1r0", [block_stored([h(1, 1, bs=8)], None, toks(1, 1, 8), 8)])
    # A store whose token count does not fit its hashes x block_size.
    sc.publish("w1r0", [block_stored(hashes(3, 2), None, toks(3, 1) + [1, 2], 4)])
    sc.publish("w1r0", [block_stored(hashes(11, 1), None, toks(11, 2), 4)])
    # A mismatched store and a good one in the same batch.
    sc.publish("w1r0", [block_stored([h(5, 1, bs=8)], None, toks(5, 1, 8), 8), stored(7, 1)])
    # A block size of 0 with no tokens (vLLM's offload placeholders).
    sc.publish("w1r0", [block_stored([h(9, 1)], None, [], 0, medium="CPU")])
    sc.settle()
    sc.query(toks(1, 1, 8))
    sc.query(toks(3, 2))
    sc.query(toks(3, 1))
    sc.query(toks(11, 1))
    sc.query(toks(5, 1, 8))
    sc.query(toks(7, 1))
    sc.query(toks(9, 1))
    # A second worker registering the same partition with another block size.
    sc.socket("w2r0", instance_id=2, dp_rank=0, model="m", block_size=8)
    sc.register("w2r0", expect=409)
    sc.workers()
    sc.http("GET", "/metrics", volatile=True)


def scenario_models_and_routing_groups(sc: Scenario):
    sc.worker("a1", instance_id=1, dp_rank=0, model="model-a", block_size=4)
    sc.worker("a2g", instance_id=2, dp_rank=0, model="model-a", block_size=4,
              routing_group="blue")
    # One worker id belongs to one partition: a second model is refused.
    sc.socket("b1", instance_id=1, dp_rank=0, model="model-b", block_size=8)
    sc.register("b1", expect=409)
    sc.worker("b3", instance_id=3, dp_rank=0, model="model-b", block_size=8)
    # The same tokens everywhere.
    sc.publish("a1", [stored(1, 2)])
    sc.publish("a2g", [stored(1, 3)])
    sc.publish("b3", [block_stored([h(1, 1, bs=8)], None, toks(1, 1, 8), 8)])
    sc.settle()
    sc.query(toks(1, 3), model="model-a")
    sc.query(toks(1, 3), model="model-a", routing_group="default")
    sc.query(toks(1, 3), model="model-a", routing_group="blue")
    sc.query(toks(1, 1, 8), model="model-b")
    sc.query(toks(1, 3), model="model-b")
    sc.query(toks(1, 3), model="model-a", routing_group="green")
    sc.query(toks(1, 3), model="model-c")
    sc.query(toks(1, 3), model="model-a", tenant_id="blue")
    sc.workers()
    sc.workers("?model_name=model-a")
    sc.workers("?routing_group=blue")
    sc.workers("?model_name=model-a&routing_group=blue")
    sc.workers("?model_name=model-c")
    sc.http("GET", "/dump")
    # Unregister without a routing group: every group of that model.
    sc.http("POST", "/unregister", {"instance_id": 1, "model_name": "model-a"})
    sc.workers()
    sc.http("POST", "/unregister", {"instance_id": 2, "model_name": "model-a"})
    sc.workers()
    sc.query(toks(1, 3), model="model-a", routing_group="blue")
    sc.query(toks(1, 1, 8), model="model-b")
    # `tenant_id`, an older name, selects nothing: registered into the default
    # group, unregistered from every group.
    sc.socket("a9", instance_id=9, model="model-a")
    sc.register("a9", tenant_id="blue", additional_salt="x")
    sc.workers("?model_name=model-a")
    sc.http("POST", "/unregister", {"instance_id": 9, "model_name": "model-a",
                                    "tenant_id": "blue"})
    sc.workers("?model_name=model-a")


def local_hash(tokens, lora_name=None, cache_salt=None):
    """Dynamo's per-block hash as /query_by_hash takes it (i64)."""
    import struct
    import xxhash
    seed = 1337
    if lora_name:
        seed += xxhash.xxh3_64_intdigest(lora_name.encode(), seed=0)
    if cache_salt:
        seed += xxhash.xxh3_64_intdigest(cache_salt.encode(), seed=1)
    seed &= (1 << 64) - 1
    value = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=seed)
    return value - (1 << 64) if value >= 1 << 63 else value


def scenario_query_by_hash(sc: Scenario):
    sc.worker("w1r0", instance_id=1)
    sc.worker("w2r0", instance_id=2)
    sc.publish("w1r0", [stored(1, 3)])
    sc.publish("w2r0", [stored(1, 1, medium="CPU_TIER1")])
    sc.publish("w1r0", [stored(1, 1, extra="lora", lora_name="sql-adapter")])
    sc.publish("w1r0", [stored(1, 1, extra="salt", cache_salt="tenant-a")])
    sc.settle()
    plain = [local_hash(toks(b, 1)) for b in range(1, 4)]
    sc.query_by_hash(plain)
    sc.query_by_hash(plain[:2])
    sc.query_by_hash([plain[0], plain[2]])
    sc.query_by_hash([])
    sc.query_by_hash([local_hash(toks(1, 1), lora_name="sql-adapter")])
    sc.query_by_hash([local_hash(toks(1, 1), cache_salt="tenant-a")])
    sc.query_by_hash(plain, cache_salt="tenant-a")
    sc.query_by_hash(plain, cache_salt=None)
    sc.query_by_hash(plain, lora_name="sql-adapter")
    sc.query_by_hash(plain, model="nope")
    # The same hashes as unsigned u64 (out of i64's range when >= 2^63).
    sc.query_by_hash([x & ((1 << 64) - 1) for x in plain])
    sc.query(toks(1, 3))


def scenario_unregister(sc: Scenario):
    for w in (1, 2):
        sc.worker(f"w{w}r0", instance_id=w)
    sc.worker("w1r1", instance_id=1, dp_rank=1)
    sc.publish("w1r0", [stored(1, 2)])
    sc.publish("w1r1", [stored(1, 1)])
    sc.publish("w2r0", [stored(1, 1)])
    sc.settle()
    sc.query(toks(1, 2))
    sc.http("POST", "/unregister", {"instance_id": 1, "model_name": "m",
                                    "routing_group": "default"})
    sc.wait_until("POST", "/query", {"token_ids": toks(1, 2), "model_name": "m"},
                  lambda st, r: st == 200 and "1" not in r["scores"])
    sc.workers()
    sc.http("POST", "/unregister", {"instance_id": 1, "model_name": "m",
                                    "routing_group": "default"})
    sc.http("POST", "/unregister", {"instance_id": 2, "model_name": "m",
                                    "routing_group": "default", "dp_rank": 4})
    sc.http("POST", "/unregister", {"instance_id": 2, "model_name": "m",
                                    "routing_group": "blue"})
    sc.http("POST", "/unregister", {"instance_id": 2, "model_name": "other"})
    # Registered again on the same endpoint: it starts empty.
    sc.register("w1r0")
    sc.query(toks(1, 2))
    sc.publish("w1r0", [stored(1, 1)])
    sc.settle()
    sc.query(toks(1, 2))
    # The last worker of the partition gone: is the partition gone too?
    for w in (1, 2):
        sc.http("POST", "/unregister", {"instance_id": w, "model_name": "m"})
    sc.wait_until("GET", "/workers", None, lambda st, r: st == 200 and r == [])
    sc.query(toks(1, 2))
    sc.http("GET", "/dump")


def scenario_errors(sc: Scenario):
    sc.socket("w1r0", instance_id=1)
    sc.http("GET", "/health")
    sc.register("w1r0")
    sc.register("w1r0", expect=409)
    sc.register("w1r0", expect=409, endpoint="tcp://127.0.0.1:1")
    sc.register("w1r0", expect=409, dp_rank=1, block_size=8)
    sc.register("w1r0", expect=400, instance_id=3, endpoint="http://127.0.0.1:1")
    sc.register("w1r0", expect=400, instance_id=3, endpoint="not an endpoint")
    sc.register("w1r0", expect=400, instance_id=3, endpoint="tcp://127.0.0.1")
    sc.register("w1r0", expect=400, instance_id=3, endpoint="tcp://127.0.0.1:9",
                replay_endpoint="udp://127.0.0.1:9")
    # Accepted without a listener behind them: ipc, a wildcard host, block size 0.
    sc.register("w1r0", expect=201, instance_id=4, endpoint="ipc:///nonexistent/kv.ipc",
                model_name="other")
    sc.register("w1r0", expect=201, instance_id=5, endpoint="tcp://*:9", model_name="other")
    sc.register("w1r0", expect=201, instance_id=6, endpoint="tcp://127.0.0.1:9",
                model_name="zero", block_size=0)
    sc.http("POST", "/query", {"token_ids": [1, 2, 3, 4], "model_name": "zero"})
    for path in ("/register", "/unregister", "/query", "/query_by_hash"):
        sc.http("POST", path, body_raw="{not json")
        sc.http("POST", path, body_raw="")
        sc.http("POST", path, body_raw="[1, 2]")
        sc.http("POST", path, body={})
        sc.http("POST", path, body={"instance_id": 1}, content_type="text/plain")
        sc.http("POST", path, body={"instance_id": 1}, content_type=None)
    # One field missing at a time, one field mistyped at a time.
    good = {"instance_id": 5, "endpoint": "tcp://127.0.0.1:9", "model_name": "m",
            "block_size": 4}
    for key in good:
        sc.http("POST", "/register", {k: v for k, v in good.items() if k != key})
    for key, bad in (("instance_id", "5"), ("instance_id", -1), ("instance_id", 1.5),
                     ("endpoint", 5), ("model_name", None), ("block_size", "4"),
                     ("block_size", -4), ("dp_rank", "0"), ("replay_endpoint", 7)):
        sc.http("POST", "/register", {**good, key: bad})
    q = {"token_ids": [1, 2, 3, 4], "model_name": "m"}
    for body in ({"model_name": "m"}, {"token_ids": [1]},
                 {**q, "token_ids": [1, -2]}, {**q, "token_ids": [4294967296]},
                 {**q, "token_ids": "1234"}, {**q, "lora_name": 5},
                 {**q, "model_name": 5}, {**q, "routing_group": None},
                 {**q, "unknown_field": 1}, {**q, "tenant_id": None},
                 {**q, "lora_name": None, "cache_salt": None}):
        sc.http("POST", "/query", body)
    for body in ({"model_name": "m"}, {"block_hashes": [1, 2], "model_name": "m",
                                       "routing_group": 3},
                 {"block_hashes": [18446744073709551616], "model_name": "m"},
                 {"block_hashes": ["1"], "model_name": "m"}):
        sc.http("POST", "/query_by_hash", body)
    sc.http("POST", "/unregister", {"instance_id": 9, "model_name": "m"})
    sc.http("POST", "/unregister", {"instance_id": 9})
    sc.http("POST", "/query", {"token_ids": [1, 2, 3, 4], "model_name": "zz"})
    sc.http("GET", "/query")
    sc.http("POST", "/workers", {})
    sc.http("GET", "/no-such-route")
    sc.http("GET", "/dump")
    sc.workers()


def scenario_sequence_and_replay(sc: Scenario):
    sc.socket("w1r0", instance_id=1)
    sc.replay_socket("w1replay")
    sc.register("w1r0", replay_endpoint="{socket:w1replay}")
    sc.worker("w2r0", instance_id=2)
    sc.publish("w1r0", [stored(1, 1)])
    sc.settle()
    # Two batches never arrive: the third reveals the gap; the indexer asks
    # the replay endpoint from the first missing seq, which answers all three
    # (a publisher's ring holds every batch it sent).
    first = sc.sockets["w1r0"]["seq"]
    sc.sockets["w1r0"]["seq"] = first + 2
    sc.publish("w1r0", [stored(4, 1, h(1, 3))])
    sc.expect_replay_request("w1replay", first)
    sc.replay_reply("w1replay", [(first, [stored(2, 1, h(1, 1))], 0),
                                 (first + 1, [stored(3, 1, h(1, 2))], 0),
                                 (first + 2, [stored(4, 1, h(1, 3))], 0)])
    sc.settle()
    sc.query(toks(1, 4))
    # A replay that starts later than asked (the ring lost the first batch)
    # and ends before the live batch, which depends on it.
    first = sc.sockets["w1r0"]["seq"]
    sc.sockets["w1r0"]["seq"] = first + 2
    sc.publish("w1r0", [stored(12, 1, h(11, 1, h(1, 4)))])
    sc.expect_replay_request("w1replay", first)
    sc.replay_reply("w1replay", [(first + 1, [stored(11, 1, h(1, 4))], 0)])
    sc.settle()
    sc.query(toks(1, 4) + toks(11, 2))
    # A replay with nothing in it (END only): the live batch still is.
    first = sc.sockets["w1r0"]["seq"]
    sc.sockets["w1r0"]["seq"] = first + 1
    sc.publish("w1r0", [stored(13, 1)])
    sc.expect_replay_request("w1replay", first)
    sc.replay_reply("w1replay", [])
    sc.settle()
    sc.query(toks(13, 1))
    # Malformed frames: skipped, and they do not move the expected sequence.
    seq = sc.sockets["w2r0"]["seq"]
    sc.publish_raw("w2r0", [b"", seq.to_bytes(8, "big"), b"\xc1garbage"])
    sc.publish_raw("w2r0", [b"", seq.to_bytes(8, "big")])
    sc.publish_raw("w2r0", [b"", seq.to_bytes(8, "big"),
                            msgpack.packb([BATCH_TS, [stored(5, 1)], 0]), b"extra"])
    sc.publish_raw("w2r0", [b"", b"\x00\x01", msgpack.packb([BATCH_TS, [stored(6, 1)], 0])])
    sc.publish("w2r0", [stored(1, 2)])
    sc.settle()
    sc.query(toks(1, 2))
    sc.query(toks(5, 1))
    sc.query(toks(6, 1))
    # A gap without a replay endpoint: the batches are lost, the one that
    # revealed the gap is applied.
    sc.sockets["w2r0"]["seq"] += 2
    sc.publish("w2r0", [stored(7, 1)])
    sc.settle()
    sc.query(toks(7, 1))
    # The publisher restarts (seq from 0 again): batches whose seq is below
    # the next expected one are dropped until the sequence catches up.
    expected = sc.sockets["w2r0"]["seq"]
    sc.sockets["w2r0"]["seq"] = 0
    sc.publish("w2r0", [stored(8, 1)])
    sc.sockets["w2r0"]["seq"] = expected
    sc.settle()
    sc.query(toks(8, 1))
    # A non-empty topic is accepted (the indexer subscribes to every topic).
    sc.publish("w2r0", [stored(9, 1)], topic=b"kv@10.0.0.7@m")
    sc.settle()
    sc.query(toks(9, 1))
    sc.workers()


def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def scenario_engine_layouts(sc: Scenario):
    """One chain (blocks 1-3) stored by one worker per publisher layout, then
    one block removed and a clear, each in that layout."""
    for w in range(1, 9):
        sc.worker(f"w{w}r0", instance_id=w)
    chain = hashes(1, 3)
    tokens = toks(1, 3)
    digest = [hashlib.sha256(b"block-%d" % i).digest() for i in range(3)]
    # 1: vLLM 0.33, map-tagged, uint64 hashes.
    sc.publish("w1r0", [stored(1, 3)])
    # 2: SGLang 0.5.23, map-tagged, signed int64 hashes, no extra keys.
    sc.publish("w2r0", [{"type": "BlockStored", "block_hashes": [signed(x) for x in chain],
                         "parent_block_hash": None, "token_ids": tokens, "block_size": 4,
                         "lora_id": None, "medium": "GPU"}])
    # 3: vLLM 0.10, tag-first arrays of 6.
    sc.publish("w3r0", [["BlockStored", [signed(x) for x in chain], None, tokens, 4, None]])
    # 4: vLLM 0.23, tag-first arrays of 12.
    sc.publish("w4r0", [["BlockStored", chain, None, tokens, 4, None, "GPU", None,
                         [None, None, None], 0, "full_attention", None]])
    # 5: TensorRT-LLM through Dynamo's tee: map without medium, signed hashes.
    sc.publish("w5r0", [{"type": "BlockStored", "block_hashes": [signed(x) for x in chain],
                         "parent_block_hash": None, "token_ids": tokens, "block_size": 4,
                         "lora_id": None}])
    # 6: vLLM 0.33 with 32-byte digests as hashes.
    sc.publish("w6r0", [block_stored(digest, None, tokens, 4)])
    # 7, 8: multimodal blocks: the first block carries an image identifier
    # (vLLM 0.33's [identifier, offset], and a bare 64-hex digest).
    sc.publish("w7r0", [stored(1, 3, extra_keys=[[["img-7f3a", 0]], None, None])])
    sc.publish("w8r0", [stored(1, 3, extra_keys=[["ab" * 32], None, None])])
    sc.settle()
    sc.query(tokens)
    sc.http("GET", "/dump")
    # Block 3 removed, each in its layout.
    sc.publish("w1r0", [block_removed([chain[2]])])
    sc.publish("w2r0", [{"type": "BlockRemoved", "block_hashes": [signed(chain[2])],
                         "medium": "GPU"}])
    sc.publish("w3r0", [["BlockRemoved", [signed(chain[2])]]])
    sc.publish("w4r0", [["BlockRemoved", [chain[2]], "GPU", 0]])
    sc.publish("w5r0", [{"type": "BlockRemoved", "block_hashes": [signed(chain[2])]}])
    sc.publish("w6r0", [block_removed([digest[2]])])
    sc.settle()
    sc.query(tokens)
    # A clear in array form, and one in map form.
    sc.publish("w3r0", [["AllBlocksCleared"]])
    sc.publish("w4r0", [all_cleared()])
    sc.settle()
    sc.query(tokens)


WIRE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "wire" / "vllm-0.33.0"


def wire_payload(name: str) -> bytes:
    return (WIRE / f"{name}.msgpack").read_bytes()


def wire_tokens(name: str, event: int = 0) -> list[int]:
    return json.loads((WIRE / f"{name}.json").read_text())["input"]["events"][event]["token_ids"]


def scenario_real_vllm_payloads(sc: Scenario):
    """The golden payloads vLLM 0.33.0's own publisher wrote
    (tests/fixtures/wire/vllm-0.33.0), published as they are."""
    sc.worker("w1r0", instance_id=1, block_size=16)
    sc.worker("w2r3", instance_id=2, dp_rank=3, block_size=16)
    root, child = wire_tokens("stored-int-root"), wire_tokens("stored-int-parent")
    for name in ("stored-int-root", "stored-int-parent", "stored-lora",
                 "stored-extra-keys-mm-salt", "stored-u64-high",
                 "stored-sliding-window-all-fields", "medium-cpu-offload",
                 "stored-bytes-sha256", "empty-events"):
        sc.publish_payload("w1r0", wire_payload(name))
    sc.publish_payload("w2r3", wire_payload("dp-rank-3"))
    sc.publish_payload("w2r3", wire_payload("stored-int-root"))
    sc.settle()
    sc.query(root + child)
    sc.query(wire_tokens("stored-lora"))
    sc.query(wire_tokens("stored-lora"), lora_name="sql-adapter")
    sc.query(wire_tokens("stored-extra-keys-mm-salt"))
    sc.query(wire_tokens("stored-extra-keys-mm-salt"), cache_salt="tenant-a")
    sc.query(wire_tokens("stored-u64-high"))
    sc.query(wire_tokens("stored-sliding-window-all-fields"))
    sc.query(wire_tokens("medium-cpu-offload"))
    sc.query(wire_tokens("stored-bytes-sha256"))
    sc.query(wire_tokens("dp-rank-3"))
    sc.http("GET", "/dump")
    # Malformed payloads: each skipped whole, the stream goes on.
    for name in ("malformed-envelope-map", "malformed-events-not-list",
                 "malformed-missing-block-hashes", "malformed-truncated",
                 "malformed-unknown-type"):
        sc.publish_payload("w1r0", wire_payload(name))
    sc.settle()
    sc.query(root + child)
    # Removals, then a clear, and a clear whose envelope rank is nil.
    sc.publish_payload("w1r0", wire_payload("removed"))
    sc.settle()
    sc.query(root + child)
    sc.publish_payload("w1r0", wire_payload("cleared"))
    sc.publish_payload("w2r3", wire_payload("envelope-rank-nil"))
    sc.settle()
    sc.query(root + child)


def kindless(first_block, group_idx):
    """A store naming its KV-cache group but not the group's kind."""
    event = stored(first_block, 1, group_idx=group_idx)
    del event["kv_cache_spec_kind"]
    return event


def scenario_attention_groups(sc: Scenario):
    """Hybrid models: vLLM tags each event with its KV-cache group and the
    group's attention kind; only main attention is indexed."""
    sc.worker("w1r0", instance_id=1)
    kinds = ["full_attention", "mla_attention", "sink_full_attention", "sliding_window",
             "sliding_window_mla", "mamba", "chunked_local_attention",
             "encoder_only_attention", "cross_attention", "unknown", "no-such-kind"]
    for i, kind in enumerate(kinds):
        sc.publish("w1r0", [stored(10 + i, 1, group_idx=i, kv_cache_spec_kind=kind)])
    # Group 20 without a kind; a kind without a group.
    sc.publish("w1r0", [kindless(40, group_idx=20)])
    event = stored(41, 1)
    del event["group_idx"]
    sc.publish("w1r0", [event])
    # The same blocks in the main group 0 and in sliding-window group 3;
    # then a removal naming group 3, one naming group 0, one naming none.
    sc.publish("w1r0", [stored(1, 3), stored(1, 3, group_idx=3,
                                                kv_cache_spec_kind="sliding_window")])
    sc.settle()
    sc.query_each_block(10, len(kinds))
    sc.query(toks(40, 1))
    sc.query(toks(41, 1))
    sc.query(toks(1, 3))
    # Events without a kind take their group's last known kind; an unknown
    # group is main only when it is group 0.
    sc.worker("w2r0", instance_id=2)
    sc.worker("w3r0", instance_id=3)
    sc.publish("w2r0", [stored(50, 1, group_idx=1, kv_cache_spec_kind="mla_attention")])
    sc.publish("w2r0", [kindless(51, group_idx=1)])
    sc.publish("w2r0", [stored(52, 1, group_idx=2, kv_cache_spec_kind="sliding_window")])
    sc.publish("w2r0", [kindless(53, group_idx=2)])
    sc.publish("w2r0", [kindless(54, group_idx=0)])
    sc.publish("w3r0", [stored(55, 1, group_idx=0, kv_cache_spec_kind="sliding_window")])
    sc.publish("w3r0", [kindless(56, group_idx=0)])
    sc.publish("w3r0", [stored(57, 1, group_idx=5, kv_cache_spec_kind="full_attention")])
    sc.publish("w3r0", [kindless(58, group_idx=5)])
    sc.publish("w3r0", [kindless(59, group_idx=0)])
    sc.settle()
    sc.query_each_block(50, 10)
    sc.publish("w1r0", [dict(block_removed([h(1, 3)]), group_idx=3)])
    sc.settle()
    sc.query(toks(1, 3))
    sc.publish("w1r0", [dict(block_removed([h(1, 2)]), group_idx=0)])
    sc.settle()
    sc.query(toks(1, 3))
    sc.publish("w1r0", [block_removed([h(1, 1)])])
    sc.settle()
    sc.query(toks(1, 3))


def scenario_divergent_engine_hashes(sc: Scenario):
    """Not a golden: Dynamo keeps one engine hash per tree node (the first
    stored), so workers publishing different hashes for one block diverge
    from an exact index. Recorded at --threads 1 and 4 for docs/index.md."""
    for w in (1, 2, 3):
        sc.worker(f"w{w}r0", instance_id=w)
    sc.publish("w1r0", [stored(1, 2, extra="w1")])
    sc.settle()
    sc.publish("w2r0", [stored(1, 1, extra="w2")])
    sc.settle()
    sc.publish("w3r0", [stored(1, 3, extra="w3")])
    sc.settle()
    sc.query(toks(1, 3))
    sc.publish("w3r0", [block_removed([h(1, 3, extra="w3")])])
    sc.settle()
    sc.query(toks(1, 3))
    sc.publish("w3r0", [block_removed([h(1, 1, extra="w3")])])
    sc.settle()
    sc.query(toks(1, 3))


SCENARIOS = {
    "single-worker-prefix-chains": (
        scenario_single_worker_prefix_chains,
        "One worker, one rank: chains stored in one and several events, a branch, "
        "queries along, across and off them; partial last block; empty query; a "
        "block stored twice; a store under an unknown parent."),
    "two-workers-shared-divergent": (
        scenario_two_workers_shared_divergent,
        "Two workers caching one prefix, then diverging; one evicts the shared part."),
    "dp-ranks": (
        scenario_dp_ranks,
        "A worker with 2 dp ranks and one with 4, each rank at its own depth; one "
        "rank unregistered; one rank cleared."),
    "dp-rank-envelope": (
        scenario_dp_rank_envelope,
        "Batches whose envelope dp_rank differs from the registered rank or is nil."),
    "removals-and-clear": (
        scenario_removals_and_clear,
        "Removals leaf-first and from the middle, re-stores, unknown and repeated "
        "removals, several events per batch, AllBlocksCleared and stores after it."),
    "tiers": (
        scenario_tiers,
        "Every medium spelling's tier; GPU then CPU, disk and external continuing one "
        "chain; offloaded copies of GPU blocks; tier-specific removals; a clear."),
    "lora-and-salt": (
        scenario_lora_and_salt,
        "LoRA names and cache salts as vLLM and SGLang send them, queried with "
        "matching and non-matching lora_name/cache_salt."),
    "block-size-mismatch": (
        scenario_block_size_mismatch,
        "Stores whose block size or token count disagree with the registration; a "
        "registration with another block size."),
    "models-and-routing-groups": (
        scenario_models_and_routing_groups,
        "Two models and two routing groups; one worker id in one partition only; "
        "unknown model/group; /workers filters; unregister across groups."),
    "query-by-hash": (
        scenario_query_by_hash,
        "/query_by_hash with Dynamo's per-block hashes as i64 (and out of range), "
        "with a cache_salt, for an unknown model."),
    "unregister": (
        scenario_unregister,
        "Unregister a worker, unknown workers/ranks/models, register again, the last "
        "worker of a partition."),
    "sequence-and-replay": (
        scenario_sequence_and_replay,
        "A gap answered by the replay endpoint; malformed frames; a gap without a "
        "replay endpoint; a publisher restart (seq back to 0); a non-empty topic."),
    "engine-layouts": (
        scenario_engine_layouts,
        "One chain stored, removed from and cleared in each publisher layout: vLLM "
        "0.33 maps, SGLang signed hashes, vLLM 0.10 and 0.23 arrays, TensorRT-LLM's "
        "tee, 32-byte digests; multimodal extra keys."),
    "attention-groups": (
        scenario_attention_groups,
        "Every kv_cache_spec_kind, events with a group but no kind and the reverse, "
        "one chain in a main and a sliding-window group, removals per group."),
    "real-vllm-payloads": (
        scenario_real_vllm_payloads,
        "vLLM 0.33.0's own payloads (tests/fixtures/wire/vllm-0.33.0) published as "
        "they are: chains, LoRA, extra keys, high hashes, offload, digests, "
        "malformed batches, removals, clears."),
    "errors": (
        scenario_errors,
        "Malformed JSON, missing and mistyped fields, wrong content types, duplicate "
        "registration, block-size conflict, bad endpoints, unknown routes."),
}

# Recorded at both thread counts into quirks/: where Dynamo is not exact.
QUIRKS = {
    "divergent-engine-hashes": (
        scenario_divergent_engine_hashes,
        "Three workers publishing different engine hashes for the same blocks "
        "(not what one model's engines do): Dynamo loses depth and ignores removals."),
}


def main():
    here = Path(__file__).resolve()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter of the venv holding ai-dynamo-runtime")
    parser.add_argument("--out", type=Path,
                        default=here.parents[2] / "tests" / "fixtures" / "dynamo-index")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS) + sorted(QUIRKS))
    parser.add_argument("--threads", type=int, default=4,
                        help="Dynamo's --threads for the goldens")
    args = parser.parse_args()
    for name in args.only or list(SCENARIOS) + list(QUIRKS):
        if name in QUIRKS:
            fn, description = QUIRKS[name]
            runs = [(t, args.out / "quirks", f"{name}-threads-{t}") for t in (1, 4)]
        else:
            fn, description = SCENARIOS[name]
            runs = [(args.threads, args.out, name)]
        for threads, out, file_name in runs:
            sc = Scenario(file_name, description, args.python, threads)
            try:
                fn(sc)
            except BaseException:
                sc.dynamo.stop()
                raise
            path = sc.finish(out)
            print(f"{file_name}: {len(sc.steps)} steps -> {path}")


if __name__ == "__main__":
    main()
