#!/usr/bin/env python3
"""The floor under kvgate's cost per subscriber: what libzmq itself costs.

Without a gateway every router would subscribe to the engine's ZMQ PUB, and
libzmq's I/O thread would write each message once per subscriber. This
script measures that cost and kvgate's, the same way, on this machine:

* a pyzmq PUB sends vLLM-shaped payloads (16 events: 12 stores of 4 new
  blocks of 16 tokens and 4 removals of 12 old blocks each, ~3 KB)
  at --rate messages/s;
* N receivers, their sockets spread over --processes receiving processes
  (2 by default; 1 puts them all in one process, as kvgate-bench's
  subscribers are); or, with --rust-receivers KVGATE_BENCH, all on one
  thread of one `kvgate-bench --floor-receivers` process, which keeps up
  at 64 where Python's fall behind (a receiver that is behind is written
  several messages at a time, so its cost is no longer per delivery);
* `zmq`: the receivers are SUB sockets on the PUB, and the CPU measured is
  the publishing process's (its libzmq I/O thread does the writes);
  `kvgate`: the PUB feeds a kvgate process, the receivers are Python gRPC
  subscribers (raw bytes, nothing decoded), and the CPU measured is
  kvgate's;
* `relay` (with --relay): the PUB feeds `kvgate-bench --floor-relay`, a
  relay that does nothing but relay (one thread, the same ZMQ crate and
  runtime as kvgate, each payload written once per receiver with a 4-byte
  length; no decoding, no state, no HTTP/2), the receivers are
  `--floor-receivers tcp:`, and the CPU measured is the relay's: the floor
  under any gateway's CPU per delivered event, which the `us/event`
  column gives for it and for kvgate (their whole CPU over N times the
  events published);
* each count runs after a run with no receiver, alternating, and the cost
  per delivery is CPU(N) - CPU(0) over the messages delivered in the window
  (from /proc/PID/stat). kvgate puts payloads that queued up while its
  drain was busy into one batch, so it may deliver fewer, larger messages
  than libzmq: the cost per payload delivered (CPU(N) - CPU(0) over N times
  the payloads published in the window) compares the same work.

Needs pyzmq, msgpack and grpcio (e.g. the venv of smg-peer.py):

    python benchmarks/floor.py --kvgate target/release/kvgate --counts 1,8,64
    python benchmarks/floor.py --kvgate target/release/kvgate --counts 8,64 \
        --rust-receivers target/release/kvgate-bench
    python benchmarks/floor.py --kvgate target/release/kvgate --counts 1,8 --relay \
        --rust-receivers target/release/kvgate-bench
"""

import argparse
import asyncio
import os
import random
import subprocess
import sys
import threading
import time

import msgpack
import zmq

TICKS = os.sysconf("SC_CLK_TCK")
STORES = 12
REMOVALS = 4
EVENTS = STORES + REMOVALS
BLOCKS = 4
BLOCK_SIZE = 16
# Removals take the blocks stored this many messages earlier, so kvgate's
# state stays bounded (STORES * BLOCKS * WINDOW live blocks).
WINDOW = 1024
PRIME_EVERY = 0.02
JOIN_TIMEOUT = 30.0
SUBSCRIBE = "/kvgate.v1.KvGate/SubscribeKvEvents"


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15; [1:] starts at field 3.
    return (int(fields[11]) + int(fields[12])) / TICKS


def others_percent(busy_before, busy_after, ours, seconds):
    """The share of all CPUs that processes other than ours used."""
    cpus = os.cpu_count()
    return max(0.0, 100.0 * ((busy_after - busy_before) - ours) / (seconds * cpus))


def machine_busy():
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal
    busy = sum(values[:8]) - values[3] - values[4]
    return busy / TICKS


class Payloads:
    """vLLM 0.23's array-form KVEventBatches, encoded before the runs (Python
    encoding them on the fly would cost the publishing process more than
    libzmq's writes) and numbered as vLLM's PUB does. The pool cycles: each
    payload removes the blocks stored WINDOW payloads earlier, so kvgate's
    state stays bounded."""

    def __init__(self):
        rng = random.Random(7)
        count = 2 * WINDOW
        stored = [list(range(1 + i * STORES * BLOCKS, 1 + (i + 1) * STORES * BLOCKS))
                  for i in range(count)]
        self.pool = []
        for i in range(count):
            events = []
            for first in range(0, len(stored[i]), BLOCKS):
                hashes = stored[i][first:first + BLOCKS]
                tokens = [rng.randrange(65536) for _ in range(BLOCKS * BLOCK_SIZE)]
                events.append(
                    ["BlockStored", hashes, hashes[0] - 1, tokens, BLOCK_SIZE, None, "GPU",
                     None, None, None, None, None]
                )
            old = stored[(i - WINDOW) % count]
            per_removal = len(old) // REMOVALS
            for index in range(REMOVALS):
                events.append(
                    ["BlockRemoved", old[index * per_removal:(index + 1) * per_removal],
                     "GPU", None]
                )
            self.pool.append(msgpack.packb([time.time(), events, 0]))
        self.sequence = 0

    def next(self):
        payload = self.pool[self.sequence % len(self.pool)]
        frames = [b"", self.sequence.to_bytes(8, "big"), payload]
        self.sequence += 1
        return frames


