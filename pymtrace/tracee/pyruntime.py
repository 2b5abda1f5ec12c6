"""The CPython interpreter inside a traced process: which file defines it, its version, and the
layout of the structures a reader outside the process walks to find each thread's Python
frames (heap's BPF program reads them at sample time: bpf/pyframes.h; tracee.pyframes names
their code objects).

    found = pyruntime.find(pid)        # None: no CPython in it
    if found.problem: print(found.problem)   # a CPython it cannot read: native stacks only
    else: found.runtime, found.layout  # the address of _PyRuntime, the offsets

The version comes from the interpreter's own data, never from a file name: `Py_Version`
(3.11+), else the PY_VERSION string Py_GetVersion formats (3.10). The layout comes from the
interpreter itself where it publishes one (`_Py_DebugOffsets` at the start of _PyRuntime,
3.13), else from the table below for its minor version: offsets of release builds on x86-64,
the same for every patch release of a minor version (checked against each installed
interpreter's own headers: tests/unit/test_pyruntime.py). Debug and trace-refs builds (other
object headers), free-threaded builds and versions outside 3.10-3.13 are refused with the reason.

3.10's thread states do not record the kernel's thread id, only pthread_self(): the tid is
read from glibc's struct pthread at the offset glibc publishes for debuggers
(`_thread_db_pthread_tid`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct

from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.tracee import elf, libc

SUPPORTED = ((3, 10), (3, 11), (3, 12), (3, 13))
_LIBPYTHON = re.compile(r"/libpython3\.\d+[a-z]*\.so")
# defined only by builds whose object headers or counters differ from a release build's
_DEBUG_SYMBOLS = ("_Py_RefTotal", "_Py_GetGlobalRefTotal", "_Py_NegativeRefcount", "_Py_PrintReferences")
_PY_VERSION = re.compile(rb"(3)\.(\d+)\.(\d+)(?:(?:a|b|rc)\d+)?\+?\0")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte offsets of the fields a walk reads (names as in _Py_DebugOffsets)."""

    interpreters_head: int  # _PyRuntimeState.interpreters.head
    interp_next: int  # PyInterpreterState.next
    interp_threads_head: int  # .threads.head (3.10: .tstate_head)
    thread_next: int  # PyThreadState.next
    thread_interp: int  # .interp
    thread_tid: int  # .native_thread_id (3.10: .thread_id, a pthread_t)
    thread_frame: int  # .current_frame (3.11, 3.12: .cframe; 3.10: .frame)
    cframe_current_frame: int | None  # _PyCFrame.current_frame (3.11, 3.12)
    frame_previous: int  # _PyInterpreterFrame.previous (3.10: PyFrameObject.f_back)
    frame_code: int  # .f_code (3.13: .f_executable)
    frame_instr: int  # .prev_instr (3.13: .instr_ptr; 3.10: the int f_lasti)
    frame_flag: int | None  # 3.11: .is_entry; 3.12+: .owner; 3.10: none
    code_filename: int
    code_name: int
    code_qualname: int | None  # 3.10 has no co_qualname
    code_linetable: int
    code_firstlineno: int
    code_adaptive: int | None  # co_code_adaptive: the instructions (3.11+)
    unicode_state: int = 32
    unicode_length: int = 16
    unicode_hash: int = 24  # PyASCIIObject.hash
    unicode_ascii_size: int = 40  # sizeof(PyASCIIObject): where an ASCII string's data starts
    unicode_compact_size: int = 56  # sizeof(PyCompactUnicodeObject): a non-ASCII one's
    bytes_size: int = 16
    bytes_sval: int = 32
    object_type: int = 8


