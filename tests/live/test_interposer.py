"""pymtrace's LD_PRELOAD interposer (pymtrace/tracee/native/interpose.c) and its ring consumer
(pymtrace.sources.interposer) on real processes, against exact ground truth: the workloads'
own record of what they called (tests/support/workloads/interpose_calls.c, record_calls.c,
top_calls.c, cxx_calls.cpp) and the tests' own LD_PRELOAD counter (preload_counter.c).
Threads, fork (followed and not), exec, vfork+exec, a signal handler that allocates, a
dlopen'ed library, C++ operator new/delete, jemalloc preloaded behind it; a full ring makes
threads wait and loses nothing; commands it cannot preload are named with the reason."""

import collections
import json
import os
import shutil
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from support.allocators import LIBS, library
from support.cli import run_pymtrace
from support.interposer import build_counter, counter_counts, run_interposed, truth
from support.needs import missing_or_fail
from support.paths import ROOT, WORKLOADS
from support.recording import ground_truth, text_range

from pymtrace.sources import interposer as I
from pymtrace.trace.formats import mtrace_bin as B

TYPES = ("malloc", "calloc", "free", "realloc", "memalign", "valloc", "pvalloc", "posix_memalign")


@pytest.fixture(scope="module")
def calls(cbuild):
    """interpose_calls, non-PIE: callers inside its text are its own calls."""
    return cbuild("interpose_calls", "-no-pie", "-ldl")


def program_calls(run, lo, hi):
    """{(pid, type, size): calls} made from [LO, HI) (None: from anywhere); a free counted
    with the size its block was allocated with, its pointer followed through each process's
    records in order."""
    found = collections.Counter()
    for pid, recs in run.records.items():
        live = {}
        for r in recs:
            kind, ptr1, ptr2, size = int(r["type"]), int(r["ptr1"]), int(r["ptr2"]), int(r["size"])
            if kind == B.FREE:
                size = live.pop(ptr1, 0)
            elif kind == B.REALLOC:
                live.pop(ptr1, None)
            if kind != B.FREE and ptr2:
                live[ptr2] = size
            if lo is None or lo <= int(r["caller"]) < hi:
                found[(pid, kind, size)] += 1
    return found


@pytest.mark.parametrize("mode", [["threads", "3"], ["fork"], ["exec"], ["vfork"], ["signal", "300"]])
def test_every_call_recorded_exactly(calls, mode):
    run = run_interposed([calls, *mode])
    assert run.proc.returncode == 0, run.proc.stderr
    want = truth(run.proc.stdout)
    assert want
    lo, hi = text_range(calls)
    assert program_calls(run, lo, hi) == want
    assert all(s.done and s.torn == 0 and not s.detached for s in run.stats)
    assert sum(s.records for s in run.stats) == len(run.all())
    pids = {pid for pid, _, _ in want}
    assert set(run.records) == pids  # a ring for every process, its records under its own pid
    for recs in run.records.values():
        for tid in set(recs["thread"]):  # each thread's records in its call order
            ts = recs["ts"][recs["thread"] == tid]
            assert (ts[1:] >= ts[:-1]).all()


def test_times_are_clock_monotonic_ns(calls):
    """Whether stamped from the time stamp counter (then converted) or clock_gettime, every
    record's time is CLOCK_MONOTONIC ns within the run."""
    before = time.monotonic_ns()
    run = run_interposed([calls, "threads", "2"])
    after = time.monotonic_ns()
    ts = run.all()["ts"]
    assert len(ts) > 16000 and before <= ts.min() and ts.max() <= after


def test_exec_registers_a_new_ring(calls):
    run = run_interposed([calls, "exec"])
    assert [(s.pid, s.generation) for s in run.stats] == [(run.stats[0].pid, 0), (run.stats[0].pid, 1)]
    assert [s.records >= n for s, n in zip(run.stats, (30, 80))] == [True, True]


