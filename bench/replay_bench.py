#!/usr/bin/env python3
"""Benchmark of the native replay simulator (not a test): `python bench/replay_bench.py`.

1. Simulator cost per replayed call beyond the allocator's own: large synthetic workloads
   (malloc/free with a sliding window of live blocks, sizes 16..1024) on 1 and N independent
   threads. allocator time = the sum of the per-call rdtscp intervals; simulator overhead =
   (replay threads' CPU time - allocator time) / calls, i.e. decoding, slot bookkeeping,
   statistics, ideal-RSS accounting and the timer itself. Run with --no-fill (the 0x11/0x22
   writes are deliberate page touching, reported separately as the "fill" row).
2. Sync cost per cross-thread handoff, futex words vs upstream's mutex+condvar:
   - ping-pong: two threads strictly alternate on one address (every handoff waits);
   - stream: one thread allocates, the other frees (handoffs mostly already signalled).

Prints a markdown table (docs/replay.md has one). Keep it short on shared machines: --calls.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pymtrace.replay import runner as replay  # noqa: E402
from pymtrace.trace.formats import wl  # noqa: E402


def churn_stream(calls, base_idx, window=256):
    out = bytearray()
    live = []
    idx = 0
    sizes = [16, 24, 32, 48, 64, 100, 128, 200, 256, 512, 1024]
    for i in range(calls // 2):
        slot = base_idx + (idx % (window * 2))
        idx += 1
        out += wl.encode_op(wl.MALLOC, slot, sizes[i % len(sizes)])
        live.append(slot)
        if len(live) > window:
            out += wl.encode_op(wl.FREE, live.pop(0))
    for slot in live:
        out += wl.encode_op(wl.FREE, slot)
    out.append(wl.DONE)
    return bytes(out)


def churn(calls, threads):
    per = calls // threads
    streams = [churn_stream(per, 1 + t * 512) for t in range(threads)]
    return wl.build(1 + threads * 512, 1, streams)


def ping_pong(n):
    a, b = bytearray(), bytearray()
    k = 0
    for i in range(n):
        if i:
            k += 1
            b += wl.encode_op(wl.SYNC_W, k)
            a += wl.encode_op(wl.SYNC_R, k)
        a += wl.encode_op(wl.MALLOC, 1, 64)
        k += 1
        a += wl.encode_op(wl.SYNC_W, k)
        b += wl.encode_op(wl.SYNC_R, k)
        b += wl.encode_op(wl.FREE, 1)
    return wl.build(2, k + 1, [bytes(a) + b"\x01", bytes(b) + b"\x01"]), 2 * n - 1


def stream(n, inflight=64):
    """A allocates, B frees; a slot is reused by A only after B signalled its free."""
    a, b = bytearray(), bytearray()
    back = []
    k = 0
    for i in range(n):
        slot = 1 + i % (inflight * 4)
        if i >= inflight * 4:
            a += wl.encode_op(wl.SYNC_R, back[i - inflight * 4])
        a += wl.encode_op(wl.MALLOC, slot, 64)
        k += 1
        a += wl.encode_op(wl.SYNC_W, k)
        b += wl.encode_op(wl.SYNC_R, k) + wl.encode_op(wl.FREE, slot)
        k += 1
        b += wl.encode_op(wl.SYNC_W, k)
        back.append(k)
    return wl.build(1 + inflight * 4, k + 1, [bytes(a) + b"\x01", bytes(b) + b"\x01"]), n + max(0, n - inflight * 4)


def sync_only(n):
    """One thread writes then reads each sync id: the primitives' own cost, never waiting."""
    body = b"".join(wl.encode_op(wl.SYNC_W, k) + wl.encode_op(wl.SYNC_R, k) for k in range(1, n + 1))
    return wl.build(1, n + 1, [body + b"\x01"]), n


