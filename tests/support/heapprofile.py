"""A synthetic heap profile whose every value the tests know, and a fake symbolizer.

Stacks (leaf first), sample_bytes 1 (every call sampled: all values exact):
  chain:   malloc <- leaf (inlining inl_mid) <- b <- a <- main <- __libc_start_call_main <- _start
           1000 blocks of 100..107 bytes (103500 bytes), all freed
  leak:    malloc <- lib_inner <- lib_outer (libchain.so) <- gamma_ <- main <- ... <- _start
           10 blocks of 4000 bytes, all live; 5 allocated at 10 s (old), 5 at 99 s
  cxx:     operator new(unsigned long) <- shapes::Pool<shapes::Node>::make(long)
           <- shapes::worker(int, long) <- start_thread <- __clone3
           20 blocks of 64 bytes at 50 s, 10 live
  hostile: malloc <- "<img src=x onerror=alert(1)>;x" <- main <- ... <- _start
           3 blocks of 5000 bytes at 95 s, all live
  partial: malloc <- libchain.so+0x999 (unknown), incomplete; 2 blocks of 8 bytes, freed
The run ends at 100 s; drops: ring_full 3.
"""

import io

from pymtrace.sources.heapprofile import HeapProfile
from pymtrace.tracee.unwind import Frame, Module

EXE = Module("/usr/local/bin/chain", "aa11bb22cc33dd44ee55ff6600112233")
LIB = Module("/usr/local/lib/libchain.so", "0123456789abcdef0123456789abcdef01234567")
LIBC = Module("/lib/x86_64-linux-gnu/libc.so.6", "")
HOSTILE = "<img src=x onerror=alert(1)>;x"
CXX_NEW = "operator new(unsigned long)"
CXX_MAKE = "shapes::Pool<shapes::Node>::make(long)"
CXX_WORKER = "shapes::worker(int, long)"

FRAMES = {
    (LIBC, 0x100): [Frame("malloc", "malloc.c", 3287)],
    (LIBC, 0x110): [Frame(CXX_NEW)],
    (LIBC, 0x300): [Frame("__libc_start_call_main", "libc_start_call_main.h", 58)],
    (LIBC, 0x400): [Frame("start_thread", "pthread_create.c", 442)],
    (LIBC, 0x410): [Frame("__clone3")],
    (EXE, 0x200): [Frame("_start")],
    (EXE, 0x210): [Frame("inl_mid", "chain.c", 6, inlined=True), Frame("leaf", "chain.c", 7)],
    (EXE, 0x220): [Frame("b", "chain.c", 12)],
    (EXE, 0x230): [Frame("a", "chain.c", 17)],
    (EXE, 0x240): [Frame("main", "chain.c", 30)],
    (EXE, 0x241): [Frame("main", "chain.c", 31)],
    (EXE, 0x242): [Frame("main", "chain.c", 32)],
    (EXE, 0x250): [Frame("gamma_", "chain.c", 22)],
    (EXE, 0x260): [Frame(CXX_MAKE, "shapes.cpp", 40)],
    (EXE, 0x270): [Frame(CXX_WORKER, "shapes.cpp", 55)],
    (EXE, 0x280): [Frame(HOSTILE, "evil.c", 1)],
    (LIB, 0x110): [Frame("lib_inner", "libchain.c", 4)],
    (LIB, 0x120): [Frame("lib_outer", "libchain.c", 9)],
}

ROOT_CALLS = ((LIBC, 0x300), (EXE, 0x200))
STACKS = {
    "chain": ((LIBC, 0x100), (EXE, 0x210), (EXE, 0x220), (EXE, 0x230), (EXE, 0x240), *ROOT_CALLS),
    "leak": ((LIBC, 0x100), (LIB, 0x110), (LIB, 0x120), (EXE, 0x250), (EXE, 0x241), *ROOT_CALLS),
    "cxx": ((LIBC, 0x110), (EXE, 0x260), (EXE, 0x270), (LIBC, 0x400), (LIBC, 0x410)),
    "hostile": ((LIBC, 0x100), (EXE, 0x280), (EXE, 0x242), *ROOT_CALLS),
    "partial": ((LIBC, 0x100), (LIB, 0x999)),
}
ROOT_FIRST = {
    "chain": "_start;__libc_start_call_main;main;a;b;leaf;inl_mid;malloc",
    "leak": "_start;__libc_start_call_main;main;gamma_;lib_outer;lib_inner;malloc",
    "cxx": f"__clone3;start_thread;{CXX_WORKER};{CXX_MAKE};{CXX_NEW}",
    "hostile": "_start;__libc_start_call_main;main;<img src=x onerror=alert(1)>_x;malloc",
    "partial": "libchain.so+0x999;malloc",
}
# (alloc_objects, alloc_space, inuse_objects, inuse_space) without --older, and with --older 30
EXPECTED = {
    "chain": (1000, 103500, 0, 0),
    "leak": (10, 40000, 10, 40000),
    "cxx": (20, 1280, 10, 640),
    "hostile": (3, 15000, 3, 15000),
    "partial": (2, 16, 0, 0),
}
EXPECTED_OLDER_30 = {
    "chain": (1000, 103500, 0, 0),
    "leak": (10, 40000, 5, 20000),
    "cxx": (20, 1280, 10, 640),
    "hostile": (3, 15000, 0, 0),
    "partial": (2, 16, 0, 0),
}
END_NS = 100 * 10**9
DROPS = {"ring_full": 3, "live_map_full": 0}


class FakeSymbolizer:
    """frames(loc) like target.unwind.Symbolizer: known pcs from FRAMES, else module+0xpc."""

    def __init__(self, frames=None):
        self.table = dict(FRAMES if frames is None else frames)
        self.calls = 0

    def frames(self, loc):
        self.calls += 1
        module, pc = loc
        known = self.table.get(loc)
        if known is not None:
            return list(known)
        return [Frame(f"{module.path.rsplit('/', 1)[-1]}+0x{pc:x}")]


def build_profile(older_s=None):
    """The profile above, finished (with --older OLDER_S if given)."""
    profile = HeapProfile(1, {"command": "chain 1000 10", "pids": [4242], "exe": EXE.path})
    sample_id = 0
    live = set()

    def add(name, size, ts_s, is_live, complete=True):
        nonlocal sample_id
        sample_id += 1
        # a fresh tuple each time: interning must go by content, not identity
        profile.add(sample_id, tuple(STACKS[name]), size, int(ts_s * 10**9), complete)
        if is_live:
            live.add(sample_id)

    for i in range(1000):
        add("chain", 100 + i % 8, 1 + i / 1000, False)
    for i in range(10):
        add("leak", 4000, 10 if i < 5 else 99, True)
    for i in range(20):
        add("cxx", 64, 50, i % 2 == 0)
    for _ in range(3):
        add("hostile", 5000, 95, True)
    for _ in range(2):
        add("partial", 8, 2, False, complete=False)
    profile.finish(live | {999999}, END_NS, older_s=older_s, drops=DROPS)
    return profile


def written(writer, profile, *args, **kw):
    """The bytes WRITER (a heap profile writer) makes of PROFILE with the fake symbolizer."""
    out = io.BytesIO()
    writer(profile, FakeSymbolizer(), out, *args, **kw)
    return out.getvalue()
