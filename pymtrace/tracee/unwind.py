"""Call stacks of a traced process from registers and a copy of its stack, and their names.

    image = ProcessImage(pid)                 # while the process lives: maps, files, build IDs
    stack, complete = image.unwind(tid, regs, stack_bytes, len(stack_bytes))
    symbolizer = Symbolizer(); symbolizer.add(image)
    for module, pc in stack: print(symbolizer.frames((module, pc)))

Code built without frame pointers is unwound from its DWARF call-frame information (`.eh_frame`)
by elfutils' libdwfl, in pymtrace/tracee/native/unwind.c (compiled on first use by
target/nativebuild.py, loaded with ctypes): no Python work per frame. A ProcessImage keeps a
descriptor of every ELF file the process maps, opened through /proc/PID/map_files (the very
inode mapped, even if the file was deleted or replaced since), so unwinding and symbolizing work
after the process exited. Files are only ever mapped read-only (docs/heap.md, "How stacks are
unwound"). A Location's pc is the file's own virtual address (what `nm`, `addr2line -e FILE`
and the symbol tables use): the same in every process mapping that file.
"""

from __future__ import annotations

import ctypes
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, Union

from pymtrace import nativebuild
from pymtrace.errors import MissingLibrary, ProcessGone, PymtraceError

NATIVE_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "unwind.c")
CFLAGS = ["-O2", "-Wall"]
LIBS = ["-ldw", "-lelf", "-ldl"]
MAX_FRAMES = 256  # deeper stacks are cut (reported incomplete)
MAX_INTERNED = 65536  # uncached stacks interned per process by their raw frames (then built each time)
LIBDW_PACKAGES = "Debian/Ubuntu: apt install libdw-dev; Fedora: dnf install elfutils-devel"


@dataclass(frozen=True)
class Module:
    """Identity of one mapped ELF file, the same in every process."""

    path: str  # as mapped (/proc/PID/maps), without " (deleted)"
    build_id: str  # lowercase hex, "" when the file has none


@dataclass(frozen=True)
class Frame:
    """One symbolized frame."""

    function: str  # demangled, "@GLIBC_x" version suffix stripped; "libx.so+0x1a2b" if unknown
    file: str = ""  # source file when debug info exists
    line: int = 0
    inlined: bool = False  # True for an inlined callee (a pc can yield several frames)
    python: bool = False  # a Python function (file: its co_filename; tracee.pyframes)


Location = tuple[Module, int]  # (module, file-relative pc: return address - 1 for callers)
UNKNOWN = Module("[unknown]", "")  # a pc in no captured file (its Location holds the absolute pc)


class MapLine(NamedTuple):
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str
    offset: int
    dev: str  # "major:minor", hex
    inode: int
    path: str  # "" for anonymous memory; may end in " (deleted)"


def parse_maps(text: str) -> list[MapLine]:
    """The lines of a /proc/PID/maps text (paths may contain spaces)."""
    lines = []
    for row in text.split("\n"):  # not splitlines(): a path may contain \r (the kernel escapes only \n)
        fields = row.split(None, 5)
        if len(fields) < 5:
            continue
        start, _, end = fields[0].partition("-")
        path = fields[5].strip(" ") if len(fields) == 6 else ""
        lines.append(
            MapLine(int(start, 16), int(end, 16), fields[1], int(fields[2], 16), fields[3], int(fields[4]), path)
        )
    return lines


def format_maps(lines: Sequence[MapLine]) -> str:
    """LINES in /proc/PID/maps' own format (what libdwfl's maps reader parses)."""
    return "".join(
        f"{m.start:x}-{m.end:x} {m.perms} {m.offset:08x} {m.dev} {m.inode} {m.path}\n".replace(" \n", "\n")
        for m in lines
    )


def elf_file_lines(lines: Sequence[MapLine]) -> list[MapLine]:
    """The mappings of files that have an executable mapping (the ELF code; not the locale
    archive or other data files), all of each such file's mappings."""
    code = {m.path for m in lines if m.path.startswith("/") and "x" in m.perms}
    return [m for m in lines if m.path in code]


