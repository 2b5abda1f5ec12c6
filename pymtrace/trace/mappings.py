"""The executable mappings of a recorded process, kept with its trace so that its callers can be
named offline (docs/formats.md, section 7).

`record` reads /proc/PID/maps when a process's trace is opened, at each exec of a launched
command, every second while it records and when a launched command exits (held there before
its mappings go), and keeps each executable file mapping once: path, GNU build ID, file
offset, start and end. The log is JSON lines, version 1: a header
`{"format": "pymtrace-maps", "version": 1, "trace": NAME, "pid": PID}`, then one line per
mapping `{"start": S, "end": E, "offset": O, "path": P, "build_id": B, "vaddr": V}` (V: the
file's own virtual address mapped at S, from its program headers; absent if they could not be
read) and, at an exec,
`{"exec": N}` (the mappings after it belong to the N-th program the process ran). A Parquet
trace holds the log in its key-value metadata (`pymtrace.maps`), mtrace-bin and mtrace-text
in the side file FILE.maps, appended as mappings are learned (the lines of a mapping are
written before the drain that follows, so the file is complete up to a kill).

Symbolizer (below) names a caller address offline: the mapping holding it gives the file and
its file-relative address (V + address - S; a debug file's program headers no longer give the
file offsets, so V is taken when recording); the file is the one at the recorded path if its build ID matches,
else the debug file /usr/lib/debug/.build-id/XX/REST.debug; libdwfl (tracee/unwind.py) reads
the symbols and the line tables (and finds debug files by build ID itself).
"""

from __future__ import annotations

import bisect
import json
import os
import struct
from dataclasses import dataclass
from typing import Iterable

from pymtrace.errors import CorruptFile, PymtraceError
from pymtrace.trace import files

FORMAT = "pymtrace-maps"
VERSION = 1
SUFFIX = ".maps"
METADATA_KEY = "maps"  # under parquet's "pymtrace." prefix
DEBUG_ROOT = "/usr/lib/debug/.build-id"
_MAX_LINE = 1 << 16
PAGE = os.sysconf("SC_PAGE_SIZE")


def side_path(trace_path: str) -> str:
    """Where the maps of the mtrace-bin or mtrace-text trace TRACE_PATH live."""
    return files.side_file(trace_path, SUFFIX)


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int  # in the file, of start
    path: str
    build_id: str  # lowercase hex, "" when unknown
    program: int = 0  # the exec count of the process when it was mapped
    vaddr: int | None = None  # the file's virtual address mapped at start (None: not recorded)


class MapsLog:
    """The executable mappings of process PID as they are learned (record): lines() is the log
    so far, take_new() the lines since the last call (what a side file appends)."""

    def __init__(self, pid: int, trace_name: str) -> None:
        self.pid = pid
        self.program = 0
        self.seen: set[tuple] = set()
        self.files: dict[tuple, tuple] = {}  # (dev, inode) -> (build id, program headers or None)
        self._lines = [_dump({"format": FORMAT, "version": VERSION, "trace": os.path.basename(trace_name), "pid": pid})]
        self._taken = 0

    def lines(self) -> list[str]:
        return list(self._lines)

    def text(self) -> str:
        return "".join(self._lines)

    def take_new(self) -> str:
        new = "".join(self._lines[self._taken :])
        self._taken = len(self._lines)
        return new

    def exec(self) -> None:
        """The process exec'd: the mappings read from now on are its new program's."""
        self.program += 1
        self.seen.clear()
        self._lines.append(_dump({"exec": self.program}))

    def snapshot(self) -> bool:
        """Read /proc/PID/maps now and log the executable file mappings not logged yet; whether
        any was new (False too when the process is gone or its maps cannot be read)."""
        from pymtrace.tracee.unwind import module_path, parse_maps

        try:
            with open(f"/proc/{self.pid}/maps") as f:
                lines = parse_maps(f.read())
        except OSError:
            return False
        new = False
        for m in lines:
            if "x" not in m.perms or not m.path.startswith("/"):
                continue
            key = (m.start, m.end, m.offset, m.dev, m.inode)
            if key in self.seen:
                continue
            self.seen.add(key)
            found = self.files.get((m.dev, m.inode))
            if found is None:
                found = self.files[(m.dev, m.inode)] = self._identify(m)
            build_id, headers = found
            line = {
                "start": m.start,
                "end": m.end,
                "offset": m.offset,
                "path": module_path(m.path),
                "build_id": build_id,
            }
            vaddr = _vaddr(headers, m.offset)
            if vaddr is not None:
                line["vaddr"] = vaddr
            self._lines.append(_dump(line))
            new = True
        return new

    def _identify(self, m: object) -> tuple:
        """(build ID, program headers) of the file mapping M maps, read through /proc."""
        from pymtrace.tracee import elf

        for path in (f"/proc/{self.pid}/map_files/{m.start:x}-{m.end:x}", f"/proc/{self.pid}/root{m.path}"):
            headers = elf.program_headers(path)
            if headers is not None:
                return _note_build_id(path, headers), headers
        return "", None