def run(sim, path, *extra, repeat=3):
    results = []
    for _ in range(repeat):
        with tempfile.NamedTemporaryFile(suffix=".json") as j:
            subprocess.run(
                [sim, "--json", j.name, "--sample-ms", "50", *extra, path], check=True, stdout=subprocess.DEVNULL
            )
            results.append(json.load(open(j.name)))
    results.sort(key=lambda r: r["wall_us"])
    return results[len(results) // 2]


def overhead_row(label, r):
    calls = sum(c["count"] for c in r["calls"].values())
    ticks_per_ns = r["ticks"] / (r["wall_us"] * 1000) if r["unit"] == "cycles" else 1.0
    alloc_ns = sum(c["total"] - c["count"] * r["timer_overhead"] for c in r["calls"].values()) / ticks_per_ns
    cpu_ns = r["thread_cpu_us"] * 1000
    over = (cpu_ns - alloc_ns) / calls
    return (
        f"| {label} | {calls:,} | {calls / (r['wall_us'] / 1e6) / 1e6:.2f} M/s | "
        f"{alloc_ns / calls:.1f} ns | {over:.1f} ns ({over * ticks_per_ns:.0f} cycles) |"
    )


def glibc_probed(r):
    """Someone's uprobes on libc (a running `pymtrace record`/`top`) make every glibc call trap."""
    return r["calls"]["malloc"]["p50"] > 2000


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2_000_000, help="calls in the churn workload")
    ap.add_argument("--threads", type=int, default=4, help="threads for the multi-threaded churn")
    ap.add_argument("--handoffs", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sim = replay.simulator_path()
    with tempfile.TemporaryDirectory() as tmp:

        def save(name, data):
            p = os.path.join(tmp, name)
            with open(p, "wb") as f:
                f.write(data)
            return p

        one = save("one.wl", churn(args.calls, 1))
        many = save("many.wl", churn(args.calls, args.threads))
        r1 = run(sim, one, "--no-fill", repeat=args.repeat)
        print(
            f"timer: {r1['timer']} (empty timed region: {r1['timer_overhead']} {r1['unit']}, counted as "
            f"simulator overhead below); {os.cpu_count()} CPUs; median of {args.repeat}\n"
        )
        print("| workload | calls | replayed calls/s (wall) | allocator time/call | simulator overhead/call |")
        print("|---|---|---|---|---|")
        if glibc_probed(r1):
            print(
                "WARNING: glibc malloc takes > 2000 cycles: libc is being uprobed by a tracer right now; "
                "glibc rows measure the probes\n"
            )
        print(overhead_row("churn, 1 thread, glibc", r1))
        print(overhead_row("churn, 1 thread, glibc, with 0x11/0x22 fill", run(sim, one, repeat=args.repeat)))
        print(overhead_row(f"churn, {args.threads} threads, glibc", run(sim, many, "--no-fill", repeat=args.repeat)))
        for name in ("jemalloc", "tcmalloc", "mimalloc"):
            try:
                lib = replay.find_library(name)
            except Exception:
                continue
            os.environ["LD_PRELOAD"] = lib
            try:
                print(overhead_row(f"churn, 1 thread, {name}", run(sim, one, "--no-fill", repeat=args.repeat)))
            finally:
                del os.environ["LD_PRELOAD"]

        pp, n_pp = ping_pong(args.handoffs)
        st_, n_st = stream(args.handoffs)
        so, n_so = sync_only(args.handoffs)
        pp, st_, so = save("pp.wl", pp), save("st.wl", st_), save("so.wl", so)
        print(
            "\n| handoff pattern | handoffs | futex words: wall/handoff | mutex+condvar: wall/handoff | futex sleeps | mutex waits |"
        )
        print("|---|---|---|---|---|---|")
        for label, path, n in (
            ("sync write+read, no waiting (1 thread)", so, n_so),
            ("ping-pong (every handoff waits)", pp, n_pp),
            ("producer/consumer stream", st_, n_st),
        ):
            f = run(sim, path, "--no-fill", "--sync", "futex", repeat=args.repeat)
            m = run(sim, path, "--no-fill", "--sync", "mutex", repeat=args.repeat)
            print(
                f"| {label} | {n:,} | {f['wall_us'] * 1000 / n:.0f} ns | {m['wall_us'] * 1000 / n:.0f} ns | "
                f"{f['sync_sleeps']:,} | {m['sync_waits']:,} |"
            )


if __name__ == "__main__":
    main()
