"""Which libc a process uses, and what is inside it: symbols and USDT probe notes.

Everything is read from the process's own view (/proc/PID/maps, /proc/PID/root/...), so a
process in a container or running on another libc is traced through the file it really
maps. ELF parsing uses pyelftools.
"""

import dataclasses
import functools
import os
import re
import struct
import sys
import time

from elftools.elf.elffile import ELFFile

from pymtrace.errors import ProcessGone, PymtraceError

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


def parse_maps_text(text):
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


def read_maps(pid):
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


def is_libc_path(path):
    return bool(_LIBC_NAME.search(path))


def process_libc(pid, maps=None):
    """Path (as seen from our mount namespace) of the libc PID maps, or None (static binary).
    MAPS: PID's maps when already read."""
    libc_maps = [m for m in (read_maps(pid) if maps is None else maps) if is_libc_path(m.path)]
    if not libc_maps:
        return None
    code_first = min(libc_maps, key=lambda m: "x" not in m.perms)
    return host_path(pid, code_first.path)


def host_path(pid, path):
    """A path inside PID's mount namespace, reachable from ours (containers)."""
    try:
        if os.readlink(f"/proc/{pid}/root") == "/":
            return path
    except OSError:
        return path
    return f"/proc/{pid}/root{path}"


@functools.lru_cache(maxsize=None)
def system_libc():
    """The libc this Python runs on: the one ordinary programs here use."""
    return process_libc(os.getpid())


def distinct_libcs(skipped=None):
    """Every libc file in use, once per file: [(path, {pid, ...}), ...], the system libc first.

    Files are told apart by (device, inode), so one libc reached through several paths
    (containers, symlinks) is listed once; processes whose maps cannot be read are skipped.
    A file that only looks like a libc (any user can map a file named libc.so.6: not an
    ELF file, truncated, another architecture, no malloc) is left out and, when SKIPPED
    is a list, appended to it as (path, {pid, ...}, reason), so one bad file never stops
    the others from being traced.
    """
    found = {}
    system = system_libc()
    candidates = [(system, os.getpid())] if system else []
    for pid in pids():
        try:
            path = process_libc(pid)
        except (PymtraceError, OSError):
            continue
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


def libc_problem(path):
    """Why PATH cannot be a libc to trace (a sentence), or None when it can."""
    try:
        with open(path, "rb") as f:
            machine, own = _machine(f), _own_machine()
            if own is not None and machine != own:
                return f"not a libc for this machine (ELF machine {machine}, ours is {own})"
            if not _DynSyms(f).defined("malloc"):
                return "exports no malloc"
    except (OSError, ValueError, struct.error) as exc:
        return f"not a readable ELF file ({exc})"
    return None


def _machine(f):
    f.seek(0)
    head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    return struct.unpack_from("<H", head, 18)[0]


@functools.lru_cache(maxsize=None)
def _own_machine():
    try:
        with open(sys.executable, "rb") as f:
            return _machine(f)
    except (OSError, ValueError):
        return None


def skipped_note(skipped, limit=3):
    """One line about the files distinct_libcs left out (SKIPPED: its list), or None."""
    if not skipped:
        return None
    parts = []
    for path, users, reason in skipped[:limit]:
        who = ",".join(str(p) for p in sorted(users)[:3]) + (",..." if len(users) > 3 else "")
        parts.append(f"{path} (mapped by PID {who}): {reason}")
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return "skipped " + "; ".join(parts) + more


def pids():
    return sorted(int(d) for d in os.listdir("/proc") if d.isdigit())


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


@dataclasses.dataclass(frozen=True)
class Symbol:
    name: str
    address: int  # ELF virtual address
    size: int


@functools.lru_cache(maxsize=64)
def _symbols(path, _mtime):
    table = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for section_name in (".symtab", ".dynsym"):
            section = elf.get_section_by_name(section_name)
            if section is None:
                continue
            for sym in section.iter_symbols():
                if sym["st_value"] == 0 or not sym.name:
                    continue
                name = sym.name.split("@")[0]
                table.setdefault(name, Symbol(name, sym["st_value"], sym["st_size"]))
    return table


def symbols(path):
    try:
        return _symbols(path, os.stat(path).st_mtime_ns)
    except FileNotFoundError:
        raise PymtraceError(f"{path}: no such file") from None
    except Exception as exc:
        raise PymtraceError(f"{path}: not a readable ELF file ({exc})") from None


