"""glibc's text malloc trace (MALLOC_TRACE / mtrace()), as glibc 2.36's libc_malloc_debug writes it.

    = Start
    @ ./prog:[0x11f0] + 0x561bdf6122a0 0xa        malloc/calloc/memalign/valloc/pvalloc/
                                                  posix_memalign/realloc(NULL,n)
    @ ./prog:[0x1240] - 0x561bdf612510            free(p), realloc(p,0)
    @ ./prog:[0x1218] < 0x561bdf6124a0            realloc(p,n): old ...
    @ ./prog:[0x1218] > 0x561bdf6124a0 0x64       ... and new (caller repeated)
    @ ./prog:[0x12da] ! 0x561bdf6122a0 0x4000...  failed realloc
    = End

Checked by running glibc 2.36: a failed allocation is `+ (nil) SIZE`, free(NULL) and a
failed posix_memalign are not logged, sizes are printed with `%#lx` (so 0 is `0`), and the
caller is `FILE:[0xOFF]` with OFF relative to the module's load address (glibc >= 2.35),
`FILE:(SYM+0xOFF)[0xOFF]` when dladdr finds a symbol, or `[0xADDR]` when it finds no module.
glibc's `mtrace` script resolves `FILE:[0xOFF]` with `addr2line -e FILE`, so pymtrace
writes the module's absolute path.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import IO, TYPE_CHECKING, Callable, Iterable, Iterator, Union

from pymtrace.errors import CorruptFile
from pymtrace.trace.formats import mtrace_bin as B

if TYPE_CHECKING:
    from pymtrace.tracee.libc import Mapping


def _hex(n: int) -> str:
    return f"{n:#x}" if n else "0"  # C's %#lx prints 0 as "0"


def _ptr(n: int) -> str:
    return f"{n:#x}" if n else "(nil)"  # C's %p


def record_lines(rec: B.Record, where: str = "") -> list[str]:
    """The text lines (without newline) glibc's mtrace hooks would write for one record."""
    at = f"@ {where} " if where else ""
    t = rec.type
    if t in (B.MALLOC, B.CALLOC, B.MEMALIGN, B.VALLOC, B.PVALLOC):
        return [f"{at}+ {_ptr(rec.ptr2)} {_hex(rec.size)}"]
    if t == B.POSIX_MEMALIGN:
        if rec.ptr1 != 0:  # failed posix_memalign (EINVAL/ENOMEM): glibc logs nothing
            return []
        return [f"{at}+ {_ptr(rec.ptr2)} {_hex(rec.size)}"]
    if t == B.FREE:
        return [f"{at}- {_ptr(rec.ptr1)}"] if rec.ptr1 else []
    if t == B.REALLOC:
        if rec.ptr1 == 0:
            return [f"{at}+ {_ptr(rec.ptr2)} {_hex(rec.size)}"]
        if rec.ptr2 == 0:
            if rec.size == 0:
                return [f"{at}- {_ptr(rec.ptr1)}"]
            return [f"{at}! {_ptr(rec.ptr1)} {_hex(rec.size)}"]
        return [f"{at}< {_ptr(rec.ptr1)}", f"{at}> {_ptr(rec.ptr2)} {_hex(rec.size)}"]
    return []


class CallerResolver:
    """Turns absolute caller addresses into glibc's `FILE:[0xOFF]` using /proc/PID/maps snapshots."""

    def __init__(self) -> None:
        self.modules = []  # (start, end, base, path), newest snapshot first wins
        self.cache = {}

    def add_maps(self, mappings: Iterable[Mapping], prefer: bool = True) -> None:
        """Add a /proc/PID/maps snapshot; prefer=False puts it behind the ones known already."""
        files = [m for m in mappings if m.path.startswith("/")]
        heads = {}
        for m in files:
            if m.offset == 0:
                heads.setdefault(m.path, []).append(m.start)
        new = []
        for m in files:
            bases = [b for b in heads.get(m.path, ()) if b <= m.start]
            new.append((m.start, m.end, max(bases) if bases else m.start - m.offset, m.path))
        if new:
            self.modules = new + self.modules if prefer else self.modules + new
            self.cache.clear()

    def __call__(self, addr: int) -> str:
        if not addr:
            return ""
        hit = self.cache.get(addr)
        if hit is not None:
            return hit
        where = f"[{addr:#x}]"
        for start, end, base, path in self.modules:
            if start <= addr < end:
                where = f"{path}:[{addr - base:#x}]"
                break
        self.cache[addr] = where
        return where


def write(
    records: Iterable[B.Record], out: IO[str], resolve: Callable[[int], str] | None = None, end: bool = True
) -> int:
    """Write RECORDS (mtrace_bin.Record) to the text stream OUT; returns the number of lines."""
    resolve = resolve or (lambda addr: f"[{addr:#x}]" if addr else "")
    out.write("= Start\n")
    n = 1
    for rec in records:
        for line in record_lines(rec, resolve(rec.caller)):
            out.write(line + "\n")
            n += 1
    if end:
        out.write("= End\n")
        n += 1
    return n


@dataclasses.dataclass
class Event:
    op: str  # + - < > ! (= for Start/End)
    addr: int = 0
    size: int = 0
    where: str = ""
    line: int = 0


_LINE = re.compile(
    r"^(?:@ (?P<where>\S+) )?(?P<op>[-+<>!])\s+(?P<addr>0x[0-9a-fA-F]+|\(nil\)|0)(?:\s+(?P<size>0x[0-9a-fA-F]+|[0-9]+))?\s*$"
)
_NEEDS_SIZE = {"+": True, ">": True, "!": True, "-": False, "<": False}