def module_path(raw: str) -> str:
    """A maps path without the kernel's " (deleted)" mark."""
    return raw[: -len(" (deleted)")] if raw.endswith(" (deleted)") else raw


# -- the native library ----------------------------------------------------------------------
_LIB: ctypes.CDLL | None = None
_LIB_LOCK = threading.Lock()


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    lib.pmt_open.restype = c.c_void_p
    lib.pmt_open.argtypes = []
    lib.pmt_close.argtypes = [c.c_void_p]
    lib.pmt_add_file.argtypes = [c.c_void_p, c.c_char_p, c.c_int, c.c_char_p, c.c_size_t]
    lib.pmt_file_build_id.argtypes = [c.c_void_p, c.c_int, c.c_char_p]
    lib.pmt_report.argtypes = [c.c_void_p, c.c_int, c.c_char_p, c.c_size_t, c.c_uint64, c.c_uint64]
    lib.pmt_unwind.argtypes = [
        c.c_void_p,
        c.c_int,
        c.c_void_p,  # 8 u64 registers
        c.c_void_p,
        c.c_size_t,
        c.POINTER(c.c_uint64),
        c.POINTER(c.c_int32),
        c.c_int,
        c.POINTER(c.c_int),
        c.POINTER(c.c_int),
    ]
    lib.pmt_ring_scan.argtypes = [
        c.c_void_p,
        c.c_uint64,
        c.c_uint64,
        c.c_uint64,
        c.c_uint32,
        c.c_uint32,
        c.c_uint32,
        c.c_uint32,
        c.c_uint32,
        c.c_void_p,
        c.c_void_p,
        c.c_int,
        c.c_void_p,
        c.c_int,
        c.POINTER(c.c_uint64),
    ]
    lib.pmt_cache_enable.argtypes = [c.c_void_p, c.c_int]
    lib.pmt_cache_stats.argtypes = [c.c_void_p, c.POINTER(c.c_uint64), c.POINTER(c.c_uint64)]
    lib.pmt_symbolize.argtypes = [c.c_void_p, c.c_int, c.c_uint64, c.c_char_p, c.c_size_t]
    lib.pmt_errmsg.restype = c.c_char_p
    lib.pmt_errmsg.argtypes = []
    return lib


def native_library() -> ctypes.CDLL:
    """The unwinder's shared library, compiled on first use (trusted cache: nativebuild).

    Raises MissingLibrary when elfutils' libdw is not installed, nativebuild.BuildFailed when
    the compiler fails otherwise."""
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            try:
                path = nativebuild.build_cached(
                    "unwind", [NATIVE_SRC], CFLAGS, LIBS, kind="shared", what="stack unwinder", cache_label="unwinder"
                )
            except nativebuild.BuildFailed as exc:
                if any(word in exc.output for word in ("elfutils/", "libdw", "-ldw", "-lelf", "libelf")):
                    raise MissingLibrary(f"unwinding stacks needs elfutils' libdw ({LIBDW_PACKAGES})") from None
                raise
            try:
                _LIB = _declare(ctypes.CDLL(path))
            except OSError as exc:
                raise MissingLibrary(
                    f"cannot load the stack unwinder ({exc}); it needs libdw ({LIBDW_PACKAGES})"
                ) from None
        return _LIB