# Release builds, x86-64 (offsetof on each version's headers: tests/unit/test_pyruntime.py)
TABLES = {
    (3, 10): Layout(
        interpreters_head=32,
        interp_next=0,
        interp_threads_head=8,
        thread_next=8,
        thread_interp=16,
        thread_tid=176,
        thread_frame=24,
        cframe_current_frame=None,
        frame_previous=24,
        frame_code=32,
        frame_instr=96,
        frame_flag=None,
        code_filename=104,
        code_name=112,
        code_qualname=None,
        code_linetable=120,
        code_firstlineno=40,
        code_adaptive=None,
        unicode_ascii_size=48,
        unicode_compact_size=72,
    ),
    (3, 11): Layout(
        interpreters_head=40,
        interp_next=0,
        interp_threads_head=16,
        thread_next=8,
        thread_interp=16,
        thread_tid=160,
        thread_frame=56,
        cframe_current_frame=8,
        frame_previous=48,
        frame_code=32,
        frame_instr=56,
        frame_flag=68,
        code_filename=112,
        code_name=120,
        code_qualname=128,
        code_linetable=136,
        code_firstlineno=72,
        code_adaptive=184,
        unicode_ascii_size=48,
        unicode_compact_size=72,
    ),
    (3, 12): Layout(
        interpreters_head=40,
        interp_next=0,
        interp_threads_head=72,
        thread_next=8,
        thread_interp=16,
        thread_tid=144,
        thread_frame=56,
        cframe_current_frame=0,
        frame_previous=8,
        frame_code=0,
        frame_instr=56,
        frame_flag=70,
        code_filename=112,
        code_name=120,
        code_qualname=128,
        code_linetable=136,
        code_firstlineno=68,
        code_adaptive=192,
    ),
}

# _Py_DebugOffsets of 3.13 (Include/internal/pycore_runtime.h): its u64 fields in order, by
# group; the names used below. Stable within 3.13, changed in 3.14.
_DEBUG_GROUPS = (
    ("cookie", 1),
    ("version", 1),
    ("free_threaded", 1),
    ("runtime_state", 3),  # size finalizing interpreters_head
    ("interpreter_state", 13),  # size id next threads_head ...
    ("thread_state", 9),  # size prev next interp current_frame thread_id native_thread_id ...
    ("interpreter_frame", 6),  # size previous executable instr_ptr localsplus owner
    ("code_object", 10),  # size filename name qualname linetable firstlineno argcount ... co_code_adaptive
    ("pyobject", 2),  # size ob_type
    ("type_object", 4),
    ("tuple_object", 3),
    ("list_object", 3),
    ("dict_object", 3),
    ("float_object", 2),
    ("long_object", 3),
    ("bytes_object", 3),  # size ob_size ob_sval
    ("unicode_object", 4),  # size state length asciiobject_size
)
DEBUG_COOKIE = b"xdebugpy"


@dataclasses.dataclass(frozen=True)
class Interpreter:
    """The CPython of one process. PROBLEM set: it cannot be read (the reason), the rest may
    be partial."""

    path: str  # the file defining _PyRuntime (the executable or libpython), as mapped
    bias: int  # load bias: process address = ELF virtual address + bias
    version: tuple[int, int, int] | None
    problem: str | None = None
    runtime: int = 0  # the address of _PyRuntime
    layout: Layout | None = None
    source: str = ""  # where the layout came from: "_Py_DebugOffsets" or "table"
    tid_in_pthread: int | None = None  # 3.10: offset of the tid in glibc's struct pthread
    code_type: int = 0  # addresses of PyCode_Type, PyUnicode_Type, PyBytes_Type
    unicode_type: int = 0
    bytes_type: int = 0

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version)) if self.version else "?"

    def describe(self) -> str:
        """One line: which CPython, and how it is read or why not."""
        what = f"CPython {self.version_text} ({os.path.basename(self.path)})"
        return f"{what}: {self.problem}" if self.problem else f"{what}, layout from {self.source}"


def find(pid: int, maps: list[libc.Mapping] | None = None) -> Interpreter | None:
    """PID's CPython (None: it runs none), read from the files it maps. Raises ProcessGone."""
    maps = libc.read_maps(pid) if maps is None else maps
    exe = None
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        pass
    paths = []
    for m in maps:
        if m.path.startswith("/") and m.path not in paths and (m.path == exe or _LIBPYTHON.search(m.path)):
            paths.append(m.path)
    for path in paths:
        local = libc.host_path(pid, path)
        if not exports_runtime(local):  # a quick look first: any large executable is asked
            continue
        try:
            syms = elf.symbols(local)
        except PymtraceError:
            continue
        if "_PyRuntime" in syms:
            return _read(pid, path, local, syms, maps)
    return None


def exports_runtime(path: str) -> bool:
    """Whether PATH's .dynsym defines _PyRuntime (every CPython exports it), read through its
    hash table: what a full symbol table read would cost a large executable is not paid."""
    try:
        with open(path, "rb") as f:
            return elf.DynamicSymbols(f).defined("_PyRuntime")
    except (OSError, ValueError, struct.error):
        return False


