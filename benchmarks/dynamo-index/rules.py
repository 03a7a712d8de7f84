#!/usr/bin/env python3
"""docs/index.md's rules as a naive model, checked against Dynamo's answers.

Replays every fixture of tests/fixtures/dynamo-index/ (or the files given)
through a model written from docs/index.md alone - partitions, per-rank
blocks per tier, the token hash, the tier runs, the sequence rules - and
compares its answer to every recorded /query and /query_by_hash answer
(settle polls included). A mismatch means the page misstates Dynamo.

    python3 benchmarks/dynamo-index/rules.py    # needs msgpack and xxhash

It is slow on purpose (lists, linear scans): it states the rules, nothing
more.
"""
import base64
import json
import os
import struct
import sys
from pathlib import Path

import msgpack
import xxhash

M64 = (1 << 64) - 1
TIER = {}
for m in ("GPU", "DEVICE", None): TIER[m] = "device"
for m in ("CPU", "CPU_PINNED", "CPU_TIER1"): TIER[m] = "host"
for m in ("CPU_TIER2", "DISK", "NVME", "STORAGE"): TIER[m] = "disk"
for m in ("EXTERNAL", "NETWORK", "REMOTE", "SHARED"): TIER[m] = "external"
SALT_TAG = "dynamo-cache-salt:"
MAIN_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}

def seed(lora, salt):
    s = 1337
    if lora: s += xxhash.xxh3_64_intdigest(lora.encode(), seed=0)
    if salt: s += xxhash.xxh3_64_intdigest(salt.encode(), seed=1)
    return s & M64

def th(tokens, sd):
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=sd)

def u64(h):
    if isinstance(h, bytes): raise ValueError("bytes hash")
    return h & M64

