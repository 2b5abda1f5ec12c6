"""`pymtrace heap` end to end on real processes whose calls and call chains the test knows
(workloads/heap_chains.c + heap_chains_lib.c, heap_cxx.cpp, all -O2 -fomit-frame-pointer), read
back by real clients: the folded text, `go tool pprof` for pprof, headless Chromium for html."""

import math
import os
import re
import subprocess
import time

import pytest
from support import heapchains
from support.allocators import LIBS, library
from support.cli import PYMTRACE, run_pymtrace
from support.clients import chromium, go_pprof, traces
from support.needs import missing_or_fail
from support.paths import WORKLOADS
from support.pychains import folded

from pymtrace.bpf import load as bpfload

pytestmark = pytest.mark.bpf

NO_FP = heapchains.NO_FP
CHAIN_BYTES = sum(100 + i % 8 for i in range(200))  # alpha;beta;leaf_alloc, all freed
OLD_LEAKS = (10, 40000)  # gamma_;lib_outer;lib_inner (libheapchain.so), leaked before the gap
YOUNG_LEAKS = (3, 9000)  # delta;young_leaf, leaked after the gap
THREAD_BYTES = sum(2500 + i for i in range(50))  # worker;thread_leaf, all freed


@pytest.fixture(scope="module")
def chains(build_dir):
    exe = heapchains.build(build_dir)
    cxx = build_dir / "heap_cxx"
    try:
        subprocess.run(["g++", *NO_FP, "-o", cxx, WORKLOADS / "heap_cxx.cpp"], check=True)
    except FileNotFoundError:
        missing_or_fail("g++ is not installed")
    return {"exe": exe, "cxx": str(cxx)}


