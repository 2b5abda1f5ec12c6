"""`pymtrace heap -- CMD` sampled in-process by pymtrace's interposer (its sampling mode: the
draw in the process, a USDT probe only for sampled allocations and their frees), against
ground truth: the workloads' own counts (heap_chains' known chains, interpose_calls' COUNT
lines through threads, fork, exec, vfork and a signal handler) and the uprobe path on the
same program (`--via uprobes`). Commands the interposer cannot run in fall back to the uprobes
and say why; jemalloc preloaded behind the interposer is sampled there."""

import collections
import gzip
import math
import os
import re
import subprocess
import time

import pytest
from support import heapchains
from support.allocators import LIBS, library
from support.cli import PYMTRACE, run_pymtrace

from pymtrace.sinks import profile_pb2

pytestmark = pytest.mark.bpf

ROOT, MALLOC = heapchains.ROOT, heapchains.MALLOC
VALUES = ("alloc_objects", "alloc_space", "inuse_objects", "inuse_space")


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    return heapchains.build(tmp_path_factory.mktemp("chains"))


@pytest.fixture(scope="module")
def calls(cbuild):
    return cbuild("interpose_calls", "-ldl")


def heap(out, *args, cmd, check=True, **kw):
    proc = run_pymtrace("heap", "-o", out, *args, "--", *cmd, **kw)
    assert "Traceback" not in proc.stderr
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def stacks(path):
    """{frame names root first, joined by ';': {value name: value}} of a pprof file."""
    prof = profile_pb2.Profile()
    prof.ParseFromString(gzip.decompress(path.read_bytes()))
    names = {f.id: prof.string_table[f.name] for f in prof.function}
    locations = {loc.id: [names[line.function_id] for line in loc.line] for loc in prof.location}
    out = collections.defaultdict(lambda: dict.fromkeys(VALUES, 0))
    for sample in prof.sample:
        frames = [name for loc in sample.location_id for name in locations[loc]]
        entry = out[";".join(reversed(frames))]
        for name, value in zip(VALUES, sample.value):
            entry[name] += value
    return dict(out)


def matching(found, pattern, value):
    return sum(v[value] for s, v in found.items() if re.fullmatch(pattern, s))


def by_size(found):
    """{block size: (allocations, in use)} over stacks that allocated one size."""
    out = collections.Counter(), collections.Counter()
    for v in found.values():
        if v["alloc_objects"]:
            size = v["alloc_space"] // v["alloc_objects"]
            out[0][size] += v["alloc_objects"]
            out[1][size] += v["inuse_objects"]
    return out


def test_every_call_the_same_as_the_uprobe_path(chains, tmp_path):
    """--sample-bytes 1 on heap_chains (-O2, no frame pointers): every stack with the same
    four values on both paths, the known chains exact (the leaks in use, the rest freed);
    only pthread's DTV is larger under the interposer (its TLS is one more module)."""
    got = {}
    for via in ("interposer", "uprobes"):
        out = tmp_path / f"{via}.pb.gz"
        proc = heap(out, "--sample-bytes", "1", "--via", via, cmd=(chains, "0"))
        first = proc.stderr.splitlines()[0]
        assert f"via {via}" in first and ("(--via uprobes)" in first) == (via == "uprobes"), first
        assert re.search(rf"traced: pid \d+: {via}", proc.stderr) and "drops: none" in proc.stderr
        got[via] = stacks(out)
    dtv = re.compile(r".*;_dl_allocate_tls;.*")
    for name, values in got["uprobes"].items():
        theirs = got["interposer"].get(name)
        assert theirs is not None, name
        same = VALUES if not dtv.fullmatch(name) else ("alloc_objects", "inuse_objects")
        assert {v: theirs[v] for v in same} == {v: values[v] for v in same}, name
    assert set(got["interposer"]) == set(got["uprobes"])
    fast = got["interposer"]
    for pattern, calls, size in heapchains.CHAINS.values():
        assert matching(fast, pattern, "alloc_objects") == calls
        assert matching(fast, pattern, "alloc_space") == size
    assert matching(fast, heapchains.CHAINS["gamma"][0], "inuse_space") == 40000  # leaked
    assert matching(fast, heapchains.CHAINS["delta"][0], "inuse_objects") == 3
    assert matching(fast, heapchains.CHAINS["alpha"][0], "inuse_objects") == 0  # freed


