"""Python frames of sampled threads, named and merged into their native stacks.

The BPF program reads each frame's code object and instruction (bpf/pywalk.h); here they get
a name: the code object's qualified name, file and first line, read from the process's
memory once per code object (PythonProcess), and the line of the instruction from its line
table (line_310, line_311). A Python frame is a Location of the PYTHON module whose pc is an
index in a PythonFrames table (one per run, all processes): the writers name it through the
Symbolizer like any other Location (Frame.python set).

Merged stacks (merge): each native `_PyEval_EvalFrameDefault` frame is replaced by the Python
frames it was running, native frames of C extensions stay where they are, the interpreter's
own frames between Python calls go. Which Python frames
one evaluation loop runs differs per version (groups): 3.10 one frame each; 3.11 the frames
down to one marked is_entry; 3.12 and 3.13 the frames above an entry frame the loop pushes
(owner FRAME_OWNED_BY_CSTACK), which is no Python frame itself.

The BPF program keeps with each frame what names its code object (the addresses of its
qualified name and file, its first line, the strings' hashes): a code object is read once per
such identity, so an address freed and reused by another code object is read again. A code
object gone before it was read (a module's body, freed after its import) is named from those
strings if they are still the same (str_tags; a name the compiler gives, such as "<module>",
from its tag alone), at its first line (its line table went with it); else it is "<unknown>". HeapSource hands every sample's block over as soon as it is in the
ring (look_ahead), before the slower unwinding: code objects are read while they live.
"""

from __future__ import annotations

import struct
import threading
from typing import Callable, Sequence

from pymtrace.tracee.pyruntime import Interpreter, Layout, Memory
from pymtrace.tracee.unwind import Frame, Location, Module

PYTHON = Module("[python]", "")  # the module of every Python frame's Location
EVAL_FUNCTION = "_PyEval_EvalFrameDefault"
# bpf/pyframes.h py_frame: code, instr, name, file, name_tag, file_tag, firstlineno, flag
FRAME = struct.Struct("<QQQQQQII")
HEAD = struct.Struct("<IIQ")  # py_head: count, status, tstate
OWNED_BY_CSTACK = 3  # 3.12+: an evaluation loop's entry frame
NONE, OK, NO_THREAD, TRUNCATED, FAULT = range(5)  # py_head.status (bpf/pyframes.h PY_STATUS_*)
MAX_STRING = 4096  # characters of a name or file read at most
MAX_LINETABLE = 1 << 20
UNKNOWN_CODE = ("<unknown>", "", 0)  # a code object that could not be read

# view names (heap --native, --python-only, the default)
MERGED, NATIVE, PYTHON_ONLY = "merged", "native", "python"


class PythonFrames:
    """The Python frames of a run, interned: (qualname, file, line) -> Location. Thread-safe.
    Registered with the Symbolizer for the PYTHON module (symbolize)."""

    def __init__(self) -> None:
        self._index: dict[tuple[str, str, int], int] = {}
        self._frames: list[Frame] = []
        self._lock = threading.Lock()

    def location(self, qualname: str, filename: str, line: int) -> Location:
        key = (qualname, filename, line)
        with self._lock:
            index = self._index.get(key)
            if index is None:
                index = self._index[key] = len(self._frames)
                self._frames.append(Frame(qualname, filename, line, python=True))
        return (PYTHON, index)

    def symbolize(self, module: Module, pc: int) -> list[Frame]:
        with self._lock:
            return [self._frames[pc]] if module == PYTHON and 0 <= pc < len(self._frames) else []


def read_varint(table: bytes, i: int) -> tuple[int, int]:
    """(value, next index) of the location table's unsigned varint at I (6 bits a byte, 0x40:
    more follow)."""
    value = shift = 0
    while i < len(table):
        b = table[i]
        i += 1
        value |= (b & 63) << shift
        shift += 6
        if not b & 64:
            break
    return value, i


def read_svarint(table: bytes, i: int) -> tuple[int, int]:
    value, i = read_varint(table, i)
    return (-(value >> 1) if value & 1 else value >> 1), i


