"""Start-up: a command compiles everything it loads in ONE BCC compile,
before it attaches any uprobe (a compile under pymtrace's own malloc uprobes runs many times
slower: BCC's clang is one of the processes they trap), and compiles nothing it does not use.

Not timed (bench/startup.py measures the time). The commands run as users run them, with a
sitecustomize that reports every bcc.BPF() compile (which programs: found by their map
names) and every uprobe attached, in order."""

import json
import os
import subprocess
import time

import pytest
from support.cli import run_pymtrace

SITECUSTOMIZE = '''
import sys
try:
    import bcc
except ImportError:
    bcc = None
if bcc is not None and hasattr(bcc, "BPF"):
    _MARKERS = (("malloc_stats", b"ms_stats"), ("faults", b"pf_totals"), ("slab", b"slab_stats"),
                ("glibc_usdt", b"glibc_pid_stats"), ("record", b"record_event"))
    _init, _attach = bcc.BPF.__init__, bcc.BPF.attach_uprobe

    def _counting_init(self, *args, **kw):
        text = kw.get("text") or b""
        text = text.encode() if isinstance(text, str) else text
        found = [name for name, marker in _MARKERS if marker in text]
        print("bcc-test: compile " + ",".join(found), file=sys.stderr, flush=True)
        _init(self, *args, **kw)
        n = bcc.lib.bpf_num_functions(self.module)  # the programs the module holds
        names = [bcc.lib.bpf_function_name(self.module, i).decode() for i in range(n)]
        print("bcc-test: programs " + ",".join(names), file=sys.stderr, flush=True)

    def _counting_attach(self, *args, **kw):
        print("bcc-test: uprobe", file=sys.stderr, flush=True)
        return _attach(self, *args, **kw)

    bcc.BPF.__init__, bcc.BPF.attach_uprobe = _counting_init, _counting_attach

    # pymtrace attaches through pymtrace.bpf.uprobes (uprobe_multi links, or perf events it
    # opens itself): that call is an attach too, whichever way it goes
    try:
        from pymtrace.bpf import uprobes as _uprobes
    except ImportError:
        _uprobes = None
    if _uprobes is not None and hasattr(_uprobes, "attach"):
        _attach_probes = _uprobes.attach

        def _counting_attach_probes(bpf, probes):
            probes = list(probes)
            if probes:
                print("bcc-test: uprobe", file=sys.stderr, flush=True)
            return _attach_probes(bpf, probes)

        _uprobes.attach = _counting_attach_probes
'''


