"""Recording a launched command from inside it: pymtrace's LD_PRELOAD interposer and its rings.

    rings = RingSet(RingOptions(follow=True))
    proc = subprocess.Popen(argv, env=rings.env(os.environ))
    while proc.poll() is None:
        batches = rings.drain()                # [Batch(pid, generation, data, count)]
        for batch in batches:
            sink(batch.data)                   # struct record_event bytes, as BPF's ring gives
        if not rings.busy(batches):
            time.sleep(0.001)
    rings.finish(timeout=5)                    # the last processes' records
    rings.stats()                              # per process image: waits, records, allocator
    rings.close()

    why = not_preloadable(["/usr/bin/prog", ...])   # None, or one line: why only uprobes trace it

The library (pymtrace/tracee/native/interpose.c, built on first use by pymtrace.nativebuild)
wraps the malloc API and C++ operator new/delete, forwards each call to the next definition
and writes the record `record` writes (bpf/record.h) into a ring per process image: a file
PID.STAMP in a private directory made here (mkdtemp, 0700), shared memory, laid out as
pymtrace/tracee/native/interpose.h says (read from that header, never restated). A full ring
makes the calling thread wait; nothing is dropped. docs/internals.md, "The interposer".
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import re
import shutil
import stat
import struct
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from pymtrace import nativebuild
from pymtrace.bpf import structs
from pymtrace.bpf.load import bpf_dir
from pymtrace.errors import ProcessGone, PymtraceError

NATIVE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tracee", "native")
CFLAGS = [
    "-O2",
    "-Wall",
    "-fexceptions",  # a throwing operator new unwinds through the wrapper
    "-ftls-model=initial-exec",
    "-fvisibility=hidden",
    "-fno-plt",
]
LIBS = ["-ldl", "-lpthread"]

_H = structs.native_header("interpose", "tracee")
RingHeader = _H.structs["ring_header"]
EVENT = structs.header("record").structs["record_event"]
EVENT_SIZE = _H.consts["RING_EVENT_SIZE"]
_NAME = re.compile(r"^(\d+)\.(\d+)$")
_WORDS = EVENT_SIZE // 8
_TS = EVENT.rec.offset // 8 + 6  # rec.pad[0], the time, as a u64 word of a record
_ARANGE = np.arange(_H.consts["RING_MAX_SLOTS"], dtype=np.uint64)
LIVENESS_S = 0.05  # how often an idle ring's process is checked for having exited or exec'd
SCAN_S = 0.002  # how often the directory is listed for new rings (a new process's ring fills in ~4 ms)
SCAN_SHARE = 20  # ... but never more often than every 20 times what the last listing took


def library() -> str:
    """Path of the interposer, built on first use (a trusted, hash-keyed cache)."""
    bpf = str(bpf_dir())
    sources = [
        os.path.join(NATIVE, "interpose.c"),
        os.path.join(NATIVE, "interpose.h"),
        os.path.join(bpf, "record.h"),
        os.path.join(bpf, "common.h"),
    ]
    return nativebuild.build_cached(
        "interpose", sources, [*CFLAGS, "-I", bpf], LIBS, kind="shared", what="allocation interposer"
    )


@dataclasses.dataclass(frozen=True)
class RingOptions:
    follow: bool = True  # trace the processes the command forks (else: it and its execs)
    slots: int = _H.consts["RING_SLOTS"]  # records per ring, a power of two
    parent: str | None = None  # where the ring directory is made (default: /dev/shm, else $TMPDIR)


class Batch(NamedTuple):
    pid: int
    generation: int  # 0, then one more per later image of the pid (an exec)
    data: memoryview  # `count` struct record_event (bpf/record.h), in the process's call order
    count: int


@dataclasses.dataclass
class RingStats:
    pid: int
    generation: int
    allocator: str  # the object its calls were forwarded to
    glibc_chunks: bool  # size2/size3 are glibc chunk sizes
    records: int  # drained so far
    waits: int  # calls that found the ring full and waited
    wait_ns: int
    deferred: int  # calls of a signal handler that interrupted its thread's write
    torn: int  # slots reserved but never written (the process died mid-write)
    done: bool  # the process image ended and every record was drained
    detached: bool  # recording stopped (the consumer closed or was gone)


class Ring:
    """One process image's ring, mapped by the consumer."""

    def __init__(self, path: str, pid: int, stamp: int, fd: int, size: int) -> None:
        self.path, self.pid, self.stamp = path, pid, stamp
        self.generation = 0  # set by the RingSet: this pid's images seen before it
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.header = RingHeader.from_buffer(self.map)
        self.slots = self.header.slots
        self.mask = self.slots - 1
        base = self.header.header_size
        self.seq = np.frombuffer(self.map, dtype=np.uint64, count=self.slots, offset=base)
        self.events = base + 8 * self.slots
        self.records = self.torn = 0
        self.tsc = bool(self.header.flags & _H.consts["RING_F_TSC"])
        self.done = False
        self.checked = time.monotonic()

    def take(self, final: bool = False) -> list[np.ndarray]:
        """The committed records from tail on, in order, as (n, 9) uint64 copies (FINAL: the
        writers are gone, so a slot reserved but never written is skipped, and counted in
        `torn`)."""
        h = self.header
        tail = h.tail
        n = min(h.head - tail, self.slots)
        if n <= 0:
            return []
        start = tail & self.mask
        parts, taken = [], 0
        for first, count in ((start, min(n, self.slots - start)), (0, n - min(n, self.slots - start))):
            if count == 0:
                break
            ok = self.seq[first : first + count] - np.uint64(tail + taken + 1) == _ARANGE[:count]
            rows = np.frombuffer(
                self.map, dtype=np.uint64, count=count * _WORDS, offset=self.events + first * EVENT_SIZE
            )
            rows = rows.reshape(count, _WORDS)
            if final:
                idx = np.flatnonzero(ok)
                self.torn += count - len(idx)
                parts.append(rows[idx])
                taken += count
                continue
            good = count if ok.all() else int(np.argmin(ok))
            if good:
                parts.append(rows[:good].copy())
            taken += good
            if good < count:
                break
        h.tail = tail + taken  # after the copy: the producers may reuse those slots now
        self.records += sum(len(p) for p in parts)
        return [p for p in parts if len(p)]

    def alive(self) -> bool:
        """Whether the process still maps this ring (gone, a zombie, or exec'd: no)."""
        try:
            with open(f"/proc/{self.pid}/maps") as f:
                text = f.read()
        except OSError:
            return False
        return f" {self.path}\n" in text

    def stats(self) -> RingStats:
        h = self.header
        return RingStats(
            self.pid,
            self.generation,
            h.allocator.decode(errors="replace"),
            bool(h.flags & _H.consts["RING_F_GLIBC_CHUNKS"]),
            self.records,
            h.waits,
            h.wait_ns,
            h.deferred,
            self.torn,
            self.done,
            bool(h.detached),
        )

    def close(self) -> None:
        del self.header, self.seq  # the buffer's exports, before the map can close
        self.map.close()


