"""The stack table of a `record --stacks` recording: FILE.stacks beside the trace FILE.

Allocation records carry a stack id (mtrace-bin: bits 8-31 of the type word, flagged in the
MAGIC record; Parquet: the `stack_id` column); the table gives each id its frames. Format
(docs/formats.md, section 6): JSON lines, version 1. The first line is the header
`{"format": "pymtrace-stacks", "version": 1, "trace": NAME, "pid": PID}`, then one line per
stack, in id order (1, 2, ...; id 0 means "no stack"):

    {"id": 1, "complete": true, "frames": [{"function": "main", "file": "x.c", "line": 9,
     "module": "/usr/bin/x", "build_id": "ab12...", "offset": 4660, "inlined": false}, ...]}

frames run root to leaf (the allocating function last); `offset` is the pc in the module's
own virtual addresses (return address - 1 for callers), what `addr2line -e MODULE` takes;
`complete` says whether unwinding reached the outermost frame. In a CPython process the
Python frames are merged in (tracee.pyframes.merge): such a frame has `"python": true`, its
function the code object's qualified name, its file and line the Python source's, module ""
and offset 0 (a reader that ignores the key still reads it). Stacks are interned by content
(their exact frame addresses, Python frames by name, file and line): equal stacks share one
id, different ones never do.

The writer appends each new stack as it is first seen, before any record that uses it is
written, so the table is complete for every record in the file even after a SIGKILL.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from pymtrace import jsonread
from pymtrace.errors import CorruptFile, PymtraceError
from pymtrace.trace import files
from pymtrace.tracee.unwind import Frame, Location

FORMAT = "pymtrace-stacks"
VERSION = 1
SUFFIX = ".stacks"
MAX_ID = (1 << 24) - 1  # mtrace-bin keeps the id in 24 bits of the type word
_MAX_LINE = 1 << 24  # a line longer than this is refused when reading


def table_path(trace_path: str) -> str:
    """Where the stack table of TRACE_PATH lives."""
    return files.side_file(trace_path, SUFFIX)


@dataclass(frozen=True)
class StackFrame:
    """One frame of a stack table entry."""

    function: str
    file: str
    line: int
    module: str
    build_id: str
    offset: int
    inlined: bool = False
    python: bool = False  # a Python frame (function: qualified name; module "", offset 0)


@dataclass(frozen=True)
class Stack:
    """One stack table entry: frames root to leaf."""

    id: int
    frames: tuple[StackFrame, ...]
    complete: bool

    def folded(self) -> str:
        """The frames' function names root first, `;`-separated (flame graph tools' form)."""
        return ";".join(f.function for f in self.frames)


class TableWriter:
    """Interns stacks (Locations leaf first) of one trace into ids and appends new ones to the
    table file FD. SYMBOLIZE gives a Location's frames innermost first (Symbolizer.frames)."""

    def __init__(self, fd: int, trace_name: str, pid: int, symbolize: Callable[[Location], list[Frame]]) -> None:
        self.fd = fd
        self.symbolize = symbolize
        self.ids: dict[tuple[tuple[Location, ...], bool], int] = {}
        self.pending: list[bytes] = []
        self.overflow = 0  # stacks beyond MAX_ID: their records get id 0
        self._line({"format": FORMAT, "version": VERSION, "trace": os.path.basename(trace_name), "pid": pid})
        self.flush()

    def _line(self, obj: dict) -> None:
        self.pending.append(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def intern(self, stack: Sequence[Location], complete: bool) -> int:
        """The id of STACK (leaf first), a new one (written out at the next flush) if unseen."""
        key = (tuple(stack), complete)
        found = self.ids.get(key)
        if found is not None:
            return found
        if len(self.ids) >= MAX_ID:
            self.overflow += 1
            return 0
        new = len(self.ids) + 1
        self.ids[key] = new
        frames = []
        for module, pc in reversed(key[0]):
            for f in reversed(self.symbolize((module, pc))):
                if f.python:
                    frames.append(_python_frame(f))
                    continue
                frames.append(
                    {
                        "function": f.function,
                        "file": f.file,
                        "line": f.line,
                        "module": module.path,
                        "build_id": module.build_id,
                        "offset": pc,
                        "inlined": f.inlined,
                    }
                )
        self._line({"id": new, "complete": complete, "frames": frames})
        return new

    def flush(self) -> None:
        """Write the stacks interned since the last flush (OSError: the caller's write failure)."""
        if not self.pending:
            return
        data = memoryview(b"".join(self.pending))
        self.pending.clear()
        done = 0
        while done < len(data):
            done += os.write(self.fd, data[done:])

    def close(self) -> None:
        try:
            self.flush()
        finally:
            os.close(self.fd)


def _python_frame(f: Frame) -> dict:
    return {
        "function": f.function,
        "file": f.file,
        "line": f.line,
        "module": "",
        "build_id": "",
        "offset": 0,
        "inlined": False,
        "python": True,
    }


def read_table(path: str) -> dict[int, Stack]:
    """{id: Stack} of the table at PATH; CorruptFile (one line) if it is not one."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise PymtraceError(f"cannot read {path}: {exc.strerror}") from None
    with f:
        return parse_table(f, path)


def parse_table(lines: Iterable[bytes], name: str) -> dict[int, Stack]:
    """{id: Stack} from the lines of a stack table (NAME for error messages)."""
    table: dict[int, Stack] = {}
    number = 0
    for number, raw in enumerate(lines, 1):
        if len(raw) > _MAX_LINE:
            raise CorruptFile(f"{name}: line {number} is longer than {_MAX_LINE} bytes")
        try:
            obj = jsonread.loads(raw)
        except ValueError:
            raise CorruptFile(f"{name}: line {number} is not JSON") from None
        if number == 1:
            if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                raise CorruptFile(f"{name}: not a pymtrace stack table")
            if obj.get("version") != VERSION:
                raise CorruptFile(f"{name}: stack table version {obj.get('version')!r}; this pymtrace reads {VERSION}")
            continue
        try:
            frames = tuple(
                StackFrame(
                    str(f["function"]),
                    str(f["file"]),
                    int(f["line"]),
                    str(f["module"]),
                    str(f["build_id"]),
                    int(f["offset"]),
                    bool(f.get("inlined", False)),
                    bool(f.get("python", False)),
                )
                for f in obj["frames"]
            )
            entry = Stack(int(obj["id"]), frames, bool(obj["complete"]))
        except (KeyError, TypeError, ValueError):
            raise CorruptFile(f"{name}: line {number} is not a stack entry") from None
        if entry.id != len(table) + 1:
            raise CorruptFile(f"{name}: line {number}: stack id {entry.id}, expected {len(table) + 1}")
        table[entry.id] = entry
    if number == 0:
        raise CorruptFile(f"{name}: empty file, not a pymtrace stack table")
    return table