def test_default_sampling_within_four_sd(chains, tmp_path):
    """The default sampling (512 KiB) drawn in the process: 60,000 blocks of 4000 bytes
    estimated within 4 sd (relative sd ~ sqrt(mean / total bytes), docs/heap.md)."""
    n, size, mean = 60000, 4000, 524288
    out = tmp_path / "s.pb.gz"
    proc = heap(out, cmd=(chains, "0", str(n), str(size)))
    assert "via interposer" in proc.stderr.splitlines()[0]
    estimate = matching(stacks(out), rf"{ROOT};storm_leaf;{MALLOC}", "alloc_space")
    total = n * size
    assert abs(estimate / total - 1) < 4 * math.sqrt(mean / total), (estimate, total)


def truth(stdout):
    """{size: allocations} of interpose_calls' COUNT lines (type 1: malloc)."""
    found = collections.Counter()
    for line in stdout.splitlines():
        if line.startswith("COUNT "):
            _pid, kind, size, n = map(int, line.split()[1:])
            if kind == 1:
                found[size] += n
    return found


@pytest.mark.parametrize(
    "mode, follow, absent",
    [
        (["threads", "2"], False, ()),
        (["fork"], True, ()),
        (["fork"], False, (2002,)),  # the child, not followed
        (["exec"], False, ()),  # the same process's next image
        (["vfork"], True, ()),  # the child execs itself: followed into its new image
        (["vfork"], False, (4004,)),
        (["signal", "300"], False, ()),  # a handler's malloc+free
    ],
)
def test_processes_threads_and_handlers_exact(calls, tmp_path, mode, follow, absent):
    """--sample-bytes 1: each size group's allocations exactly the workload's own count, in
    the processes heap follows, none in those it does not; every block freed (the exec'd
    image's leaks gone with it) is not in use."""
    out = tmp_path / "p.pb.gz"
    args = ("--sample-bytes", "1") + (("--follow-forks",) if follow else ())
    proc = heap(out, *args, cmd=(calls, *mode))
    assert "via interposer" in proc.stderr.splitlines()[0] and "drops: none" in proc.stderr
    allocated, inuse = by_size(stacks(out))
    want = truth(proc.stdout)
    assert want
    for size, n in want.items():
        assert allocated[size] == (0 if size in absent else n), (size, allocated)
        assert inuse[size] == 0, size


@pytest.mark.parametrize(
    "mode, follow",
    [(["threads", "4"], False), (["fork"], True), (["exec"], False), (["signal", "300"], False)],
)
def test_a_full_ring_makes_the_program_wait_never_drop(calls, tmp_path, mode, follow):
    """A 512 KiB ring holds a few samples: the probes of threads, of a followed child, of an
    exec'd image and of signal handlers wait for heap to read it, and every allocation is
    still there exactly, none dropped (an emulated VM takes minutes: each wait is a read)."""
    out = tmp_path / "p.pb.gz"
    args = ("--sample-bytes", "1", "--ring-bytes", "512K") + (("--follow-forks",) if follow else ())
    proc = heap(out, *args, cmd=(calls, *mode), timeout=900)
    assert "drops: none" in proc.stderr, proc.stderr
    if mode[0] != "signal":  # (handlers allocate one at a time, as signals come)
        assert re.search(r"waits for room in the ring: [1-9]", proc.stderr), proc.stderr
    allocated, inuse = by_size(stacks(out))
    want = truth(proc.stdout)
    assert want
    for size, n in want.items():
        assert allocated[size] == n and inuse[size] == 0, (size, allocated)