def _note_build_id(path: str, headers: object) -> str:
    """The GNU build ID in PATH's PT_NOTE segments ("" if none): read from the program
    headers, as the loader sees it (~50 us a file; walking the section headers took ~6 ms)."""
    try:
        with open(path, "rb") as f:
            for seg in headers.segments:
                if seg.type != 4 or not 0 < seg.filesz <= 1 << 16:  # PT_NOTE
                    continue
                f.seek(seg.offset)
                data = f.read(seg.filesz)
                pos = 0
                while pos + 12 <= len(data):
                    namesz, descsz, kind = struct.unpack_from("<III", data, pos)
                    name_end = pos + 12 + namesz
                    desc = (name_end + 3) & ~3
                    if kind == 3 and data[pos + 12 : name_end] == b"GNU\0":  # NT_GNU_BUILD_ID
                        return data[desc : desc + descsz].hex()
                    pos = (desc + descsz + 3) & ~3
    except OSError:
        pass
    return ""


def _vaddr(headers: object, offset: int) -> int | None:
    """The virtual address of file offset OFFSET by the program headers HEADERS (None: in no
    loaded segment, or no headers). A mapping starts at the page holding its segment's first
    byte, so its offset can lie before the segment's: the address is linear from there."""
    if headers is None:
        return None
    found = [
        s
        for s in headers.segments
        if s.type == 1 and s.offset - s.offset % PAGE <= offset < s.offset + max(s.filesz, 1)
    ]
    found.sort(key=lambda s: not s.flags & 1)  # the executable segment first: only those are kept
    return found[0].vaddr + offset - found[0].offset if found else None


