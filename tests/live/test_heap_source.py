"""HeapSource (bpf/heap.bpf.c) on a real process making known calls (workloads/heap_calls.c,
built -O2 -fomit-frame-pointer): exact samples and live blocks at sample_bytes=1, the stack
copy holding the callers' return addresses, exec/fork/exit records, and the Poisson sampler's
estimates at the default mean within a stated bound."""

import collections
import copy
import ctypes
import math
import pathlib
import subprocess
import sys
import time

import pytest
from elftools.elf.elffile import ELFFile

from pymtrace.bpf import load as bpfload
from pymtrace.bpf import uprobes
from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.sources.heap import DEFAULT_SAMPLE_BYTES, HeapSample, HeapSource

FLAGS = ("-O2", "-fomit-frame-pointer")
STACK_WORDS = 256  # return addresses of the chain looked for in the first 2 KiB above sp


def functions(path):
    """{name: (start, end)} of the executable's functions (its symbol table)."""
    with open(path, "rb") as f:
        symtab = ELFFile(f).get_section_by_name(".symtab")
        return {
            s.name: (s["st_value"], s["st_value"] + s["st_size"])
            for s in symtab.iter_symbols()
            if s["st_info"]["type"] == "STT_FUNC" and s["st_size"]
        }


def function_at(funcs, vaddr):
    return next((name for name, (lo, hi) in funcs.items() if lo <= vaddr < hi), None)