class Clock:
    """Maps time stamp counter values (a ring flagged RING_F_TSC stamps records with them) to
    CLOCK_MONOTONIC ns: linear between pairs of both read together (clockpair.c), one taken
    when the consumer starts and one after each drain's copy, so every record lies between
    two pairs."""

    KEEP = 256

    def __init__(self) -> None:
        path = nativebuild.build_cached(
            "clockpair", [os.path.join(NATIVE, "clockpair.c")], ["-O2"], kind="shared", what="clock helper"
        )
        self._fn = ctypes.CDLL(path).pymtrace_clock_pair
        self._fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
        self._fn.restype = None
        self._a, self._b = ctypes.c_uint64(), ctypes.c_uint64()
        self.tsc: list[int] = []
        self.ns: list[int] = []
        self.pair()

    def pair(self) -> None:
        self._fn(ctypes.byref(self._a), ctypes.byref(self._b))
        self.tsc.append(self._a.value)
        self.ns.append(self._b.value)
        if len(self.tsc) > 2 * self.KEEP:  # the first pair and the latest ones
            del self.tsc[1 : -self.KEEP], self.ns[1 : -self.KEEP]

    def to_ns(self, tsc: np.ndarray) -> np.ndarray:
        """TSC (uint64 counter values) as CLOCK_MONOTONIC ns (uint64). Most values lie
        between the last two pairs (one linear map); the others are interpolated over all the
        pairs kept, and beyond them extended at the rate over all of them."""
        t1, n1 = self.tsc[-2], self.ns[-2]
        t2, n2 = self.tsc[-1], self.ns[-1]
        x = tsc.view(np.int64) - t1
        out = x * ((n2 - n1) / max(t2 - t1, 1)) + 0.5
        older = np.flatnonzero(x < 0)
        if len(older):
            t0, n0 = self.tsc[0], self.ns[0]
            t = np.array(self.tsc, dtype=np.int64) - t0
            n = np.array(self.ns, dtype=np.int64) - n0
            y = (tsc[older].view(np.int64) - t0).astype(np.float64)
            rate = n[-1] / max(t[-1], 1)
            old = np.where(y < 0, y * rate, np.interp(y, t, n))
            out[older] = old + (n0 - n1) + 0.5
        return (out.astype(np.int64) + n1).view(np.uint64)