def traced_run(tmp_path, *args, timeout=600):
    """Run pymtrace ARGS; (process, [set of programs of each compile, in order], events).
    Events: "compile ...", "uprobe", and after each compile "programs NAME,..." (the BPF
    functions it holds; left out of the returned events, see compiled_functions)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    proc = run_pymtrace(*args, env=env, timeout=timeout)
    events = [line[len("bcc-test: ") :] for line in proc.stderr.splitlines() if line.startswith("bcc-test: ")]
    compiles = [set(e.split(" ", 1)[1].split(",")) - {""} for e in events if e.startswith("compile")]
    return proc, compiles, [e for e in events if not e.startswith("programs")]


def compiled_functions(proc):
    """[set of BPF function names] of each compile of the run PROC (traced_run)."""
    tag = "bcc-test: programs "
    return [set(line[len(tag) :].split(",")) - {""} for line in proc.stderr.splitlines() if line.startswith(tag)]


# malloc_stats's programs, exactly (bpf/malloc_stats.bpf.c): the libc's (MS_GLIBC), the other
# allocators' (MS_FOREIGN: pymtrace.tracee.allocators' tables; of those only the argument
# layouts the probed files use), C++'s (MS_CXX), and the exec probe they all need.
GLIBC_PROGRAMS = {
    "ms_malloc_entry", "ms_malloc_return", "ms_calloc_entry", "ms_calloc_return", "ms_free_entry",
    "ms_realloc_entry", "ms_memalign_entry", "ms_posix_memalign_entry", "ms_valloc_entry",
    "ms_pvalloc_entry", "ms_outer_return",
}  # fmt: skip
# Debian 12's jemalloc 5.3 (no pvalloc; free calls no other probed function), which also
# defines every C++ operator new/delete (a process preloading it resolves them there)
JEMALLOC_PROGRAMS = {
    "ms_f_return", "ms_f_free_p1", "ms_f_malloc_s1", "ms_f_calloc_n1s2", "ms_f_realloc_p1s2",
    "ms_f_realloc_x", "ms_f_memalign_s2", "ms_f_posix_memalign_p1s3", "ms_f_valloc_s1",
}  # fmt: skip
CXX_PROGRAMS = {
    "ms_f_return", "ms_f_new_s1", "ms_f_new_array_s1", "ms_f_new_nothrow_s1", "ms_f_new_aligned_s1",
    "ms_f_delete_p1", "ms_f_delete_array_p1", "ms_f_delete_sized_p1", "ms_f_delete_aligned_p1",
}  # fmt: skip
FOREIGN_PROGRAMS = JEMALLOC_PROGRAMS | CXX_PROGRAMS  # a process on jemalloc
# record's (bpf/record.bpf.c): the libc's entry programs, and `leave` (every return probe)
RECORD_GLIBC = {
    "enter_malloc", "enter_calloc", "enter_realloc", "enter_memalign", "enter_posix_memalign",
    "enter_valloc", "enter_pvalloc", "enter_free", "leave",
}  # fmt: skip


def attached_programs(path, family):
    """The programs pymtrace.tracee.allocators' probe plan attaches in PATH (ground truth
    for the exact sets above: the plan's own decoding, not the pre-compile selection)."""
    from pymtrace.tracee import allocators

    return {p.program for _, probes in allocators.probe_plan(path, family) for p in probes}


def malloc_programs(functions):
    return {f for f in functions if f.startswith("ms_")}


@pytest.fixture
def target():
    """A process to trace with -p (system-wide runs would also probe every libc other tests
    map, planted fakes included)."""
    proc = subprocess.Popen(["sleep", "120"])
    time.sleep(0.2)  # its libc mapped
    yield proc.pid
    proc.kill()
    proc.wait()


def compiled_before_uprobes(events):
    """Every compile precedes every uprobe attach."""
    kinds = [e.split(" ", 1)[0] for e in events]
    return "uprobe" not in kinds or "compile" not in kinds[kinds.index("uprobe") :]


@pytest.mark.bpf
def test_top_full_mode_compiles_once_before_its_uprobes(tmp_path, target):
    proc, compiles, events = traced_run(tmp_path, "top", "-p", target, "--batch", "-n", "1", "-i", "0.2")
    assert proc.returncode == 0, proc.stderr
    # glibc_usdt joins when the libc has malloc probes (not compiled otherwise)
    assert len(compiles) == 1 and compiles[0] - {"glibc_usdt"} == {"malloc_stats", "faults", "slab"}, events
    assert "uprobe" in " ".join(events) and compiled_before_uprobes(events), events


@pytest.mark.bpf
def test_top_always_on_compiles_no_per_call_program(tmp_path, target):
    proc, compiles, events = traced_run(tmp_path, "top", "-p", target, "--always-on", "--batch", "-n", "1", "-i", "0.2")
    assert proc.returncode == 0, proc.stderr
    assert len(compiles) == 1 and compiles[0] - {"glibc_usdt"} == {"faults", "slab"}, events


@pytest.mark.bpf
def test_top_batch_compiles_only_what_its_views_show(tmp_path, target):
    """--view slab needs neither the malloc uprobes nor the fault tracepoints."""
    proc, compiles, events = traced_run(
        tmp_path, "top", "-p", target, "--batch", "-n", "1", "-i", "0.2", "--view", "slab"
    )
    assert proc.returncode == 0, proc.stderr
    assert compiles == [{"slab"}] and "uprobe" not in events, events
    assert "== slab caches" in proc.stdout, proc.stdout


