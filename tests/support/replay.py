"""Helpers for the `pymtrace replay` and simulator tests (no tests here): hand-built traces
and workloads, the replay's --json report, which allocators this machine has."""

import json

from pymtrace.errors import PymtraceError
from pymtrace.trace.formats import mtrace_bin as mb
from pymtrace.trace.formats import wl
from support.cli import run_pymtrace

R = mb.Record
A, B = 2000, 2001
SIM_TIMEOUT = 120


def write_trace(path, records):
    path.write_bytes(mb.magic_record(records[0].thread) + b"".join(mb.pack(r) for r in records))
    return path


def replay_json(*args, timeout=SIM_TIMEOUT):
    proc = run_pymtrace("replay", *args, "--json", timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def only_result(doc):
    (conf,) = doc["configurations"]
    assert conf["error"] is None, conf["error"]
    return conf["result"]


SINGLE = [
    R(A, mb.MALLOC, 0, 0x1000, 100),  # live 100
    R(A, mb.CALLOC, 0, 0x2000, 50),  # 150
    R(A, mb.REALLOC, 0x1000, 0x3000, 300),  # 350
    R(A, mb.MEMALIGN, 0, 0x4000, 1000, 64),  # 1350
    R(A, mb.VALLOC, 0, 0x5000, 10, 4096),  # 1360
    R(A, mb.PVALLOC, 0, 0x6000, 10),  # 1370
    R(A, mb.MALLOC, 0, 0, 1 << 50),  # NULL result: skipped
    R(A, mb.POSIX_MEMALIGN, 22, 0, 64, 3),  # EINVAL: skipped
    R(A, mb.FREE, 0x2000),
    R(A, mb.FREE, 0x3000),
    R(A, mb.FREE, 0x4000),  # 20
    R(A, mb.MALLOC, 0, 0x7000, 2000),  # 2020 <- peak
    R(A, mb.FREE, 0x5000),
    R(A, mb.FREE, 0x6000),
    R(A, mb.FREE, 0x7000),
    R(A, mb.FREE, 0),
]


def lib_for(name):
    """The path of allocator NAME's library here, or None if it is not installed."""
    from pymtrace.replay import runner as replay

    try:
        return replay.find_library(name)
    except PymtraceError:
        return None


def simulator():
    """The simulator, built (once) into the cache like `pymtrace replay` does."""
    from pymtrace.replay import runner as replay

    return replay.simulator_path()


def op(o, *args):
    return wl.encode_op(o, *args)


def one_thread(body, nptrs=8, nsyncs=4):
    return wl.build(nptrs, nsyncs, [body + bytes((wl.DONE,))])


# The .wl reference vector (docs/formats.md): a trace of two threads and upstream trace2wl's
# output for it (--upstream-compat must reproduce it byte for byte)
REF_A, REF_B = 1000, 1016
REFERENCE_RECORDS = [
    R(REF_A, mb.MALLOC, 0, 0x1000, 16),
    R(REF_A, mb.CALLOC, 0, 0x2000, 32),
    R(REF_A, mb.REALLOC, 0x1000, 0x3000, 64),
    R(REF_B, mb.FREE, 0x2000),
    R(REF_B, mb.MEMALIGN, 0, 0x4000, 100, 64),
    R(REF_A, mb.FREE, 0x3000),
    R(REF_A, mb.FREE, 0),
    R(REF_A, mb.MALLOC, 0, 0x2000, 24),
    R(REF_A, mb.MALLOC, 0, 0x4000, 8),
    R(REF_B, mb.FREE, 0x4000),
    R(REF_A, mb.POSIX_MEMALIGN, 0, 0x5000, 48, 32),
    R(REF_A, mb.FREE, 0x999),
    R(REF_A, mb.MALLOC, 0, 0, 1 << 40),
]
# docs/formats.md: upstream trace2wl's output for the trace above
UPSTREAM_HEX = (
    "080809040a020b0b0b3401"
    "020210 030320 04040240 0601 0602 0504 0500 0703 020318 0704 020508 0c062030 0200a08080808000 01"
    "0701 0702 0503 0c054064 0603 0505 0604 01"
)
UPSTREAM = bytes.fromhex(UPSTREAM_HEX.replace(" ", ""))