def _ring_dir_parent() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


class RingSet:
    """The ring directory of one traced command and every ring its processes registered."""

    def __init__(self, options: RingOptions = RingOptions(), lib: str | None = None) -> None:
        slots = options.slots
        if slots & (slots - 1) or not _H.consts["RING_MIN_SLOTS"] <= slots <= _H.consts["RING_MAX_SLOTS"]:
            raise PymtraceError(f"ring slots must be a power of two in [1024, 2^24], not {slots}")
        self.options = options
        self.lib = lib or library()
        if any(c in self.lib for c in " :"):
            raise PymtraceError(f"the interposer's path {self.lib} holds a space or colon: LD_PRELOAD cannot name it")
        # mkdtemp: 0700, a fresh name; the library never follows a symlink inside it
        self.directory = os.path.realpath(
            tempfile.mkdtemp(prefix="pymtrace-rings-", dir=options.parent or _ring_dir_parent())
        )
        self.rings: dict[str, Ring] = {}
        self.retired: set[str] = set()
        self._generations: dict[int, int] = {}  # pid -> its images seen
        self.finished: list[RingStats] = []
        self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._scanned = 0.0
        self._scan_every = SCAN_S
        self.clock = Clock()

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """BASE with what a launched command needs to be recorded: the library first in
        LD_PRELOAD (so the next definitions are the user's own preloads, then the libraries)."""
        env = dict(base)
        old = env.get("LD_PRELOAD", "").strip()
        env["LD_PRELOAD"] = self.lib + (":" + old if old else "")
        env["PYMTRACE_RING_DIR"] = self.directory
        env["PYMTRACE_FOLLOW"] = "1" if self.options.follow else "0"
        env["PYMTRACE_RING_SLOTS"] = str(self.options.slots)
        env["PYMTRACE_RING_OWNER"] = str(os.getpid())
        return env

    def _scan(self) -> None:
        found = []
        for name in os.listdir(self._dir_fd):
            m = _NAME.match(name)
            if m and name not in self.rings and name not in self.retired:
                found.append((int(m.group(1)), int(m.group(2)), name))
        for pid, stamp, name in sorted(found):  # a pid's images in the order they were made
            ring = self._open(name, pid, stamp)
            if ring is not None:
                ring.generation = self._generations.get(pid, 0)
                self._generations[pid] = ring.generation + 1
                self.rings[name] = ring

    def _open(self, name: str, pid: int, stamp: int) -> Ring | None:
        """NAME's ring once its header is complete (None: not yet, or not one of ours)."""
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < _H.consts["RING_HEADER_SIZE"]:
                return None
            head = os.pread(fd, 24, 0)
            magic, version, header_size, slots, event_size = struct.unpack("<QIIII", head)
            if magic != _H.consts["RING_MAGIC"]:
                return None  # still being created
            size = header_size + slots * (8 + EVENT_SIZE)
            if (
                version != _H.consts["RING_VERSION"]
                or header_size != _H.consts["RING_HEADER_SIZE"]
                or event_size != EVENT_SIZE
                or slots & (slots - 1)
                or st.st_size != size
            ):
                raise PymtraceError(f"{name}: not a ring of this pymtrace version")
            return Ring(os.path.join(self.directory, name), pid, stamp, fd, size)
        finally:
            os.close(fd)

    def drain(self) -> list[Batch]:
        """The records written since the last drain, a batch per process image, a process's
        images in exec order; a ring whose process ended or exec'd (a newer ring of its pid
        exists, or the process maps it no more) is drained to its end and retired. Each call
        costs some microseconds whatever it finds: a caller polling in a loop should sleep a
        millisecond or so while batches are small (see `busy`)."""
        now = time.monotonic()
        if now - self._scanned >= self._scan_every:
            # a retired ring keeps its name: with thousands of processes the listing itself
            # gets costly, so its share of the consumer's time is bounded
            self._scan()
            self._scanned = time.monotonic()
            self._scan_every = max(SCAN_S, (self._scanned - now) * SCAN_SHARE)
        newest = {}
        for ring in self.rings.values():
            newest[ring.pid] = max(newest.get(ring.pid, -1), ring.stamp)
        taken = []
        for name, ring in sorted(self.rings.items(), key=lambda item: (item[1].pid, item[1].stamp)):
            replaced = ring.stamp < newest[ring.pid]
            parts = [] if replaced else ring.take()
            if replaced or (not parts and now - ring.checked >= LIVENESS_S):
                ring.checked = now
                if replaced or not ring.alive():  # no writer can come back: the rest, then retire it
                    parts = ring.take(final=True)
                    self._retire(name, ring)
            taken.append((ring, parts))
        self.clock.pair()  # after the copies: every record taken is older
        out = []
        for ring, parts in taken:
            for rows in parts:
                if ring.tsc:
                    rows[:, _TS] = self.clock.to_ns(rows[:, _TS])
                out.append(Batch(ring.pid, ring.generation, memoryview(rows).cast("B"), len(rows)))
        return out

    def _retire(self, name: str, ring: Ring) -> None:
        """Done with NAME: detached (a writer this consumer did not know of, a child cloned
        without fork's handlers, stops writing) and removed."""
        ring.done = True
        self.finished.append(ring.stats())
        del self.rings[name]
        self.retired.add(name)
        ring.header.detached = _H.consts["RING_F_DETACHED"]
        ring.close()
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except OSError:
            pass

    def busy(self, batches: list[Batch]) -> bool:
        """Whether BATCHES (one drain's) filled a ring by a quarter or more: drain again at
        once, rather than sleep (so the producers do not find it full)."""
        return any(b.count * 4 >= self.options.slots for b in batches)

    def live(self) -> int:
        """Rings whose process image may still write."""
        return len(self.rings)

    def finish(self, timeout: float = 5.0) -> Iterator[Batch]:
        """Drain until every ring's process image has ended (or TIMEOUT seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            self._scanned = 0.0  # a process may register at the last moment
            batches = self.drain()
            yield from batches
            if not self.rings or time.monotonic() >= deadline:
                return
            if not self.busy(batches):
                time.sleep(0.001)

    def stats(self) -> list[RingStats]:
        """Every ring seen: retired ones, then live ones, each in registration order."""
        return self.finished + [r.stats() for r in self.rings.values()]

    def close(self) -> None:
        """Stop recording (a process still running goes on untraced, never blocked) and
        remove the directory."""
        for ring in self.rings.values():
            ring.header.detached = _H.consts["RING_F_DETACHED"]
            self.finished.append(ring.stats())
            ring.close()
        self.rings.clear()
        os.close(self._dir_fd)
        shutil.rmtree(self.directory, ignore_errors=True)


def records(data: bytes) -> np.ndarray:
    """DATA (a Batch's) as a structured array of record_event (fields: thread, type, ptr1,
    ptr2, size, size2, size3, ts, caller, tgid)."""
    dtype = np.dtype(
        {
            "names": ["thread", "type", "ptr1", "ptr2", "size", "size2", "size3", "ts", "caller", "tgid"],
            "formats": ["<i4", "<u4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8"],
            "offsets": [0, 4, 8, 16, 24, 32, 40, 48, 56, 64],
            "itemsize": EVENT_SIZE,
        }
    )
    return np.frombuffer(data, dtype=dtype)


# -- can this command be preloaded? -----------------------------------------------------------
_SHN_UNDEF = 0
_STT_FUNC = 2
_SYM = struct.Struct("<IBBHQQ")


def _unwrapped() -> frozenset[str]:
    """The allocating and freeing functions of jemalloc's, tcmalloc's and mimalloc's own APIs
    (mallocx, tc_malloc, mi_malloc, ...): the interposer wraps only the standard ones."""
    from pymtrace.tracee import allocators

    standard = {f.name for f in allocators.STANDARD}
    return (
        frozenset(f.name for family in ("jemalloc", "tcmalloc", "mimalloc") for f in allocators.FAMILIES[family])
        - standard
    )


def _malloc_symbols(path: str) -> tuple[bool, list[str]]:
    """(whether PATH itself defines a function `malloc`, the functions of an allocator's own
    API it imports). Read from .dynsym and .symtab; an undefined `malloc`, even with a PLT
    address, is no definition."""
    from elftools.elf.elffile import ELFFile  # ~45 ms to import: once per launched command

    unwrapped = _unwrapped()
    defines, imports = False, set()
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for name in (".dynsym", ".symtab"):
            section = elf.get_section_by_name(name)
            if section is None:
                continue
            strtab = elf.get_section(section["sh_link"]).data()
            for st_name, info, _other, shndx, _value, _size in _SYM.iter_unpack(section.data()):
                end = strtab.find(b"\0", st_name)
                symbol = strtab[st_name:end].decode("utf-8", "replace").split("@")[0]
                if symbol == "malloc" and shndx != _SHN_UNDEF and info & 0xF == _STT_FUNC:
                    defines = True
                elif shndx == _SHN_UNDEF and symbol in unwrapped:
                    imports.add(symbol)
    return defines, sorted(imports)


def not_preloadable(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """Why the command ARGV cannot be recorded by the interposer (one line), or None. Follows
    #! scripts to their interpreter; PATH from ENV (default os.environ)."""
    env = os.environ if env is None else env
    program = argv[0]
    for _ in range(5):  # #! chains
        path = program if "/" in program else shutil.which(program, path=env.get("PATH", os.defpath))
        if path is None:
            return f"{program}: not found"
        try:
            with open(path, "rb") as f:
                head = f.read(256)
            st = os.stat(path)
        except OSError as exc:
            return f"{path}: {exc.strerror}"
        if head.startswith(b"#!"):
            words = head[2:].split(b"\n")[0].split()
            if not words:
                return f"{path}: a #! line without an interpreter"
            program = os.fsdecode(words[0])
            continue
        break
    else:
        return f"{argv[0]}: too many #! interpreters"
    if head[:4] != b"\x7fELF":
        return f"{path}: not an ELF executable"
    if head[4] != 2 or head[5] != 1 or struct.unpack_from("<H", head, 18)[0] != 62:
        return f"{path}: not a 64-bit x86-64 program, the interposer cannot be loaded into it"
    if (st.st_mode & stat.S_ISUID and st.st_uid != os.geteuid()) or (
        st.st_mode & stat.S_ISGID and st.st_gid != os.getegid()
    ):
        return f"{path}: setuid/setgid, the dynamic loader ignores LD_PRELOAD for it (secure mode)"
    try:
        if os.getxattr(path, "security.capability"):
            return f"{path}: has file capabilities, the dynamic loader ignores LD_PRELOAD for it (secure mode)"
    except OSError:
        pass
    from pymtrace.tracee import elf

    headers = elf.program_headers(path)
    loader = re.search(r"/ld-linux[^/]*\.so", os.path.realpath(path))
    if headers is None or (not loader and not any(s.type == elf.PT_INTERP for s in headers.segments)):
        return f"{path}: a static binary, no dynamic loader runs to preload a library"
    try:
        own, imports = _malloc_symbols(path)
    except Exception:  # pyelftools raises many types on a malformed file
        own, imports = False, []
    if own:
        return f"{path}: defines malloc itself, its definition wins over a preloaded one"
    if imports:
        return f"{path}: calls an allocator's own API ({', '.join(imports[:3])}), which the interposer does not wrap"
    return None