@pytest.mark.bpf
def test_record_compiles_only_the_record_program(tmp_path, target):
    proc, compiles, events = traced_run(
        tmp_path, "record", "-p", target, "--duration", "0.3", "-o", tmp_path / "trace.mtrace"
    )
    assert proc.returncode == 0, proc.stderr
    assert compiles == [{"record"}], events
    assert compiled_before_uprobes(events), events
    # a glibc process without C++ and without glibc's libc_malloc_debug interposer: the
    # libc's programs, exactly (no enter_outer_*, no other allocator's or C++'s enter_f_*)
    assert compiled_functions(proc) == [RECORD_GLIBC]


@pytest.mark.bpf
def test_record_on_jemalloc_compiles_its_programs_only(tmp_path, cbuild):
    """record -p on a process on jemalloc: the enter_f_* programs of the layouts jemalloc's
    functions use, those of its C++ operator new/delete record's plan probes (tracee.cxxplan:
    its carried news' enter_cxx_new_<slot>), and `leave`; none of the libc's."""
    from support.allocators import LIBS, library

    from pymtrace.recorder.plan import recorded_names
    from pymtrace.tracee import cxxplan, libc

    jemalloc = library(LIBS["jemalloc"])
    work = _foreign_workload(cbuild)
    try:
        found = libc.allocator(work.pid)
        recorded = recorded_names([(libc.process_libc(work.pid), False)], found)
        cxx = cxxplan.for_process(work.pid, jemalloc, recorded)
        proc, compiles, events = traced_run(
            tmp_path, "record", "-p", work.pid, "--duration", "0.3", "-o", tmp_path / "trace.mtrace"
        )
    finally:
        work.kill()
    assert proc.returncode == 0, proc.stderr
    assert compiles == [{"record"}] and compiled_before_uprobes(events), events
    own = attached_programs(jemalloc, "jemalloc")
    assert own | attached_programs(jemalloc, "c++") == FOREIGN_PROGRAMS
    expected = {"enter_f_" + p.removeprefix("ms_f_") for p in own - {"ms_f_return"}} | cxx.programs() | {"leave"}
    assert cxx.carried and compiled_functions(proc) == [expected]