def heap(out, *args, cmd=(), check=True, timeout=120):
    proc = run_pymtrace("heap", "-o", str(out), *args, *(("--", *cmd) if cmd else ()), timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


def value_of(stacks, pattern):
    """The value of the one stack matching PATTERN (a regex over the whole folded stack)."""
    found = [v for s, v in stacks.items() if re.fullmatch(pattern, s)]
    assert len(found) == 1, (pattern, stacks)
    return found[0]


MALLOC = heapchains.MALLOC
ROOT = heapchains.ROOT


def test_every_call_exact_per_chain_in_folded(chains, tmp_path):
    out = tmp_path / "a.folded"
    proc = heap(out, "--sample-bytes", "1", "--value", "alloc_space", cmd=(chains["exe"], "0"))
    got = folded(out)
    assert value_of(got, f"{ROOT};alpha;beta;leaf_alloc;{MALLOC}") == CHAIN_BYTES
    assert value_of(got, f"{ROOT};gamma_;lib_outer;lib_inner;{MALLOC}") == OLD_LEAKS[1]
    assert value_of(got, f"{ROOT};delta;young_leaf;{MALLOC}") == YOUNG_LEAKS[1]
    assert value_of(got, rf".*;worker;thread_leaf;{MALLOC}") == THREAD_BYTES
    # the workload exited before the report: every sample is still symbolized, complete
    m = re.search(r"samples: (\d+), complete root-to-leaf: (\d+)", proc.stderr)
    assert m and m.group(1) == m.group(2) and int(m.group(1)) >= 200 + 10 + 3 + 50
    assert "drops: none" in proc.stderr
    assert bpfload.own_uprobe_events() == []  # nothing left attached


def pprof_sums(path, value):
    """{the 3 frames above malloc, leaf first: value summed}: `go tool pprof -traces` lists each
    stack of distinct pcs apart (an unrolled loop has several call sites with the same names);
    malloc's own name is malloc or __libc_malloc (one address, the symbol table decides)."""
    sums = {}
    for frames, amount in traces(go_pprof(str(path), "-traces", f"-sample_index={value}", "-unit=B")).items():
        if frames[0] in ("malloc", "__libc_malloc"):
            sums[frames[1:4]] = sums.get(frames[1:4], 0) + amount
    return sums


def test_pprof_exact_in_go_tool_pprof_with_older(chains, tmp_path):
    out = tmp_path / "a.pb.gz"
    heap(out, "--sample-bytes", "1", "--older", "0.7", cmd=(chains["exe"], "1500"))
    chain, old, young = (
        ("leaf_alloc", "beta", "alpha"),
        ("lib_inner", "lib_outer", "gamma_"),
        ("young_leaf", "delta", "main"),
    )
    space = pprof_sums(out, "alloc_space")
    assert (space[chain], space[old], space[young]) == (CHAIN_BYTES, OLD_LEAKS[1], YOUNG_LEAKS[1])
    objects = pprof_sums(out, "alloc_objects")
    assert (objects[chain], objects[old], objects[young]) == (200, OLD_LEAKS[0], YOUNG_LEAKS[0])
    # in use, older than 0.7 s: the old leaks only (the young ones were made after the gap)
    inuse = pprof_sums(out, "inuse_space")
    assert (inuse[old], inuse.get(young, 0), inuse.get(chain, 0)) == (OLD_LEAKS[1], 0, 0)
    assert pprof_sums(out, "inuse_objects")[old] == OLD_LEAKS[0]
    # cumulative values are complete up to main: everything main's chains allocated
    top = go_pprof(str(out), "-top", "-cum", "-sample_index=alloc_space", "-unit=B", "-nodecount=100")
    main = re.search(r"^\s*\S+\s+\S+%\s+\S+%\s+(\d+)B\s+\S+%\s+main$", top, re.M)
    assert main and int(main.group(1)) >= CHAIN_BYTES + OLD_LEAKS[1] + YOUNG_LEAKS[1], top


def test_cxx_new_shows_its_caller_demangled(chains, tmp_path):
    out = tmp_path / "c.folded"
    heap(out, "--sample-bytes", "1", "--value", "alloc_objects", cmd=(chains["cxx"],))
    got = folded(out)
    new = r"operator new\(unsigned long\)"
    assert value_of(got, rf"{ROOT};shapes::build\(int\);{new};{MALLOC}") == 30
    # new[] reaches operator new by a tail call: its caller is still there
    assert value_of(got, rf"{ROOT};shapes::buffers\(int\);{new}(;{new})?;{MALLOC}") == 4
    inuse = tmp_path / "c2.folded"
    heap(inuse, "--sample-bytes", "1", "--value", "inuse_space", cmd=(chains["cxx"],))
    got = folded(inuse)
    assert value_of(got, rf"{ROOT};shapes::build\(int\);{new};{MALLOC}") == 5 * 48


def heap_by_pid(exe, out, *args, env=None):
    """`heap -p PID ARGS --duration 60 -o OUT` on heap_chains (EXE -w 0, its environment ENV)
    while it makes its calls, stopped with Ctrl-C once they are done: whether the process
    still ran after heap had ended."""
    target = subprocess.Popen([exe, "-w", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert target.stdout.readline() == b"ready\n"
        tracer = subprocess.Popen(
            [*PYMTRACE, "heap", "-p", str(target.pid), *args, "--duration", "60", "-o", str(out)],
            stderr=subprocess.PIPE,
            text=True,
        )
        line = tracer.stderr.readline()
        assert "sampling PID" in line, line
        target.stdin.write(b"go\n")
        target.stdin.flush()
        assert target.stdout.readline() == b"done\n"
        time.sleep(0.3)
        tracer.send_signal(2)  # Ctrl-C: write the profile, the process keeps running
        _, err = tracer.communicate(timeout=60)
        assert tracer.returncode == 0, err
        return target.poll() is None
    finally:
        target.stdin.close()
        target.wait(timeout=30)


def test_attach_by_pid_leaves_the_process_running(chains, tmp_path):
    out = tmp_path / "p.txt"
    assert heap_by_pid(chains["exe"], out, "--sample-bytes", "1")
    text = out.read_text()
    # text: in use by default, the leaks with their chains
    assert f"{OLD_LEAKS[1]} bytes in {OLD_LEAKS[0]} allocations from stack" in text
    assert re.search(r"lib_inner \[libheapchain\.so\]\n\s+lib_outer \[libheapchain\.so\]\n\s+gamma_", text)


def test_default_sampling_estimates_within_four_sd(chains, tmp_path):
    """A storm of N blocks of SIZE at --sample-bytes MEAN: the weighted alloc_space estimate of
    its stack within 4 standard deviations (relative sd ~ sqrt(MEAN / total bytes))."""
    n, size, mean = 60000, 4000, 65536
    out = tmp_path / "s.folded"
    heap(out, "--sample-bytes", str(mean), "--value", "alloc_space", cmd=(chains["exe"], "0", str(n), str(size)))
    estimate = value_of(folded(out), f"{ROOT};storm_leaf;{MALLOC}")
    total = n * size
    bound = 4 * math.sqrt(mean / total)
    assert abs(estimate / total - 1) < bound, (estimate, total, bound)


def test_html_opens_in_chromium_with_the_frames(chains, tmp_path):
    out = tmp_path / "h.html"
    heap(out, "--sample-bytes", "1", "--value", "alloc_space", cmd=(chains["exe"], "0"))
    dom = chromium(tmp_path, "--dump-dom", out.as_uri()).decode(errors="replace")
    for name in ("leaf_alloc", "lib_inner", "young_leaf", "thread_leaf"):
        assert name in dom, name
    shot = tmp_path / "h.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1000,700", out.as_uri())
    from PIL import Image

    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 20  # drawn frames, not a blank page


def test_errors_are_one_line(tmp_path):
    for args, message in (
        (["-p", "999999999", "-o", str(tmp_path / "x")], "999999999"),
        (["-o", str(tmp_path / "x")], "give -p PID"),
        (["--sample-bytes", "lots", "-o", str(tmp_path / "x"), "-p", "1"], "--sample-bytes"),
        (["--sample-bytes", "0", "-o", str(tmp_path / "x"), "--", "true"], "--sample-bytes must be from 1"),
        (["--stack-bytes", "5000", "-o", str(tmp_path / "x"), "--", "true"], "--stack-bytes must be a multiple"),
    ):
        proc = run_pymtrace("heap", *args)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    existing = tmp_path / "exists"
    existing.write_text("keep")
    proc = run_pymtrace("heap", "-o", str(existing), "--", "true")
    assert proc.returncode != 0 and "exists" in proc.stderr and existing.read_text() == "keep"


def test_a_jemalloc_process_gives_exact_chains(chains, tmp_path):
    """heap -p on a process whose malloc is jemalloc's (LD_PRELOADed) samples jemalloc's
    functions (target/allocators.py): with --sample-bytes 1 every chain exact in folded."""
    jemalloc = library(LIBS["jemalloc"])
    out = tmp_path / "j.folded"
    heap_by_pid(
        chains["exe"], out, "--sample-bytes", "1", "--value", "alloc_space", env=dict(os.environ, LD_PRELOAD=jemalloc)
    )
    got = folded(out)
    leaf = r"(je_)?malloc"  # jemalloc's own symbol names the leaf
    assert value_of(got, f"{ROOT};alpha;beta;leaf_alloc;{leaf}") == CHAIN_BYTES
    assert value_of(got, f"{ROOT};gamma_;lib_outer;lib_inner;{leaf}") == OLD_LEAKS[1]
    assert value_of(got, f"{ROOT};delta;young_leaf;{leaf}") == YOUNG_LEAKS[1]
    assert value_of(got, rf".*;worker;thread_leaf;{leaf}") == THREAD_BYTES


def test_a_command_on_a_preloaded_jemalloc_gives_exact_chains(chains, tmp_path):
    """`heap -- env LD_PRELOAD=libjemalloc.so.2 PROG`: env (on glibc) execs PROG, which is
    stopped once its loader has mapped jemalloc; jemalloc's functions are probed then, and
    with --sample-bytes 1 every chain is exact in folded."""
    jemalloc = library(LIBS["jemalloc"])
    out = tmp_path / "je.folded"
    proc = heap(
        out, "--sample-bytes", "1", "--value", "alloc_space", cmd=("env", f"LD_PRELOAD={jemalloc}", chains["exe"], "0")
    )
    assert "warning" not in proc.stderr
    got = folded(out)
    leaf = r"(je_)?malloc"
    assert value_of(got, f"{ROOT};alpha;beta;leaf_alloc;{leaf}") == CHAIN_BYTES
    assert value_of(got, f"{ROOT};gamma_;lib_outer;lib_inner;{leaf}") == OLD_LEAKS[1]
    assert value_of(got, f"{ROOT};delta;young_leaf;{leaf}") == YOUNG_LEAKS[1]
    assert value_of(got, rf".*;worker;thread_leaf;{leaf}") == THREAD_BYTES
    assert bpfload.own_uprobe_events() == []


def test_a_static_binary_is_refused_not_shown_empty(cbuild, tmp_path):
    """A process whose allocator heap cannot probe (a stripped static binary) gets one line,
    not an empty profile."""
    target = subprocess.Popen([cbuild("top_steady", "-static", "-s"), "10", "0", "pmt-static"], stdin=subprocess.PIPE)
    try:
        time.sleep(0.3)
        proc = run_pymtrace("heap", "-p", str(target.pid), "-o", str(tmp_path / "x.txt"))
    finally:
        target.kill()
        target.wait()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "static" in proc.stderr and "nothing to sample" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.txt").exists()


def test_output_is_private(chains, tmp_path):
    out = tmp_path / "a.folded"
    heap(out, "--sample-bytes", "1", cmd=(chains["exe"], "0"))
    assert os.stat(out).st_mode & 0o777 == 0o600
