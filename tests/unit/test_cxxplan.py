"""pymtrace.tracee.cxxplan: record's probes on C++ operator new/delete, decoded from the real
libstdc++, jemalloc, tcmalloc and mimalloc (no root needed), and checked against how a real
process resolves the names the plan relies on."""

import os
import signal
import subprocess

import pytest
from support.allocators import LIBS, library
from support.cxxcalls import STDCXX
from support.needs import missing_or_fail
from support.paths import WORKLOADS

from pymtrace.tracee import allocators, cxxplan, elf, libc, mallocapi

DELETES = [f.name for f in allocators.CXX if f.call.startswith("delete")]


def _probes(plan):
    return {f: probes for f, probes in plan.probes}


def test_libstdcxx_deletes_and_new_array_have_no_probe_and_new_is_carried_by_malloc():
    plan = cxxplan.plan(STDCXX)
    probes, via = _probes(plan), dict(plan.via)
    # every delete tail-jumps, at last to free: free's own probe sees the program's call
    assert not set(DELETES) & set(probes)
    for name in DELETES:
        while name in via:
            name = via[name]
        assert name == "free"
    assert via["_Znam"] == "_Znwm"  # new[] jumps to new: new's probe sees the program's call
    carried = {c.function: c for c in plan.carried}
    assert [(p.kind, p.program) for p in probes["_Znwm"]] == [("entry", "cxx_new")]  # no return probe
    assert carried["_Znwm"].recorded == "malloc"
    assert carried["_Znwm"].size == elf.symbol(STDCXX, "_Znwm").size
    # nothrow new: `endbr64; sub $8,%rsp; call _Znwm` -- probed on the call (emulated), 8 bytes down
    nothrow = carried["_ZnwmRKSt9nothrow_t"]
    code = elf.read_code(STDCXX, elf.symbol(STDCXX, nothrow.function).address + nothrow.offset, 1)
    assert code == b"\xe8" and nothrow.depth == 8
    assert ("free", False) in plan.needs and ("malloc", False) in plan.needs and ("_Znwm", True) in plan.needs


def test_without_carrying_every_new_has_its_return_probe_and_deletes_still_none():
    """record --stacks: the stack is taken at the recorded call's return, the program's."""
    plan = cxxplan.plan(STDCXX, carry=False)
    probes = _probes(plan)
    assert not plan.carried and not set(DELETES) & set(probes)
    assert {p.kind for p in probes["_Znwm"]} == {"entry", "return"}
    assert all(p.program.startswith("ms_f_") for ps in probes.values() for p in ps)


@pytest.mark.parametrize("name", sorted(LIBS))
def test_replacing_allocators(name):
    """jemalloc's and mimalloc's aligned new call their aligned_alloc / mi_malloc_aligned first
    thing (carried); their new and tcmalloc's are inlined fast paths (their own probes); a
    delete that is `jmp free@plt` has none; tcmalloc's delete is its free (the C plan's)."""
    path = library(LIBS[name])
    plan = cxxplan.plan(path)
    probes = _probes(plan)
    assert {p.kind for p in probes["_Znwm"]} == {"entry", "return"}
    carried = {c.function for c in plan.carried}
    assert ("_ZnwmSt11align_val_t" in carried) == (name != "tcmalloc")
    assert all(c.recorded == "memalign" for c in plan.carried)
    if name == "jemalloc":
        assert dict(plan.via)["_ZdlPv"] == "free" and "_ZdlPvm" in probes  # sized delete: its own code
    if name == "tcmalloc":
        assert not plan.via and not plan.carried


@pytest.mark.parametrize("path", [STDCXX] + [LIBS[n] for n in sorted(LIBS)])
def test_programs_before_the_compile_are_exactly_those_attached(path):
    path = path if path.startswith("/") else library(path)
    plan = cxxplan.plan(path)
    attached = {f"enter_cxx_new_{k}" for k in range(len(plan.carried))} | {
        "enter_f_" + p.program.removeprefix("ms_f_") for _, ps in plan.probes for p in ps if p.program != "cxx_new"
    }
    assert plan.programs() == attached - {"enter_f_return"}
    carried_probes = [p for _, ps in plan.probes for p in ps if p.program == "cxx_new"]
    assert len(carried_probes) == len(plan.carried)


def _started(argv):
    """A cxx_calls process started and waiting (it prints "ready PID" first): its Popen."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("ready")
    return proc


def _build(tmp_path, *extra):
    out = tmp_path / "cxx_calls"
    try:
        subprocess.run(["g++", "-O1", "-o", out, WORKLOADS / "cxx_calls.cpp", *extra], check=True)
    except FileNotFoundError:
        missing_or_fail("g++ is not installed")
    return str(out)


def _glibc_names(pid):
    """What record probes in PID's glibc (the recorder's recorded_names for it)."""
    return {libc.file_key(libc.process_libc(pid)): frozenset(f.name for f in mallocapi.FUNCTIONS)}


def test_a_process_resolving_as_the_plan_assumes_gets_it(tmp_path):
    proc = _started([_build(tmp_path)])
    try:
        runtime = libc.cxx_runtime(proc.pid)
        plan = cxxplan.for_process(proc.pid, runtime, _glibc_names(proc.pid))
        assert plan == cxxplan.plan(runtime) and plan.carried
        # free not recorded there (a -p on another allocator that does not define it): top's plan
        fallback = cxxplan.for_process(proc.pid, runtime, {})
        assert not fallback.carried and not fallback.via and set(DELETES) <= set(_probes(fallback))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_an_operator_delete_of_the_programs_own_gets_every_delete_probed(tmp_path):
    """The program defines operator delete(void*) (libstdc++'s sized delete jumps to it, not to
    libstdc++'s): the plan's jumps would land in code it does not know, so top's plan is used."""
    src = tmp_path / "own_delete.cpp"
    src.write_text("#include <cstdlib>\nvoid operator delete(void *p) noexcept { free(p); }\n")
    proc = _started([_build(tmp_path, str(src))])
    try:
        runtime = libc.cxx_runtime(proc.pid)
        assert os.path.realpath(runtime) == os.path.realpath(STDCXX)
        assert libc.first_definers(proc.pid, ["_ZdlPv"])["_ZdlPv"] != runtime
        plan = cxxplan.for_process(proc.pid, runtime, _glibc_names(proc.pid))
        assert not plan.carried and not plan.via
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