def test_each_exec_takes_a_higher_generation():
    """A process that execs again after its earlier rings were drained and retired: each
    image a new, higher generation (a retired ring's name is kept), none retired early."""
    script = 'sleep 0.2; exec sh -c "sleep 0.2; exec sh -c \\"sleep 0.2; exec true\\""'
    run = run_interposed(["sh", "-c", script])
    assert run.proc.returncode == 0, run.proc.stderr
    pid = max(run.stats, key=lambda s: s.generation).pid  # (each sleep is a process of its own)
    images = [s for s in run.stats if s.pid == pid]
    assert [s.generation for s in images] == [0, 1, 2, 3]
    assert all(s.done and s.torn == 0 for s in images)
    assert all(s.records for s in images[:3])  # the shells allocate (true makes no call)


def test_signal_handler_records_survive_interrupted_writes(calls):
    """The handler's malloc/free land between the main thread's free(NULL) writes; some of
    them interrupt a write (deferred), none is lost."""
    run = run_interposed([calls, "signal", "1000"])
    assert run.proc.returncode == 0, run.proc.stderr
    lo, hi = text_range(calls)
    assert program_calls(run, lo, hi) == truth(run.proc.stdout)
    print("deferred:", sum(s.deferred for s in run.stats), "waits:", sum(s.waits for s in run.stats))


def test_two_nesting_signal_handlers_keep_every_record_in_order(calls):
    """A SIGALRM and a SIGPROF handler that each malloc and free, interrupting the main
    thread's writes and each other: every call recorded once, and each handler block freed
    after it was allocated, never allocated twice while live (no buffer slot shared)."""
    run = run_interposed([calls, "signals2", "3000"])
    assert run.proc.returncode == 0, run.proc.stderr
    lo, hi = text_range(calls)
    want = truth(run.proc.stdout)
    assert any(size == 6116 for _, _, size in want)  # SIGPROF fired too
    assert program_calls(run, lo, hi) == want
    recs = run.all()
    live = set()
    sizes = {}
    for r in recs:
        t, p1, p2 = int(r["type"]), int(r["ptr1"]), int(r["ptr2"])
        if t == B.MALLOC and int(r["size"]) in (6006, 6116):
            assert p2 not in live
            live.add(p2)
            sizes[p2] = int(r["size"])
        elif t == B.FREE and p1 in sizes:
            assert p1 in live
            live.discard(p1)
    assert not live


@pytest.mark.parametrize("mode", ["fork", "vfork"])
def test_not_following_forks_records_the_parent_alone(calls, mode):
    run = run_interposed([calls, mode], I.RingOptions(follow=False))
    assert run.proc.returncode == 0, run.proc.stderr
    want = truth(run.proc.stdout)
    parent = min(pid for pid, _, _ in want)
    assert set(run.records) == {parent}
    lo, hi = text_range(calls)
    assert program_calls(run, lo, hi) == {k: n for k, n in want.items() if k[0] == parent}


def test_not_following_forks_still_follows_exec(calls):
    run = run_interposed([calls, "exec"], I.RingOptions(follow=False))
    lo, hi = text_range(calls)
    assert program_calls(run, lo, hi) == truth(run.proc.stdout)