def _dump(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"


class Maps:
    """The mappings of one recorded process (parse()); lookup() finds an address's."""

    def __init__(self, mappings: list[Mapping]) -> None:
        self.mappings = mappings
        # the newest program first: an address is looked up in the last program that mapped it
        self._by_program: list[tuple[list[int], list[Mapping]]] = []
        for program in sorted({m.program for m in mappings}, reverse=True):
            ms = sorted((m for m in mappings if m.program == program), key=lambda m: m.start)
            self._by_program.append(([m.start for m in ms], ms))

    def lookup(self, addr: int) -> Mapping | None:
        for starts, ms in self._by_program:
            i = bisect.bisect_right(starts, addr) - 1
            if i >= 0 and addr < ms[i].end:
                return ms[i]
        return None


def parse(lines: Iterable[str | bytes], name: str) -> Maps:
    """The Maps of a maps log (its lines; NAME for error messages); CorruptFile if it is not one."""
    mappings = []
    program = 0
    number = 0
    for number, raw in enumerate(lines, 1):
        if len(raw) > _MAX_LINE:
            raise CorruptFile(f"{name}: maps line {number} is longer than {_MAX_LINE} bytes")
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            raise CorruptFile(f"{name}: maps line {number} is not JSON") from None
        if number == 1:
            if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                raise CorruptFile(f"{name}: not a pymtrace maps log")
            if obj.get("version") != VERSION:
                raise CorruptFile(f"{name}: maps log version {obj.get('version')!r}; this pymtrace reads {VERSION}")
            continue
        try:
            if "exec" in obj:
                program = int(obj["exec"])
                continue
            vaddr = obj.get("vaddr")
            m = Mapping(
                int(obj["start"]),
                int(obj["end"]),
                int(obj["offset"]),
                str(obj["path"]),
                str(obj["build_id"]),
                program,
                None if vaddr is None else int(vaddr),
            )
        except (KeyError, TypeError, ValueError):
            raise CorruptFile(f"{name}: maps line {number} is not a mapping") from None
        mappings.append(m)
    if number == 0:
        raise CorruptFile(f"{name}: empty, not a pymtrace maps log")
    return Maps(mappings)


def load(trace_path: str, fmt: str, metadata: dict[str, str] | None = None) -> Maps | None:
    """The recorded maps of the trace TRACE_PATH (format FMT; METADATA: a Parquet file's
    pymtrace.* metadata), None when it has none (recorded without them, or the side file is gone)."""
    if fmt == "parquet":
        text = (metadata or {}).get(METADATA_KEY)
        return parse(text.splitlines(), f"{trace_path} (pymtrace.maps)") if text else None
    path = side_path(trace_path)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            return parse(f, path)
    except OSError as exc:
        raise PymtraceError(f"cannot read {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class Place:
    function: str
    file: str  # "" without debug line information
    line: int

    def text(self) -> str:
        return f"{self.function} ({self.file}:{self.line})" if self.file else self.function


class Symbolizer:
    """Names callers of recorded processes offline, from their Maps, with the files found on this
    machine (the recorded path with the same build ID, or its debug file by build ID). missing
    lists the files found nowhere (their callers stay addresses)."""

    def __init__(self) -> None:
        self.missing: set[str] = set()
        self._images: dict[Mapping, object] = {}
        self._cache: dict[tuple[int, int], Place | None] = {}

    def place(self, maps: Maps, key: int, addr: int) -> Place | None:
        """The function and source line of the call that returned to ADDR (a caller) in the
        process whose Maps are MAPS (KEY: which process, for the cache); None if unknown."""
        if not addr:
            return None
        found = self._cache.get((key, addr), False)
        if found is not False:
            return found
        place = None
        m = maps.lookup(addr)
        if m is not None:
            place = self._symbolize(m, addr - 1)  # the call instruction, not the return address
        self._cache[(key, addr)] = place
        return place

    def _symbolize(self, m: Mapping, addr: int) -> Place | None:
        from pymtrace.tracee import elf
        from pymtrace.tracee.unwind import RecordedImage

        local = self._local_file(m)
        if local is None:
            self.missing.add(m.path)
            return None
        if m.vaddr is not None:
            vaddr = m.vaddr + addr - m.start
        else:
            vaddr = _vaddr(elf.program_headers(local), addr - m.start + m.offset)
            if vaddr is None:
                return None
        image = self._images.get(m)
        if image is None:
            try:
                image = self._images[m] = RecordedImage(m.start, m.end, m.offset, m.path, local)
            except PymtraceError:
                self.missing.add(m.path)
                return None
        frames = image.symbolize(image.modules[0], vaddr) if image.modules else []
        if not frames or (not frames[0].file and "+0x" in frames[0].function):
            return None
        inner = frames[0]  # the function the call is in, an inlined one if it was inlined
        return Place(inner.function, inner.file, inner.line)

    def _local_file(self, m: Mapping) -> str | None:
        """The file on this machine for M: its path if the build ID matches (or none was
        recorded), else the debug file named by the build ID; None if neither is there."""
        from pymtrace.tracee import elf

        if os.path.isfile(m.path) and (not m.build_id or elf.build_id(m.path) == m.build_id):
            return m.path
        if len(m.build_id) > 2:
            debug = os.path.join(DEBUG_ROOT, m.build_id[:2], m.build_id[2:] + ".debug")
            if os.path.isfile(debug):
                return debug
        return None
