"""Replay workload files (.wl): what upstream trace2wl writes and trace_run reads.

Layout (docs/formats.md, section 3): an opcode byte, then unsigned big-endian base-128 varints.
Header `ALLOC_PTRS n, ALLOC_SYNCS m, NTHREADS t, START_THREAD off x t, DONE`, then one
stream per thread, each ending in DONE.

`parse()` validates everything the native simulator relies on and raises CorruptFile with the
byte offset of the first problem: unknown opcodes, varints running off the end or beyond 64
bits, stream offsets outside the file or inside the header, pointer indices >= ALLOC_PTRS,
sync ids beyond ALLOC_SYNCS, streams without DONE, and sync ids that no runnable thread
ever writes (a deadlock, found by a dry run of the sync order -- sync flags never reset, so
the dry run's outcome holds for every schedule). Each op is decoded and dry-run once however
many threads share it, so validation is linear in the file (not threads x stream).

Upstream trace2wl sizes the sync array one short (ids run 1..m with ALLOC_SYNCS m); files it
wrote are accepted (`Workload.upstream_sync_sizing` says so), pymtrace writes m+1.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence, Union

from pymtrace.bpf import structs
from pymtrace.errors import CorruptFile

_WL = structs.native_header("wl")  # pymtrace/replay/native/wl.h: opcodes, arguments, limits
OP_NAMES = _WL.names("WL_OP_")  # opcode -> name, in opcode order
(
    NOP,
    DONE,
    MALLOC,
    CALLOC,
    REALLOC,
    FREE,
    SYNC_W,
    SYNC_R,
    ALLOC_PTRS,
    ALLOC_SYNCS,
    NTHREADS,
    START_THREAD,
    MEMALIGN,
    VALLOC,
    PVALLOC,
) = (
    _WL.consts["WL_OP_" + n]
    for n in (
        "NOP",
        "DONE",
        "MALLOC",
        "CALLOC",
        "REALLOC",
        "FREE",
        "SYNC_W",
        "SYNC_R",
        "ALLOC_PTRS",
        "ALLOC_SYNCS",
        "NTHREADS",
        "START_THREAD",
        "MEMALIGN",
        "VALLOC",
        "PVALLOC",
    )
)
# number of varint arguments per opcode
NARGS = {op: _WL.consts["WL_NARGS_" + name] for op, name in OP_NAMES.items()}
HEADER_OPS = {NOP, ALLOC_PTRS, ALLOC_SYNCS, NTHREADS, START_THREAD}
STREAM_OPS = {NOP, MALLOC, CALLOC, REALLOC, FREE, SYNC_W, SYNC_R, MEMALIGN, VALLOC, PVALLOC}
MAX_THREADS = _WL.consts["WL_MAX_THREADS"]
MAX_VARINT = (1 << 64) - 1
# memalign alignments are rounded up to a power of two at replay (as glibc does); beyond this: invalid
MAX_ALIGN = _WL.consts["WL_MAX_ALIGN"]
MAX_TABLE = _WL.consts["WL_MAX_TABLE"]  # pointer slots / sync ids (the simulator's limit too)


def encode_varint(value: int) -> bytes:
    """Big-endian base-128: 16 -> b'\\x10', 2**40 -> a0 80 80 80 80 00."""
    if value < 0:
        raise ValueError("varints are unsigned")
    if value < 0x80:
        return bytes((value,))
    out = [value & 0x7F]
    value >>= 7
    while value:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes(reversed(out))


def decode_varint(data: bytes, pos: int, name: str = "workload") -> tuple[int, int]:
    """(value, new_pos); CorruptFile if it runs off the end or exceeds 64 bits."""
    start = pos
    value = 0
    n = len(data)
    while True:
        if pos >= n:
            raise CorruptFile(f"{name}: truncated: varint at byte {start} runs off the end of the file")
        c = data[pos]
        pos += 1
        value = (value << 7) | (c & 0x7F)
        if value > MAX_VARINT:
            raise CorruptFile(f"{name}: varint at byte {start} exceeds 64 bits")
        if not c & 0x80:
            return value, pos


def encode_op(op: int, *args: int) -> bytes:
    return bytes((op,)) + b"".join(encode_varint(a) for a in args)


@dataclasses.dataclass
class Workload:
    nptrs: int
    nsyncs: int
    offsets: list  # file offset of each thread stream
    ops: dict  # byte offset -> (op, args tuple, offset of the next op): every op decoded once
    upstream_sync_sizing: bool = False  # a sync id == ALLOC_SYNCS was used (upstream trace2wl)

    def stream(self, off: int) -> list[tuple[int, tuple[int, ...], int]]:
        """The ops of the stream starting at OFF, DONE excluded: [(op, args, byte offset)]."""
        out = []
        while True:
            op, args, nxt = self.ops[off]
            if op == DONE:
                return out
            out.append((op, args, off))
            off = nxt

    @functools.cached_property
    def threads(self) -> list[list[tuple[int, tuple[int, ...], int]]]:
        """Per thread: its list of (op, args tuple, byte offset); threads starting at the same
        offset share one list. Built on first use (a file can make this threads x stream)."""
        by_off = {}
        for off in self.offsets:
            if off not in by_off:
                by_off[off] = self.stream(off)
        return [by_off[off] for off in self.offsets]

    def counts(self) -> dict[str, int]:
        """Per-opcode-name counts over all threads (allocations with index 0 included)."""
        out = {}
        for ops in self.threads:
            for op, _, _ in ops:
                out[OP_NAMES[op]] = out.get(OP_NAMES[op], 0) + 1
        return out


def _read_op(data: bytes, pos: int, name: str) -> tuple[int, tuple[int, ...], int]:
    op = data[pos]
    if op not in NARGS:
        raise CorruptFile(f"{name}: byte {pos}: unknown opcode {op}")
    args = []
    p = pos + 1
    for _ in range(NARGS[op]):
        v, p = decode_varint(data, p, name)
        args.append(v)
    return op, tuple(args), p


def parse(data: Union[bytes, bytearray, memoryview], name: str = "workload", check_deadlock: bool = True) -> Workload:
    """Decode and validate a whole .wl file (bytes); returns a Workload.

    Every op is decoded once, however many threads share it (streams that reach the same
    offset are the same from there on), so the cost is linear in the file, not in threads x
    stream; the sync dry run likewise (check_sync_order).
    """
    data = bytes(data)
    pos = 0
    nptrs = nsyncs = nthreads = None
    offsets = []
    while True:
        if pos >= len(data):
            raise CorruptFile(f"{name}: truncated: the header has no DONE")
        start = pos
        op, args, pos = _read_op(data, pos, name)
        if op == DONE:
            break
        if op not in HEADER_OPS:
            raise CorruptFile(f"{name}: byte {start}: opcode {OP_NAMES[op]} is not allowed in the header")
        if op == ALLOC_PTRS:
            nptrs = args[0]
        elif op == ALLOC_SYNCS:
            nsyncs = args[0]
        elif op == NTHREADS:
            nthreads = args[0]
            if nthreads > MAX_THREADS:
                raise CorruptFile(f"{name}: byte {start}: {nthreads} threads (at most {MAX_THREADS} supported)")
        elif op == START_THREAD:
            offsets.append((args[0], start))
            if len(offsets) > MAX_THREADS:
                raise CorruptFile(f"{name}: byte {start}: more than {MAX_THREADS} threads")
    header_end = pos
    if nptrs is None:
        raise CorruptFile(f"{name}: the header has no ALLOC_PTRS")
    if nsyncs is None:
        nsyncs = 0
    for what, n in (("ALLOC_PTRS", nptrs), ("ALLOC_SYNCS", nsyncs)):
        if n > MAX_TABLE:
            raise CorruptFile(f"{name}: {what} {n} is absurd")
    if nthreads is not None and nthreads != len(offsets):
        raise CorruptFile(f"{name}: NTHREADS says {nthreads} but the header starts {len(offsets)} threads")
    decoded = {}
    upstream_sizing = False
    for off, where in offsets:
        if off < header_end or off >= len(data):
            raise CorruptFile(
                f"{name}: byte {where}: thread stream offset {off} is outside the file body "
                f"({header_end}..{len(data) - 1})"
            )
    for off, _ in offsets:
        p = off
        while p not in decoded:
            if p >= len(data):
                raise CorruptFile(f"{name}: truncated: the thread stream at byte {off} has no DONE")
            start = p
            op, args, p = _read_op(data, p, name)
            decoded[start] = (op, args, p)
            if op == DONE:
                break
            if op not in STREAM_OPS:
                raise CorruptFile(f"{name}: byte {start}: opcode {OP_NAMES[op]} is not allowed in a thread stream")
            if op in (SYNC_W, SYNC_R):
                if args[0] > nsyncs:
                    raise CorruptFile(f"{name}: byte {start}: sync id {args[0]} out of range (ALLOC_SYNCS {nsyncs})")
                if args[0] == nsyncs:
                    upstream_sizing = True
            elif op != NOP:
                idxs = args[:2] if op == REALLOC else args[:1]
                for i in idxs:
                    if i >= nptrs:
                        raise CorruptFile(f"{name}: byte {start}: pointer index {i} out of range (ALLOC_PTRS {nptrs})")
                if op == MEMALIGN and args[0] and args[1] > MAX_ALIGN:
                    raise CorruptFile(f"{name}: byte {start}: alignment {args[1]} is absurd (more than 2**40)")
    wl = Workload(nptrs, nsyncs, [o for o, _ in offsets], decoded, upstream_sizing)
    if check_deadlock:
        check_sync_order(wl, name)
    return wl


def check_sync_order(wl: Workload, name: str = "workload") -> None:
    """Dry-run the sync operations; CorruptFile naming the stuck threads if some never finish.

    Sync flags never reset, so the state only grows and the outcome holds for every schedule.
    Each op is executed once: a thread reaching an offset another thread already reached
    stops and shares that thread's fate, resolved from the end of the file backwards (an op's
    successor lies after it).
    """
    ops = wl.ops
    written = set()
    waiting = {}  # sync id -> [(thread, offset)]
    reached = set()
    parked = {}  # thread -> offset of the SYNC_R it waits at
    runnable = [(t, off, False) for t, off in enumerate(wl.offsets)]
    while runnable:
        t, p, resumed = runnable.pop()
        while True:
            if not resumed:
                if p in reached:
                    break
                reached.add(p)
            resumed = False
            op, args, nxt = ops[p]
            if op == DONE:
                break
            if op == SYNC_W and args[0] not in written:
                written.add(args[0])
                for u, q in waiting.pop(args[0], ()):
                    del parked[u]
                    runnable.append((u, q, True))
            elif op == SYNC_R and args[0] not in written:
                waiting.setdefault(args[0], []).append((t, p))
                parked[t] = p
                break
            p = nxt
    finishes = {}
    stuck_at = set(parked.values())
    for p in sorted(reached, reverse=True):
        op, _, nxt = ops[p]
        finishes[p] = op == DONE or (p not in stuck_at and finishes[nxt])
    stuck = [t for t, off in enumerate(wl.offsets) if not finishes[off]]
    if stuck:
        all_written = {a[0] for op, a, _ in ops.values() if op == SYNC_W}
        parts = []
        for t in stuck[:5]:
            p = wl.offsets[t]
            while True:  # where it waits: the first SYNC_R of an id never written
                op, args, nxt = ops[p]
                if op == SYNC_R and args[0] not in written:
                    break
                p = nxt
            why = "never written" if args[0] not in all_written else "written only by a thread that is itself stuck"
            parts.append(f"thread {t} waits at byte {p} for sync id {args[0]} ({why})")
        more = f" (and {len(stuck) - 5} more threads)" if len(stuck) > 5 else ""
        raise CorruptFile(f"{name}: deadlock: " + "; ".join(parts) + more)


def read_file(path: Union[str, os.PathLike]) -> Workload:
    with open(path, "rb") as f:
        return parse(f.read(), name=str(path))


def build(nptrs: int, nsyncs: int, streams: Sequence[bytes]) -> bytes:
    """A whole .wl file from encoded per-thread streams (each must end with DONE).

    Like upstream, the header is rebuilt until its length (which depends on the varint
    length of the stream offsets) stops changing.
    """
    return header_bytes(nptrs, nsyncs, [len(s) for s in streams]) + b"".join(streams)


def header_bytes(nptrs: int, nsyncs: int, stream_lengths: Sequence[int]) -> bytes:
    """The header for streams of the given lengths (see build())."""
    old_len, new_len = 1, 2
    header = b""
    while old_len != new_len:
        old_len = new_len
        off = new_len
        parts = [encode_op(ALLOC_PTRS, nptrs), encode_op(ALLOC_SYNCS, nsyncs), encode_op(NTHREADS, len(stream_lengths))]
        for n in stream_lengths:
            parts.append(encode_op(START_THREAD, off))
            off += n
        parts.append(bytes((DONE,)))
        header = b"".join(parts)
        new_len = len(header)
    return header
