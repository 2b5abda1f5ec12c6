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

from elftools.elf.elffile import ELFFile

from pymtrace.errors import PymtraceError, ProcessGone

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


def read_maps(pid):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return parse_maps_text(f.read())
    except FileNotFoundError:
        raise ProcessGone(pid) from None
    except ProcessLookupError:
        raise ProcessGone(pid) from None
    except OSError as exc:  # EACCES: another user namespace, a sandbox, a hardened /proc
        raise PymtraceError(f"cannot read /proc/{pid}/maps: {exc.strerror or exc} (pymtrace needs the "
                            "process's memory map: run it where it can see the process, e.g. in the "
                            "same container)") from None


def is_libc_path(path):
    return bool(_LIBC_NAME.search(path))


def process_libc(pid):
    """Path (as seen from our mount namespace) of the libc PID maps, or None (static binary)."""
    libc_maps = [m for m in read_maps(pid) if is_libc_path(m.path)]
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


def distinct_libcs():
    """Every libc file in use, once per file: [(path, {pid, ...}), ...], the system libc first.

    Files are told apart by (device, inode), so one libc reached through several paths
    (containers, symlinks) is listed once; processes whose maps cannot be read are skipped.
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
    return list(found.values())


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
        name = data[pos:pos + namesz].rstrip(b"\0")
        pos += (namesz + 3) & ~3
        desc = data[pos:pos + descsz]
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