def _read(pid: int, path: str, local: str, syms: dict[str, elf.Symbol], maps: list[libc.Mapping]) -> Interpreter:
    bias = load_bias(local, [m for m in maps if m.path == path])
    base = Interpreter(path, bias or 0, None)
    if bias is None:
        return dataclasses.replace(base, problem="cannot tell where it is loaded")
    version = _version(local, syms)
    if version is None:
        return dataclasses.replace(base, problem="cannot tell its version (no Py_Version, no PY_VERSION string)")
    base = dataclasses.replace(base, version=version)
    if version[:2] not in SUPPORTED:
        return dataclasses.replace(base, problem="Python frames are read for CPython 3.10-3.13 only")
    debug = next((s for s in _DEBUG_SYMBOLS if s in syms), None)
    if debug:
        return dataclasses.replace(base, problem=f"a debug build (it defines {debug}): its structures differ")
    types = {}
    for name in ("PyCode_Type", "PyUnicode_Type", "PyBytes_Type"):
        if name not in syms:
            return dataclasses.replace(base, problem=f"it has no symbol {name}")
        types[name] = syms[name].address + bias
    runtime = syms["_PyRuntime"].address
    if version[:2] >= (3, 13):
        layout, problem = debug_offsets(local, runtime, version)
        source = "_Py_DebugOffsets"
    else:
        layout, problem, source = TABLES[version[:2]], None, "table"
    if problem:
        return dataclasses.replace(base, problem=problem)
    tid_in_pthread = None
    if version[:2] == (3, 10):
        tid_in_pthread = glibc_tid_offset(pid, maps)
        if tid_in_pthread is None:
            return dataclasses.replace(base, problem="3.10 needs glibc's _thread_db_pthread_tid to tell threads apart")
    return dataclasses.replace(
        base,
        runtime=runtime + bias,
        layout=layout,
        source=source,
        tid_in_pthread=tid_in_pthread,
        code_type=types["PyCode_Type"],
        unicode_type=types["PyUnicode_Type"],
        bytes_type=types["PyBytes_Type"],
    )


def load_bias(path: str, mappings: list[libc.Mapping]) -> int | None:
    """Process address minus ELF virtual address for PATH, from its MAPPINGS (its lines of
    the process's maps): the mapping of file offset 0 holds the PT_LOAD of offset 0."""
    headers = elf.program_headers(path)
    first = next((m for m in mappings if m.offset == 0), None)
    if headers is None or first is None:
        return None
    seg = next((s for s in headers.segments if s.type == elf.PT_LOAD and s.offset == 0), None)
    if seg is None:
        return None
    return first.start - (seg.vaddr & ~0xFFF)


def read_file_at(path: str, address: int, length: int) -> bytes:
    """LENGTH bytes of PATH's initialized data at ELF virtual ADDRESS (b"" when not in the file)."""
    headers = elf.program_headers(path)
    if headers is None:
        return b""
    for seg in headers.segments:
        if seg.type == elf.PT_LOAD and seg.vaddr <= address < seg.vaddr + seg.filesz:
            with open(path, "rb") as f:
                f.seek(seg.offset + address - seg.vaddr)
                return f.read(min(length, seg.vaddr + seg.filesz - address))
    return b""


def _version(path: str, syms: dict[str, elf.Symbol]) -> tuple[int, int, int] | None:
    """(major, minor, micro) from Py_Version (3.11+: PY_VERSION_HEX), else from the PY_VERSION
    string Py_GetVersion passes to snprintf as its fourth argument (lea disp(%rip), %rcx)."""
    if "Py_Version" in syms:
        data = read_file_at(path, syms["Py_Version"].address, 8)
        if len(data) == 8:
            (hexversion,) = struct.unpack("<Q", data)
            return (hexversion >> 24 & 0xFF, hexversion >> 16 & 0xFF, hexversion >> 8 & 0xFF)
    if "Py_GetVersion" not in syms:
        return None
    start = syms["Py_GetVersion"].address
    try:
        code = elf.read_code(path, start, 96)
    except PymtraceError:
        return None
    for m in re.finditer(rb"\x48\x8d\x0d", code):  # lea disp32(%rip), %rcx
        if m.start() + 7 > len(code):
            break
        (disp,) = struct.unpack_from("<i", code, m.start() + 3)
        text = read_file_at(path, start + m.start() + 7 + disp, 24)
        found = _PY_VERSION.match(text)
        if found:
            return (int(found.group(1)), int(found.group(2)), int(found.group(3)))
    return None