@pytest.mark.bpf
def test_top_compiles_glibc_probes_with_the_rest(tmp_path, sdt_libc, cbuild):
    """A process on a libc with malloc USDT probes: its probe readers (generated C) are
    compiled in the same module as top's programs, and view 4 reads them."""
    prefix, _ = sdt_libc
    work = subprocess.Popen(prefix + [cbuild("glibc_idle")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert work.stdout.readline().startswith("ready")
        proc, compiles, events = traced_run(tmp_path, "top", "-p", work.pid, "--json", "-n", "1", "-i", "0.2")
    finally:
        work.kill()
        work.wait()
    assert proc.returncode == 0, proc.stderr
    assert compiles == [{"malloc_stats", "faults", "slab", "glibc_usdt"}], events
    assert compiled_before_uprobes(events), events
    glibc = json.loads(proc.stdout.splitlines()[0])["snapshot"]["glibc"][str(work.pid)]
    assert glibc["probes"] > 0, glibc


def _foreign_workload(cbuild):
    """A process whose malloc is jemalloc's (LD_PRELOAD), waiting for stdin."""
    from support.allocators import LIBS, library
    from support.top import Workload

    return Workload(["env", f"LD_PRELOAD={library(LIBS['jemalloc'])}", cbuild("top_calls", "-DANY_ALLOCATOR")])


@pytest.mark.bpf
def test_top_compiles_other_allocators_programs_only_where_one_is_mapped(tmp_path, target, cbuild):
    """The ms_f_* programs (jemalloc, tcmalloc, mimalloc, a malloc in the executable) are
    compiled only for a traced process on such an allocator, the libc's only for one on the
    libc: counted exactly (every program of the module is one it can attach)."""
    from support.allocators import LIBS, library

    plain = ("--batch", "-n", "1", "-i", "0.2", "--view", "processes")
    proc, compiles, events = traced_run(tmp_path, "top", "-p", target, *plain)
    assert proc.returncode == 0, proc.stderr
    assert compiles == [{"malloc_stats", "faults"}], events
    assert [malloc_programs(f) for f in compiled_functions(proc)] == [GLIBC_PROGRAMS | {"ms_exec"}]

    work = _foreign_workload(cbuild)
    try:
        proc, compiles, events = traced_run(tmp_path, "top", "-p", work.pid, *plain)
        assert proc.returncode == 0, proc.stderr
        # of the other allocators' programs, only jemalloc's argument layouts (not e.g.
        # mimalloc's ms_f_malloc_n1s2): exactly what its probe plan attaches
        jemalloc = library(LIBS["jemalloc"])
        assert attached_programs(jemalloc, "jemalloc") | attached_programs(jemalloc, "c++") == FOREIGN_PROGRAMS
        assert [malloc_programs(f) for f in compiled_functions(proc)] == [FOREIGN_PROGRAMS | {"ms_exec"}]
        proc, compiles, events = traced_run(tmp_path, "top", "-p", work.pid, "-p", target, *plain)
        assert proc.returncode == 0, proc.stderr
        assert len(compiles) == 1, events
        both = GLIBC_PROGRAMS | FOREIGN_PROGRAMS | {"ms_exec"}
        assert [malloc_programs(f) for f in compiled_functions(proc)] == [both]
    finally:
        work.kill()


@pytest.mark.bpf
def test_system_wide_top_compiles_other_allocators_programs_when_one_is_mapped(tmp_path, cbuild):
    """System-wide, the /proc/*/maps scan that finds the libcs decides before the compile:
    a jemalloc process running -> its ms_f_* programs are in the one compile, and of the
    other allocators' only the layouts some mapped file uses. (Without one they are not,
    which a shared machine cannot promise for a system-wide test: the -p test above shows
    it; other users' allocator files mapped now are added to the expected set.)"""
    from pymtrace.tracee import allocators, libc

    work = _foreign_workload(cbuild)
    try:
        others = set()
        for path, (name, _) in libc.distinct_allocators().items():
            others |= allocators.programs(path, allocators.family_of(name))
        if libc.distinct_cxx_runtimes():
            others |= CXX_PROGRAMS
        proc, compiles, events = traced_run(tmp_path, "top", "--batch", "-n", "1", "-i", "0.2", "--view", "processes")
    finally:
        work.kill()
    assert proc.returncode == 0, proc.stderr
    assert len(compiles) == 1 and "malloc_stats" in compiles[0], events
    expected = GLIBC_PROGRAMS | FOREIGN_PROGRAMS | others | {"ms_exec"}
    assert [malloc_programs(f) for f in compiled_functions(proc)] == [expected]


@pytest.mark.bpf
def test_system_wide_top_names_a_later_allocator_file_as_not_counted(tmp_path, cbuild):
    """A process started after top attached, on an allocator file no process mapped then
    (a fresh copy of jemalloc: a new inode), is not probed (its file was not in the
    program set nor the attach): its row names the allocator as not traced, never zeros."""
    import shutil

    from support.allocators import LIBS, library
    from support.top import Top, Workload

    late = tmp_path / "libjemalloc-late.so.2"
    shutil.copy(library(LIBS["jemalloc"]), late)
    top = Top("--json", "-i", "0.5", "--view", "processes", "--no-glibc")
    work = None
    try:
        top.json_doc()  # attached
        work = Workload(["env", f"LD_PRELOAD={late}", cbuild("top_calls", "-DANY_ALLOCATOR")])
        work.go()
        work.result()
        started = time.monotonic()
        for _ in range(20):
            doc = top.json_after(started)
            p = doc["snapshot"]["processes"].get(str(work.pid), {})
            if "allocator" in p:
                break
        assert p["allocator"] == "jemalloc" and p["allocator_traced"] is False, p
        row = {r["pid"]: r for r in doc["views"]["processes"]["rows"]}[work.pid]
        assert row["untraced_allocator"] == "jemalloc" and row["malloc_per_s"] is None, row
        assert top.stop() == 0
    finally:
        top.kill()
        if work is not None:
            work.kill()
