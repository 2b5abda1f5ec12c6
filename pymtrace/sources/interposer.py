"""Recording a launched command from inside it: pymtrace's LD_PRELOAD interposer and its rings.

    rings = RingSet(RingOptions(follow=True))
    proc = subprocess.Popen(argv, env=rings.env(os.environ))
    while proc.poll() is None:
        batches = rings.drain()                # [Batch(pid, generation, data, count)]
        for batch in batches:
            sink(batch.data)                   # 64-byte mtrace records (valid until the next drain)
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
StackModule = _H.structs["stack_module"]
EVENT_SIZE = _H.consts["RING_EVENT_SIZE"]  # a ring slot's struct record_event (bpf/record.h)
RECORD_SIZE = ctypes.sizeof(structs.header("record").structs["mtrace_record"])  # what a Batch holds
_NAME = re.compile(r"^(\d+)\.(\d+)$")
_WORDS = RECORD_SIZE // 8
TAKE_RECORDS = 1 << 16  # records copied out of a ring at a time (4 MiB: the copy stays in the cache)
LIVENESS_S = 0.05  # how often an idle ring's process is checked for having exited or exec'd
SCAN_S = 0.002  # how often the directory is listed for new rings (a new process's ring fills in ~4 ms)
SCAN_SHARE = 20  # ... but never more often than every 20 times what the last listing took


ENV = "PYMTRACE_RING"  # the one variable the library reads to record (interpose.c: OWNER:FOLLOW:SLOTS:FRAMES:DIR)
SAMPLE_ENV = "PYMTRACE_SAMPLE"  # ... and to sample for heap (PARENT:FOLLOW:BYTES:LIVE)


def ring_variable(owner: int, follow: bool, slots: int, directory: str, frames: int = 0) -> str:
    """ENV's value: the consumer's pid, whether forks are followed, slots per ring, the frames
    of each allocation's stack (0: no stacks), the ring directory."""
    return f"{owner}:{int(follow)}:{slots}:{frames}:{directory}"


def library() -> str:
    """Path of the interposer, built on first use (a trusted, hash-keyed cache)."""
    bpf = str(bpf_dir())
    sources = [
        os.path.join(NATIVE, "interpose.c"),
        os.path.join(NATIVE, "interpose.h"),
        os.path.join(bpf, "record.h"),
        os.path.join(bpf, "common.h"),
    ]
    # everyone: a child that switches user (su, runuser) still loads it, not an error of the loader's
    return nativebuild.build_cached(
        "interpose", sources, [*CFLAGS, "-I", bpf], LIBS, kind="shared", what="allocation interposer", everyone=True
    )


@dataclasses.dataclass(frozen=True)
class RingOptions:
    follow: bool = True  # trace the processes the command forks (else: it and its execs)
    slots: int = _H.consts["RING_SLOTS"]  # records per ring, a power of two
    parent: str | None = None  # where the ring directory is made (default: /dev/shm, else $TMPDIR)
    frames: int = 0  # record --stacks: each allocation's stack, at most this many frames (0: none)


def stack_table_parts(at: int) -> tuple[int, int, int]:
    """Where the entry offsets, the modules and the entries of a stack table at AT are."""
    offs = at + 8 * _H.consts["STACK_HASH_SLOTS"]
    mods = offs + ((4 * (_H.consts["STACK_IDS"] + 1) + 4095) & ~4095)
    return offs, mods, mods + ctypes.sizeof(StackModule) * _H.consts["STACK_MODULES"]


def stack_table_offset(slots: int) -> int:
    """Where a ring of SLOTS slots has its stack table (interpose.c's arithmetic)."""
    return (_H.consts["RING_HEADER_SIZE"] + slots * (8 + EVENT_SIZE) + 4095) & ~4095


def ring_size(slots: int, stacks: bool) -> int:
    """A ring file's size: its header, SLOTS sequence words and events, and with STACKS the
    stack table."""
    if not stacks:
        return _H.consts["RING_HEADER_SIZE"] + slots * (8 + EVENT_SIZE)
    at = stack_table_offset(slots)
    return stack_table_parts(at)[2] + 8 * _H.consts["STACK_WORDS"]