def line_311(table: bytes, firstlineno: int, offset: int) -> int:
    """The line of the instruction at byte OFFSET in a 3.11+ location table (PEP 657,
    Objects/locations.md): entries of (code, length in code units) in a first byte with bit 7
    set, the line delta by code; -1 where the table says none. FIRSTLINENO where OFFSET lies
    before the code (a frame not started yet)."""
    if offset < 0:
        return firstlineno
    line, addr, i = firstlineno, 0, 0
    while i < len(table):
        first = table[i]
        if not first & 128:
            break  # not an entry's first byte: a damaged table
        code, length = (first >> 3) & 15, (first & 7) + 1
        i += 1
        delta, has_line = 0, True
        if code == 15:  # no location
            has_line = False
        elif code == 14:  # long form: line delta, end line delta, column, end column
            delta, i = read_svarint(table, i)
            for _ in range(3):
                _, i = read_varint(table, i)
        elif code == 13:  # no columns: line delta
            delta, i = read_svarint(table, i)
        elif code >= 10:  # one line form: delta code - 10, then column, end column bytes
            delta = code - 10
            i += 2
        else:  # short form: same line, one column byte
            i += 1
        line += delta
        end = addr + 2 * length
        if addr <= offset < end:
            return line if has_line else -1
        addr = end
    return -1


def line_310(table: bytes, firstlineno: int, offset: int) -> int:
    """The line of byte OFFSET in a 3.10 co_linetable: (byte delta, signed line delta) pairs,
    a line delta of -128 for a range without a line (Objects/lnotab_notes.txt)."""
    if offset < 0:
        return firstlineno
    line, start = firstlineno, 0
    for i in range(0, len(table) - 1, 2):
        sdelta, ldelta = table[i], table[i + 1] - 256 if table[i + 1] > 127 else table[i + 1]
        end = start + sdelta
        if ldelta != -128:
            line += ldelta
        if start <= offset < end:
            return -1 if ldelta == -128 else line
        start = end
    return -1


def str_tags(head: bytes, layout: Layout) -> tuple[int, int]:
    """The identities a str object whose first bytes are HEAD may have been given at sample
    time (bpf/pywalk.h py_tag: hash ^ first 8 bytes of ASCII data ^ length): with its hash
    as it is now, and with -1, the hash of a str whose hash was computed since."""
    (length,) = struct.unpack_from("<Q", head, layout.unicode_length)
    (hash_,) = struct.unpack_from("<Q", head, layout.unicode_hash)
    (first,) = struct.unpack_from("<Q", head, layout.unicode_ascii_size)
    return hash_ ^ first ^ length, 0xFFFFFFFFFFFFFFFF ^ first ^ length


def hashless_tag(text: str) -> int:
    """py_tag of a str of TEXT (ASCII, at least 8 characters) whose hash is not computed."""
    data = text.encode("ascii")
    return 0xFFFFFFFFFFFFFFFF ^ int.from_bytes(data[:8], "little") ^ len(data)


# The names the compiler gives code objects that often die right after they ran (a module's
# body, a lambda, a comprehension in 3.10 and 3.11): their str objects die with them, yet the
# tag of such a str whose hash was never computed tells which of these it was.
COMPILER_NAMES = {
    hashless_tag(name): name for name in ("<module>", "<lambda>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")
}


class CodeInfo:
    """What a code object says of itself: its name, file, first line, line table."""

    __slots__ = ("qualname", "filename", "firstlineno", "linetable", "code_start", "lines")

    def __init__(self, qualname: str, filename: str, firstlineno: int, linetable: bytes, code_start: int) -> None:
        self.qualname = qualname
        self.filename = filename
        self.firstlineno = firstlineno
        self.linetable = linetable
        self.code_start = code_start  # address of its first instruction (3.11+)
        self.lines: dict[int, int] = {}  # instruction offset -> line


