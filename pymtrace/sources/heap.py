"""HeapSource: sampled malloc-API calls with a copy of the user stack and the registers at
entry, and the sampled blocks still live, for `pymtrace heap` (bpf/heap.bpf.c, docs/heap.md).

    c = HeapSource({pid}, sample_bytes=524288, on_sample=handle)
    c.attach()
    while running:
        c.poll(10)          # calls on_sample(HeapSample) for each sample (and on_exec/fork/exit)
    c.drain()
    in_use = c.live()       # {sample_id: block address} of sampled blocks not freed
    lost = c.drops()        # {counter: n}: everything a bounded map or the ring could not take
    c.close()

Sampling is Poisson by bytes per thread (docs/design/heap-stacks.md section 6): on average one
sample per SAMPLE_BYTES allocated, a block of at least SAMPLE_BYTES always; SAMPLE_BYTES 1
samples every call. The exponential draw runs in BPF from a log2 table user space fills
(log2_table); draw_bytes is the same arithmetic in Python, for tests.

Two paths: uprobes on each process's allocator (every call traps; the sampling is drawn in
BPF), or, for a process running pymtrace's interposer in sampling mode (INTERPOSER: its
path; sources.interposer.sampling_env), its USDT sites (sources.heapsites): it draws the
samples in-process and only sampled calls trap. `via` says per process which path traces it
and, for the uprobes, why (`--via`, a command the interposer cannot be preloaded into).

A sample's stack bytes are read in place from the ring buffer: HeapSample.stack is their
address, valid only during the on_sample callback (copy them with ctypes.string_at if needed).

The ring buffer is read in batches by native code (tracee.unwind.RingScanner), not one Python
callback per record. Given IMAGES (tracee.unwind.ProcessImages) and ON_STACK, a sample whose
stack the process image's unwind cache already knows goes to on_stack(pid, sample_id, stack,
size, ts_ns) with no unwinding and no HeapSample; the others to on_sample(HeapSample).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import os
import select
import struct
import threading
import time
from typing import Any, Callable, Iterable

from pymtrace.bpf import structs, uprobes
from pymtrace.bpf.ringbuf import MappedRing
from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.sources import interposer as interposer_lib
from pymtrace.sources.base import Source, attach_plan, lost_counts, lost_names
from pymtrace.sources.heapsites import InterposerSites
from pymtrace.stopping import stop_deferred
from pymtrace.tracee import allocators, elf, launch, libc, mallocapi, probesite, proc, pyruntime
from pymtrace.tracee.unwind import Location, ProcessImages, RingScanner

PROGRAM = "heap"
DEFAULT_SAMPLE_BYTES = 524288
DEFAULT_STACK_BYTES = 32768
LG_FRACTION_BITS = 20  # hp_lg's fixed point: log2 values * 2^20
RING_RECORDS = 4096  # --sample-bytes 1: sample records the ring holds at least (~20-40 ms of a storm)
MAX_LIVE = 262144  # live-block map entries at a sampling rate (~100 bytes of kernel memory each)
MAX_LIVE_EVERY_CALL = 1 << 20  # with every call sampled (~100 MiB preallocated)
MAX_LIVE_LIMIT = 1 << 26  # a BPF hash map preallocates its entries: ~6 GiB of kernel memory here
RING_LIMIT = 1 << 32  # the kernel's largest ring buffer is just below 4 GiB
_FORK_MEMORY = 4096
INTERPOSER, UPROBES = "interposer", "uprobes"  # the two paths (HP_VIA_*)
# a RingScanner row: payload offset, length, cache result, then hp_event's type pid tid call size ts id
_ROW = struct.Struct("<QIi4I3Q")
_KIND_PID = struct.Struct("<II")
_RB_BUSY, _RB_DISCARD = 1 << 31, 1 << 30  # a ring record's header bits (the kernel's BPF_RINGBUF_*)
LOOK_AHEAD_S = 0.002  # while unwinding a backlog, Python blocks are looked at this often
# StackSink(pid, sample_id, stack leaf first, size, ts_ns, python block or None): a sample whose
# stack the unwind cache knew
StackSink = Callable[[int, int, "tuple[Location, ...]", int, int, "bytes | None"], None]
PY_FRAMES = 128  # Python frames read per sample at most (bpf/pywalk.h), with python=True


@dataclasses.dataclass
class HeapSample:
    """One sampled allocation call (HEAP-API.md section B)."""

    pid: int
    tid: int
    call: str  # "malloc", "calloc", "realloc", "memalign" (aligned_alloc too), "posix_memalign", ...
    size: int  # bytes requested (calloc: n * m)
    ts_ns: int  # CLOCK_MONOTONIC at entry
    sample_id: int  # unique in a run (the key of live())
    regs: tuple[int, ...]  # ip, sp, bp, bx, r12, r13, r14, r15 at the probed (entry) instruction
    stack: int  # address of the stack bytes copied from sp upward; valid during the callback only
    stack_len: int
    py: bytes | None = None  # the thread's Python frames (bpf/pyframes.h py_head + frames), if read


def check_settings(
    sample_bytes: int,
    stack_bytes: int = DEFAULT_STACK_BYTES,
    sample_option: str = "sample bytes",
    stack_option: str = "stack bytes",
) -> None:
    """The sampler's settings the BPF program can take, else a PymtraceError naming the options
    (commands check them before root, a compile or a launch; HeapSource again)."""
    if not 1 <= sample_bytes < 1 << 32:  # the BPF draw's fixed point needs mean < 2^32
        raise PymtraceError(f"{sample_option} must be from 1 to {(1 << 32) - 1}, not {sample_bytes}")
    header = structs.header(PROGRAM)
    page, max_pages = header.consts["HP_PAGE"], header.consts["HP_MAX_PAGES"]
    if stack_bytes % page or not page <= stack_bytes <= max_pages * page:
        raise PymtraceError(f"{stack_option} must be a multiple of {page} from {page} to {max_pages * page}")


def log2_table(bits: int = 10) -> list[int]:
    """hp_lg: round(2^20 * log2(1 + j / 2^BITS)) for j = 0 .. 2^BITS (the BPF draw's table)."""
    n = 1 << bits
    return [round((1 << LG_FRACTION_BITS) * math.log2(1 + j / n)) for j in range(n + 1)]


def draw_bytes(x: int, mean: int, table: list[int]) -> int:
    """The BPF program's Exp(MEAN) draw (hp_draw) for the random 32-bit X, in Python: about
    -MEAN * ln(U) with U = (X | 1) / 2^32. Kept identical to the C for tests of the table."""
    x = (x | 1) & 0xFFFFFFFF
    k = x.bit_length() - 1
    m = (x << (31 - k)) & 0x7FFFFFFF
    j, rem = (m >> 21) & 1023, (m >> 9) & 4095
    lgf = table[j] + ((table[j + 1] - table[j]) * rem >> 12)
    neg = (32 << LG_FRACTION_BITS) - ((k << LG_FRACTION_BITS) + lgf)
    a = mean * 45426
    return ((a >> 16) * neg >> LG_FRACTION_BITS) + ((a & 0xFFFF) * neg >> 36) + 1


# glibc's argument layout of each call type (the standard names' in pymtrace.tracee.allocators):
# another allocator's function with the same layout is sampled by the same hp_<call>_entry program
_GLIBC_LAYOUTS = {f.call: f.layout for f in allocators.STANDARD}


def probe_plan(path: str, family: str = "glibc") -> list[tuple[str, list[tuple[str, int, str]]]]:
    """heap's uprobes on the libc at PATH: [(function, [(kind, offset, bpf_function), ...])].

    free goes where pymtrace.tracee.probesite finds an emulated instruction, as in top. The
    allocating functions are probed at +0: their return probe replaces the return address
    at [sp] as soon as +0 has run, and the copied stack must hold the real one for the
    unwinder (on glibc 2.36 this costs posix_memalign, valloc and pvalloc a single-step:
    rare calls). Functions sharing an address (memalign and aligned_alloc) are probed once.
    Raises PymtraceError if PATH has no malloc/free to probe.

    FAMILY other than glibc (jemalloc, ...: pymtrace.tracee.allocators): the functions of
    allocators.probe_plan (one per address, forwarders left out) whose arguments are laid
    out as glibc's (mallocx, rallocx, sdallocx, dallocx too; not xallocx or mimalloc's
    (size, alignment) functions, which no sampler program reads), the same way."""
    if family != "glibc":
        table = {f.name: f for f in allocators.FAMILIES[family]}
        plan = []
        for function, probes in allocators.probe_plan(path, family):
            f = table[function]
            if _GLIBC_LAYOUTS.get(f.call) != f.layout:
                continue
            if f.call == "free":
                entries = [("entry", p.offset, "hp_free_entry") for p in probes if p.kind == "entry"]
            else:
                entries = [("entry", 0, f"hp_{f.call}_entry"), ("return", 0, "hp_return")]
            plan.append((function, entries))
        return plan
    syms = elf.symbols(path)
    plan, done = [], set()
    for f in mallocapi.FUNCTIONS:
        sym = syms.get(f.name)
        if sym is None or sym.address in done:
            continue
        done.add(sym.address)
        if f.returns:
            probes = [("entry", 0, f"hp_{f.call}_entry"), ("return", 0, "hp_return")]
        else:
            sites = probesite.sites(path, f.name)
            probes = [("entry", off, f"hp_{f.call}_entry") for off in (sites.offset, *sites.side_paths)]
        plan.append((f.name, probes))
    if not {"malloc", "free"} <= {name for name, _ in plan}:
        raise PymtraceError(f"{path}: no malloc/free symbols to probe (not a libc with the malloc API?)")
    return plan


# The interpreter's allocators (--python-allocators), with the programs that sample them: the
# API, and the domain functions it calls through its allocator table (_PyObject, _PyMem),
# where the file keeps their local symbols (also called directly, and kept whole by LTO).
PY_ALLOCATORS = tuple(
    (f"{api}_{call}", program)
    for api in ("PyObject", "PyMem", "_PyObject")
    for call, program in (
        ("Malloc", "hp_py_malloc_entry"),
        ("Calloc", "hp_py_calloc_entry"),
        ("Realloc", "hp_realloc_entry"),
        ("Free", "hp_free_entry"),
    )
)


def python_allocator_plan(path: str) -> list[tuple[str, list[tuple[str, int, str]]]]:
    """heap --python-allocators' uprobes on the interpreter's file at PATH, as probe_plan's:
    each of PY_ALLOCATORS it defines (once per address), frees where probesite finds an
    emulated instruction. Empty when it defines none."""
    syms = elf.symbols(path)
    plan, done = [], set()
    for name, program in PY_ALLOCATORS:
        sym = syms.get(name)
        if sym is None or sym.address in done:
            continue
        done.add(sym.address)
        if program == "hp_free_entry":
            sites = probesite.sites(path, name)
            plan.append((name, [("entry", off, program) for off in (sites.offset, *sites.side_paths)]))
        else:
            plan.append((name, [("entry", 0, program), ("return", 0, "hp_return")]))
    return plan


def without_frees(plan: list[tuple[str, list[tuple[str, int, str]]]]) -> list:
    """PLAN (probe_plan's) without the free probes: the allocating calls only."""
    return [(f, kept) for f, probes in plan if (kept := [p for p in probes if p[2] != "hp_free_entry"])]


def _ring_record(size: int) -> int:
    """Ring bytes a BPF ring-buffer record of SIZE bytes takes (its 8-byte header, 8-aligned)."""
    return (size + 8 + 7) & ~7


def default_ring_pages(sample_bytes: int, stack_bytes: int, reserve: bool, page: int, header: int) -> int:
    """Ring-buffer pages (a power of two): 16 MiB at a sampling rate; 64 MiB with every call
    sampled, and with RESERVE (each record takes the largest size) room for RING_RECORDS."""
    if sample_bytes != 1:
        return 4096
    if not reserve:
        return 16384
    pages = max(16384, -(-RING_RECORDS * (stack_bytes + header + 8) // page))
    return 1 << (pages - 1).bit_length()


def ring_pages(size: int, option: str = "ring bytes") -> int:
    """The ring-buffer pages of a ring of SIZE bytes: a power of two, at least a page, below RING_LIMIT."""
    page = structs.header(PROGRAM).consts["HP_PAGE"]
    if size < page or size >= RING_LIMIT or size & (size - 1):
        raise PymtraceError(f"{option} must be a power of two from {page} to {RING_LIMIT // 2}, not {size}")
    return size // page


def default_max_live(sample_bytes: int) -> int:
    """Sampled blocks the live map holds: every block with every call sampled (a process with
    millions of blocks live), else the sampled ones (one per SAMPLE_BYTES of heap in use)."""
    return MAX_LIVE_EVERY_CALL if sample_bytes == 1 else MAX_LIVE


def write_python(table: Any, pid: int, config: Any | None) -> None:
    """PID's entry of a BPF map of py_configs (heap's hp_py, record's py): CONFIG, or none."""
    try:
        if config is None:
            del table[ctypes.c_uint32(pid)]
        else:
            table[ctypes.c_uint32(pid)] = config
    except Exception:  # BCC: an absent key on delete (KeyError), a full map on update
        pass


def python_config(interp: pyruntime.Interpreter) -> Any:
    """The py_config (bpf/pyframes.h) of a readable interpreter: its frame walk's offsets."""
    layout = interp.layout
    assert layout is not None
    none = structs.header(PROGRAM).consts["PY_NO_OFFSET"]
    fields = (layout.frame_previous, layout.frame_code, layout.frame_instr, layout.frame_flag or 0)
    name = layout.code_qualname if layout.code_qualname is not None else layout.code_name
    code_fields = (name, layout.code_filename, layout.code_firstlineno)
    code_at = min(code_fields) & ~7
    return structs.header(PROGRAM).structs["py_config"](
        runtime=interp.runtime,
        interp_head=layout.interpreters_head,
        interp_next=layout.interp_next,
        interp_threads=layout.interp_threads_head,
        ts_next=layout.thread_next,
        ts_tid=layout.thread_tid,
        tid_in_pthread=none if interp.tid_in_pthread is None else interp.tid_in_pthread,
        ts_frame=layout.thread_frame,
        cframe_frame=none if layout.cframe_current_frame is None else layout.cframe_current_frame,
        f_previous=layout.frame_previous,
        f_code=layout.frame_code,
        f_instr=layout.frame_instr,
        f_flag=none if layout.frame_flag is None else layout.frame_flag,
        f_read=max(fields) + 8,
        c_at=code_at,
        c_read=max(code_fields) + 8 - code_at,
        c_name=name - code_at,
        c_file=layout.code_filename - code_at,
        c_line=layout.code_firstlineno - code_at,
        s_read=layout.unicode_ascii_size + 8,
        s_length=layout.unicode_length,
        s_hash=layout.unicode_hash,
        s_data=layout.unicode_ascii_size,
    )


def possible_cpus() -> int:
    """Number of CPU ids the kernel may use (the per-CPU scratch slots)."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            return max(int(part.split("-")[-1]) for part in f.read().strip().split(",")) + 1
    except (OSError, ValueError):
        return os.cpu_count() or 1


def _is_thread(pid: int) -> bool | None:
    """Whether task PID is a thread of another process (None: it is gone)."""
    try:
        return proc.tgid(pid) != pid
    except ProcessGone:
        return None


class HeapSource(Source):
    """Sampled allocation calls (stack copy + registers) of a set of processes, and the sampled
    blocks still live. Callbacks: on_sample(HeapSample), on_exec(pid), on_fork(parent, child),
    on_exit(pid), on_stack (module docstring), on_free(sample_id); they run inside
    poll()/drain()."""

    program = PROGRAM
    what = "sampling allocation call stacks"
    required = True
    in_window = True  # samples may come now (under a budget, sources.budget: only in a window)

    def __init__(
        self,
        pids: Iterable[int],
        sample_bytes: int = DEFAULT_SAMPLE_BYTES,
        stack_bytes: int = DEFAULT_STACK_BYTES,
        follow_forks: bool = False,
        on_sample: Callable[[HeapSample], None] | None = None,
        on_exec: Callable[[int], None] | None = None,
        on_fork: Callable[[int, int], None] | None = None,
        on_exit: Callable[[int], None] | None = None,
        ring_pages: int | None = None,
        max_live: int | None = None,
        max_pending: int = 16384,
        max_threads: int = 16384,
        max_targets: int = 4096,
        libc_path: str | None = None,
        reserve: bool = False,
        images: ProcessImages | None = None,
        on_stack: StackSink | None = None,
        on_free: Callable[[int], None] | None = None,
        interposer: str | None = None,
        python: bool = False,
        on_python: Callable[[int, bytes], None] | None = None,
        credits: interposer_lib.Credits | None = None,
        frees: bool = True,
    ) -> None:
        pids = set(pids)
        if not pids:
            raise PymtraceError("heap needs at least one process to trace")
        super().__init__(pids, track_exits=False)  # exits come as ring records
        check_settings(sample_bytes, stack_bytes)
        header = structs.header(PROGRAM)
        page = header.consts["HP_PAGE"]
        if ring_pages is None:
            ring_pages = default_ring_pages(
                sample_bytes, stack_bytes, reserve, page, ctypes.sizeof(header.structs["hp_event"])
            )
        if ring_pages & (ring_pages - 1):
            raise PymtraceError(f"ring buffer pages must be a power of two, not {ring_pages}")
        self.sample_bytes = sample_bytes
        self.stack_bytes = stack_bytes
        self.follow_forks = follow_forks
        self.on_sample = on_sample
        self.on_exec = on_exec
        self.on_fork = on_fork
        self.on_exit = on_exit
        self.ring_pages = ring_pages
        self.libc_path = libc_path  # a launched command's libc, not mapped yet (launch.predict_libc)
        self.reserve = reserve  # one stack copy straight into a largest-size ring record (slower: bpf)
        self.limits = {
            "HP_MAX_LIVE": 1 if not frees else default_max_live(sample_bytes) if max_live is None else max_live,
            "HP_MAX_PENDING": max_pending,
            "HP_MAX_THREADS": max_threads,
            "HP_MAX_TARGETS": max_targets,
        }
        self.frees = frees  # free probes and the sampled blocks live (off: allocating calls only)
        self._handles: list | None = None  # a list: what attaching adds goes in it (uprobes.release)
        self.libcs = {}  # libc path -> [pid, ...] (or [-1]: every process, filtered in BPF)
        self.families = {}  # path -> another allocator's family (allocators.FAMILIES); glibc if absent
        self.plans = {}
        self.attached = []  # (path, function, offset, kind, pid)
        self.calls = {v: k[len("CALL_") :].lower() for k, v in header.consts.items() if k.startswith("CALL_")}
        self.event_type = header.structs["hp_event"]
        self.event_size = ctypes.sizeof(self.event_type)
        # python: a Python process's sample carries its Python frames after its stack
        self.py_frames = PY_FRAMES if python and not reserve else 0
        self.py_frame_size = ctypes.sizeof(header.structs["py_frame"])
        self.py_head_size = ctypes.sizeof(header.structs["py_head"])
        self.stack_at = self.event_size
        self._stack_len_at = self.event_type.stack_len.offset
        self.python: dict[int, Any] = {}  # pid -> the py_config written to hp_py
        self.py_allocators: dict[str, list[int]] = {}  # interpreter file -> [pid] (--python-allocators)
        self.on_python = on_python if python else None  # on_python(pid, block): look_ahead
        self._ahead = 0  # the ring position look_ahead has seen up to
        self._ahead_at = 0.0
        self.kinds = {header.consts[f"HP_REC_{k}"]: k.lower() for k in ("SAMPLE", "EXEC", "FORK", "EXIT", "FREE")}
        self.images = images
        self.on_stack = on_stack
        self.on_free = on_free  # on_free(sample_id): that sample's block was freed (or realloc'd away)
        self.ring: MappedRing | None = None
        self.scanner: RingScanner | None = None
        self._epoll: Any = None
        self._sample_type = header.consts["HP_REC_SAMPLE"]
        self._free_type = header.consts["HP_REC_FREE"]
        self._unresolved_forks = {}  # child -> parent: gone before we could tell thread from process
        self.interposer = interposer  # the interposer library a launched command may preload
        self.sites = InterposerSites(interposer) if interposer else None
        self.credits = credits  # the interposer's probes wait for room in the ring (none: lost when full)
        self.via: dict[int, tuple[str, str | None]] = {}  # pid -> (INTERPOSER or UPROBES, why uprobes)
        self._via_codes = {INTERPOSER: header.consts["HP_VIA_INTERPOSER"], UPROBES: header.consts["HP_VIA_UPROBES"]}

    # -- lifecycle (sources.base.Source)
    def _defines(self) -> dict[str, Any]:
        return {
            "HP_SAMPLE_MEAN": self.sample_bytes,
            "HP_STACK_PAGES": self.stack_bytes // structs.header(PROGRAM).consts["HP_PAGE"],
            "HP_RB_PAGES": self.ring_pages,
            "HP_MAX_CPUS": possible_cpus(),
            "HP_FOLLOW": int(self.follow_forks),
            "HP_RESERVE": int(self.reserve),
            "HP_PY_FRAMES": self.py_frames,
            "HP_LIVE": int(self.frees),
            **self.limits,
        }

    def part(self) -> Any:
        part = super().part()
        return part._replace(prelude=self.sites.prelude()) if self.sites is not None else part

    def prepare(self) -> None:
        targets = {}
        self.families = {}
        for pid in self.pids:
            if self._choose_via(pid, loaded=True) == INTERPOSER:
                continue
            path, family = self._allocator_of(pid)
            targets.setdefault(path, []).append(pid)
            if family != "glibc":
                self.families[path] = family
        # following forks: children are probed by system-wide uprobes filtered in BPF (a uprobe
        # bound to one process is not inherited); otherwise each process alone
        self.libcs = {path: [-1] for path in targets} if self.follow_forks else targets
        super().prepare()

    def _choose_via(self, pid: int, loaded: bool) -> str:
        """Decide (and remember in `via`) which path traces PID: the interposer when it runs
        in PID (LOADED: its loader has mapped its objects, else it has just exec'd), else the
        uprobes, with why."""
        if self.interposer is None:
            self.via[pid] = (UPROBES, self.via.get(pid, (UPROBES, None))[1])  # a why the caller gave kept
        elif loaded and interposer_lib.maps_file(pid, self.interposer):
            self.via[pid] = (INTERPOSER, None)
        else:
            why = interposer_lib.preload_problem(pid, self.interposer)
            if why is None and not loaded:
                self.via[pid] = (INTERPOSER, None)
            else:
                self.via[pid] = (UPROBES, why or "the interposer was not loaded into it")
        if self.bpf is not None:
            try:
                self.bpf[b"hp_targets"][ctypes.c_uint32(pid)] = ctypes.c_uint32(self._via_codes[self.via[pid][0]])
            except Exception:  # BCC's update of a full map: its fork was counted as targets_full
                pass
        return self.via[pid][0]

    def _allocator_of(self, pid: int) -> tuple[str, str]:
        """(the file whose malloc PID calls, its family): libc.allocator's answer (jemalloc,
        ...), else its libc (or the libc_path given). Raises ProcessGone, or PymtraceError
        when it maps no libc (static binary) or its maps are unreadable."""
        found = None if self.libc_path else libc.allocator(pid)
        if found is not None and found.family not in (None, "glibc"):  # jemalloc, ...
            return found.path, found.family
        path = self.libc_path or libc.process_libc(pid)
        if path is None:
            raise PymtraceError(f"process {pid} maps no libc (static binary?): cannot trace its malloc calls")
        return path, "glibc"

    def probe_program(self, pid: int) -> None:
        """PID (traced) stopped after an exec, its new program's objects mapped but nothing
        run (tracee.launch's on_exec): probe the file its malloc calls now resolve to, unless
        it is probed already (`heap -- env LD_PRELOAD=libjemalloc.so.2 PROG`). Raises
        PymtraceError when that program's malloc cannot be probed. With the interposer: the
        path is chosen again (the new program may not be preloadable), its sites attached."""
        if self._choose_via(pid, loaded=True) == INTERPOSER:
            self.sites.attach(self.bpf, -1 if self.follow_forks else pid)
            return
        path, family = self._allocator_of(pid)
        if path in self.libcs:
            return
        if family != "glibc":
            self.families[path] = family
        self.plans[path] = probe_plan(path, family)
        who = -1 if self.follow_forks else pid
        self.libcs[path] = [who]
        self._attach_file(path, who)

    def plan(self) -> None:
        self.plans = {path: probe_plan(path, self.families.get(path, "glibc")) for path in self.libcs}

    def _attach(self) -> None:
        if self.py_frames:  # the program that reads the frames, tail-called (bpf/heap.bpf.c)
            program = uprobes.load_tail_program(self.bpf, "hp_py_output")
            self.bpf[b"hp_progs"][ctypes.c_int(0)] = ctypes.c_int(program.fd)
        table = self.bpf[b"hp_lg"]
        for j, v in enumerate(log2_table(structs.header(PROGRAM).consts["HP_LG_BITS"])):
            table[ctypes.c_int(j)] = ctypes.c_uint32(v)
        targets = self.bpf[b"hp_targets"]
        for pid in self.pids:
            targets[ctypes.c_uint32(pid)] = ctypes.c_uint32(self._via_codes[self.via[pid][0]])
            self._set_top(pid)
        for pid, config in self.python.items():
            self.bpf[b"hp_py"][ctypes.c_uint32(pid)] = config
        ring = self.bpf[b"hp_events"]
        ring_bytes = self.ring_pages * structs.header(PROGRAM).consts["HP_PAGE"]
        self.ring = MappedRing(ring.map_fd, ring_bytes)
        if self.credits is not None:
            # the most a probe's record takes (with the ring's 8-byte header, 8-aligned); a
            # quarter of the ring left for exec/fork/exit's records
            sample = self.stack_at + self.stack_bytes + self.py_head_size + self.py_frames * self.py_frame_size
            self.credits.start(_ring_record(sample), _ring_record(self.event_size), ring_bytes * 3 // 4)
        ev = self.event_type
        self.scanner = RingScanner(
            self.ring.data_addr,
            self.ring.mask,
            self._sample_type,
            self._free_type,
            ev.regs.offset,
            ev.stack_len.offset,
            self.stack_at,
        )
        self._epoll = select.epoll()
        self._epoll.register(ring.map_fd, select.EPOLLIN)
        self.bpf.attach_tracepoint(tp=b"sched:sched_process_exec", fn_name=b"hp_exec")
        self.bpf.attach_tracepoint(tp=b"sched:sched_process_exit", fn_name=b"hp_exit")
        # return probes first: an entry seen without its return would leave a stale pending call
        for kinds in (("return",), ("entry",)):
            for path, pids in self.libcs.items():
                for pid in pids:
                    self._attach_libc(path, pid, kinds)
        for pid in self.pids:
            if self.via[pid][0] == INTERPOSER:
                self.sites.attach(self.bpf, -1 if self.follow_forks else pid)
        for path, pids in list(self.py_allocators.items()):
            self.py_allocators[path] = []
            for pid in pids:
                self.probe_python_allocators(pid, path)
        for pid in self.pids:  # gone while we attached: its probes would wait for nothing
            if not proc.alive(pid):
                raise ProcessGone(pid)

    def _set_top(self, pid: int) -> None:
        """Tell BPF PID's stack top, so its main thread's copies stop there (bpf: hp_tops)."""
        if self.bpf is None:  # not attached
            return
        try:
            top = proc.start_stack(pid)
        except ProcessGone:
            return
        if top:
            self.bpf[b"hp_tops"][ctypes.c_uint32(pid)] = ctypes.c_uint64(top)

    def probe_python_allocators(self, pid: int, path: str) -> None:
        """Sample PID's interpreter allocators too (PY_ALLOCATORS in PATH, the file defining
        its interpreter): now if attached, else with the other probes. Once per file (every
        process, filtered in BPF, when following forks). PID traced through the interposer:
        nothing (its programs ignore the uprobes')."""
        if self.via.get(pid, (UPROBES,))[0] == INTERPOSER:
            return
        who = -1 if self.follow_forks else pid
        pids = self.py_allocators.setdefault(path, [])
        if who in pids or -1 in pids:
            return
        pids.append(who)
        if self.bpf is None:
            return
        if path not in self.plans:
            self.plans[path] = python_allocator_plan(path)
        self._attach_file(path, who)

    def _attach_file(self, path: str, pid: int) -> None:
        """Attach PATH's probes for PID after the others (returns first, as _attach does)."""
        for kinds in (("return",), ("entry",)):
            self._attach_libc(path, pid, kinds)

    def _attach_libc(self, path: str, pid: int, kinds: tuple[str, ...]) -> None:
        plan = self.plans[path] if self.frees else without_frees(self.plans[path])
        self.attached += attach_plan(self.bpf, path, pid, plan, kinds, handles=self._handles)

    # -- consuming the ring buffer
    def poll(self, timeout_ms: int = 10) -> None:
        """Wait up to TIMEOUT_MS for records (samples do not wake us: they are taken in batches
        here), then hand every record written so far to the callbacks."""
        credits = self.credits
        if credits is not None and credits.pressed():  # probes wait for room: read as soon as one does
            end = time.monotonic() + timeout_ms / 1000
            while not credits.waiting() and time.monotonic() < end:
                self._epoll.poll(0.0005)
        else:
            self._epoll.poll(timeout_ms / 1000)
        self.drain()

    def drain(self) -> None:
        """Hand every record written before this call to the callbacks.

        Only up to the producer position read on entry: a traced process that allocates
        faster than we unwind (an emulated VM: every call sampled) would otherwise keep the
        loop going forever, and the reader thread with it (top --stacks never stopped)."""
        ring, scanner = self.ring, self.scanner
        images = self.images.images if self.images is not None else {}
        on_stack = self.on_stack if self.images is not None else None
        sample, free, base = self._sample_type, self._free_type, ring.data_addr
        on_free = self.on_free
        pythons = self.python  # the processes whose records carry Python frames
        ahead = bool(pythons) and self.on_python is not None
        main = threading.current_thread() is threading.main_thread()
        fired = self.credits.fired() if self.credits is not None else 0  # before the ring's end
        _, limit = ring.positions()
        if ahead:
            self.look_ahead()
        while True:
            cons = ring.positions()[0]
            if cons >= limit:
                if self.credits is not None:
                    self.credits.grant(fired)  # the probes' records up to FIRED are read
                return
            # a stop (Ctrl-C, raised in the main thread) waits for the batch's end: one cut
            # short would be handed over again by the next drain (its samples counted twice)
            with stop_deferred() if main else contextlib.nullcontext():
                rows, after = scanner.scan(cons, limit, images)
                if after == cons:
                    return  # the first record is still being written
                for off, length, result, kind, pid, _tid, _call, size, ts, sample_id in _ROW.iter_unpack(rows):
                    if ahead and result < 0 and time.monotonic() - self._ahead_at > LOOK_AHEAD_S:
                        self.look_ahead()  # an unwind may be slow: Python's code objects first
                    if kind == free:
                        if on_free is not None:
                            on_free(sample_id)
                    elif kind == sample and result >= 0 and on_stack is not None:
                        py = self._py_block(base + off, length) if pid in pythons else None
                        on_stack(pid, sample_id, images[pid].cached_stack(result), size, ts, py)
                    else:
                        self._record(base + off, length)
                ring.advance(after)

    def look_ahead(self) -> None:
        """Hand the Python block of every sample written since the last call to on_python(pid,
        block), before the samples are unwound: the code objects they name are read while
        they live (a backlog of samples to unwind can outlast them)."""
        ring, on_python = self.ring, self.on_python
        self._ahead_at = time.monotonic()
        if ring is None or on_python is None:
            return
        cons, prod = ring.positions()
        pos, data, mask = max(self._ahead, cons), ring.data_addr, ring.mask
        sample = self._sample_type
        while pos < prod:
            record = data + (pos & mask)
            flags = ctypes.c_uint32.from_address(record).value
            if flags & _RB_BUSY:
                break
            length = flags & ~(_RB_BUSY | _RB_DISCARD)
            pos += (length + 8 + 7) & ~7
            if flags & _RB_DISCARD or length < self.stack_at:
                continue
            kind, pid = _KIND_PID.unpack(ctypes.string_at(record + 8, 8))
            if kind == sample and pid in self.python:
                block = self._py_block(record + 8, length)
                if block is not None and len(block) > self.py_head_size:
                    on_python(pid, block)
        self._ahead = pos

    def written(self) -> int:
        """The ring's producer position: every record reserved so far lies below it."""
        return self.ring.positions()[1]

    def handed_over(self, pos: int) -> bool:
        """Whether every record below POS (a position written() returned) has been handed to
        the callbacks."""
        return self.ring.positions()[0] >= pos

    def _record(self, data: int, size: int) -> None:
        ev = self.event_type.from_address(data)
        kind = self.kinds.get(ev.type)
        if kind == "sample":
            if self.on_sample is not None:
                stack_len = max(min(ev.stack_len, size - self.stack_at), 0)
                sample = self.decode_sample(ev, data + self.stack_at, stack_len)
                if ev.pid in self.python:
                    sample.py = self._py_block(data, size)
                self.on_sample(sample)
        elif kind == "exec":
            self._set_top(ev.pid)
            self._forget_live(ev.pid, ev.id)
            if self.interposer is not None and ev.pid not in self.pids:
                self._child_exec(ev.pid)
            if self.on_exec is not None:
                self.on_exec(ev.pid)
        elif kind == "fork":
            self._fork(ev.pid, ev.other)
        elif kind == "exit":
            parent = self._unresolved_forks.pop(ev.pid, None)
            if parent is not None and self.on_fork is not None:
                self.on_fork(parent, ev.pid)
            try:
                del self.bpf[b"hp_targets"][ctypes.c_uint32(ev.pid)]  # its pid may be reused
            except KeyError:
                pass
            if self.on_exit is not None:
                self.on_exit(ev.pid)

    def _py_block(self, record: int, length: int) -> bytes | None:
        """The Python block (bpf/pyframes.h: its head and the frames filled) of the sample record
        of LENGTH bytes at RECORD: after its stack, at an 8-byte boundary; None if it has none."""
        stack_len = ctypes.c_uint32.from_address(record + self._stack_len_at).value
        at = self.stack_at + ((stack_len + 7) & ~7)
        if length < at + self.py_head_size:
            return None
        count = min(
            ctypes.c_uint32.from_address(record + at).value, (length - at - self.py_head_size) // self.py_frame_size
        )
        return ctypes.string_at(record + at, self.py_head_size + count * self.py_frame_size)

    def set_python(self, pid: int, config: Any | None) -> None:
        """Have the BPF program read PID's Python frames as CONFIG (a py_config) says, or not
        (None). Before attach: remembered, written when the maps exist."""
        if config is None:
            self.python.pop(pid, None)
        else:
            self.python[pid] = config
        if self.bpf is None or not self.py_frames:
            return
        write_python(self.bpf[b"hp_py"], pid, config)

    def decode_sample(self, ev: Any, stack: int, stack_len: int) -> HeapSample:
        """A HeapSample from a ring record's header EV (an hp_event) and its stack bytes."""
        return HeapSample(
            pid=ev.pid,
            tid=ev.tid,
            call=self.calls.get(ev.call, f"call{ev.call}"),
            size=ev.size,
            ts_ns=ev.ts,
            sample_id=ev.id,
            regs=tuple(ev.regs),
            stack=stack,
            stack_len=stack_len,
        )

    def _child_exec(self, pid: int) -> None:
        """A followed child exec'd (its loader may not have run yet): traced by the interposer
        if the new program will load it, else by uprobes on the libc it will map, attached for
        every process if not yet (filtered in BPF; samples before the attach are not seen)."""
        try:
            if self._choose_via(pid, loaded=False) == INTERPOSER:
                return
            exe = os.readlink(f"/proc/{pid}/exe")
        except (OSError, ProcessGone):
            return
        path = launch.predict_libc([exe], exe)
        if path is None or path in self.libcs:
            return
        try:
            plan = probe_plan(path)
            self.plans[path] = plan
            self._attach_file(path, -1)
        except PymtraceError as exc:  # not traced: the report says why
            self.via[pid] = (UPROBES, f"{self.via[pid][1]}; not probed: {exc}")
            return
        self.libcs[path] = [-1]

    def _fork(self, parent: int, child: int) -> None:
        """A clone in a followed process: a new process (reported) or a thread (not)."""
        thread = _is_thread(child)
        if thread is False and parent in self.via:
            self.via.setdefault(child, self.via[parent])  # BPF traces it as its parent
        if thread is None:  # gone already: a process's exit record will tell
            if len(self._unresolved_forks) >= _FORK_MEMORY:
                self._unresolved_forks.pop(next(iter(self._unresolved_forks)))
            self._unresolved_forks[child] = parent
        elif not thread:
            self._set_top(child)
            if self.on_fork is not None:
                self.on_fork(parent, child)

    def _forget_live(self, pid: int, last_id: int) -> None:
        """PID exec'd: the blocks of its old image sampled up to LAST_ID are gone with it."""
        table = self.bpf[b"hp_live"]
        for key, value in list(table.items()):
            if key.pid == pid and value.value <= last_id:
                try:
                    del table[key]
                except KeyError:
                    pass

    # -- results
    def live(self) -> dict[int, int]:
        """{sample_id: block address} of the sampled blocks not freed (so far)."""
        return {int(v.value): int(k.addr) for k, v in self.bpf[b"hp_live"].items()}

    def drops(self) -> dict[str, int]:
        """{counter: n} of everything dropped (bpf/heap.h HP_LOST_*), zeros included."""
        return lost_counts(self.bpf[b"hp_lost"], lost_names(PROGRAM, "HP"))

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        super().close()

    def snapshot(self) -> dict[str, Any]:
        """The source's counters in the snapshot shape (lost counts only)."""
        return {"lost": {f"heap_{k}": v for k, v in self.drops().items()}}