# -- heap's sampling mode ---------------------------------------------------------------------
# The same library, started with PYMTRACE_SAMPLE_BYTES instead of a ring directory: it draws
# heap's samples in-process and tells only the sampled allocations and their frees, through
# its USDT probes (pymtrace:heap_alloc, pymtrace:heap_free), to heap's BPF program.
SAMPLE_PROVIDER = "pymtrace"
SAMPLE_PROBES = ("heap_alloc", "heap_free")


@dataclasses.dataclass(frozen=True)
class SampleOptions:
    sample_bytes: int  # the mean bytes between samples (1: every call)
    max_live: int  # sampled blocks remembered until freed (heap --max-live)
    follow: bool = False  # the command's children sample too (else: it and its execs)


def check_preload_path(lib: str) -> None:
    """A PymtraceError if LD_PRELOAD cannot name LIB (a space or a colon separates its entries)."""
    if any(c in lib for c in " :"):
        raise PymtraceError(f"the interposer's path {lib} holds a space or colon: LD_PRELOAD cannot name it")


def sampling_env(base: Mapping[str, str], lib: str, options: SampleOptions) -> dict[str, str]:
    """BASE with what a launched command needs to be sampled in-process by LIB: LIB first in
    LD_PRELOAD (the user's own preloads, then the libraries, are the next definitions)."""
    check_preload_path(lib)
    env = {k: v for k, v in base.items() if k != "PYMTRACE_RING_DIR"}  # sampling, no ring
    old = env.get("LD_PRELOAD", "").strip()
    env["LD_PRELOAD"] = lib + (":" + old if old else "")
    env["PYMTRACE_SAMPLE_BYTES"] = str(options.sample_bytes)
    env["PYMTRACE_SAMPLE_LIVE"] = str(options.max_live)
    env["PYMTRACE_FOLLOW"] = "1" if options.follow else "0"
    env["PYMTRACE_SAMPLE_PARENT"] = str(os.getpid())  # not following: only this process's child samples
    return env