MAX_LINE = 1 << 20  # longer lines are corrupt (a caller is a path and a symbol: a few KiB)
_DIGITS = {16: 16, 10: 20}  # most digits of a 64-bit value, leading zeros aside


def _u64(text: str, base: int, what: str, name: str | None, no: int) -> int:
    """TEXT (hex with 0x, or decimal) as an int; CorruptFile (at line NO of NAME) if it does
    not fit in 64 bits, checked before converting (int() of 4,300 digits raises ValueError)."""
    if len(text) <= 18:  # 0x + 16 hex digits, or 18 decimal digits: always below 2^64
        return int(text, base)
    digits = text[2:] if base == 16 else text
    value = int(digits, base) if len(digits.lstrip("0")) <= _DIGITS[base] else 1 << 64
    if value >> 64:
        shown = text if len(text) <= 24 else text[:24] + "..."
        raise CorruptFile(f"{name + ': ' if name else ''}line {no}: {what} {shown} does not fit in 64 bits")
    return value


def iter_events(lines: Iterable[Union[bytes, str]], name: str = "trace") -> Iterator[Event]:
    """Events from an iterable of lines (bytes or str, each with or without its newline);
    CorruptFile on anything malformed. Streams: nothing is kept between lines."""
    no = 0
    for no, raw in enumerate(lines, start=1):
        if len(raw) > MAX_LINE:
            raise CorruptFile(f"{name}: line {no} is longer than {MAX_LINE} bytes")
        if not isinstance(raw, str):
            try:
                raw = bytes(raw).decode("ascii")
            except UnicodeDecodeError:
                raise CorruptFile(f"{name}: not a glibc mtrace text log (non-ASCII bytes)") from None
        line = (raw[:-1] if raw.endswith("\n") else raw).rstrip("\r")
        if no == 1:
            if line != "= Start":
                raise CorruptFile(f"{name}: not a glibc mtrace text log (first line is not `= Start`)")
            continue
        if line == "= Start":
            continue  # several mtrace() calls append to one log
        if line == "= End":
            yield Event("=", line=no)
            continue
        m = _LINE.match(line)
        if m is None or (m.group("size") is None) == _NEEDS_SIZE[m.group("op")]:
            raise CorruptFile(f"{name}: line {no} is not an mtrace event: {line[:80]!r}")
        addr = m.group("addr")
        size = m.group("size")
        yield Event(
            m.group("op"),
            0 if addr in ("(nil)", "0") else _u64(addr, 16, "address", name, no),
            0 if size is None else _u64(size, 16 if size.startswith("0x") else 10, "size", name, no),
            m.group("where") or "",
            no,
        )
    if no == 0:
        raise CorruptFile(f"{name}: not a glibc mtrace text log (first line is not `= Start`)")


def parse(data: Union[bytes, bytearray, memoryview, str], name: str = "trace") -> list[Event]:
    """Parse a text trace (bytes or str) into a list of Events; CorruptFile on anything malformed."""
    lines = bytes(data).split(b"\n") if isinstance(data, (bytes, bytearray, memoryview)) else data.split("\n")
    if lines and not lines[-1]:
        lines.pop()
    return list(iter_events(lines, name))


def read_file(path: Union[str, os.PathLike]) -> Iterator[Event]:
    """Events of a text trace file, streamed."""
    with open(path, "rb") as f:
        # a line is read at most MAX_LINE + 1 bytes at a time: iter_events refuses a longer one
        yield from iter_events(iter(lambda: f.readline(MAX_LINE + 1), b""), name=str(path))


_ADDR_IN_WHERE = re.compile(r"\[(0x[0-9a-fA-F]+)\]$")


def to_records(events: Iterable[Event], thread: int = 0) -> Iterator[B.Record]:
    """Events -> mtrace_bin.Records (what a text log can tell: no threads, chunk sizes, types
    beyond alloc/free/realloc; the caller only when it is an absolute `[0xADDR]`)."""
    pending = None  # a `<` waiting for its `>`
    for ev in events:
        caller = 0
        if ev.where and ":" not in ev.where:
            m = _ADDR_IN_WHERE.search(ev.where)
            caller = _u64(m.group(1), 16, "caller address", None, ev.line) if m else 0
        if pending is not None and ev.op != ">":
            raise CorruptFile(f"line {pending.line}: `<` not followed by `>`")
        if ev.op == "+":
            yield B.Record(thread, B.MALLOC, 0, ev.addr, ev.size, caller=caller)
        elif ev.op == "-":
            yield B.Record(thread, B.FREE, ev.addr, caller=caller)
        elif ev.op == "<":
            pending = ev
        elif ev.op == ">":
            if pending is None:
                raise CorruptFile(f"line {ev.line}: `>` without a preceding `<`")
            yield B.Record(thread, B.REALLOC, pending.addr, ev.addr, ev.size, caller=caller)
            pending = None
        elif ev.op == "!":
            yield B.Record(thread, B.REALLOC, ev.addr, 0, ev.size, caller=caller)
    if pending is not None:
        raise CorruptFile(f"line {pending.line}: `<` not followed by `>`")


def leaks(events: Iterable[Event]) -> dict[int, int]:
    """{addr: size} still allocated at the end, the way glibc's `mtrace` script counts."""
    live = {}
    for ev in events:
        if ev.op in "+>" and ev.addr:
            live[ev.addr] = ev.size
        elif ev.op in "-<":
            live.pop(ev.addr, None)
    return live