def test_dlopened_library_calls(calls, build_dir):
    lib = build_dir / "libinterpose_lib.so"
    src = WORKLOADS / "interpose_lib.c"
    subprocess.run(["gcc", "-O1", "-fno-builtin", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    run = run_interposed([calls, "dlopen", str(lib)])
    assert run.proc.returncode == 0, run.proc.stderr
    want = truth(run.proc.stdout)
    got = program_calls(run, None, None)
    assert {k: got[k] for k in want} == want


def test_errno_is_kept(calls):
    run = run_interposed([calls, "errno"])
    assert run.proc.returncode == 0 and "ERRNO ok" in run.proc.stdout


def test_record_calls_exact_records_with_chunk_sizes(cbuild):
    """Every field of every call record_calls makes (and prints), glibc chunk sizes included;
    what else is recorded is libc's own (thread set-up), never attributed to the program."""
    prog = cbuild("record_calls", "-no-pie")
    run = run_interposed([prog])
    assert run.proc.returncode == 0, run.proc.stderr
    (pid,) = run.records
    recs = run.records[pid]
    mine = collections.Counter(
        tuple(int(r[f]) for f in ("thread", "type", "ptr1", "ptr2", "size", "size2", "size3")) for r in recs
    )
    want = collections.Counter(ground_truth(run.proc.stdout))
    assert not want - mine
    lo, hi = text_range(prog)
    extra = mine - want
    own = [r for r in recs if lo <= r["caller"] < hi]
    assert len(own) == sum(want.values())
    assert sum(extra.values()) == len(recs) - len(own)
    assert [s.pid for s in run.stats] == [pid]
    assert run.stats[0].glibc_chunks and run.stats[0].allocator.endswith("libc.so.6")


def test_counts_equal_an_ld_preload_counter(cbuild, build_dir, tmp_path):
    """Per call type, per process, over whole runs (start-up and exit included): the tests'
    own LD_PRELOAD counter, in front of the interposer, saw exactly what it recorded; on the
    workload and on a real compile (gcc, which runs cc1 and as)."""
    counter = build_counter(build_dir)
    prog = cbuild("interpose_calls", "-no-pie", "-ldl")
    compile_c = ["gcc", "-O2", "-c", str(WORKLOADS / "record_calls.c"), "-o", str(tmp_path / "rc.o")]
    for argv in ([prog, "threads", "2"], [prog, "fork"], [prog, "signal", "200"], compile_c):
        d = tmp_path / str(len(os.listdir(tmp_path)))
        d.mkdir()
        env = dict(os.environ, COUNTER_DIR=str(d))
        run = run_interposed(argv, env=env, preload_first=counter)
        assert run.proc.returncode == 0, run.proc.stderr
        counted = counter_counts(d)
        assert counted == {pid: run.counts(pid) for pid in run.records}, argv
        assert len(counted) == (3 if argv is compile_c else 2 if "fork" in argv else 1)  # gcc, cc1, as


def _cxx(tmp_path):
    if shutil.which("g++") is None:
        missing_or_fail("g++ is not installed")
    prog = tmp_path / "cxx_calls"
    src = WORKLOADS / "cxx_calls.cpp"
    subprocess.run(["g++", "-O1", "-std=c++17", "-fsized-deallocation", "-no-pie", "-o", prog, src], check=True)
    return str(prog)


def test_cxx_new_and_delete_every_variant(tmp_path, build_dir):
    """new, new[], nothrow -> malloc; aligned new -> memalign; every delete -> free; the
    malloc/free inside (and new[] -> new) not recorded again; the counter agrees."""
    prog = _cxx(tmp_path)
    d = tmp_path / "counts"
    d.mkdir()
    run = run_interposed(
        [prog], env=dict(os.environ, COUNTER_DIR=str(d)), input="xx", preload_first=build_counter(build_dir)
    )
    assert run.proc.returncode == 0, run.proc.stderr
    c = json.loads(run.proc.stdout.splitlines()[-1])["calls"]
    (pid,) = run.records
    counted = counter_counts(d)
    assert counted == {pid: run.counts(pid)}
    # without the counter in front, the callers are the program's own
    run = run_interposed([prog], input="xx")
    lo, hi = text_range(prog)
    (recs,) = run.records.values()
    own = collections.Counter(int(r["type"]) for r in recs if lo <= r["caller"] < hi)
    assert own == {
        B.MALLOC: c["new"] + c["new_array"] + c["new_nothrow"],
        B.MEMALIGN: c["new_aligned"],
        B.FREE: sum(c[k] for k in ("delete", "delete_array", "delete_sized", "delete_aligned")),
    }
    aligned = recs[(recs["type"] == B.MEMALIGN) & (recs["caller"] >= lo) & (recs["caller"] < hi)]
    assert (aligned["size2"] == 64).all()  # the alignment, as record writes it


def test_throwing_new_unwinds_through_the_wrapper(tmp_path):
    """bad_alloc thrown from inside the wrapped operator new[] reaches the program's catch, and
    the thread's calls after it are recorded (the nesting depth was restored on the way out).
    Nothing is recorded for a new that threw, but the exception object the runtime allocated
    inside it is (its free, by __cxa_end_catch, a tail call, has the program's call site)."""
    if shutil.which("g++") is None:
        missing_or_fail("g++ is not installed")
    prog = tmp_path / "cxx_throw"
    subprocess.run(["g++", "-O1", "-no-pie", "-o", prog, WORKLOADS / "cxx_throw.cpp"], check=True)
    run = run_interposed([str(prog)])
    assert (run.proc.returncode, run.proc.stdout) == (0, "caught 3\n"), run.proc.stderr
    lo, hi = text_range(str(prog))
    (recs,) = run.records.values()
    own = recs[(recs["caller"] >= lo) & (recs["caller"] < hi)]
    assert collections.Counter(int(r["size"]) for r in own if r["type"] == B.MALLOC) == {100: 10}
    assert collections.Counter(int(t) for t in own["type"]) == {B.MALLOC: 10, B.FREE: 13}
    exception_frees = {int(r["ptr1"]) for r in own if r["type"] == B.FREE} - {
        int(r["ptr2"]) for r in own if r["type"] == B.MALLOC
    }
    allocated = {int(r["ptr2"]) for r in recs if r["type"] == B.MALLOC}
    assert exception_frees and exception_frees <= allocated  # every block freed was recorded


def test_jemalloc_preloaded_behind_it(cbuild):
    """LD_PRELOAD=jemalloc in the command's environment: the interposer comes first and
    forwards to jemalloc; every call of top_calls recorded, no glibc chunk sizes."""
    lib = library(LIBS["jemalloc"])
    prog = cbuild("top_calls", "-DANY_ALLOCATOR", "-no-pie")
    run = run_interposed([prog], env=dict(os.environ, LD_PRELOAD=lib), input="xx")
    assert run.proc.returncode == 0, run.proc.stderr
    tally = json.loads(run.proc.stdout.splitlines()[-1])
    lo, hi = text_range(prog)
    (recs,) = run.records.values()
    own = collections.Counter(int(r["type"]) for r in recs if lo <= r["caller"] < hi)
    assert {n: own[getattr(B, n.upper())] for n in TYPES} == {n: tally["calls"].get(n, 0) for n in TYPES}
    (stats,) = run.stats
    assert "jemalloc" in stats.allocator and not stats.glibc_chunks
    assert (recs["size3"] == 0).all()


def test_a_full_ring_makes_threads_wait_and_loses_nothing(calls):
    run = run_interposed([calls, "threads", "4"], I.RingOptions(slots=1024), stall=0.3, drain_every=0.01)
    assert run.proc.returncode == 0, run.proc.stderr
    lo, hi = text_range(calls)
    assert program_calls(run, lo, hi) == truth(run.proc.stdout)
    assert sum(s.waits for s in run.stats) > 0


def test_closing_the_consumer_releases_a_waiting_program(calls):
    """A program blocked on a full ring goes on, untraced, once the consumer closes."""
    rings = I.RingSet(I.RingOptions(slots=1024))
    proc = subprocess.Popen([calls, "threads", "2"], env=rings.env(os.environ), stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    assert proc.poll() is None  # blocked: nobody drains
    rings.drain()  # finds the ring (and makes a little room)
    assert sum(s.waits for s in rings.stats()) > 0
    rings.close()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert truth(out)


def test_a_vanished_consumer_releases_a_waiting_program(calls):
    """The consumer's process is gone (PYMTRACE_RING names a dead pid as its owner): a producer
    waiting on a full ring stops recording instead of hanging."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    rings = I.RingSet(I.RingOptions(slots=1024))
    try:
        env = dict(rings.env(os.environ))
        env[I.ENV] = I.ring_variable(dead.pid, True, rings.options.slots, rings.directory)
        proc = subprocess.run([calls, "threads", "2"], env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0
        rings.drain()
        assert all(s.detached for s in rings.stats())
    finally:
        rings.close()


@pytest.mark.parametrize(
    "argv",
    [
        ["sh", "-c", "echo out; echo err >&2; exit 3"],
        ["sh", "-c", "kill -TERM $$"],
        [sys.executable, "-c", "import json, sys; print(json.dumps([{'a': list(range(9))}] * 3)); sys.exit(7)"],
    ],
)
def test_the_program_computes_the_same(argv):
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    run = run_interposed(argv)
    assert (run.proc.returncode, run.proc.stdout, run.proc.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert run.records  # and it was recorded


def test_preloadable_commands():
    assert I.not_preloadable(["sh"]) is None
    assert I.not_preloadable([sys.executable]) is None
    assert "not found" in I.not_preloadable(["no-such-command-here"])


def test_script_is_judged_by_its_interpreter(tmp_path):
    script = tmp_path / "s"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    assert I.not_preloadable([str(script)]) is None


def test_static_binary_is_not_preloadable(tmp_path):
    prog = tmp_path / "static"
    src = WORKLOADS / "interpose_calls.c"
    r = subprocess.run(["gcc", "-O1", "-static", "-o", prog, src], capture_output=True, text=True)
    if r.returncode != 0:
        missing_or_fail(f"no static libc to link with: {r.stderr[-200:]}")
    why = I.not_preloadable([str(prog), "after"])
    assert why == f"{prog}: a static binary, no dynamic loader runs to preload a library"
    run = run_interposed([str(prog), "after"])  # runs as ever, and nothing is recorded
    assert run.proc.returncode == 0 and truth(run.proc.stdout)
    assert not run.records and not run.stats


def test_executable_defining_malloc_is_not_preloadable(cbuild):
    prog = cbuild("top_calls_own")
    assert I.not_preloadable([prog]) == f"{prog}: defines malloc itself, its definition wins over a preloaded one"


def test_executable_calling_jemallocs_own_api_is_not_preloadable(tmp_path):
    """mallocx/sdallocx go to jemalloc past the interposer: such a program is left to uprobes."""
    lib = library(LIBS["jemalloc"])
    src = tmp_path / "x.c"
    src.write_text(
        "#include <stddef.h>\nvoid *mallocx(size_t, int); void sdallocx(void *, size_t, int);\n"
        "int main(void) { void *p = mallocx(10, 0); sdallocx(p, 10, 0); return 0; }\n"
    )
    prog = tmp_path / "x"
    subprocess.run(["gcc", "-o", prog, src, lib], check=True)
    assert I.not_preloadable([str(prog)]) == (
        f"{prog}: calls an allocator's own API (mallocx, sdallocx), which the interposer does not wrap"
    )


def test_setuid_to_another_user_is_not_preloadable(calls, tmp_path):
    prog = tmp_path / "suid"
    shutil.copy(calls, prog)
    os.chown(prog, 65534, 65534)
    prog.chmod(0o4755)
    assert I.not_preloadable([str(prog)]) == (
        f"{prog}: setuid/setgid, the dynamic loader ignores LD_PRELOAD for it (secure mode)"
    )


def test_32bit_program_is_not_preloadable(tmp_path):
    prog = tmp_path / "m32"
    r = subprocess.run(["gcc", "-m32", "-o", prog, WORKLOADS / "interpose_lib.c", "-shared"], capture_output=True)
    if r.returncode != 0:
        pytest.skip("gcc cannot build 32-bit code here (no multilib)")
    assert "not a 64-bit x86-64 program" in I.not_preloadable([str(prog)])


def test_ring_files_are_private():
    rings = I.RingSet()
    try:
        st = os.stat(rings.directory)
        assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.geteuid()
        proc = subprocess.Popen(["sh", "-c", "read x"], env=rings.env(os.environ), stdin=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not [n for n in os.listdir(rings.directory) if n.startswith(f"{proc.pid}.")]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (name,) = [n for n in os.listdir(rings.directory) if n.startswith(f"{proc.pid}.")]
        st = os.lstat(os.path.join(rings.directory, name))
        assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
        proc.communicate(b"\n", timeout=30)
    finally:
        rings.close()
    assert not os.path.exists(rings.directory)


def test_planted_symlinks_are_not_followed(calls, tmp_path):
    """A symlink planted in the ring directory where the library opens a file of a known name
    (`root`, not following forks) is neither followed nor replaced (O_EXCL|O_NOFOLLOW: the
    process is then not traced, rather than write through it); one with a ring's name is not
    opened by the consumer. The targets are untouched."""
    target = tmp_path / "target"
    target.write_text("untouched")
    rings = I.RingSet(I.RingOptions(follow=False))
    try:
        os.symlink(target, os.path.join(rings.directory, "root"))
        os.symlink(target, os.path.join(rings.directory, "1.1"))
        proc = subprocess.run([calls, "threads", "1"], env=rings.env(os.environ), capture_output=True, text=True)
        assert proc.returncode == 0 and truth(proc.stdout)
        assert not rings.drain() and not rings.stats()
    finally:
        rings.close()
    assert target.read_text() == "untouched"


@pytest.mark.bpf
def test_same_records_as_the_uprobe_path(cbuild, tmp_path):
    """`record -- PROG` (uprobes) and the interposer on the same program: as many calls of
    each type, and the program's own the same, type and requested size. (Chunk sizes depend
    on where each thread's arena put a block, and libc's per-thread calloc grows with the
    number of libraries holding thread-local data, the interposer one of them.)"""
    prog = cbuild("record_calls", "-no-pie")
    lo, hi = text_range(prog)
    out = tmp_path / "trace"
    r = run_pymtrace("record", "-q", "-o", out, "--", prog)
    assert r.returncode == 0, r.stderr
    uprobes = list(B.read_file(out))
    run = run_interposed([prog])
    (recs,) = run.records.values()
    assert collections.Counter(rec.type for rec in uprobes) == collections.Counter(int(t) for t in recs["type"])
    own = collections.Counter((rec.type, rec.size) for rec in uprobes if lo <= rec.caller < hi)
    mine = collections.Counter((int(r["type"]), int(r["size"])) for r in recs if lo <= r["caller"] < hi)
    assert mine == own and sum(own.values()) > 300


def _stress(cbuild, lib=None):
    """interpose_stress: 3 waves of 8 threads, 20,000 pairs each, through a 1024-slot ring
    (wrapping some 900 times, threads waiting on it): each thread's records are exactly its
    calls, in its order."""
    prog = cbuild("interpose_stress")
    run = run_interposed([prog, "3", "8", "20000"], I.RingOptions(slots=1024), lib=lib)
    assert run.proc.returncode == 0, run.proc.stderr
    (recs,) = run.records.values()
    mallocs = recs[(recs["type"] == B.MALLOC) & (recs["size"] >= 1 << 20)]
    seen = set()
    for tid in np.unique(mallocs["thread"]):
        sizes = mallocs["size"][mallocs["thread"] == tid]
        j = int(sizes[0]) >> 20
        assert (sizes == (j << 20) + np.arange(1, 20001, dtype=np.uint64)).all()
        seen.add(j)
    assert seen == set(range(1, 24))  # thread 0's sizes start below 1 MiB: checked apart
    frees = recs[recs["type"] == B.FREE]
    assert len(frees) >= 24 * 20000
    assert sum(s.waits for s in run.stats) > 0 and all(s.torn == 0 for s in run.stats)
    return run


def test_ring_under_many_racing_threads(cbuild):
    _stress(cbuild)


def test_ring_under_many_racing_threads_with_ubsan(cbuild, build_dir):
    """The same race with the library built with the undefined-behaviour sanitizer (aborting
    on the first report: an ASan build cannot interpose malloc, ASan does it itself)."""
    lib = build_dir / "interpose-ubsan.so"
    native = ROOT / "pymtrace" / "tracee" / "native"
    r = subprocess.run(
        ["gcc", *I.CFLAGS, "-g", "-fsanitize=undefined", "-fno-sanitize-recover=all", "-shared", "-fPIC",
         "-I", str(ROOT / "bpf"), "-o", str(lib), str(native / "interpose.c"), *I.LIBS],
        capture_output=True, text=True,
    )  # fmt: skip
    if r.returncode != 0:
        missing_or_fail(f"no UBSan runtime: {r.stderr[-300:]}")
    run = _stress(cbuild, str(lib))
    assert "runtime error" not in run.proc.stderr