def symbol(path, name):
    try:
        return symbols(path)[name]
    except KeyError:
        raise PymtraceError(f"{path} has no symbol {name}") from None


def file_offset(path, address):
    """(file offset, bytes of the segment left) of ELF virtual ADDRESS in PATH's PT_LOAD segments."""
    with open(path, "rb") as f:
        for seg in ELFFile(f).iter_segments():
            if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= address < seg["p_vaddr"] + seg["p_filesz"]:
                return seg["p_offset"] + address - seg["p_vaddr"], seg["p_vaddr"] + seg["p_filesz"] - address
    raise PymtraceError(f"{path}: address {address:#x} is not in a loaded segment")


def read_code(path, address, length):
    """LENGTH bytes of code at ELF virtual ADDRESS of PATH."""
    offset, left = file_offset(path, address)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(min(length, left))


@dataclasses.dataclass(frozen=True)
class UsdtProbe:
    provider: str
    name: str
    address: int  # ELF virtual address of the probe site (prelink-adjusted)
    semaphore: int
    args: str  # the raw argument spec, e.g. "-4@%esi 8@%rdi"

    @property
    def arg_specs(self):
        return self.args.split() if self.args else []


def _parse_stapsdt(elf):
    notes = elf.get_section_by_name(".note.stapsdt")
    if notes is None:
        return []
    base_section = elf.get_section_by_name(".stapsdt.base")
    base_addr = base_section["sh_addr"] if base_section is not None else None
    data = notes.data()
    probes = []
    pos = 0
    while pos + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
        pos += 12
        name = data[pos : pos + namesz].rstrip(b"\0")
        pos += (namesz + 3) & ~3
        desc = data[pos : pos + descsz]
        pos += (descsz + 3) & ~3
        if name != b"stapsdt" or ntype != 3 or len(desc) < 24:
            continue
        pc, base, sem = struct.unpack_from("<QQQ", desc, 0)
        strings = desc[24:].split(b"\0")
        if len(strings) < 3:
            continue
        provider, pname, args = (s.decode("ascii", "replace") for s in strings[:3])
        if base_addr is not None:
            pc += base_addr - base  # prelink adjustment, as systemtap does
        probes.append(UsdtProbe(provider, pname, pc, sem, args))
    return probes


@functools.lru_cache(maxsize=64)
def _usdt_probes(path, _mtime):
    with open(path, "rb") as f:
        return tuple(_parse_stapsdt(ELFFile(f)))


def usdt_probes(path, provider=None, prefix=""):
    """USDT probes in PATH's .note.stapsdt (optionally one provider, names with PREFIX)."""
    try:
        probes = _usdt_probes(path, os.stat(path).st_mtime_ns)
    except FileNotFoundError:
        raise PymtraceError(f"{path}: no such file") from None
    except Exception as exc:
        raise PymtraceError(f"{path}: not a readable ELF file ({exc})") from None
    return [p for p in probes if (provider is None or p.provider == provider) and p.name.startswith(prefix)]


def malloc_probes(path):
    """glibc's malloc USDT probes (provider libc, memory_*) carried by PATH."""
    return usdt_probes(path, provider="libc", prefix="memory_")


# ---------------------------------------------------------------- whose malloc a process calls

# names of glibc's own objects that export malloc and pass every call on to libc's
_GLIBC_WRAPPERS = re.compile(r"/(?:libc_malloc_debug\.so[.\d]*|libmemusage\.so)$")
# a symbol only this allocator exports -> its name
_SIGNATURES = (
    ("mallocx", "jemalloc"),
    ("je_malloc", "jemalloc"),
    ("tc_malloc", "tcmalloc"),
    ("mi_malloc", "mimalloc"),
    ("__asan_init", "AddressSanitizer"),
    ("__hwasan_init", "HWAddressSanitizer"),
)


@dataclasses.dataclass(frozen=True)
class Allocator:
    name: str  # "glibc" (or "musl") when traced; "jemalloc", "tcmalloc", ..., "static binary"
    traced: bool  # its malloc calls reach the libc pymtrace puts its uprobes on
    path: str = None  # the file whose malloc the process calls (None: none found)