def debug_offsets(path: str, runtime: int, version: tuple[int, int, int]) -> tuple[Layout | None, str | None]:
    """(the layout, None) from the _Py_DebugOffsets at the start of _PyRuntime in PATH (static
    data: read from the file), or (None, why not)."""
    count = sum(n for _, n in _DEBUG_GROUPS)
    data = read_file_at(path, runtime, 8 * count)
    if len(data) < 8 * count or data[:8] != DEBUG_COOKIE:
        return None, "its _PyRuntime does not start with _Py_DebugOffsets"
    values = struct.unpack(f"<{count}Q", data)
    groups, i = {}, 0
    for name, n in _DEBUG_GROUPS:
        groups[name] = values[i : i + n]
        i += n
    hexversion = groups["version"][0]
    if (hexversion >> 24, hexversion >> 16 & 0xFF) != version[:2]:
        return None, f"its _Py_DebugOffsets are of version {hexversion:#x}"
    if groups["free_threaded"][0]:
        return None, "a free-threaded build: not supported"
    rt, interp, thread = groups["runtime_state"], groups["interpreter_state"], groups["thread_state"]
    frame, code, uni, byt = (
        groups["interpreter_frame"],
        groups["code_object"],
        groups["unicode_object"],
        groups["bytes_object"],
    )
    layout = Layout(
        interpreters_head=rt[2],
        interp_next=interp[2],
        interp_threads_head=interp[3],
        thread_next=thread[2],
        thread_interp=thread[3],
        thread_tid=thread[6],
        thread_frame=thread[4],
        cframe_current_frame=None,
        frame_previous=frame[1],
        frame_code=frame[2],
        frame_instr=frame[3],
        frame_flag=frame[5],
        code_filename=code[1],
        code_name=code[2],
        code_qualname=code[3],
        code_linetable=code[4],
        code_firstlineno=code[5],
        code_adaptive=code[9],
        unicode_state=uni[1],
        unicode_length=uni[2],
        unicode_ascii_size=uni[3],
        unicode_compact_size=uni[3] + 16,  # PyCompactUnicodeObject: + utf8_length, utf8
        bytes_size=byt[1],
        bytes_sval=byt[2],
        object_type=groups["pyobject"][1],
    )
    if max(layout.frame_previous, layout.frame_code, layout.frame_instr, layout.frame_flag or 0) >= 120:
        return None, "its _Py_DebugOffsets place frame fields beyond what a walk reads"
    return layout, None


def glibc_tid_offset(pid: int, maps: list[libc.Mapping]) -> int | None:
    """The offset of the kernel thread id in glibc's struct pthread, from the descriptor
    glibc publishes for libthread_db (`_thread_db_pthread_tid`: bits, count, offset) in the
    libc (2.34+) or libpthread PID maps; None when neither has it (musl, static)."""
    for m in maps:
        name = os.path.basename(m.path)
        if not (libc.is_libc_path(m.path) or name.startswith("libpthread")):
            continue
        local = libc.host_path(pid, m.path)
        try:
            sym = elf.symbols(local).get("_thread_db_pthread_tid")
        except PymtraceError:
            continue
        if sym is None:
            continue
        data = read_file_at(local, sym.address, 12)
        if len(data) == 12:
            bits, _count, offset = struct.unpack("<3I", data)
            if bits == 32:
                return offset
    return None


class Memory:
    """Reads of a process's memory through /proc/PID/mem (root: any process it may ptrace)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError):
            raise ProcessGone(pid) from None
        except OSError as exc:
            raise PymtraceError(f"cannot read the memory of process {pid}: {exc.strerror}") from None

    def read(self, address: int, length: int) -> bytes:
        """Up to LENGTH bytes at ADDRESS (fewer, or b"", where it is not mapped)."""
        if self.fd < 0 or address <= 0 or address >= 1 << 47:
            return b""
        try:
            return os.pread(self.fd, length, address)
        except OSError:
            return b""

    def u64(self, address: int) -> int | None:
        data = self.read(address, 8)
        return struct.unpack("<Q", data)[0] if len(data) == 8 else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close()