class PythonProcess:
    """One process's interpreter as a reader of its memory: code objects named (cached), the
    BPF program's blocks made into groups of Locations."""

    MAX_CODES = 1 << 16  # code objects remembered (then forgotten and read again)
    MAX_BLOCKS = 1 << 16

    def __init__(self, pid: int, interp: Interpreter, table: PythonFrames) -> None:
        assert interp.layout is not None and interp.version is not None
        self.pid = pid
        self.interp = interp
        self.layout: Layout = interp.layout
        self.minor = interp.version[1]
        self.table = table
        self.memory = Memory(pid)
        self._codes: dict[tuple[int, int, int, int], CodeInfo | None] = {}
        self._strings: dict[int, str | None] = {}
        self._blocks: dict[bytes, tuple[tuple[Location, ...], ...]] = {}
        self.unreadable = 0  # frames whose code object could not be read

    def close(self) -> None:
        self.memory.close()

    def is_interpreter(self, loc: Location) -> bool:
        """Whether LOC is code of the interpreter's own file (libpython or the executable)."""
        return loc[0].path == self.interp.path

    # -- objects in the process
    def _object(self, address: int, type_address: int, length: int) -> bytes | None:
        data = self.memory.read(address, length)
        if len(data) < length:
            return None
        (ob_type,) = struct.unpack_from("<Q", data, self.layout.object_type)
        return data if ob_type == type_address else None

    def string(self, address: int) -> str | None:
        """The str object at ADDRESS (compact strings: every name and file a code object has)."""
        lay = self.layout
        head = self._object(address, self.interp.unicode_type, lay.unicode_compact_size)
        if head is None:
            return None
        (length,) = struct.unpack_from("<q", head, lay.unicode_length)
        (state,) = struct.unpack_from("<I", head, lay.unicode_state)
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or kind not in (1, 2, 4) or not 0 <= length <= MAX_STRING:
            return None
        start = address + (lay.unicode_ascii_size if ascii_ else lay.unicode_compact_size)
        data = self.memory.read(start, length * kind)
        if len(data) != length * kind:
            return None
        return data.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind], errors="replace")

    def bytes_object(self, address: int) -> bytes | None:
        lay = self.layout
        head = self._object(address, self.interp.bytes_type, lay.bytes_sval)
        if head is None:
            return None
        (size,) = struct.unpack_from("<q", head, lay.bytes_size)
        if not 0 <= size <= MAX_LINETABLE:
            return None
        data = self.memory.read(address + lay.bytes_sval, size)
        return data if len(data) == size else None

    def code(
        self, address: int, name: int = 0, file: int = 0, firstlineno: int = 0, tags: tuple[int, int] = (0, 0)
    ) -> CodeInfo | None:
        """The code object at ADDRESS whose qualified name and file are the str objects at NAME
        and FILE (of str_tag TAGS), first line FIRSTLINENO, as the BPF program saw it (NAME 0:
        not seen), read once; from those strings alone when the object is gone and they are
        not; None when neither can be read."""
        key = (address, name, file, firstlineno)
        if key in self._codes:
            return self._codes[key]
        info = self._read_code(address, name, file, firstlineno)
        if info is None and name and file:
            qualname = self._string(name, tags[0]) or COMPILER_NAMES.get(tags[0])
            filename = self._string(file, tags[1])
            if qualname is not None and filename is not None:
                info = CodeInfo(qualname, filename, firstlineno, b"", 0)
        if len(self._codes) >= self.MAX_CODES:
            self._codes.clear()
            self._strings.clear()
        self._codes[key] = info
        return info

    def _string(self, address: int, tag: int | None = None) -> str | None:
        """The str at ADDRESS (cached); with TAG, only if it is still the str of that str_tag."""
        if tag is not None:
            lay = self.layout
            head = self.memory.read(address, lay.unicode_ascii_size + 8)
            if len(head) != lay.unicode_ascii_size + 8 or tag not in str_tags(head, lay):
                return None
        if address not in self._strings:
            self._strings[address] = self.string(address)
        return self._strings[address]

    def _read_code(self, address: int, name: int, file: int, firstlineno: int) -> CodeInfo | None:
        lay = self.layout
        fields = [lay.code_filename, lay.code_name, lay.code_linetable, lay.code_firstlineno, lay.object_type]
        if lay.code_qualname is not None:
            fields.append(lay.code_qualname)
        head = self._object(address, self.interp.code_type, max(fields) + 8)
        info = None
        if head is not None:

            def ptr(off: int) -> int:
                return struct.unpack_from("<Q", head, off)[0]

            name_at = ptr(lay.code_qualname if lay.code_qualname is not None else lay.code_name)
            file_at = ptr(lay.code_filename)
            (first,) = struct.unpack_from("<i", head, lay.code_firstlineno)
            if name and (name_at, file_at, first) != (name, file, firstlineno):
                return None  # another object now: the one sampled is gone
            qualname, filename = self._string(name_at), self._string(file_at)
            table = self.bytes_object(ptr(lay.code_linetable)) or b""
            start = address + lay.code_adaptive if lay.code_adaptive is not None else 0
            if qualname is not None and filename is not None:
                info = CodeInfo(qualname, filename, first, table, start)
        return info

    def line(self, info: CodeInfo, instr: int) -> int:
        """The line of a frame of INFO at INSTR (the raw f_instr bytes of the frame)."""
        if self.minor == 10:
            lasti = instr & 0xFFFFFFFF
            offset = (lasti - (1 << 32) if lasti >= 1 << 31 else lasti) * 2  # f_lasti counts code units
        else:
            offset = instr - info.code_start if instr else -1
        line = info.lines.get(offset)
        if line is None:
            find = line_310 if self.minor == 10 else line_311
            line = info.lines[offset] = find(info.linetable, info.firstlineno, offset)
            if line < 0:
                line = info.lines[offset] = info.firstlineno
        return line

    # -- a sample's block
    def groups(self, block: bytes) -> tuple[tuple[Location, ...], ...]:
        """The Python frames of a sample's BLOCK (bpf/pyframes.h), innermost first, grouped by
        the C-level evaluation loop running them (innermost first); () when it has none."""
        found = self._blocks.get(block)
        if found is None:
            found = self._groups(block)
            if len(self._blocks) >= self.MAX_BLOCKS:
                self._blocks.clear()
            self._blocks[block] = found
        return found

    def _groups(self, block: bytes) -> tuple[tuple[Location, ...], ...]:
        if len(block) < HEAD.size:
            return ()
        count = min(HEAD.unpack_from(block)[0], (len(block) - HEAD.size) // FRAME.size)
        groups: list[tuple[Location, ...]] = []
        current: list[Location] = []
        for i in range(count):
            address, instr, name, file, name_tag, file_tag, first, flag = FRAME.unpack_from(
                block, HEAD.size + i * FRAME.size
            )
            flag &= 0xFF
            if self.minor >= 12 and flag == OWNED_BY_CSTACK:
                if current:
                    groups.append(tuple(current))
                current = []
                continue
            info = self.code(address, name, file, first, (name_tag, file_tag))
            if info is None:
                self.unreadable += 1
                current.append(self.table.location(*UNKNOWN_CODE))
            elif info.filename != "<shim>":  # 3.13's frame that runs a class's __init__ call
                current.append(self.table.location(info.qualname, info.filename, self.line(info, instr)))
            if self.minor == 10 or (self.minor == 11 and flag):  # 3.10: a loop per frame; 3.11: is_entry
                groups.append(tuple(current))
                current = []
        if current:
            groups.append(tuple(current))
        return tuple(groups)


def merge(
    native: Sequence[Location],
    groups: Sequence[tuple[Location, ...]],
    is_eval: Callable[[Location], bool],
    view: str = MERGED,
    is_interpreter: Callable[[Location], bool] | None = None,
) -> tuple[Location, ...]:
    """The stack of a sample in VIEW, leaf first. MERGED: each native frame IS_EVAL says runs
    the evaluation loop replaced by its group of Python frames (in order from the leaf; groups
    left over when the native stack was cut short go to its root end, loops left over keep
    their native frame); rootward of the innermost Python frame, the interpreter's own native
    frames (IS_INTERPRETER: its call machinery between Python calls, its start-up) are left
    out, as py-spy and pystack show them, and those of other files (C extensions, libc) stay;
    leafward of it every native frame stays (what the Python line allocated through).
    PYTHON_ONLY: the Python frames alone. NATIVE: the native stack. A sample without Python
    frames keeps its native stack in every view."""
    if view == NATIVE or not groups:
        return tuple(native)
    if view == PYTHON_ONLY:
        return tuple(loc for group in groups for loc in group)
    out: list[Location] = []
    left = iter(groups)
    inside = False  # rootward of the innermost Python frame
    for loc in native:
        if is_eval(loc):
            group = next(left, None)
            if group is not None:
                out.extend(group)
                inside = True
                continue
        if inside and is_interpreter is not None and is_interpreter(loc):
            continue
        out.append(loc)
    for group in left:
        out.extend(group)
    return tuple(out)
