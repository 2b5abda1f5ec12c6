"""Which libc a process uses, and what is inside it: symbols and USDT probe notes.

Everything is read from the process's own view (/proc/PID/maps, /proc/PID/root/...), so a
process in a container or running on another libc is traced through the file it really
maps. ELF files are read through pymtrace.tracee.elf.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import struct
import time
from typing import Any, Collection, Iterator, Optional

from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.tracee import elf, proc

# read through libc by callers that predate pymtrace.tracee.elf; defined there
from pymtrace.tracee.elf import Symbol, UsdtProbe, file_offset, read_code, symbol, symbols, usdt_probes  # noqa: F401

# libc.so.6, libc-2.36.so, libc.musl-x86_64.so.1; not libcrypto, libcap, ...
_LIBC_NAME = re.compile(r"/libc(?:\.so(?:\.\d+)*|-[\d.]+\.so)$")


@dataclasses.dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str  # "" for anonymous; "[heap]", "[stack]", ... for special regions


def parse_maps_text(text: str) -> list[Mapping]:
    maps = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        path = parts[5].strip() if len(parts) > 5 else ""
        maps.append(Mapping(start, end, parts[1], int(parts[2], 16), int(parts[4]), path))
    return maps


class MapsUnreadable(PymtraceError):
    """/proc/PID/maps exists but cannot be read (EACCES even for root in some sandboxes)."""


def read_maps(pid: int) -> list[Mapping]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return parse_maps_text(f.read())
    except FileNotFoundError:
        raise ProcessGone(pid) from None
    except ProcessLookupError:
        raise ProcessGone(pid) from None
    except OSError as exc:  # EACCES: another user namespace, a sandbox, a hardened /proc
        raise MapsUnreadable(
            f"cannot read /proc/{pid}/maps: {exc.strerror or exc} (pymtrace needs the "
            "process's memory map: run it where it can see the process, e.g. in the "
            "same container)"
        ) from None


def is_libc_path(path: str) -> bool:
    return bool(_LIBC_NAME.search(path))


def process_libc(pid: int, maps: list[Mapping] | None = None) -> str | None:
    """Path (as seen from our mount namespace) of the libc PID maps, or None (static binary).
    MAPS: PID's maps when already read."""
    libc_maps = [m for m in (read_maps(pid) if maps is None else maps) if is_libc_path(m.path)]
    if not libc_maps:
        return None
    code_first = min(libc_maps, key=lambda m: "x" not in m.perms)
    return host_path(pid, code_first.path)


def host_path(pid: int, path: str) -> str:
    """A path inside PID's mount namespace, reachable from ours (containers)."""
    try:
        if os.readlink(f"/proc/{pid}/root") == "/":
            return path
    except OSError:
        return path
    return f"/proc/{pid}/root{path}"


@functools.lru_cache(maxsize=None)
def system_libc() -> str | None:
    """The libc this Python runs on: the one ordinary programs here use."""
    return process_libc(os.getpid())


def distinct_libcs(
    skipped: list[tuple[str, set[int], str]] | None = None, maps_seen: dict[int, list[Mapping]] | None = None
) -> list[tuple[str, set[int]]]:
    """Every libc file in use, once per file: [(path, {pid, ...}), ...], the system libc first.

    Files are told apart by (device, inode), so one libc reached through several paths
    (containers, symlinks) is listed once; processes whose maps cannot be read are skipped.
    A file that only looks like a libc (any user can map a file named libc.so.6: not an
    ELF file, truncated, another architecture, no malloc) is left out and, when SKIPPED
    is a list, appended to it as (path, {pid, ...}, reason), so one bad file never stops
    the others from being traced. MAPS_SEEN, when a dict, gets each process's maps (for
    distinct_allocators: one read of /proc/PID/maps a process).
    """
    found = {}
    system = system_libc()
    candidates = [(system, os.getpid())] if system else []
    for pid in pids():
        try:
            maps = read_maps(pid)
            path = process_libc(pid, maps)
        except (PymtraceError, OSError):
            continue
        if maps_seen is not None:
            maps_seen[pid] = maps
        if path:
            candidates.append((path, pid))
    for path, pid in candidates:
        try:
            st = os.stat(path)
        except OSError:
            continue
        found.setdefault((st.st_dev, st.st_ino), (path, set()))[1].add(pid)
    good = []
    for path, users in found.values():
        reason = libc_problem(path)
        if reason is None:
            good.append((path, users))
        elif skipped is not None:
            skipped.append((path, users, reason))
    return good