# ---- receivers (child processes) ------------------------------------------

def commands(on_command):
    for line in sys.stdin:
        on_command(line.strip())
    os._exit(0)


def receive_zmq(endpoint, sockets):
    context = zmq.Context()
    poller = zmq.Poller()
    subs = []
    for _ in range(sockets):
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        poller.register(sub, zmq.POLLIN)
        subs.append(sub)
    counts = [0] * sockets
    index = {sub: i for i, sub in enumerate(subs)}
    serve_commands(counts)
    while True:
        for sub, _ in poller.poll(100):
            while True:
                try:
                    sub.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                counts[index[sub]] += 1


def receive_grpc(address, streams):
    import grpc

    counts = [0] * streams

    async def subscribe(i):
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_stream(
                SUBSCRIBE, request_serializer=bytes, response_deserializer=bytes
            )
            async for _ in call(b""):
                counts[i] += 1

    async def main():
        await asyncio.gather(*(subscribe(i) for i in range(streams)))

    serve_commands(counts)
    asyncio.run(main())


def serve_commands(counts):
    """`ready?` answers whether every socket got a message; `count` prints
    the messages received so far."""

    def on_command(command):
        if command == "ready?":
            print(int(all(counts)), flush=True)
        elif command == "count":
            print(sum(counts), flush=True)

    threading.Thread(target=commands, args=(on_command,), daemon=True).start()


# ---- the measurement (parent) ---------------------------------------------

class Receivers:
    def __init__(self, kind, target, count, args):
        self.children = []
        if args.rust_receivers:
            scheme = {"zmq": "zmq", "kvgate": "grpc", "relay": "tcp"}[kind]
            commands = [[args.rust_receivers, "--floor-receivers", f"{scheme}:{target}",
                         "--floor-count", str(count)]] if count else []
        else:
            processes = args.processes
            share = [count // processes + (i < count % processes) for i in range(processes)]
            commands = [[sys.executable, __file__, "--receiver", kind, target, str(sockets)]
                        for sockets in share if sockets]
        for command in commands:
            self.children.append(subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            ))

    def ask(self, command):
        answers = []
        for child in self.children:
            child.stdin.write(command + "\n")
            child.stdin.flush()
        for child in self.children:
            answers.append(int(child.stdout.readline()))
        return answers

    def ready(self):
        return all(self.ask("ready?"))

    def count(self):
        return sum(self.ask("count"))

    def close(self):
        for child in self.children:
            child.kill()
            child.wait()


class Publisher:
    def __init__(self, payloads):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.payloads = payloads

    def send(self):
        self.socket.send_multipart(self.payloads.next(), copy=False)

    def prime_until(self, done, what):
        deadline = time.monotonic() + JOIN_TIMEOUT
        while not done():
            if time.monotonic() > deadline:
                sys.exit(f"floor.py: {what} got nothing within {JOIN_TIMEOUT} s")
            self.send()
            time.sleep(PRIME_EVERY)

    def run(self, rate, seconds):
        start = time.monotonic()
        sent = 0
        while True:
            now = time.monotonic()
            if now - start >= seconds:
                return
            due = int((now - start) * rate) + 1
            while sent < due:
                self.send()
                sent += 1
            time.sleep(max(0.0, start + sent / rate - time.monotonic()))