def slots_for(size: int) -> int:
    """The slots of a ring of at most SIZE bytes of records (a power of two, within the
    library's bounds)."""
    slots = 1 << max(0, (size // (8 + EVENT_SIZE)).bit_length() - 1)
    return min(max(slots, _H.consts["RING_MIN_SLOTS"]), _H.consts["RING_MAX_SLOTS"])


class Stack(NamedTuple):
    """A stack a process interned in its ring's table (interpose.h)."""

    ips: tuple[int, ...]  # return addresses, innermost first
    cut: bool  # deeper than the frame limit
    call: int  # the call type of the first record that names it (its allocating function)


class Module(NamedTuple):
    """An object a process had loaded when it wrote a stack (interpose.h's stack_module)."""

    bias: int  # a return address minus this is its ELF virtual address
    start: int  # its lowest mapped page and its end, as /proc/PID/maps would show them
    end: int
    path: str


class Batch(NamedTuple):
    pid: int
    generation: int  # 0, then one more per later image of the pid (an exec)
    data: memoryview  # `count` 64-byte mtrace records (bpf/record.h), in the process's call order
    count: int
    types: tuple[int, ...]  # the records per call type (index: the dj/malloc type, 0-8)
    # with stacks: the ring's stack ids (bits 8-31 of a record's type word) first seen in
    # this batch, and their stacks; a later batch of the same image names them by id only;
    # the objects the process added since the last batch (where those stacks' addresses are)
    stacks: dict[int, Stack] = {}
    modules: tuple[Module, ...] = ()


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
    stacks: int = 0  # stack ids handed out (record --stacks)
    stacks_full: int = 0  # allocations recorded without a stack: the table was full
    stacks_nested: int = 0  # ... a signal handler's, while its thread was unwinding
    stack_error: str | None = None  # why the process took no stacks at all


_STACK_ERRORS = {_H.consts["STACK_E_NOLIB"]: "libunwind (libunwind.so.8) could not be loaded into it"}


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
        self._anchor = ctypes.c_char.from_buffer(self.map)  # the mapping's address (an export: closed first)
        self.seq_address = ctypes.addressof(self._anchor) + base
        self.events_address = self.seq_address + 8 * self.slots
        self.records = self.torn = 0
        self.tsc = bool(self.header.flags & _H.consts["RING_F_TSC"])
        self.done = False
        self.checked = time.monotonic()
        self.stack_offs = self.stack_words = self.modules = None
        self.stacks_seen: set[int] = set()
        self.modules_seen: set[int] = set()
        at = self.header.stack_offset
        if at:  # the stack table (interpose.h): entry offsets by id, the modules, the entries
            offs, mods, words = stack_table_parts(at)
            self.stack_offs = np.frombuffer(self.map, dtype=np.uint32, count=_H.consts["STACK_IDS"] + 1, offset=offs)
            self.modules = (StackModule * _H.consts["STACK_MODULES"]).from_buffer(self.map, mods)
            self.stack_words = np.frombuffer(self.map, dtype=np.uint64, count=_H.consts["STACK_WORDS"], offset=words)

    def new_modules(self) -> tuple[Module, ...]:
        """The modules written since the last call (interpose.h: before the stacks that need them)."""
        if self.modules is None:
            return ()
        out = []
        for i in range(min(self.header.module_next, len(self.modules))):
            m = self.modules[i]
            if i not in self.modules_seen and m.ready:
                self.modules_seen.add(i)
                out.append(Module(m.bias, m.start, m.end, m.path.decode(errors="surrogateescape")))
        return tuple(out)

    def new_stacks(self, records: np.ndarray) -> dict[int, Stack]:
        """The stacks RECORDS ((n, 8) uint64, taken from this ring) name that no earlier batch
        did, by id. A record's id has its entry written (interpose.h)."""
        if self.stack_offs is None or not len(records):
            return {}
        ids, first = np.unique((records[:, 0] >> np.uint64(40)) & np.uint64(0xFFFFFF), return_index=True)
        out = {}
        last = _H.consts["STACK_IDS"]
        for i, f in zip(ids.tolist(), first.tolist()):
            if i == 0 or i in self.stacks_seen or i > last:
                continue
            at = int(self.stack_offs[i]) - 1
            if at < 0:
                continue  # (never: the writer stores the offset before the id is used)
            head = int(self.stack_words[at])
            n = min(head & 0xFFFF, _H.consts["STACK_MAX_FRAMES"])
            out[i] = Stack(
                tuple(self.stack_words[at + 1 : at + 1 + n].tolist()),
                bool((head >> 16) & _H.consts["STACK_F_CUT"]),
                int(records[f, 0] >> np.uint64(32)) & 0xFF,
            )
            self.stacks_seen.add(i)
        return out

    def take(self, out: np.ndarray, types: ctypes.Array, final: bool = False) -> int:
        """Copy the committed records from tail on into OUT ((n, 8) uint64: as many as fit) as
        64-byte records, adding to TYPES (9 counts: per call type); how many (FINAL: the writers
        are gone, so a slot reserved but never written is skipped, and counted in `torn`). Their
        times are still counter values if `tsc` (Clock.map_times)."""
        h = self.header
        tail = h.tail
        n = min(h.head - tail, self.slots, len(out))
        if n <= 0:
            return 0
        written, torn = ctypes.c_uint64(), ctypes.c_uint64()
        taken = _Native.get().pymtrace_ring_take(
            self.seq_address, self.events_address, self.slots, tail, n, int(final), out.ctypes.data,
            ctypes.byref(written), ctypes.byref(torn), types,
        )  # fmt: skip
        h.tail = tail + taken  # after the copy: the producers may reuse those slots now
        self.torn += torn.value
        self.records += written.value
        return written.value

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
            h.stack_next,
            h.stacks_full,
            h.stacks_nested,
            _STACK_ERRORS.get(h.stack_error, f"error {h.stack_error}") if h.stack_error else None,
        )

    def close(self) -> None:
        # the buffer's exports, before the map can close
        del self.header, self._anchor, self.stack_offs, self.stack_words, self.modules
        self.map.close()


class _Native:
    """ringtake.c, loaded once: the clock pair and the rings' copy."""

    _lib = None

    @classmethod
    def get(cls) -> ctypes.CDLL:
        if cls._lib is None:
            path = nativebuild.build_cached(
                "ringtake", [os.path.join(NATIVE, "ringtake.c")], ["-O2"], kind="shared", what="ring reader"
            )
            lib = ctypes.CDLL(path)
            u64, p64 = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)
            lib.pymtrace_clock_pair.argtypes = [p64, p64]
            lib.pymtrace_clock_pair.restype = None
            lib.pymtrace_ring_take.argtypes = [
                ctypes.c_void_p, ctypes.c_void_p, u64, u64, u64, ctypes.c_int, ctypes.c_void_p, p64, p64, p64,
            ]  # fmt: skip
            lib.pymtrace_ring_take.restype = u64
            lib.pymtrace_map_times.argtypes = [ctypes.c_void_p, u64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            lib.pymtrace_map_times.restype = None
            cls._lib = lib
        return cls._lib


class Clock:
    """Maps time stamp counter values (a ring flagged RING_F_TSC stamps records with them) to
    CLOCK_MONOTONIC ns: linear between pairs of both read together (ringtake.c), one when the
    consumer starts and one after each drain's copy, so every record lies between two pairs."""

    KEEP = 256  # pairs kept: the first and the latest ones

    def __init__(self) -> None:
        self._lib = _Native.get()
        self._a, self._b = ctypes.c_uint64(), ctypes.c_uint64()
        self.tsc = np.zeros(2 * self.KEEP + 1, dtype=np.int64)
        self.ns = np.zeros(2 * self.KEEP + 1, dtype=np.int64)
        self.count = 0
        self.pair()

    def pair(self) -> None:
        self._lib.pymtrace_clock_pair(ctypes.byref(self._a), ctypes.byref(self._b))
        if self.count == len(self.tsc):  # the first pair and the latest ones
            keep = self.KEEP
            self.tsc[1 : 1 + keep] = self.tsc[self.count - keep : self.count]
            self.ns[1 : 1 + keep] = self.ns[self.count - keep : self.count]
            self.count = 1 + keep
        self.tsc[self.count], self.ns[self.count] = self._a.value, self._b.value
        self.count += 1

    def map_times(self, records: np.ndarray) -> None:
        """RECORDS ((n, 8) uint64 rows, the time in word 6): counter values to ns, in place."""
        if self.count < 2:
            self.pair()
        self._lib.pymtrace_map_times(
            records.ctypes.data, len(records), self.tsc.ctypes.data, self.ns.ctypes.data, self.count
        )


def _ring_dir_parent() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


_PREFIX = "pymtrace-rings-"  # + the consumer's pid + "-" + mkdtemp's letters


def sweep_stale(parent: str) -> int:
    """Remove the ring directories in PARENT that a consumer of this user left behind when it
    was killed (SIGKILL: no close()), the rings' memory with them; how many. A directory of
    a consumer still running, or of another user, is left alone."""
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        m = re.fullmatch(re.escape(_PREFIX) + r"(\d+)-\w+", name)
        if m is None:
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


def private_dir(parent: str | None = None) -> str:
    """A fresh directory for the interposer's shared files, made in PARENT (default: /dev/shm,
    else $TMPDIR) after removing those killed consumers left there: mkdtemp, 0700, its real
    path (the library never follows a symlink inside it)."""
    parent = parent or _ring_dir_parent()
    sweep_stale(parent)
    return os.path.realpath(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent))


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
        self.directory = private_dir(options.parent)
        self.rings: dict[str, Ring] = {}
        self.retired: set[str] = set()
        self._generations: dict[int, int] = {}  # pid -> its images seen
        self.finished: list[RingStats] = []
        self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._scanned = 0.0
        self._scan_every = SCAN_S
        self.clock = Clock()
        self._buffer = np.empty((TAKE_RECORDS, _WORDS), dtype=np.uint64)  # drain(): the batches' records
        self._tsc: list[bool] = []  # per batch of the drain under way: its times are counter values

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """BASE with what a launched command needs to be recorded: the library first in
        LD_PRELOAD (so the next definitions are the user's own preloads, then the libraries)."""
        env = dict(base)
        old = env.get("LD_PRELOAD", "").strip()
        env["LD_PRELOAD"] = self.lib + (":" + old if old else "")
        env[ENV] = ring_variable(
            os.getpid(), self.options.follow, self.options.slots, self.directory, self.options.frames
        )
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
            (stack_at,) = struct.unpack("<Q", os.pread(fd, 8, RingHeader.stack_offset.offset))
            size = ring_size(slots, stack_at != 0)
            if (
                version != _H.consts["RING_VERSION"]
                or header_size != _H.consts["RING_HEADER_SIZE"]
                or event_size != EVENT_SIZE
                or slots & (slots - 1)
                or st.st_size != size
                or stack_at not in (0, stack_table_offset(slots))
            ):
                raise PymtraceError(f"{name}: not a ring of this pymtrace version")
            return Ring(os.path.join(self.directory, name), pid, stamp, fd, size)
        finally:
            os.close(fd)

    def drain(self) -> list[Batch]:
        """The records written since the last drain, a batch per process image, a process's
        images in exec order, valid until the next drain (one buffer holds them); a ring whose process ended or exec'd (a newer ring of its pid
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
        out, used = [], 0
        for name, ring in sorted(self.rings.items(), key=lambda item: (item[1].pid, item[1].stamp)):
            replaced = ring.stamp < newest[ring.pid]
            types = (ctypes.c_uint64 * 9)()
            n = 0 if replaced else ring.take(self._room(used), types)
            final = replaced
            if not n and not replaced and now - ring.checked >= LIVENESS_S:
                ring.checked = now
                final = not ring.alive()
            if final:  # no writer can come back: the rest, then retire it
                n = self._take_rest(ring, used, n, types)
            if n:
                out.append(self._batch(ring, used, n, types))
                used += n
            if final:  # (after its batch: its stacks are read from it)
                self._retire(name, ring)
        return self._timed(out)

    def _timed(self, batches: list[Batch]) -> list[Batch]:
        """BATCHES with counter times mapped to ns, from a pair read after their copy."""
        self.clock.pair()
        for batch, ring_tsc in zip(batches, self._tsc):
            if ring_tsc:
                self.clock.map_times(np.frombuffer(batch.data, dtype=np.uint64).reshape(batch.count, _WORDS))
        self._tsc = []
        return batches

    def _room(self, used: int) -> np.ndarray:
        """The drain buffer from record USED on (TAKE_RECORDS at least), grown as needed: the
        batches of one drain are consecutive parts of it."""
        if len(self._buffer) - used < TAKE_RECORDS:
            grown = np.empty((max(2 * len(self._buffer), used + TAKE_RECORDS), _WORDS), dtype=np.uint64)
            grown[:used] = self._buffer[:used]
            self._buffer = grown
        return self._buffer[used : used + TAKE_RECORDS]

    def _batch(self, ring: Ring, start: int, n: int, types: ctypes.Array) -> Batch:
        self._tsc.append(ring.tsc)
        records = self._buffer[start : start + n]
        stacks = ring.new_stacks(records)
        modules = ring.new_modules() if stacks else ()
        return Batch(ring.pid, ring.generation, memoryview(records).cast("B"), n, tuple(types), stacks, modules)

    def ended(self, pid: int) -> list[Batch]:
        """PID's images so far are gone (it exec'd: its tracer holds it at the exec): every
        record of their rings, which are retired."""
        self._scan()
        out, used = [], 0
        for name, ring in sorted(self.rings.items(), key=lambda item: item[1].stamp):
            if ring.pid == pid:
                types = (ctypes.c_uint64 * 9)()
                n = self._take_rest(ring, used, 0, types)
                if n:
                    out.append(self._batch(ring, used, n, types))
                    used += n
                self._retire(name, ring)
        return out

    def _take_rest(self, ring: Ring, used: int, n: int, types: ctypes.Array) -> int:
        """RING's records to its end (its writers are gone), after the N a drain took into the
        buffer from USED on; how many in all (the caller retires it)."""
        while m := ring.take(self._room(used + n), types, final=True):
            n += m
        return n

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
        """Drain until every ring's process image has ended (or TIMEOUT seconds); a batch is
        valid until the next one is asked for (the next drain reuses the buffer)."""
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
    """DATA (a Batch's) as a structured array of mtrace records (fields: thread, type, ptr1,
    ptr2, size, size2, size3, ts, caller)."""
    dtype = np.dtype(
        {
            "names": ["thread", "type", "ptr1", "ptr2", "size", "size2", "size3", "ts", "caller"],
            "formats": ["<i4", "<u4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8"],
            "offsets": [0, 4, 8, 16, 24, 32, 40, 48, 56],
            "itemsize": RECORD_SIZE,
        }
    )
    return np.frombuffer(data, dtype=dtype)


# -- can this command be preloaded? -----------------------------------------------------------
_CALLER_LOGGERS = re.compile(r"(?:^|/)(?:libc_malloc_debug\.so[.\d]*|libmemusage\.so)$")
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
    from pymtrace.tracee import elf

    names = elf.symbol_names(path)
    return "malloc" in names.functions, sorted(names.undefined & _unwrapped())


def _program(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str, bytes, os.stat_result, list[str]] | str:
    """(path, its first 256 bytes, its stat, its arguments) of the program ARGV runs, #!
    scripts followed to their interpreter (PATH from ENV); or why it cannot be found, one line."""
    program, args = argv[0], list(argv[1:])
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
            words = [os.fsdecode(w) for w in head[2:].split(b"\n")[0].split()]
            if not words:
                return f"{path}: a #! line without an interpreter"
            program, args = words[0], words[1:] + [path] + args
            continue
        return path, head, st, args
    return f"{argv[0]}: too many #! interpreters"


def runs_python(argv: Sequence[str], env: Mapping[str, str] | None = None) -> bool:
    """Whether the command ARGV runs CPython: its program (a script's interpreter, through
    `env` too) exports _PyRuntime or links a libpython."""
    env = os.environ if env is None else env
    found = _program(argv, env)
    if isinstance(found, str):
        return False
    path, _, _, args = found
    if os.path.basename(path) == "env":  # env [-i] [NAME=VALUE...] python3 ...
        words = [w for w in args if not w.startswith("-") and "=" not in w]
        return bool(words) and runs_python(words, env)
    from pymtrace.tracee import elf, pyruntime

    if pyruntime.exports_runtime(path):
        return True
    return any(re.match(r"libpython\d", lib) for lib in elf.needed(path))


def not_preloadable(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """Why the command ARGV cannot be recorded by the interposer (one line), or None. Follows
    #! scripts to their interpreter; PATH and LD_PRELOAD from ENV (default os.environ): glibc's
    caller-logging wrappers preloaded would log the interposer as every call's caller."""
    env = os.environ if env is None else env
    found = _program(argv, env)
    if isinstance(found, str):
        return found
    path, head, st, _ = found
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
    for lib in re.split(r"[ :]", env.get("LD_PRELOAD", "")):
        if _CALLER_LOGGERS.search(lib):
            return (
                f"LD_PRELOAD has glibc's {os.path.basename(lib)}, which logs each call's caller "
                "(mtrace, memusage): an interposer in front of it would be that caller"
            )
    return None


