"""Helpers for the interposer's tests (no tests here): a command run under pymtrace's
LD_PRELOAD interposer with its rings drained, and the tests' own LD_PRELOAD counter."""

import collections
import os
import subprocess
import time

import numpy as np

from pymtrace.sources import interposer as I
from support.paths import WORKLOADS


class Run:
    def __init__(self, proc, batches, stats):
        self.proc = proc  # subprocess.CompletedProcess-like: returncode, stdout, stderr
        self.stats = stats  # [RingStats]
        by_pid = collections.defaultdict(list)
        for b in batches:
            by_pid[b.pid].append(b.data)
        self.records = {pid: I.records(b"".join(parts)) for pid, parts in by_pid.items()}

    def all(self):
        return np.concatenate(list(self.records.values())) if self.records else I.records(b"")

    def counts(self, pid=None):
        """{dj/malloc type: calls} of PID (every process: None)."""
        recs = self.all() if pid is None else self.records.get(pid, I.records(b""))
        return dict(collections.Counter(int(t) for t in recs["type"]))


def run_interposed(
    argv, options=None, env=None, input=None, drain_every=0.002, stall=0.0, timeout=120, preload_first=None, lib=None
):
    """Run ARGV under the interposer, draining its rings every DRAIN_EVERY seconds (after
    STALL seconds without draining), until it exits and every ring is retired.
    PRELOAD_FIRST: a library preloaded in front of the interposer (the counter); LIB: another
    build of the interposer."""
    rings = I.RingSet(options or I.RingOptions(), lib=lib)
    batches = []
    try:
        run_env = rings.env(os.environ if env is None else env)
        if preload_first:
            run_env["LD_PRELOAD"] = preload_first + ":" + run_env["LD_PRELOAD"]
        proc = subprocess.Popen(
            argv,
            env=run_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        if input is not None:
            proc.stdin.write(input.encode())
        proc.stdin.close()
        deadline = time.monotonic() + timeout
        time.sleep(stall)
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"{argv} did not finish"
            got = rings.drain()
            batches += [b._replace(data=bytes(b.data)) for b in got]  # a drain's buffer is reused
            if not rings.busy(got):
                time.sleep(drain_every)
        batches += [b._replace(data=bytes(b.data)) for b in rings.finish(timeout=10)]
        out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
        proc.stdout.close()
        proc.stderr.close()
        assert not rings.live(), "a ring outlived its process"
        stats = rings.stats()
    finally:
        rings.close()
    return Run(subprocess.CompletedProcess(argv, proc.returncode, out, err), batches, stats)


def truth(stdout):
    """The COUNT lines interpose_calls prints: {(pid, type, size): n}."""
    found = collections.Counter()
    for line in stdout.splitlines():
        if line.startswith("COUNT "):
            pid, kind, size, n = map(int, line.split()[1:])
            found[(pid, kind, size)] += n
    return found


def build_counter(build_dir):
    """tests/support/workloads/preload_counter.c as a shared library."""
    out = build_dir / "preload_counter.so"
    if not out.exists():
        src = WORKLOADS / "preload_counter.c"
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"], check=True)
    return str(out)


def counter_counts(directory):
    """{pid: {type: calls}} the counter wrote in DIRECTORY."""
    found = {}
    for name in os.listdir(directory):
        values = np.fromfile(os.path.join(directory, name), dtype=np.uint64)
        found[int(name)] = {t: int(v) for t, v in enumerate(values) if v}
    return found