class Run:
    """heap_calls ARGS traced by a HeapSource; samples keep the first STACK_WORDS words.
    COPIES processes of it traced by the one source: copy(i) is the run as seen by the i-th
    (pid, base, output), the first by default."""

    def __init__(self, exe, args, copies=1, **source_args):
        self.exe = exe
        self.procs, self.bases = [], {}
        for _ in range(copies):
            proc = subprocess.Popen([exe, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            _, pid, base = proc.stdout.readline().split()
            self.procs.append(proc)
            self.bases[int(pid)] = int(base, 16)
        self.proc = self.procs[0]
        self.pid, self.base = self.proc.pid, self.bases[self.proc.pid]
        self.samples, self.words, self.execs, self.forks, self.exits = [], {}, [], [], []
        self.source = HeapSource(
            set(self.bases),
            on_sample=self._sample,
            on_exec=self.execs.append,
            on_fork=lambda parent, child: self.forks.append((parent, child)),
            on_exit=self.exits.append,
            **source_args,
        )

    def _sample(self, s: HeapSample):
        n = min(s.stack_len, 8 * STACK_WORDS) // 8
        self.words[s.sample_id] = list((ctypes.c_uint64 * n).from_address(s.stack))
        self.samples.append(s)

    def run(self, timeout=60):
        c = self.source
        c.attach()
        try:
            for proc in self.procs:
                proc.stdin.write("\n")
                proc.stdin.flush()
            deadline = time.monotonic() + timeout
            while not set(self.bases) <= set(self.exits) and time.monotonic() < deadline:
                c.poll(10)
            c.drain()
            self.outs = {proc.pid: proc.stdout.read() for proc in self.procs}
            self.out = self.outs[self.pid]
            assert [proc.wait(timeout=10) for proc in self.procs] == [0] * len(self.procs)
            assert set(self.bases) <= set(self.exits), "no exit record"
            self.live = c.live()
            self.drops = c.drops()
        finally:
            c.close()
            for proc in self.procs:
                proc.kill()
                proc.wait()
        assert bpfload.own_perf_event_fds() == []  # no uprobe left attached: perf events,
        assert uprobes.own_links() == []  # uprobe_multi links (and raw tracepoints)
        assert bpfload.own_uprobe_events() == []
        return self

    def copy(self, index):
        """This run as the INDEX-th process's: its pid, load address and output."""
        view = copy.copy(self)
        view.proc = self.procs[index]
        view.pid = view.proc.pid
        view.base, view.out = self.bases[view.pid], self.outs[view.pid]
        return view

    def facts(self, key):
        return [line.split()[1] for line in self.out.splitlines() if line.startswith(key + " ")]


def expected_calls(pid):
    """(call, size, calling function, from the main thread) of every call heap_calls makes."""
    out = [("malloc", 1000 + i % 8, "chain_leaf", True) for i in range(100)]
    out += [("malloc", 5000 + i, "leak_leaf", True) for i in range(7)]
    out += [("calloc", 3 * (700 + i), "calloc_leaf", True) for i in range(5)]
    out += [("malloc", 3000 + i, "chain_leaf", True) for i in range(5)]
    out += [("realloc", 4000 + i, "realloc_leaf", True) for i in range(5)]
    out += [("realloc", 900, "realloc_leaf", True)]
    out += [("posix_memalign", 6000 + i, "posix_memalign_leaf", True) for i in range(3)]
    out += [("posix_memalign", 6500, "posix_memalign_leaf", True)]
    out += [("memalign", 7040 + 128 * i, "aligned_alloc_leaf", True) for i in range(3)]  # counted as memalign
    out += [("memalign", 800, "memalign_leaf", True)] * 2
    out += [("malloc", 0, "zero_leaf", True)] * 2
    out += [("malloc", 2500 + i, "thread_leaf", False) for i in range(50)]
    out += [("malloc", 2600 + i, "thread_leaf", False) for i in range(2)]
    return collections.Counter(out)


LEAKED = {("malloc", 5000 + i) for i in range(7)} | {("realloc", 4004), ("posix_memalign", 6000)}
LEAKED |= {("posix_memalign", 6500)}
LEAKED |= {("malloc", 2600), ("malloc", 2601)}


def check_exact(run):
    """sample_bytes=1: every call of the workload sampled once, from the right caller, with a
    stack copy holding the chain; live() is exactly the leaked blocks; nothing dropped."""
    funcs = functions(run.exe)
    assert run.drops and set(run.drops.values()) == {0}, run.drops
    mine, by_id = collections.Counter(), {}
    for s in run.samples:
        if s.pid != run.pid:
            continue
        ra = run.words[s.sample_id][0]  # at entry, [sp] is the return address into the caller
        caller = function_at(funcs, ra - run.base)
        assert s.regs[1] % 16 == 8, "sp at function entry (16-byte aligned before the call)"
        assert 0 < s.stack_len <= 32768
        if caller is not None:
            mine[(s.call, s.size, caller, s.tid == s.pid)] += 1
            by_id[s.sample_id] = s
            if caller == "chain_leaf" and s.size < 2000:  # main -> calls -> chain_a -> chain_b -> chain_leaf
                found = [function_at(funcs, w - run.base) for w in run.words[s.sample_id][1:]]
                chain = [f for f in found if f in ("chain_b", "chain_a", "calls", "main")]
                assert chain[:4] == ["chain_b", "chain_a", "calls", "main"], found
        else:  # glibc's own calls (a new thread's TLS); nested calls are never sampled twice
            assert (s.call, s.size) not in {("malloc", 800), ("malloc", 900), ("malloc", 6500)}
    assert mine == expected_calls(run.pid)
    malloc_ips = {s.regs[0] for s in by_id.values() if s.call == "malloc"}
    assert len(malloc_ips) == 1  # ip: malloc's entry, where the probe is
    ids = [s.sample_id for s in run.samples]
    assert len(set(ids)) == len(ids)
    leaked = {sid: addr for sid, addr in run.live.items() if sid in by_id}
    assert {(by_id[sid].call, by_id[sid].size) for sid in leaked} == LEAKED
    assert len(leaked) == len(LEAKED)
    assert set(leaked.values()) == {int(a, 16) for a in run.facts("leak")}


@pytest.mark.bpf
def test_every_call_sampled_exactly_with_its_stack(cbuild):
    run = Run(cbuild("heap_calls", *FLAGS), ["calls"], sample_bytes=1).run()
    check_exact(run)
    assert run.forks == [] and run.execs == [] and run.exits == [run.pid]


@pytest.mark.bpf
def test_two_processes_on_one_libc_each_exact(cbuild):
    """heap -p A -p B: each process's probes are attached for it alone, and a kernel that does
    not filter return probes by process (6.1, 6.12) runs both processes' return programs at
    every return. Each process is still sampled exactly, and its live blocks are exactly its
    leaks (posix_memalign(16)'s, whose malloc inside returns before the block is stored)."""
    run = Run(cbuild("heap_calls", *FLAGS), ["calls"], copies=2, sample_bytes=1).run()
    for index in range(2):
        check_exact(run.copy(index))
    assert sorted(run.exits) == sorted(run.bases)


@pytest.mark.bpf
def test_follow_forks_reports_fork_exec_exit_and_samples_the_child(cbuild):
    run = Run(cbuild("heap_calls", *FLAGS), ["calls", "fork"], sample_bytes=1, follow_forks=True).run()
    check_exact(run)
    (child,) = (int(c) for c in run.facts("child"))
    assert run.forks == [(run.pid, child)]  # the thread's clone is not a fork
    assert run.execs == [child]
    assert sorted(run.exits) == sorted([run.pid, child])
    assert [(s.call, s.size) for s in run.samples if s.pid == child and s.size == 12345] == [("malloc", 12345)]


@pytest.mark.bpf
def test_default_sampling_estimates_within_four_sd(cbuild):
    """N blocks of SIZE < mean: each is sampled independently with p = 1 - exp(-SIZE/mean)
    (the draws are memoryless), so the count is Binomial(N, p) and the weighted bytes
    estimate, samples * SIZE / p, has relative sd sqrt((1 - p) / (N p)) (~ sqrt(mean / total
    bytes) for SIZE << mean): both within 4 sd. Blocks >= mean are always sampled."""
    n, size, big = 25000, 40000, 600000
    run = Run(cbuild("heap_calls", *FLAGS), ["sample", str(n), str(size)]).run()
    assert set(run.drops.values()) == {0}
    p = -math.expm1(-size / DEFAULT_SAMPLE_BYTES)
    count = sum(1 for s in run.samples if s.pid == run.pid and s.size == size)
    sd = math.sqrt(n * p * (1 - p))
    assert abs(count - n * p) <= 4 * sd, (count, n * p, sd)
    estimate, truth = count * size / p, n * size
    rel_sd = math.sqrt((1 - p) / (n * p))
    assert abs(estimate / truth - 1) <= 4 * rel_sd, (estimate, truth, rel_sd)
    assert sum(1 for s in run.samples if s.pid == run.pid and s.size == big) == 3


@pytest.mark.bpf
def test_errors_are_one_line():
    gone = subprocess.Popen(["true"])
    gone.wait()
    with pytest.raises(ProcessGone):
        HeapSource({gone.pid})
    with pytest.raises(PymtraceError, match="stack bytes"):
        HeapSource({1}, stack_bytes=1000)
    c = HeapSource({2})  # kthreadd: maps nothing
    with pytest.raises(PymtraceError, match="maps no libc"):
        c.attach()


@pytest.mark.bpf
def test_not_root_is_one_error(tmp_path):
    """Run as an unprivileged user: attach() raises NotRootError (the CLI prints its one line)."""
    code = (
        "import os\n"
        "from pymtrace.sources.heap import HeapSource\n"
        "from pymtrace.errors import NotRootError\n"
        "try:\n"
        "    HeapSource({os.getpid()}).attach()\n"
        "except NotRootError as exc:\n"
        "    print('ERR', exc)\n"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.startswith("ERR ") and "needs root" in out.stdout, (out.stdout, out.stderr)