def libc_problem(path: str) -> Optional[str]:
    """Why PATH cannot be a libc to trace (a sentence), or None when it can."""
    try:
        with open(path, "rb") as f:
            machine, own = elf.machine(f), elf.own_machine()
            if own is not None and machine != own:
                return f"not a libc for this machine (ELF machine {machine}, ours is {own})"
            if not elf.DynamicSymbols(f).defined("malloc"):
                return "exports no malloc"
    except (OSError, ValueError, struct.error) as exc:
        return f"not a readable ELF file ({exc})"
    return None


def skipped_note(skipped: list[tuple[str, set[int], str]] | None, limit: int = 3) -> str | None:
    """One line about the files distinct_libcs left out (SKIPPED: its list), or None."""
    if not skipped:
        return None
    parts = []
    for path, users, reason in skipped[:limit]:
        who = ",".join(str(p) for p in sorted(users)[:3]) + (",..." if len(users) > 3 else "")
        parts.append(f"{path} (mapped by PID {who}): {reason}")
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return "skipped " + "; ".join(parts) + more


def pids() -> list[int]:
    return sorted(int(d) for d in os.listdir("/proc") if d.isdigit())


def malloc_probes(path: str) -> list[UsdtProbe]:
    """glibc's malloc USDT probes (provider libc, memory_*) carried by PATH."""
    return usdt_probes(path, provider="libc", prefix="memory_")


# ---------------------------------------------------------------- whose malloc a process calls

# names of objects that export malloc and pass every call on to the next definition:
# glibc's own wrappers, and pymtrace's interposer (pymtrace.nativebuild's name for it)
_GLIBC_WRAPPERS = re.compile(r"/(?:libc_malloc_debug\.so[.\d]*|libmemusage\.so|pymtrace-interpose-[0-9a-f]{16}\.so)$")
# a symbol only this allocator exports -> its name
_SIGNATURES = (
    ("mallocx", "jemalloc"),
    ("je_malloc", "jemalloc"),
    ("tc_malloc", "tcmalloc"),
    ("mi_malloc", "mimalloc"),
    ("__asan_init", "AddressSanitizer"),
    ("__hwasan_init", "HWAddressSanitizer"),
)


# allocators whose malloc is not counted by top even though a file defines it: the
# sanitizers intercept every call for their own checks
_UNCOUNTED = ("AddressSanitizer", "HWAddressSanitizer")


@dataclasses.dataclass(frozen=True)
class Allocator:
    name: str  # "glibc" (or "musl") when traced; "jemalloc", "tcmalloc", ..., "static binary"
    traced: bool  # its malloc calls reach the libc pymtrace puts its uprobes on (record, heap)
    path: Optional[str] = None  # the file whose malloc the process calls (None: none found)

    @property
    def family(self) -> Optional[str]:
        """How top and the exporter count its calls: "glibc" (the libc's probes), "jemalloc",
        "tcmalloc", "mimalloc", "generic" (another object defining malloc: probed by the
        standard names; pymtrace.tracee.allocators), or None (not counted: a static binary,
        a sanitizer)."""
        if self.traced:
            return "glibc"
        if self.path is None or self.name.startswith("static") or self.name in _UNCOUNTED:
            return None
        return self.name if self.name in ("jemalloc", "tcmalloc", "mimalloc") else "generic"


@functools.lru_cache(maxsize=256)
def _malloc_export(path: str, _key: tuple) -> str | None:
    """The allocator name when PATH defines and exports malloc, else None."""
    try:
        with open(path, "rb") as f:
            syms = elf.DynamicSymbols(f)
            if not syms.defined("malloc"):
                return None
            for signature, name in _SIGNATURES:
                if syms.defined(signature):
                    return name
    except (OSError, ValueError, struct.error):  # not an ELF file we can read: no malloc of its own
        return None
    base = os.path.basename(path)
    for name in ("jemalloc", "tcmalloc", "mimalloc", "hoard", "snmalloc", "rpmalloc"):
        if name in base:
            return name
    return f"its own malloc in {base}"