class Model:
    def __init__(self):
        self.parts = {}      # (model, group) -> {"bs":, "workers": {wid: set(ranks)}}
        self.where = {}      # wid -> (model, group)
        self.blocks = {}     # (part, wid, rank, tier) -> {ehash: (tokens_hash, parent)}
        self.socks = {}      # socket -> dict(wid, rank, part, expected, replay)
        self.groups = {}     # (part, wid, rank) -> {group_idx: main attention?}
    def register(self, body, sock):
        part = (body["model_name"], body.get("routing_group", "default"))
        p = self.parts.setdefault(part, {"bs": body["block_size"], "workers": {}})
        p["workers"].setdefault(body["instance_id"], set()).add(body.get("dp_rank") or 0)
        self.where[body["instance_id"]] = part
        if sock:
            self.socks[sock] = dict(wid=body["instance_id"], rank=body.get("dp_rank") or 0, part=part,
                                    expected=0, replay=body.get("replay_endpoint"), waiting=False)
    def drop_worker(self, wid, rank=None):
        part = self.where[wid]
        for k in list(self.blocks):
            if k[0] == part and k[1] == wid and (rank is None or k[2] == rank): del self.blocks[k]
        for s, v in list(self.socks.items()):
            if v["wid"] == wid and (rank is None or v["rank"] == rank): del self.socks[s]
        if rank is None:
            del self.parts[part]["workers"][wid]; del self.where[wid]
        else:
            self.parts[part]["workers"][wid].discard(rank)
            if not self.parts[part]["workers"][wid]:
                del self.parts[part]["workers"][wid]; del self.where[wid]
        if not self.parts[part]["workers"]: del self.parts[part]
    def unregister(self, body):
        wid = body["instance_id"]
        if wid not in self.where: return
        part = self.where[wid]
        if part[0] != body["model_name"]: return
        if "routing_group" in body and body["routing_group"] != part[1]: return
        self.drop_worker(wid, body.get("dp_rank") if "routing_group" in body else None)
    def apply_batch(self, sock, payload):
        info = self.socks.get(sock)
        if info is None: return
        try:
            batch = msgpack.unpackb(payload, strict_map_key=False)
        except Exception:
            return
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            return
        rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else info["rank"]
        bs = self.parts[info["part"]]["bs"]
        evs = []
        try:
            for e in batch[1]:
                if isinstance(e, list):
                    t = e[0]
                    if t == "BlockStored":
                        e = {"type": t, "block_hashes": e[1], "parent_block_hash": e[2], "token_ids": e[3],
                             "block_size": e[4], "medium": e[6] if len(e) > 6 else None,
                             "lora_name": e[7] if len(e) > 7 else None, "extra_keys": e[8] if len(e) > 8 else None,
                             "group_idx": e[9] if len(e) > 9 else None,
                             "kv_cache_spec_kind": e[10] if len(e) > 10 else None}
                    elif t == "BlockRemoved":
                        e = {"type": t, "block_hashes": e[1], "medium": e[2] if len(e) > 2 else None,
                             "group_idx": e[3] if len(e) > 3 else None}
                    else: e = {"type": t}
                if e["type"] not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
                    return
                if any(isinstance(k, bytes) for keys in e.get("extra_keys") or [] for k in keys or []):
                    return
                if e["type"] in ("BlockStored", "BlockRemoved"):
                    e["block_hashes"] = [u64(h) for h in e["block_hashes"]]
                    if e.get("parent_block_hash") is not None: e["parent_block_hash"] = u64(e["parent_block_hash"])
                evs.append(e)
        except (ValueError, KeyError, TypeError, IndexError):
            return
        for e in evs: self.apply(info["part"], info["wid"], rank, e, bs)
    def is_main_attention(self, part, wid, rank, e):
        """A group's kind is the last one named with it; a kindless event
        takes its group's, and an unknown group is main only when it is 0."""
        groups = self.groups.setdefault((part, wid, rank), {})
        kind, group = e.get("kv_cache_spec_kind"), e.get("group_idx")
        if kind is not None:
            if group is not None:
                groups[group] = kind in MAIN_KINDS
            return kind in MAIN_KINDS
        return True if group is None else groups.get(group, group == 0)

    def apply(self, part, wid, rank, e, bs):
        key = lambda tier: (part, wid, rank, tier)
        if e["type"] != "AllBlocksCleared" and not self.is_main_attention(part, wid, rank, e):
            return
        if e["type"] == "AllBlocksCleared":
            for t in ("device", "host", "disk", "external"): self.blocks.pop(key(t), None)
            return
        medium = e.get("medium")
        if medium not in TIER: return
        tier = TIER[medium]
        if e["type"] == "BlockRemoved":
            d = self.blocks.get(key(tier), {})
            for h in e["block_hashes"]:
                if h in d:
                    self.remove_subtree(d, h) if tier == "device" else d.pop(h)
            return
        if e["block_size"] != bs or bs == 0: return
        lora = e.get("lora_name") or None
        salt = e.get("cache_salt") or None
        if salt is None and e.get("extra_keys"):
            first = e["extra_keys"][0] or []
            skip = lora
            for k in first:
                if not isinstance(k, str): continue
                if skip is not None and k == skip: skip = None; continue
                if k.startswith(SALT_TAG) and len(k) > len(SALT_TAG): salt = k[len(SALT_TAG):]; break
        sd = seed(lora, salt)
        d = self.blocks.setdefault(key(tier), {})
        parent = e["parent_block_hash"]
        if tier == "device" and parent is not None and parent not in d: return
        toks = e["token_ids"]
        for i, h in enumerate(e["block_hashes"]):
            chunk = toks[i * bs:(i + 1) * bs]
            if len(chunk) < bs: break
            if h not in d: d[h] = (th(chunk, sd), parent)
            parent = h
    def remove_subtree(self, d, h):
        d.pop(h)
        for c in [c for c, (_, p) in d.items() if p == h]: self.remove_subtree(d, c)
    def query(self, part, q):
        p = self.parts[part]; bs = p["bs"]
        res = {"scores": {}, "frequencies": [], "instances": {}}
        for wid, ranks in p["workers"].items():
            inst = None
            for r in sorted(ranks | {k[2] for k in self.blocks if k[0] == part and k[1] == wid}):
                depth, prev = 0, None
                depths = []
                for tiers in (("device",), ("host",), ("disk", "external")):
                    while depth < len(q):
                        found = None
                        for t in tiers:
                            for h, (tok, par) in self.blocks.get((part, wid, r, t), {}).items():
                                if tok == q[depth] and par == prev: found = h; break
                            if found is not None: break
                        if found is None: break
                        prev = found; depth += 1
                    depths.append(depth)
                dev, host, disk = depths
                if dev: res["scores"].setdefault(str(wid), {})[str(r)] = dev * bs
                if disk:
                    inst = inst or {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}
                    inst["gpu"] = max(inst["gpu"], dev * bs); inst["cpu"] = max(inst["cpu"], host * bs)
                    inst["disk"] = max(inst["disk"], disk * bs); inst["longest_matched"] = inst["disk"]
                    inst["dp"][str(r)] = dev * bs
            if inst: res["instances"][str(wid)] = inst
        return res