# -- heap's sampling mode ---------------------------------------------------------------------
# The same library, started with PYMTRACE_SAMPLE instead of PYMTRACE_RING: it draws
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


def sampling_env(
    base: Mapping[str, str], lib: str, options: SampleOptions, credits: "Credits | None" = None
) -> dict[str, str]:
    """BASE with what a launched command needs to be sampled in-process by LIB: LIB first in
    LD_PRELOAD (the user's own preloads, then the libraries, are the next definitions); with
    CREDITS, its probes wait for room in heap's ring instead of being lost."""
    check_preload_path(lib)
    env = {k: v for k, v in base.items() if k != ENV}  # sampling, no ring
    old = env.get("LD_PRELOAD", "").strip()
    env["LD_PRELOAD"] = lib + (":" + old if old else "")
    # one variable, as for the rings; not following: only this process's child samples
    env[SAMPLE_ENV] = f"{os.getpid()}:{int(options.follow)}:{options.sample_bytes}:{options.max_live}"
    if credits is not None:
        env[SAMPLE_ENV] += ":" + credits.path  # last: it may hold a colon
    return env


class Credits:
    """The credits a sampled command's probes fire against (interpose.h's sample_credits), in
    a private directory made here: a probe whose record might not fit in heap's BPF ring
    waits until heap has read what came before, so `--sample-bytes 1` loses nothing."""

    def __init__(self, parent: str | None = None) -> None:
        self.directory = private_dir(parent)
        self.path = os.path.join(self.directory, "credits")
        size = _H.consts["CREDIT_SIZE"]
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.header = _H.structs["sample_credits"].from_buffer(self._map)
        self.header.owner = os.getpid()
        self.header.magic = _H.consts["CREDIT_MAGIC"]  # last: the samplers read it first
        self.room = 0
        self._waits, self._pressed_at = 0, -1.0

    def start(self, alloc_cost: int, free_cost: int, room: int) -> None:
        """Before the command runs: what each probe's record may take of the ring, and the
        ROOM its probes may fill before heap has read any."""
        self.header.alloc_cost = alloc_cost
        self.header.free_cost = free_cost
        self.room = room
        self.header.granted = room

    def fired(self) -> int:
        """The ring bytes of the probes that have fired so far (read before reading the ring)."""
        return self.header.fired

    def waiting(self) -> bool:
        """Whether a probe is waiting for room (or about to)."""
        return self.header.used > self.header.granted

    def pressed(self) -> bool:
        """Whether probes waited for room in the last second: the ring is read as soon as one
        waits, not at the next timeout."""
        waits, now = self.header.waits, time.monotonic()
        if waits != self._waits:
            self._waits, self._pressed_at = waits, now
        return now - self._pressed_at < 1.0

    def grant(self, fired: int) -> None:
        """Every record of the probes counted in FIRED has been read: ROOM more may come."""
        self.header.granted = fired + self.room

    def waits(self) -> tuple[int, float]:
        """(probes that waited for room, seconds they waited in all)."""
        return self.header.waits, self.header.wait_ns / 1e9

    def detach(self) -> None:
        """Nobody waits any more: the program goes on, its probes fire no more."""
        self.header.detached = 1

    def close(self) -> None:
        """Detach, and remove the file."""
        if self._map.closed:
            return
        self.detach()
        del self.header
        self._map.close()
        shutil.rmtree(self.directory, ignore_errors=True)


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