def _malloc_export_of(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _malloc_export(path, (st.st_dev, st.st_ino, st.st_mtime_ns))


def _link_map(pid: int, exe: str, maps: list[Mapping]) -> list[str] | None:
    """Paths of the objects of PID in the dynamic linker's search order (its link map:
    the executable, LD_PRELOADs, then DT_NEEDED breadth-first, then dlopen()ed ones), read
    from the process's memory through the executable's DT_DEBUG; None when unreadable."""
    headers = elf.program_headers(exe)
    if headers is None:
        return None
    pie, segments = headers
    loads = [s for s in segments if s.type == elf.PT_LOAD]
    dyn = next((s for s in segments if s.type == elf.PT_DYNAMIC), None)
    if dyn is None or not loads:
        return None
    first_vaddr = min(s.vaddr for s in loads) & ~0xFFF
    dyn_vaddr, dyn_size = dyn.vaddr, dyn.memsz
    bias = 0
    if pie:
        starts = [m.start for m in maps if m.offset == 0 and m.path and host_path(pid, m.path) == exe]
        if not starts:  # reached through another name
            real = os.path.realpath(exe)
            starts = [
                m.start for m in maps if m.offset == 0 and m.path and os.path.realpath(host_path(pid, m.path)) == real
            ]
        if not starts:
            return None
        bias = min(starts) - first_vaddr
    with open(f"/proc/{pid}/mem", "rb") as mem:

        def read(address: int, n: int) -> bytes:
            mem.seek(address)
            data = mem.read(n)
            if len(data) != n:
                raise OSError("short read")
            return data

        raw = read(bias + dyn_vaddr, min(dyn_size, 16 * 512))
        r_debug = 0
        for i in range(0, len(raw) - 15, 16):
            tag, value = struct.unpack_from("<qQ", raw, i)
            if tag == 0:
                break
            if tag == 21:  # DT_DEBUG: the dynamic linker's struct r_debug
                r_debug = value
        if not r_debug:
            return None
        entry = struct.unpack("<Q", read(r_debug + 8, 8))[0]  # r_map
        paths = []
        for _ in range(4096):
            if not entry:
                break
            name_ptr, _ld, nxt = struct.unpack("<QQQ", read(entry + 8, 24))  # l_name, l_ld, l_next
            name = b""
            while name_ptr and b"\0" not in name and len(name) < 4096:
                chunk = read(name_ptr, 256 - name_ptr % 256)  # never across a page boundary
                name += chunk
                name_ptr += len(chunk)
            name = name.split(b"\0", 1)[0]
            paths.append(exe if not paths else host_path(pid, os.fsdecode(name)) if name.startswith(b"/") else "")
            entry = nxt
    return paths


def allocator(pid: int, skip: Collection[str] = ()) -> Allocator | None:
    """Whose malloc PID calls: an Allocator, or None while that is not known yet (a
    dynamically linked program whose loader has not mapped its libc). Raises ProcessGone.

    The first object in the dynamic linker's search order (the executable, LD_PRELOADs,
    then the libraries in load order) that defines malloc is the one every call goes to:
    the libc -> traced; jemalloc, tcmalloc, mimalloc, ... -> not traced (glibc's own
    libc_malloc_debug and libmemusage pass calls on to libc, so they do not count). When
    the link map cannot be read, any mapped object but the libc that exports malloc is
    taken to be the allocator. No libc mapped: a static binary, not traced. The files in SKIP
    are passed over (pymtrace's interposer: the allocator its calls go on to)."""
    try:
        maps = read_maps(pid)
    except MapsUnreadable:
        return None  # maps unreadable even to root (some sandboxes): cannot tell
    libc_path = process_libc(pid, maps)
    own = proc.exe(pid)
    exe = host_path(pid, own) if own is not None else None
    order = None
    if exe is not None and libc_path is not None:
        try:
            order = _link_map(pid, exe, maps)
        except Exception:  # the link map lives in the process's own (corruptible) memory:
            order = None  # any failure to follow it means "order unknown", handled below
    in_order = order is not None
    if order is None:
        order = ([exe] if exe else []) + [
            host_path(pid, m.path) for m in maps if "x" in m.perms and m.path.startswith("/")
        ]
    libc_key = file_key(libc_path) if libc_path else None
    skipped = {key for key in map(file_key, skip) if key is not None}
    for path in order:
        if not path or file_key(path) in skipped:
            continue  # the vDSO, an entry without a name, a file skipped
        if libc_key is not None and file_key(path) == libc_key:
            if in_order:
                break  # libc comes first: objects after it do not interpose
            continue
        if _GLIBC_WRAPPERS.search(path) or is_libc_path(path):
            continue
        name = _malloc_export_of(path)
        if name is not None:
            return Allocator(name, False, path)
    if libc_path is None:
        if exe is None or _dynamic(exe):
            return None  # its dynamic loader has not mapped the libraries yet (just exec'd)
        return Allocator("static binary (no shared libc)", False, exe)
    return Allocator("musl" if "musl" in os.path.basename(libc_path) else "glibc", True, libc_path)


@functools.lru_cache(maxsize=256)
def _defines(path: str, name: str, _key: tuple) -> bool:
    try:
        with open(path, "rb") as f:
            return bool(elf.DynamicSymbols(f).defined(name))
    except (OSError, ValueError, struct.error):  # not an ELF file we can read
        return False


def defines(path: str, name: str) -> bool:
    """Whether the ELF file PATH defines and exports the symbol NAME (.dynsym; cached per file)."""
    key = file_key(path)
    return key is not None and _defines(path, name, key)


def cxx_runtime(pid: int) -> str | None:
    """The file PID's C++ `operator new` calls go to (the first object in the dynamic
    linker's search order that exports _Znwm: libstdc++, or an allocator that replaces it,
    such as a preloaded jemalloc/tcmalloc/mimalloc), or None (no C++ runtime mapped, or the
    maps are unreadable). When the link map cannot be read, the mapped files in map order."""
    return first_definers(pid, ("_Znwm",))["_Znwm"]


def first_definers(pid: int, names: Collection[str]) -> dict[str, str | None]:
    """{name: the file a call of NAME through a PLT stub reaches in PID}: the first object in
    the dynamic linker's search order that exports it, or None (not found, or the maps are
    unreadable). When the link map cannot be read, the mapped files in map order."""
    try:
        maps = read_maps(pid)
    except MapsUnreadable:
        return dict.fromkeys(names)
    own = proc.exe(pid)
    exe = host_path(pid, own) if own is not None else None
    order = None
    if exe is not None:
        try:
            order = _link_map(pid, exe, maps)
        except Exception:  # the link map lives in the process's own (corruptible) memory
            order = None
    if order is None:
        order = ([exe] if exe else []) + [
            host_path(pid, m.path) for m in maps if "x" in m.perms and m.path.startswith("/")
        ]
    mapped = {file_key(host_path(pid, m.path)) for m in maps if m.path.startswith("/")}
    found = [path for path in order if path and file_key(path) in mapped]
    return {name: next((path for path in found if defines(path, name)), None) for name in names}


def _mapped_files(maps_seen: dict[int, list[Mapping]] | None) -> Iterator[tuple[int, str, str]]:
    """(pid, path as mapped, path from here) of every executable file mapping of every
    process (MAPS_SEEN, else every process's maps read here); unreadable processes skipped."""
    for pid in sorted(maps_seen) if maps_seen is not None else pids():
        try:
            maps = maps_seen[pid] if maps_seen is not None else read_maps(pid)
            root = os.readlink(f"/proc/{pid}/root")
        except (PymtraceError, OSError):
            continue
        prefix = "" if root == "/" else f"/proc/{pid}/root"
        for path in {m.path for m in maps if "x" in m.perms and m.path.startswith("/")}:
            yield pid, path, prefix + path


def distinct_allocators(maps_seen: dict[int, list[Mapping]] | None = None) -> dict[str, tuple[str, set[int]]]:
    """Every mapped file other than a libc that defines and exports malloc (jemalloc,
    tcmalloc, mimalloc, an executable with its own malloc, ...), once per file (device,
    inode): {path: (allocator name, {pid, ...})}. Processes whose maps cannot be read are
    skipped; glibc's own wrappers (libc_malloc_debug, libmemusage) are left out. MAPS_SEEN:
    {pid: maps} already read (distinct_libcs), else every process's maps are read here."""
    found = {}
    looked = {}  # path from here -> (key, name) or None: each file read once, not per process
    for pid, path, real in _mapped_files(maps_seen):
        if real not in looked:
            name = None
            if not (is_libc_path(path) or _GLIBC_WRAPPERS.search(path)):
                name = _malloc_export_of(real)
            looked[real] = (file_key(real), name) if name is not None else None
        hit = looked[real]
        if hit is not None and hit[0] is not None:
            found.setdefault(hit[0], (real, hit[1], set()))[2].add(pid)
    return {path: (name, users) for path, name, users in found.values()}


def distinct_cxx_runtimes(maps_seen: dict[int, list[Mapping]] | None = None) -> dict[str, set[int]]:
    """Every mapped file exporting C++'s operator new (_Znwm: libstdc++, or an allocator
    replacing it), once per file (device, inode): {path: {pid, ...}}. MAPS_SEEN as for
    distinct_allocators."""
    found = {}
    looked = {}
    for pid, path, real in _mapped_files(maps_seen):
        if real not in looked:
            key = file_key(real)
            looked[real] = key if key is not None and not is_libc_path(path) and defines(real, "_Znwm") else None
        if looked[real] is not None:
            found.setdefault(looked[real], (real, set()))[1].add(pid)
    return {path: users for path, users in found.values()}


def _dynamic(path: str) -> bool:
    """PATH has a program interpreter (dynamically linked), or is the dynamic loader itself."""
    if re.search(r"/ld-linux[^/]*\.so|/ld-musl[^/]*\.so", os.path.realpath(path)):
        return True
    headers = elf.program_headers(path)
    return headers is not None and any(s.type == elf.PT_INTERP for s in headers.segments)


def untraced_message(pid: int, found: Allocator) -> str:
    """The sentence for a process whose malloc (FOUND: an Allocator) is not the traced glibc."""
    where = f" in {found.path}" if found.path and not found.name.startswith("static") else ""
    who = (
        "pymtrace does not trace (only glibc's malloc is)"
        if found.family is None
        else "`heap -- CMD` and `record -- CMD` do not trace (only glibc's; with -p, heap, record, top and the exporter do)"
    )
    return (
        f"process {pid} ({proc.comm(pid, missing='?')}) does not allocate with glibc's malloc: its allocator is "
        f"{found.name}{where}, which {who}, so its malloc calls are not seen"
    )


def file_key(path: str) -> tuple[int, int] | None:
    """(device, inode) of PATH, or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class AllocatorCache:
    """allocator() per PID, computed once per program a PID runs (an exec starts afresh)."""

    def __init__(self) -> None:
        self.known = {}  # pid -> (exe identity, Allocator or None)
        # (device, inode) of the files whose malloc top probes, or None (not checked): a
        # process whose allocator is not among them (a file first mapped after top
        # attached, system-wide) is not counted, and annotate() says so
        self.probed = None
        self._in_probed = {}  # allocator path -> its file is probed (decided while it exists)

    budget = 0.2  # seconds of new detections per annotate() (~1-4 ms a process); the rest wait

    def get(self, pid: int, deadline: float | None = None) -> Allocator | None:
        """PID's Allocator (None: not known yet; or not looked up when past DEADLINE)."""
        try:
            key = os.stat(f"/proc/{pid}/exe")
            key = (key.st_dev, key.st_ino, _start_time(pid))
        except OSError:
            return self.known.get(pid, (None, None))[1]  # exited: what it was
        old = self.known.get(pid)
        if old is not None and old[0] == key:
            return old[1]
        if deadline is not None and time.monotonic() > deadline:
            return None
        try:
            found = allocator(pid)
        except (PymtraceError, OSError):
            found = None
        if found is not None:  # None: not known yet, ask again next time
            self.known[pid] = (key, found)
        return found

    def annotate(self, processes: dict[Any, Any], pids: Collection[int] = ()) -> None:
        """Add "allocator" and "allocator_traced" (its calls are counted by top: glibc,
        jemalloc, tcmalloc, mimalloc, another object's malloc; Allocator.family) to each entry
        of PROCESSES ({pid: dict}), and an entry for each of PIDS (the watched ones) that has
        none because its malloc is not counted (no event to list it by); forget PIDs no
        longer listed. New lookups
        stop after `budget` seconds (a system-wide view may list hundreds of new processes):
        the watched PIDs first, then processes without a traced malloc call (where another
        allocator would show), then the others, which are left for the next call."""
        deadline = time.monotonic() + self.budget
        for pid in pids:
            if pid not in processes and str(pid) not in processes and proc.exists(pid):
                found = self.get(pid)
                if found is not None and found.family is None:
                    processes[pid] = {"pid": pid, "comm": proc.comm(pid, missing="?")}

        def busy(item: tuple[Any, Any]) -> tuple[int, bool]:
            calls = item[1].get("calls") if isinstance(item[1], dict) else None
            return int(int(item[0]) not in pids), bool(calls and any(calls.values()))

        for pid, p in sorted(processes.items(), key=busy):
            found = self.get(int(pid), deadline)
            if found is not None and isinstance(p, dict):
                p["allocator"], p["allocator_traced"] = found.name, self.counted(found)
        listed = {int(pid) for pid in processes} | set(pids)
        for pid in [p for p in self.known if p not in listed]:
            del self.known[pid]

    def counted(self, found: Allocator) -> bool:
        """Whether top counts the calls of a process on FOUND: an allocator it can probe, in
        a file it probes (self.probed)."""
        if found.family is None:
            return False
        if self.probed is None or found.path is None:
            return True
        if found.path not in self._in_probed:
            self._in_probed[found.path] = file_key(found.path) in self.probed
        return self._in_probed[found.path]


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]