def check(path) -> int:
    d = json.load(open(path))
    m = Model(); bad = 0; n = 0
    for i, s in enumerate(d["steps"]):
        if "publish" in s:
            pb = s["publish"]; info = m.socks.get(pb["socket"])
            if info is None: continue
            payload = base64.b64decode(pb["payload_b64"])
            seq = pb["seq"]
            if info["waiting"]: continue
            if seq < info["expected"]: continue
            if seq > info["expected"] and info["replay"]:
                # Held until the replay of [expected, seq) has been applied.
                info["waiting"] = (seq, payload); continue
            info["expected"] = seq + 1
            m.apply_batch(pb["socket"], payload)
        elif "publish_raw" in s:
            pass
        elif "replay_reply" in s:
            owner = [k for k, v in m.socks.items() if v["replay"] == "{socket:%s}" % s["replay_reply"]["socket"]][0]
            live_seq, live_payload = m.socks[owner]["waiting"]
            for frames in s["replay_reply"]["messages_b64"]:
                fr = [base64.b64decode(f) for f in frames]
                if fr[2] == b"\xff" * 8: break
                if int.from_bytes(fr[2], "big") < live_seq:
                    m.apply_batch(owner, fr[3])
            m.apply_batch(owner, live_payload)
            m.socks[owner]["expected"] = live_seq + 1
            m.socks[owner]["waiting"] = False
        elif "http" in s or "settle" in s:
            st = s.get("settle", s); h = st["http"]; body = h.get("body")
            if h["path"] == "/register" and st["status"] == 201:
                ep = body["endpoint"]
                m.register(body, ep[8:-1] if ep.startswith("{socket:") else None)
            elif h["path"] == "/unregister" and st["status"] == 200:
                m.unregister(body)
            elif h["path"] in ("/query", "/query_by_hash") and st["status"] == 200:
                part = (body["model_name"], body.get("routing_group", "default"))
                bs = m.parts[part]["bs"]
                if h["path"] == "/query":
                    sd = seed(body.get("lora_name"), body.get("cache_salt"))
                    t = body["token_ids"]
                    q = [th(t[j:j + bs], sd) for j in range(0, len(t) - bs + 1, bs)] if bs else []
                else:
                    q = [x & M64 for x in body["block_hashes"]]
                got = m.query(part, q); n += 1
                if got != st["response"]:
                    bad += 1; print(os.path.basename(path), i, "want", json.dumps(st["response"], sort_keys=True)[:300]); print("      got ", json.dumps(got, sort_keys=True)[:300])
    print(os.path.basename(path), "answers", n, "mismatches", bad)
    return bad


def main():
    paths = sys.argv[1:] or sorted(
        (Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "dynamo-index").glob("*.json"))
    sys.exit(1 if sum(check(p) for p in paths) else 0)


if __name__ == "__main__":
    main()