def kvgate_joined(publisher, address):
    """Primes kvgate's SUB (ZMQ drops everything until it joins) with one
    subscriber that returns once a batch arrives."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(SUBSCRIBE, request_serializer=bytes,
                                    response_deserializer=bytes)(b"")
        got = threading.Event()

        def read():
            for _ in call:
                got.set()
                return

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        publisher.prime_until(got.is_set, "kvgate's first subscriber")
        call.cancel()
        thread.join()


def start_kvgate(binary, endpoint):
    kvgate = subprocess.Popen(
        [binary, "serve", "--log-format", "text", "--listen", "127.0.0.1:0",
         "--zmq-endpoint", endpoint],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "RUST_LOG": "warn,zeromq=error"},
    )
    for line in kvgate.stdout:
        if line.startswith("kvgate: serving gRPC on "):
            address = line.split("on ", 1)[1].split(",")[0].strip()
            threading.Thread(target=kvgate.stdout.read, daemon=True).start()
            return kvgate, address
    sys.exit(f"floor.py: {binary} exited before serving")


def start_relay(binary, endpoint):
    relay = subprocess.Popen(
        [binary, "--floor-relay", endpoint],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
    )
    line = relay.stdout.readline()
    if not line.startswith("floor relay listening on "):
        relay.kill()
        sys.exit(f"floor.py: {binary} --floor-relay printed {line!r}")
    return relay, line.rsplit(" ", 1)[1].strip()


def measure(kind, count, args, payloads):
    """One run: CPU seconds of the measured process over the window and the
    messages delivered in it."""
    publisher = Publisher(payloads)
    relay = None  # the measured child process: kvgate or the floor relay
    receivers = None
    try:
        if kind == "kvgate":
            relay, target = start_kvgate(args.kvgate, publisher.endpoint)
            kvgate_joined(publisher, target)
            pid = relay.pid
        elif kind == "relay":
            relay, target = start_relay(args.rust_receivers, publisher.endpoint)
            pid = relay.pid
        else:
            target = publisher.endpoint
            pid = os.getpid()
        receivers = Receivers(kind, target, count, args)
        if count:
            publisher.prime_until(receivers.ready, "every receiver")
        publisher.run(args.rate, args.warmup)

        def reading():
            receivers_cpu = sum(cpu_seconds(child.pid) for child in receivers.children)
            return (cpu_seconds(pid), receivers.count(), machine_busy(), time.monotonic(),
                    cpu_seconds(os.getpid()) + receivers_cpu, payloads.sequence)

        before = reading()
        publisher.run(args.rate, args.duration)
        after = reading()
        seconds = after[3] - before[3]
        # The run's own processes: publisher, receivers and the relay.
        ours = (after[4] - before[4]) + (after[0] - before[0] if kind != "zmq" else 0.0)
        return {
            "cpu_s": after[0] - before[0],
            "delivered": after[1] - before[1],
            "published": after[5] - before[5],
            "seconds": seconds,
            "others_percent": others_percent(before[2], after[2], ours, seconds),
        }
    finally:
        if receivers:
            receivers.close()
        if relay:
            relay.kill()
            relay.wait()
        publisher.socket.close(linger=0)
        publisher.context.term()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--receiver":
        kind, target, count = sys.argv[2], sys.argv[3], int(sys.argv[4])
        (receive_zmq if kind == "zmq" else receive_grpc)(target, count)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,8,64")
    parser.add_argument("--processes", type=int, default=None,
                        help="Python receiving processes (default 2)")
    parser.add_argument("--rust-receivers", metavar="KVGATE_BENCH",
                        help="a kvgate-bench binary: its --floor-receivers, all on one "
                             "thread, instead of Python receivers")
    parser.add_argument("--rate", type=float, default=1250.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kvgate", help="a kvgate binary: measure it too")
    parser.add_argument("--relay", action="store_true",
                        help="measure the floor relay too (needs --rust-receivers)")
    args = parser.parse_args()
    if args.relay and not args.rust_receivers:
        parser.error("--relay runs kvgate-bench --floor-relay: give --rust-receivers")
    if args.rust_receivers and args.processes is not None:
        parser.error("--processes arranges Python receivers; --rust-receivers has one")
    if args.processes is None:
        args.processes = 2
    kinds = ["zmq"] + (["relay"] if args.relay else []) + (["kvgate"] if args.kvgate else [])
    payloads = Payloads()
    size = sum(map(len, payloads.pool)) // len(payloads.pool)
    arrangement = ("Rust receivers on one thread" if args.rust_receivers
                   else f"receivers over {args.processes} process(es)")
    print(f"floor.py: {args.rate:.0f} messages/s of {size} bytes, {args.duration} s "
          f"windows, {arrangement}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'relay':<7} {'N':>4} {'cpu(N) s':>9} {'cpu(0) s':>9} {'delivered':>10} "
          f"{'us/delivery':>12} {'us/payload':>11} {'us/event':>9} {'others %':>9}")
    for count in [int(c) for c in args.counts.split(",")]:
        for _ in range(args.rounds):
            for kind in kinds:
                idle = measure(kind, 0, args, payloads)
                busy = measure(kind, count, args, payloads)
                extra = busy["cpu_s"] - idle["cpu_s"] * busy["seconds"] / idle["seconds"]
                per = 1e6 * extra / max(1, busy["delivered"])
                per_payload = 1e6 * extra / max(1, count * busy["published"])
                # The publisher's own CPU is no relay's.
                per_event = ("-" if kind == "zmq" else
                             f"{1e6 * busy['cpu_s'] / max(1, count * busy['published'] * EVENTS):.2f}")
                print(f"{kind:<7} {count:>4} {busy['cpu_s']:>9.2f} {idle['cpu_s']:>9.2f} "
                      f"{busy['delivered']:>10} {per:>12.2f} {per_payload:>11.2f} {per_event:>9} "
                      f"{max(idle['others_percent'], busy['others_percent']):>9.0f}",
                      flush=True)


if __name__ == "__main__":
    main()