def process_image(pid: int) -> tuple[dict[str, str], str]:
    """(environment, executable) of process PID as its last exec set them. Raises ProcessGone;
    PymtraceError when they cannot be read (another user's, without root)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            words = f.read().split(b"\0")
        exe = os.readlink(f"/proc/{pid}/exe")
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(pid) from None
    except OSError as exc:
        raise PymtraceError(f"process {pid}: {exc.strerror}") from None
    return dict(w.decode(errors="replace").split("=", 1) for w in words if b"=" in w), exe


def image_problem(lib: str, env: Mapping[str, str], exe: str) -> str | None:
    """Why a program EXE started with the environment ENV will not run with LIB loaded (one
    line), or None."""
    if lib not in re.split(r"[ :]", env.get("LD_PRELOAD", "")):
        return f"{exe}: LD_PRELOAD no longer names the interposer (its environment was changed)"
    return not_preloadable([exe], env)


def preload_problem(pid: int, lib: str) -> str | None:
    """Why process PID, which has just exec'd, will not run with LIB loaded (one line), or None:
    read from its own environment and its program, before its loader ran. Raises ProcessGone."""
    try:
        env, exe = process_image(pid)
    except ProcessGone:
        raise
    except PymtraceError as exc:
        return str(exc)
    return image_problem(lib, env, exe)