@pytest.mark.parametrize("stop", ["sigkill", "duration"])
def test_a_waiting_program_goes_on_when_heap_stops(chains, tmp_path, stop):
    """heap SIGKILLed (a zombie until this test reaps it), or done after --duration, while the
    program waits for room in a tiny ring: the program goes on to its end unsampled (a waiting
    probe sees heap gone or stopped) and prints what it prints."""
    out = tmp_path / "p.pb.gz"
    extra = ("--duration", "2") if stop == "duration" else ()
    cmd = (*PYMTRACE, "heap", "-o", out, "--sample-bytes", "1", "--ring-bytes", "64K", *extra)
    proc = subprocess.Popen(
        (*cmd, "--", chains, "0", "300000", "64"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert "sampling" in proc.stderr.readline()
    if stop == "sigkill":
        time.sleep(2)
        proc.kill()
    stdout, stderr = proc.communicate(timeout=120)  # until the program's end too: it holds the pipe
    assert stdout.endswith("done\n"), stderr
    if stop == "duration":
        assert proc.returncode == 0 and "drops: none" in stderr and out.exists(), stderr


def test_jemalloc_preloaded_behind_the_interposer(chains, tmp_path):
    """LD_PRELOAD=libjemalloc.so.2 in heap's environment: the command preloads the interposer,
    then jemalloc, which its calls go on to; every chain exact, jemalloc's malloc the leaf."""
    jemalloc = library(LIBS["jemalloc"])
    out = tmp_path / "je.pb.gz"
    proc = heap(out, "--sample-bytes", "1", cmd=(chains, "0"), env=dict(os.environ, LD_PRELOAD=jemalloc))
    assert "via interposer" in proc.stderr.splitlines()[0]
    found = stacks(out)
    for pattern, calls, size in heapchains.CHAINS.values():
        pattern = pattern.replace(MALLOC, "(je_)?malloc")
        assert (matching(found, pattern, "alloc_objects"), matching(found, pattern, "alloc_space")) == (calls, size)


def test_an_image_without_the_interposer_falls_back_to_uprobes(chains, tmp_path):
    """`env -u LD_PRELOAD PROG`: env runs with the interposer, PROG (the same process, exec'd)
    without it: PROG is sampled by uprobes, the report says so and why, every chain exact."""
    out = tmp_path / "env.pb.gz"
    proc = heap(out, "--sample-bytes", "1", cmd=("env", "-u", "LD_PRELOAD", chains, "0"))
    assert "via interposer" in proc.stderr.splitlines()[0]
    assert re.search(r"traced: pid \d+: uprobes \(.*LD_PRELOAD no longer names the interposer", proc.stderr)
    found = stacks(out)
    for pattern, calls, _ in heapchains.CHAINS.values():
        assert matching(found, pattern, "alloc_objects") == calls


def test_own_malloc_falls_back_to_uprobes_saying_why(cbuild, tmp_path):
    """An executable defining malloc itself (its definition wins over a preload): sampled by
    uprobes on its own functions, the first line and the report naming why; its worker's calls
    counted as it counts them."""
    prog = cbuild("top_calls_own")
    out = tmp_path / "own.pb.gz"
    proc = heap(out, "--sample-bytes", "1", cmd=(prog,), input="ab")
    why = f"{prog}: defines malloc itself"
    assert f"via uprobes ({why}" in proc.stderr.splitlines()[0]
    assert re.search(rf"traced: pid \d+: uprobes \({re.escape(why)}", proc.stderr)
    did = __import__("json").loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))["calls"]
    found = stacks(out)
    worker = matching(found, r".*;worker;[^;]+", "alloc_objects")
    assert worker == sum(did[k] for k in ("malloc", "calloc", "realloc", "memalign", "posix_memalign", "valloc"))


def test_a_static_binary_is_refused_naming_why(cbuild, tmp_path):
    prog = cbuild("top_steady", "-static")
    proc = heap(tmp_path / "x.txt", cmd=(prog, "1", "0", "pmt"), check=False)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "static" in proc.stderr and "no dynamic loader runs to preload" in proc.stderr
    assert not (tmp_path / "x.txt").exists()


def test_via_interposer_needs_a_launched_command(tmp_path):
    proc = run_pymtrace("heap", "--via", "interposer", "-p", "1", "-o", tmp_path / "x")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "--via interposer samples a launched command" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
