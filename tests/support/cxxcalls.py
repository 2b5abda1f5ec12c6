"""The C++ workload workloads/cxx_calls.cpp (every operator new/delete variant a known number of
times): its build, the records `record` writes for it, and the counts top gives for its tally where
operator new resolves."""

import subprocess

from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.tracee import allocators, elf
from support.needs import missing_or_fail
from support.paths import WORKLOADS
from support.recording import text_range

NEW_CALLS = ("new", "new_array", "new_nothrow", "new_aligned")
CALLS = NEW_CALLS + ("delete", "delete_array", "delete_sized", "delete_aligned")
STDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"


def build(directory):
    """cxx_calls.cpp compiled into DIRECTORY (not PIE: the callers a recording gives can be
    checked against its text, support.recording.text_range): the binary's path."""
    out = directory / "cxx_calls"
    try:
        subprocess.run(
            ["g++", "-O1", "-std=c++17", "-fsized-deallocation", "-no-pie", "-o", out, WORKLOADS / "cxx_calls.cpp"],
            check=True,
        )
    except FileNotFoundError:
        missing_or_fail("g++ is not installed")
    return str(out)


# the functions cxx_calls.cpp calls, ROUNDS times each, by its tally's call type
CALLED = {
    "new": ("_Znwm",),
    "new_array": ("_Znam",),
    "new_nothrow": ("_ZnwmRKSt9nothrow_t", "_ZnamRKSt9nothrow_t"),
    "new_aligned": ("_ZnwmSt11align_val_t", "_ZnamSt11align_val_t"),
    "delete": ("_ZdlPv",),
    "delete_array": ("_ZdaPv",),
    "delete_sized": ("_ZdlPvm", "_ZdaPvm"),
    "delete_aligned": ("_ZdlPvSt11align_val_t", "_ZdaPvmSt11align_val_t"),
}


def expected_records(result):
    """The (dj/malloc type, size, alignment) of each call cxx_calls.cpp makes, in order, as
    `record` writes them (new, new[], nothrow -> malloc; aligned new -> memalign; delete ->
    free, without a size)."""
    out = []
    for i in range(result["calls"]["new"]):
        size = 16 + 8 * i
        out += [(B.MALLOC, size, 0), (B.FREE, 0, None)] * 4 + [(B.MEMALIGN, size, 64), (B.FREE, 0, None)] * 2
    return out


def check_records(records, result, binary):
    """RECORDS (mtrace_bin records of one run of cxx_calls) are exactly its calls: in order, with
    their sizes and alignments, each delete freeing the block the new before it returned, every
    caller in BINARY's own text (nothing recorded from inside operator new/delete)."""
    lo, hi = text_range(binary)
    got = [(r.type, r.size, r.size2 if r.type != B.FREE else None) for r in records]
    assert got == expected_records(result)
    assert all(lo <= r.caller < hi for r in records), [hex(r.caller) for r in records if not lo <= r.caller < hi][:5]
    for new, delete in zip(records[::2], records[1::2]):
        assert new.ptr2 and delete.ptr1 == new.ptr2


def expected_counts(result, runtime):
    """The tally as counted where operator new resolves (docs/top.md): one function at two
    names is counted under the first in allocators.CXX (tcmalloc's and mimalloc's new[] is
    their new), and a delete that is also the allocator's free-type C function (their
    delete is free, their sized delete tc_free_sized / mi_free_size) as free. Returns
    (C++ calls, frees)."""
    rounds = result["calls"]["new"]
    syms = elf.symbols(runtime)
    c_names = {f.name for table in allocators.FAMILIES.values() for f in table}
    c_addresses = {sym.address for name, sym in syms.items() if name in c_names}
    first = {}
    for f in allocators.CXX:
        if f.name in syms:
            first.setdefault(syms[f.name].address, f.call)
    calls, frees = dict.fromkeys(CALLS, 0), 0
    for names in CALLED.values():
        for name in names:
            address = syms[name].address
            if address in c_addresses:
                frees += rounds
            else:
                calls[first[address]] += rounds
    assert sum(calls.values()) + frees == sum(result["calls"].values())
    return calls, frees
