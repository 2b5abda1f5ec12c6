"""glibc dj/malloc binary call trace ("mtrace.out.PID"): 64-byte records, MAGIC first.

Layout (docs/formats.md, section 1), native byte order:
    int32 thread; uint32 type:8|path:14; uint64 ptr1, ptr2, size, size2, size3; uint64 pad[2]
pymtrace fills the pad words (upstream writes zeros and ignores them):
    pad[0] = CLOCK_MONOTONIC timestamp of the call in ns (0 = unknown)
    pad[1] = the caller's return address (0 = unknown)

The layout and the call type numbers come from bpf/record.h and bpf/common.h (via
pymtrace.bpf.structs), the definition the BPF recorder writes with.

Readers check the MAGIC record (type 255, ptr1 0x1234, size = word size) for byte order
and word size -- upstream never does -- and skip all-zero (UNUSED) records anywhere.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
from typing import IO, TYPE_CHECKING, Iterator, Union

from pymtrace.bpf import structs
from pymtrace.errors import CorruptFile, PymtraceError

if TYPE_CHECKING:
    import numpy

_H = structs.header("record")
RECORD_SIZE = _H.consts["RECORD_SIZE"]
MAGIC_TYPE = _H.consts["CALL_MAGIC"]
MAGIC_PTR = _H.consts["MAGIC_PTR"]

UNUSED, MALLOC, CALLOC, FREE, REALLOC, MEMALIGN, VALLOC, PVALLOC, POSIX_MEMALIGN = (
    _H.consts["CALL_" + n]
    for n in ("UNUSED", "MALLOC", "CALLOC", "FREE", "REALLOC", "MEMALIGN", "VALLOC", "PVALLOC", "POSIX_MEMALIGN")
)
TYPE_NAMES = {t: name.lower() for t, name in _H.names("CALL_").items() if t != UNUSED}
PATH_FLAGS = {
    8: "thread_cache",
    9: "cpu_cache",
    10: "cpu_cache2",
    11: "sbrk",
    12: "mmap",
    13: "munmap",
    14: "m_f_realloc",
    15: "hook",
    16: "unsorted_add",
    17: "unsorted_remove",
    18: "unsorted_empty",
    19: "fastbin_add",
    20: "fastbin_remove",
    21: "malloc_consolidate",
}


def _struct_format(ctype: type[ctypes.Structure]) -> str:
    """struct-module codes of a ctypes Structure of fixed-width integers (arrays flattened)."""
    out = ""
    for _, t in ctype._fields_:
        n = 1
        while issubclass(t, ctypes.Array):
            n, t = n * t._length_, t._type_
        code = {1: "b", 2: "h", 4: "i", 8: "q"}[ctypes.sizeof(t)]
        out += (code if t(-1).value < 0 else code.upper()) * n
    return out


# thread, type|path, ptr1, ptr2, size, size2, size3, pad0, pad1: struct mtrace_record
# struct format of one record without byte order (the BPF recorder packs with it too)
RECORD_FORMAT = _struct_format(_H.structs["mtrace_record"])
_STRUCT = {order: struct.Struct(order + RECORD_FORMAT) for order in "<>"}
if _STRUCT["<"].size != ctypes.sizeof(_H.structs["mtrace_record"]) or _STRUCT["<"].size != RECORD_SIZE:
    raise ImportError("bpf/record.h: struct mtrace_record is not RECORD_SIZE bytes without padding")


@dataclasses.dataclass
class Record:
    thread: int
    type: int
    ptr1: int = 0
    ptr2: int = 0
    size: int = 0
    size2: int = 0
    size3: int = 0
    ts_ns: int = 0
    caller: int = 0
    path: int = 0  # path flag bits 8-21, already shifted down by 8
    stack: int = 0  # record --stacks: the stack id (bits 8-31 of the type word), 0: none

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type, f"type{self.type}")


def pack(rec: Record, byteorder: str = "<") -> bytes:
    return _STRUCT[byteorder].pack(
        rec.thread,
        (rec.type & 0xFF) | ((rec.path & 0x3FFF) << 8),
        rec.ptr1,
        rec.ptr2,
        rec.size,
        rec.size2,
        rec.size3,
        rec.ts_ns,
        rec.caller,
    )


# The MAGIC record's size2 (0 upstream) in a `record --stacks` trace: bits 8-31 of every
# record's type word hold a stack id (FILE.stacks), not path flags (which an eBPF tracer never
# observes; upstream's readers take the type as an 8-bit field and ignore the rest).
STACKS_MARK = 1


# The MAGIC record's size3 (0 upstream): the allocator family the calls were recorded from
# (pymtrace.tracee.allocators.FAMILIES; 0: glibc or not known), so replay can suggest it.
ALLOCATOR_CODES = {"glibc": 0, "jemalloc": 1, "tcmalloc": 2, "mimalloc": 3, "generic": 4}


def magic_record(thread: int = 0, byteorder: str = "<", stacks: bool = False, allocator: str | None = None) -> bytes:
    code = ALLOCATOR_CODES.get(allocator or "glibc", 0)
    return pack(
        Record(thread, MAGIC_TYPE, ptr1=MAGIC_PTR, size=8, size2=STACKS_MARK if stacks else 0, size3=code),
        byteorder,
    )


def allocator_of(first: bytes, byteorder: str = "<") -> str | None:
    """The allocator family the MAGIC record FIRST names (None: glibc, or not said)."""
    if len(first) < RECORD_SIZE:
        return None
    code = _STRUCT[byteorder].unpack_from(first)[6]
    return next((name for name, c in ALLOCATOR_CODES.items() if c == code and c), None)


def has_stacks(first: bytes, byteorder: str = "<") -> bool:
    """Whether the MAGIC record FIRST marks a trace whose type words carry stack ids."""
    return len(first) >= RECORD_SIZE and _STRUCT[byteorder].unpack_from(first)[5] == STACKS_MARK


def read_first(path: str) -> bytes:
    """The first RECORD_SIZE bytes of the file PATH (fewer if it is shorter); PymtraceError if it
    cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(RECORD_SIZE)
    except OSError as exc:
        raise PymtraceError(f"cannot read {path}: {exc.strerror}") from None