def sample_sites(lib: str) -> list:
    """The USDT probe sites (tracee.elf.UsdtProbe) of LIB's sampling mode; a PymtraceError when
    LIB has not both."""
    from pymtrace.tracee import elf

    sites = [p for p in elf.usdt_probes(lib, provider=SAMPLE_PROVIDER) if p.name in SAMPLE_PROBES]
    if {p.name for p in sites} != set(SAMPLE_PROBES):
        raise PymtraceError(f"{lib}: the interposer has no heap_alloc/heap_free USDT probes (built without sys/sdt.h?)")
    return sites


def maps_file(pid: int, path: str) -> bool:
    """Whether process PID maps the file PATH (by name in /proc/PID/maps). Raises ProcessGone."""
    from pymtrace.tracee import libc

    return any(m.path == path for m in libc.read_maps(pid) or ())


def preload_problem(pid: int, lib: str) -> str | None:
    """Why process PID, which has just exec'd, will not run with LIB loaded (one line), or None:
    read from its own environment and its program (not_preloadable), before its loader ran.
    Raises ProcessGone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            words = f.read().split(b"\0")
        exe = os.readlink(f"/proc/{pid}/exe")
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(pid) from None
    except OSError as exc:
        return f"process {pid}: {exc.strerror}"
    env = dict(w.decode(errors="replace").split("=", 1) for w in words if b"=" in w)
    if lib not in re.split(r"[ :]", env.get("LD_PRELOAD", "")):
        return f"{exe}: LD_PRELOAD no longer names the interposer (its environment was changed)"
    return not_preloadable([exe], env)