class _DynSyms:
    """Defined-symbol lookups in an ELF file's .dynsym through its GNU hash table (a linear
    scan without one), reading only what a lookup needs: pyelftools parses every section
    header first, ~50 ms a file, too slow for every program a system-wide view lists."""

    def __init__(self, f):
        self.f = f
        head = self._read(0, 64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        (shoff,) = struct.unpack_from("<Q", head, 40)
        shentsize, shnum = struct.unpack_from("<HH", head, 58)
        if shentsize < 64 or not 0 < shnum <= 65535:
            raise ValueError("no section headers")
        table = self._read(shoff, shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
        self.dynsym = next((s for s in sections if s[1] == 11), None)  # SHT_DYNSYM
        if self.dynsym is None:
            raise ValueError("no .dynsym")
        self.strtab = sections[self.dynsym[6]]
        gnu = next((s for s in sections if s[1] == 0x6FFFFFF6), None)  # SHT_GNU_HASH
        self.gnu = self._read(gnu[4], gnu[5]) if gnu is not None and gnu[5] < (64 << 20) else None

    def _read(self, offset, n):
        self.f.seek(offset)
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("truncated ELF file")
        return data

    def _entry(self, i):
        """(name, st_shndx) of symbol I."""
        st_name, _info, _other, shndx = struct.unpack("<IBBH", self._read(self.dynsym[4] + 24 * i, 8))
        self.f.seek(self.strtab[4] + st_name)
        return self.f.read(256).split(b"\0", 1)[0], shndx

    def defined(self, name):
        """Whether NAME is a symbol defined (not imported) in this file's .dynsym."""
        want = name.encode()
        if self.gnu is None:
            return any(n == want and shndx != 0 for n, shndx in map(self._entry, range(self.dynsym[5] // 24)))
        nbuckets, symoffset, bloom_size, _shift = struct.unpack_from("<IIII", self.gnu, 0)
        if not nbuckets:
            return False
        h = 5381
        for c in want:
            h = (h * 33 + c) & 0xFFFFFFFF
        buckets = 16 + 8 * bloom_size
        chains = buckets + 4 * nbuckets
        (idx,) = struct.unpack_from("<I", self.gnu, buckets + 4 * (h % nbuckets))
        while idx >= symoffset and chains + 4 * (idx - symoffset) + 4 <= len(self.gnu):
            (ch,) = struct.unpack_from("<I", self.gnu, chains + 4 * (idx - symoffset))
            if (ch | 1) == (h | 1):
                n, shndx = self._entry(idx)
                if n == want:
                    return shndx != 0
            if ch & 1:
                break
            idx += 1
        return False


@functools.lru_cache(maxsize=256)
def _malloc_export(path, _key):
    """The allocator name when PATH defines and exports malloc, else None."""
    try:
        with open(path, "rb") as f:
            syms = _DynSyms(f)
            if not syms.defined("malloc"):
                return None
            for signature, name in _SIGNATURES:
                if syms.defined(signature):
                    return name
    except Exception:
        return None
    base = os.path.basename(path)
    for name in ("jemalloc", "tcmalloc", "mimalloc", "hoard", "snmalloc", "rpmalloc"):
        if name in base:
            return name
    return f"its own malloc in {base}"


def _malloc_export_of(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _malloc_export(path, (st.st_dev, st.st_ino, st.st_mtime_ns))


_PT_LOAD, _PT_DYNAMIC, _PT_INTERP = 1, 2, 3


def _program_headers(path):
    """(position-independent?, [(p_type, p_vaddr, p_memsz)]) of a 64-bit little-endian ELF
    file (None otherwise), read directly: this runs for every process a view lists."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _program_headers_cached(path, (st.st_dev, st.st_ino, st.st_mtime_ns))


@functools.lru_cache(maxsize=256)
def _program_headers_cached(path, _key):
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None
            (e_type,) = struct.unpack_from("<H", head, 16)
            (phoff,) = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            if phentsize < 56 or phnum > 256:
                return None
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError:
        return None
    segments = []
    for i in range(len(table) // phentsize):
        (p_type,) = struct.unpack_from("<I", table, i * phentsize)
        (p_vaddr,) = struct.unpack_from("<Q", table, i * phentsize + 16)
        (p_memsz,) = struct.unpack_from("<Q", table, i * phentsize + 40)
        segments.append((p_type, p_vaddr, p_memsz))
    return e_type == 3, segments  # ET_DYN


def _link_map(pid, exe, maps):
    """Paths of the objects of PID in the dynamic linker's search order (its link map:
    the executable, LD_PRELOADs, then DT_NEEDED breadth-first, then dlopen()ed ones), read
    from the process's memory through the executable's DT_DEBUG; None when unreadable."""
    headers = _program_headers(exe)
    if headers is None:
        return None
    pie, segments = headers
    loads = [s for s in segments if s[0] == _PT_LOAD]
    dyn = next((s for s in segments if s[0] == _PT_DYNAMIC), None)
    if dyn is None or not loads:
        return None
    first_vaddr = min(s[1] for s in loads) & ~0xFFF
    dyn_vaddr, dyn_size = dyn[1], dyn[2]
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

        def read(address, n):
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


def allocator(pid):
    """Whose malloc PID calls: an Allocator, or None while that is not known yet (a
    dynamically linked program whose loader has not mapped its libc). Raises ProcessGone.

    The first object in the dynamic linker's search order (the executable, LD_PRELOADs,
    then the libraries in load order) that defines malloc is the one every call goes to:
    the libc -> traced; jemalloc, tcmalloc, mimalloc, ... -> not traced (glibc's own
    libc_malloc_debug and libmemusage pass calls on to libc, so they do not count). When
    the link map cannot be read, any mapped object but the libc that exports malloc is
    taken to be the allocator. No libc mapped: a static binary, not traced."""
    try:
        maps = read_maps(pid)
    except MapsUnreadable:
        return None  # maps unreadable even to root (some sandboxes): cannot tell
    libc_path = process_libc(pid, maps)
    try:
        exe = host_path(pid, os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        exe = None
    order = None
    if exe is not None and libc_path is not None:
        try:
            order = _link_map(pid, exe, maps)
        except Exception:
            order = None
    in_order = order is not None
    if order is None:
        order = ([exe] if exe else []) + [
            host_path(pid, m.path) for m in maps if "x" in m.perms and m.path.startswith("/")
        ]
    libc_key = file_key(libc_path) if libc_path else None
    for path in order:
        if not path:
            continue  # the vDSO, or an entry without a name
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


def _dynamic(path):
    """PATH has a program interpreter (dynamically linked), or is the dynamic loader itself."""
    if re.search(r"/ld-linux[^/]*\.so|/ld-musl[^/]*\.so", os.path.realpath(path)):
        return True
    headers = _program_headers(path)
    return headers is not None and any(s[0] == _PT_INTERP for s in headers[1])


def untraced_message(pid, found):
    """The sentence for a process whose malloc (FOUND: an Allocator) is not the traced glibc."""
    where = f" in {found.path}" if found.path and not found.name.startswith("static") else ""
    return (
        f"process {pid} ({comm(pid)}) does not allocate with glibc's malloc: its allocator is "
        f"{found.name}{where}, which pymtrace does not trace (only glibc's malloc is), "
        f"so its malloc calls are not seen"
    )


def file_key(path):
    """(device, inode) of PATH, or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class AllocatorCache:
    """allocator() per PID, computed once per program a PID runs (an exec starts afresh)."""

    def __init__(self):
        self.known = {}  # pid -> (exe identity, Allocator or None)

    budget = 0.2  # seconds of new detections per annotate() (~1-4 ms a process); the rest wait

    def get(self, pid, deadline=None):
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

    def annotate(self, processes, pids=()):
        """Add "allocator" and "allocator_traced" to each entry of PROCESSES ({pid: dict}),
        and an entry for each of PIDS (the watched ones) that has none because its malloc
        is not traced (no event to list it by); forget PIDs no longer listed. New lookups
        stop after `budget` seconds (a system-wide view may list hundreds of new processes):
        the watched PIDs first, then processes without a traced malloc call (where another
        allocator would show), then the others, which are left for the next call."""
        deadline = time.monotonic() + self.budget
        for pid in pids:
            if pid not in processes and str(pid) not in processes and os.path.exists(f"/proc/{pid}"):
                found = self.get(pid)
                if found is not None and not found.traced:
                    processes[pid] = {"pid": pid, "comm": comm(pid)}

        def busy(item):
            calls = item[1].get("calls") if isinstance(item[1], dict) else None
            return int(int(item[0]) not in pids), bool(calls and any(calls.values()))

        for pid, p in sorted(processes.items(), key=busy):
            found = self.get(int(pid), deadline)
            if found is not None and isinstance(p, dict):
                p["allocator"], p["allocator_traced"] = found.name, found.traced
        listed = {int(pid) for pid in processes} | set(pids)
        for pid in [p for p in self.known if p not in listed]:
            del self.known[pid]


def _start_time(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]