def detect_byteorder(first: bytes) -> str:
    """Byte order of a trace from its first record; raises CorruptFile if it is no MAGIC."""
    if len(first) < RECORD_SIZE:
        raise CorruptFile(f"not an mtrace binary trace: {len(first)} bytes, a record is {RECORD_SIZE}")
    for order in "<>":
        _, typ, ptr1, _, size = struct.unpack_from(order + RECORD_FORMAT[:5], first)
        if typ & 0xFF == MAGIC_TYPE and ptr1 == MAGIC_PTR:
            if size != 8:
                raise CorruptFile(f"trace written with {size}-byte pointers; only 64-bit traces are supported")
            return order
    # A 32-bit trace has 4-byte pointer fields: ptr1 sits at offset 8 as a 4-byte word.
    for order in "<>":
        typ, ptr1 = struct.unpack_from(order + "II", first, 4)
        if typ & 0xFF == MAGIC_TYPE and ptr1 == MAGIC_PTR:
            raise CorruptFile("trace written by a 32-bit process; only 64-bit traces are supported")
    raise CorruptFile("not an mtrace binary trace: the first record is not the MAGIC record (type 255, ptr1 0x1234)")


def _read_magic(stream: IO[bytes], name: str) -> tuple[bytes, str]:
    """(the first record, the byte order it gives); CorruptFile naming NAME if it is no MAGIC."""
    first = _read_full(stream, RECORD_SIZE)
    if not first:
        raise CorruptFile(f"{name}: empty file, not an mtrace binary trace")
    try:
        order = detect_byteorder(first)
    except CorruptFile as exc:
        raise CorruptFile(f"{name}: {exc}") from None
    return first, order


def iter_records(stream: IO[bytes], name: str = "trace", chunk_records: int = 8192) -> Iterator[Record]:
    """Yield Records from a binary stream, checking MAGIC; skips UNUSED and the MAGIC itself.

    Raises CorruptFile (one line, with the byte offset) on a missing MAGIC, an unknown call
    type, or a trailing partial record.
    """
    first, order = _read_magic(stream, name)
    stacks = has_stacks(first, order)
    unpack = _STRUCT[order].iter_unpack
    for offset, buf in _chunks(stream, name, chunk_records):
        for thread, typ, p1, p2, s1, s2, s3, ts, caller in unpack(buf):
            t = typ & 0xFF
            if t == UNUSED:
                if thread or typ or p1 or p2 or s1 or s2 or s3 or ts or caller:
                    raise CorruptFile(f"{name}: record at byte {offset} has call type 0 but is not all zero")
                offset += RECORD_SIZE
                continue
            if t not in TYPE_NAMES or t == MAGIC_TYPE:
                if t == MAGIC_TYPE and p1 == MAGIC_PTR:
                    offset += RECORD_SIZE
                    continue  # concatenated traces repeat the MAGIC record
                raise CorruptFile(f"{name}: record at byte {offset} has unknown call type {t}")
            if stacks:
                yield Record(thread, t, p1, p2, s1, s2, s3, ts, caller, 0, typ >> 8)
            else:
                yield Record(thread, t, p1, p2, s1, s2, s3, ts, caller, (typ >> 8) & 0x3FFF)
            offset += RECORD_SIZE