# -- one process -----------------------------------------------------------------------------
def _open_mapped_file(pid: int, line: MapLine) -> int | None:
    """A read-only descriptor of the file LINE maps: through /proc/PID/map_files (the inode
    mapped, whatever its name now), else through the process's root by name, accepted only if
    it is the same inode. None when neither works."""
    try:
        return os.open(f"/proc/{pid}/map_files/{line.start:x}-{line.end:x}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        pass  # map_files needs CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE)
    if line.path.endswith(" (deleted)"):
        return None
    try:
        fd = os.open(f"/proc/{pid}/root{line.path}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    st = os.fstat(fd)
    major, _, minor = line.dev.partition(":")
    if st.st_ino != line.inode or st.st_dev != os.makedev(int(major, 16), int(minor, 16)):
        os.close(fd)
        return None
    return fd


class ProcessImage:
    """The ELF files one process maps, captured while it lives, and its unwinder session.

    One per traced process (re-created at exec). Thread-safe; close() (or garbage collection)
    frees the session and its descriptors."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.modules: list[Module] = []  # by the native session's file index
        self._index: dict[Module, int] = {}
        self._raw_paths: dict[str, int] = {}  # maps path -> file index
        self._lock = threading.Lock()
        self._lib = native_library()
        self._session = self._lib.pmt_open()
        if not self._session:
            raise PymtraceError("cannot start the stack unwinder: out of memory")
        self._pcs = (ctypes.c_uint64 * MAX_FRAMES)()
        self._files = (ctypes.c_int32 * MAX_FRAMES)()
        self._regs = (ctypes.c_uint64 * 8)()
        self._complete = ctypes.c_int()
        self._result = ctypes.c_int()
        self._complete_ref = ctypes.byref(self._complete)
        self._result_ref = ctypes.byref(self._result)
        self._pcs_addr = ctypes.addressof(self._pcs)
        self._files_addr = ctypes.addressof(self._files)
        # one tuple of Locations per distinct stack: by the native cache's result number, and
        # for uncached unwinds by their raw (file, pc) arrays; Locations are built once each
        self._by_result: dict[int, tuple[Location, ...]] = {}
        self._by_raw: dict[bytes, tuple[Location, ...]] = {}
        self.refresh()

    def _read_maps(self) -> list[MapLine]:
        try:
            with open(f"/proc/{self.pid}/maps") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):
            raise ProcessGone(self.pid) from None
        except PermissionError:
            raise PymtraceError(f"cannot read /proc/{self.pid}/maps: permission denied (run as root)") from None
        lines = parse_maps(text)
        if not lines:  # a zombie: its memory is already gone
            raise ProcessGone(self.pid)
        return lines

    def _add(self, raw: str, fd: int, image: bytes | None = None) -> None:
        index = self._lib.pmt_add_file(self._session, raw.encode(), fd, image, len(image or b""))
        if index < 0:
            if fd >= 0:
                os.close(fd)
            raise PymtraceError("cannot capture the process's files: out of memory")
        build_id = ctypes.create_string_buffer(64)
        n = self._lib.pmt_file_build_id(self._session, index, build_id)
        module = Module(module_path(raw), build_id.raw[: max(n, 0)].hex())
        self.modules.append(module)
        self._index.setdefault(module, index)
        self._raw_paths[raw] = index

    def _read_vdso(self, line: MapLine) -> bytes | None:
        """The vdso's bytes (the same kernel code in every process, but read from this one), or
        None when its memory is not readable to us: frames in it are then unknown."""
        try:
            with open(f"/proc/{self.pid}/mem", "rb", buffering=0) as mem:
                mem.seek(line.start)
                return mem.read(line.end - line.start)
        except OSError:
            return None

    def refresh(self) -> None:
        """Re-read the process's maps (after a dlopen): new files are captured, files no longer
        mapped stay known for the Locations already made. Rate-limit calls: each reads /proc."""
        with self._lock:
            lines = self._read_maps()
            elf = elf_file_lines(lines)
            for line in elf:
                if line.path not in self._raw_paths:
                    fd = _open_mapped_file(self.pid, line)
                    if fd is not None:
                        self._add(line.path, fd)
            vdso = next((m for m in lines if m.path == "[vdso]"), None)
            vdso_range = (0, 0)
            if vdso is not None:
                if "[vdso]" not in self._raw_paths:
                    image = self._read_vdso(vdso)
                    if image:
                        self._add("[vdso]", -1, image)
                if "[vdso]" in self._raw_paths:
                    vdso_range = (vdso.start, vdso.end)
            maps = format_maps([m for m in elf if m.path in self._raw_paths]).encode()
            if self._lib.pmt_report(self._session, self.pid, maps, len(maps), *vdso_range) != 0:
                raise PymtraceError(
                    f"cannot read the modules of process {self.pid}: {self._lib.pmt_errmsg().decode(errors='replace')}"
                )

    def unwind(
        self, tid: int, regs: Union[Sequence[int], int], stack: Union[int, bytes], length: int
    ) -> tuple[tuple[Location, ...], bool]:
        """The call stack of thread TID, leaf first, from REGS (ip, sp, bp, bx, r12, r13, r14,
        r15 at the probed instruction: a sequence, or the address of 8 u64 in memory valid
        during the call) and STACK, the LENGTH bytes copied from sp upward (bytes, or the
        address of memory valid during the call). The bool says whether the unwind reached the
        outermost frame (_start, clone, thread start). The same stack is the same tuple object
        (interned): callers may key on it cheaply."""
        if isinstance(stack, bytes):
            length = min(length, len(stack))
        with self._lock:
            if not self._session:
                raise PymtraceError("the process image is closed")
            if not isinstance(regs, int):
                self._regs[:] = regs[:8]
                regs = self._regs
            n = self._lib.pmt_unwind(
                self._session,
                tid,
                regs,
                stack,
                length,
                self._pcs,
                self._files,
                MAX_FRAMES,
                self._complete_ref,
                self._result_ref,
            )
            result = self._result.value
            if result >= 0:
                frames = self._by_result.get(result)
                if frames is None:
                    frames = self._by_result[result] = self._frames(n)
                return frames, True
            raw = ctypes.string_at(self._pcs_addr, 8 * n) + ctypes.string_at(self._files_addr, 4 * n)
            frames = self._by_raw.get(raw)
            if frames is None:
                frames = self._frames(n)
                if len(self._by_raw) < MAX_INTERNED:
                    self._by_raw[raw] = frames
            return frames, bool(self._complete.value)

    def cached_stack(self, result: int) -> tuple[Location, ...]:
        """The stack of the native cache's RESULT (a number RingScanner reported for this
        image: made by an earlier unwind, interned then)."""
        return self._by_result[result]

    def _frames(self, n: int) -> tuple[Location, ...]:
        modules = self.modules
        return tuple((modules[f] if f >= 0 else UNKNOWN, pc) for f, pc in zip(self._files[:n], self._pcs[:n]))

    def enable_cache(self, on: bool) -> None:
        """Switch the native unwind cache on (the default) or off (every unwind runs libdwfl:
        for benchmarks)."""
        with self._lock:
            if self._session:
                self._lib.pmt_cache_enable(self._session, int(on))

    def cache_stats(self) -> tuple[int, int]:
        """(hits, misses) of the native unwind cache so far."""
        hits, misses = ctypes.c_uint64(), ctypes.c_uint64()
        with self._lock:
            if self._session:
                self._lib.pmt_cache_stats(self._session, ctypes.byref(hits), ctypes.byref(misses))
        return hits.value, misses.value

    def symbolize(self, module: Module, pc: int) -> list[Frame]:
        """Frames of PC in MODULE (one of self.modules), innermost first: what Symbolizer uses."""
        index = self._index.get(module)
        if index is None:
            return [unknown_frame(module, pc)]
        size = 4096
        with self._lock:
            while True:
                out = ctypes.create_string_buffer(size)
                n = self._lib.pmt_symbolize(self._session, index, pc, out, size)
                if n >= 0 or size > 1 << 22:
                    break
                size *= 8
        fields = out.raw.split(b"\0")
        frames = []
        for i in range(max(n, 0)):
            name, file, line = (fields[3 * i + k].decode(errors="replace") for k in range(3))
            frames.append(Frame(name or unknown_frame(module, pc).function, file, int(line), inlined=i < n - 1))
        return frames or [unknown_frame(module, pc)]

    def close(self) -> None:
        """Free the unwinder session and the captured descriptors."""
        with self._lock:
            if self._session:
                self._lib.pmt_close(self._session)
                self._session = None

    def __del__(self) -> None:
        if getattr(self, "_session", None):
            self.close()


class RecordedImage(ProcessImage):
    """One ELF file of a recorded process, mapped as recorded (START, END, OFFSET of PATH),
    opened from LOCAL on this machine: symbolizes offline (trace/mappings.py), no process."""

    def __init__(self, start: int, end: int, offset: int, path: str, local: str) -> None:
        self._recorded = MapLine(start, end, "r-xp", offset, "00:01", 1, path)  # libdwfl skips inode 0
        self._local = local
        super().__init__(0)

    def refresh(self) -> None:
        with self._lock:
            if self.modules:
                return
            try:
                # (a path a traced process named: never wait on a FIFO or read a device)
                fd = os.open(self._local, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as exc:
                raise PymtraceError(f"cannot open {self._local}: {exc.strerror}") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise PymtraceError(f"{self._local}: not a regular file")
            self._add(self._recorded.path, fd)
            maps = format_maps([self._recorded]).encode()
            # reports the module, then fails to attach a process (there is none): the module
            # is what symbolize() needs
            self._lib.pmt_report(self._session, 0, maps, len(maps), 0, 0)


ROW_HEAD = 40  # bytes of each record a RingScanner row carries (native/unwind.c PMT_ROW_HEAD)


class RingScanner:
    """Walks a BPF ring buffer's records in native code, a batch at a time, and looks each
    sample's stack up in its process's unwind cache (no unwinding, no Python per record
    there): rows of (payload offset, length, cache result, the record's first ROW_HEAD
    bytes). A result >= 0 is ProcessImage.cached_stack's number; -1 a sample to unwind
    (ProcessImage.unwind), -2 not a sample of an imaged process. Records of SHORT_TYPE (shorter
    than a sample) are rows like samples; any other type ends a batch. See pmt_ring_scan."""

    ROW_SIZE = 16 + ROW_HEAD

    def __init__(
        self,
        data_addr: int,
        mask: int,
        sample_type: int,
        short_type: int,
        regs_off: int,
        stack_len_off: int,
        header: int,
    ) -> None:
        self._lib = native_library()
        self.data_addr, self.mask = data_addr, mask
        self.layout = (sample_type, short_type, regs_off, stack_len_off, header)
        self.max_rows = 4096
        self._rows = ctypes.create_string_buffer(self.ROW_SIZE * self.max_rows)
        self._view = memoryview(self._rows).cast("B")
        self._next = ctypes.c_uint64()
        self._next_ref = ctypes.byref(self._next)
        self._pids = (ctypes.c_int32 * 0)()
        self._sessions = (ctypes.c_void_p * 0)()
        self._images: list[ProcessImage] = []

    def scan(self, cons: int, prod: int, images: dict[int, ProcessImage]) -> tuple[memoryview, int]:
        """(rows, the consumer position after them) of the records from CONS to PROD."""
        live = [(pid, image) for pid, image in images.items() if image._session]
        if [image for _, image in live] != self._images:
            self._images = [image for _, image in live]
            self._pids = (ctypes.c_int32 * len(live))(*(pid for pid, _ in live))
            self._sessions = (ctypes.c_void_p * len(live))(*(image._session for _, image in live))
        n = self._lib.pmt_ring_scan(
            self.data_addr,
            self.mask,
            cons,
            prod,
            *self.layout,
            self._pids,
            self._sessions,
            len(self._images),
            self._rows,
            self.max_rows,
            self._next_ref,
        )
        return self._view[: n * self.ROW_SIZE], self._next.value


def unknown_frame(module: Module, pc: int) -> Frame:
    """The frame of a pc without a symbol: "libx.so+0x1a2b"."""
    return Frame(f"{os.path.basename(module.path)}+0x{pc:x}")


class FrameNamer(Protocol):
    """What names a module's Locations: ProcessImage, tracee.pyframes.PythonFrames."""

    def symbolize(self, module: Module, pc: int) -> list[Frame]: ...


class Symbolizer:
    """Names of Locations at report time, shared by all images, cached per Location."""

    def __init__(self) -> None:
        self._images: dict[Module, FrameNamer] = {}
        self._cache: dict[Location, list[Frame]] = {}

    def add(self, image: ProcessImage) -> None:
        """Keep IMAGE (its open files) to symbolize its modules; the first image of a Module
        serves it for every process."""
        for module in image.modules:
            self._images.setdefault(module, image)

    def add_source(self, module: Module, source: FrameNamer) -> None:
        """Name MODULE's Locations with SOURCE (the Python frames: tracee.pyframes)."""
        self._images[module] = source

    def frames(self, loc: Location) -> list[Frame]:
        """The frames of LOC, innermost first (inlined callees, then the function)."""
        frames = self._cache.get(loc)
        if frames is None:
            module, pc = loc
            image = self._images.get(module)
            frames = image.symbolize(module, pc) if image is not None else [unknown_frame(module, pc)]
            self._cache[loc] = frames
        return list(frames)


class ProcessImages:
    """The ProcessImage of every traced process, read when first needed, and one Symbolizer for
    them all: what `heap` and `record --stacks` unwind their stack copies with.

    A stack reaching a pc in no captured file (a library mapped since: the loader at start, a
    dlopen) makes the image re-read the process's maps, at most every REFRESH_S per process, and
    the stack is unwound again. A process gone before its maps were read has no image."""

    def __init__(self, refresh_s: float = 0.02) -> None:
        self.refresh_s = refresh_s
        self.images: dict[int, ProcessImage] = {}
        self.refreshed: dict[int, float] = {}
        self.symbolizer = Symbolizer()

    def capture(self, pid: int, required: bool = False) -> ProcessImage | None:
        """PID's image, read now; None if PID is gone (ProcessGone if REQUIRED)."""
        try:
            image = ProcessImage(pid)
        except ProcessGone:
            if required:
                raise
            return None
        self.images[pid] = image
        self.refreshed[pid] = 0.0  # a first pc in no file re-reads the maps at once
        self.symbolizer.add(image)
        return image

    def get(self, pid: int) -> ProcessImage | None:
        """PID's image, read now if it has none yet."""
        return self.images.get(pid) or self.capture(pid)

    def forget(self, pid: int) -> None:
        """PID exec'd: never unwind the new program with the old one's files."""
        self.images.pop(pid, None)

    def _refresh(self, pid: int, image: ProcessImage, limited: bool = True) -> bool:
        now = time.monotonic()
        if limited and now - self.refreshed.get(pid, 0.0) < self.refresh_s:
            return False
        self.refreshed[pid] = now
        try:
            image.refresh()
        except ProcessGone:
            return False
        self.symbolizer.add(image)
        return True

    def at_exit(self, pid: int) -> None:
        """PID is exiting but its mappings are still there (a launched command held at its exit,
        tracee.launch): capture every file it mapped since its image was read."""
        image = self.images.get(pid)
        if image is None:
            self.capture(pid)
        else:
            self._refresh(pid, image, limited=False)

    def unwind(
        self, pid: int, tid: int, regs: Sequence[int], stack: Union[int, bytes], length: int
    ) -> tuple[tuple[Location, ...], bool] | None:
        """ProcessImage.unwind with PID's image (re-read once if a pc is in no known file);
        None when PID is gone without an image."""
        image = self.get(pid)
        if image is None:
            return None
        frames, complete = image.unwind(tid, regs, stack, length)
        if any(module is UNKNOWN for module, _ in frames) and self._refresh(pid, image):
            frames, complete = image.unwind(tid, regs, stack, length)
        return frames, complete