def _chunks(stream: IO[bytes], name: str, chunk_records: int) -> Iterator[tuple[int, bytes]]:
    """(file offset, bytes of whole records) up to CHUNK_RECORDS at a time, after the MAGIC
    record; CorruptFile on stray bytes after the last whole record."""
    offset = RECORD_SIZE
    while True:
        buf = _read_full(stream, RECORD_SIZE * chunk_records)
        if not buf:
            return
        whole = len(buf) - len(buf) % RECORD_SIZE
        yield offset, buf[:whole] if whole != len(buf) else buf
        offset += whole
        if whole != len(buf):
            raise CorruptFile(
                f"{name}: truncated: {len(buf) - whole} stray bytes after the last whole record (byte {offset})"
            )


def _read_full(stream: IO[bytes], n: int) -> bytes:
    """Read N bytes, or fewer only at end of file (pipes return short reads)."""
    parts = []
    got = 0
    while got < n:
        b = stream.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


FIELD_NAMES = ("thread", "type", "ptr1", "ptr2", "size", "size2", "size3", "time_ns", "caller")


def record_dtype(byteorder: str = "<") -> numpy.dtype:
    """numpy's structured dtype of one record (FIELD_NAMES; `type` holds type | path << 8)."""
    import numpy

    codes = {"i": "i4", "I": "u4", "q": "i8", "Q": "u8"}
    return numpy.dtype([(f, byteorder + codes[c]) for f, c in zip(FIELD_NAMES, RECORD_FORMAT)])


def read_arrays(
    stream: IO[bytes], name: str = "trace", chunk_records: int = 1 << 16
) -> tuple[str, int, Iterator[numpy.ndarray]]:
    """(byte order, the MAGIC record's thread, iterator of numpy record arrays in that byte
    order): the records of iter_records, vectorized, with the same checks and messages
    (all-zero records and repeated MAGIC records dropped)."""
    import numpy

    first, order = _read_magic(stream, name)
    dtype = record_dtype(order)
    magic_thread = int(numpy.frombuffer(first, dtype)["thread"][0])
    known = numpy.zeros(256, bool)
    known[list(TYPE_NAMES)] = True
    known[MAGIC_TYPE] = False

    def arrays() -> Iterator[numpy.ndarray]:
        for offset, buf in _chunks(stream, name, chunk_records):
            recs = numpy.frombuffer(buf, dtype)
            t = (recs["type"] & 0xFF).astype(numpy.uint8)
            ok = known[t]
            if not ok.all():
                words = numpy.frombuffer(buf, numpy.uint64).reshape(-1, 8)
                unused = (t == UNUSED) & ~words.any(axis=1)
                magic = (t == MAGIC_TYPE) & (recs["ptr1"] == MAGIC_PTR)
                bad = ~(ok | unused | magic)
                if bad.any():
                    i = int(bad.argmax())
                    where = f"{name}: record at byte {offset + i * RECORD_SIZE}"
                    if t[i] == UNUSED:
                        raise CorruptFile(f"{where} has call type 0 but is not all zero")
                    raise CorruptFile(f"{where} has unknown call type {t[i]}")
                recs = recs[ok]
            if len(recs):
                yield recs

    return order, magic_thread, arrays()


def read_file(path: Union[str, os.PathLike]) -> Iterator[Record]:
    with open(path, "rb") as f:
        yield from iter_records(f, name=str(path))


class Writer:
    """Append records to a file object, MAGIC first."""

    def __init__(self, fileobj: IO[bytes], thread: int = 0) -> None:
        self.file = fileobj
        self.count = 0
        self.file.write(magic_record(thread))

    def write(self, rec: Record) -> None:
        self.file.write(pack(rec))
        self.count += 1
