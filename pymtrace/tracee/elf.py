"""Reading ELF files: symbols, file offsets, code, USDT notes, program headers, interpreter.

Two readers, each where it fits. pyelftools for what is read once per probed library
(symbol tables, code, `.note.stapsdt`). A few direct reads of the ELF header, the program
headers and the GNU hash table for what runs for every process a system-wide view lists
(which allocator it calls, on every refresh): pyelftools parses every section header first,
2-3 ms a file for the program headers and 40-90 ms for one .dynsym lookup, against
0.02-0.05 ms read directly. Those direct readers accept only 64-bit little-endian files and
fail with OSError/ValueError (or return None) on anything else, since any user can map a
file of any content under a library's name.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import struct
import sys
from typing import IO, TYPE_CHECKING, Iterator, NamedTuple

from pymtrace.errors import PymtraceError

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

PT_LOAD, PT_DYNAMIC, PT_INTERP = 1, 2, 3
PF_X = 1


def _elffile(f: IO[bytes]) -> ELFFile:
    # pyelftools (~45 ms to import) is imported on first use, not at module load: the per-
    # process readers below do not need it, and commands read symbols off their start-up path
    from elftools.elf.elffile import ELFFile

    return ELFFile(f)


# ---------------------------------------------------------------- symbols, code, notes (pyelftools)


@dataclasses.dataclass(frozen=True)
class Symbol:
    name: str
    address: int  # ELF virtual address
    size: int


@functools.lru_cache(maxsize=64)
def _symbols(path: str, _mtime: int) -> dict[str, Symbol]:
    table = {}
    with open(path, "rb") as f:
        for name, _function, _undefined, value, size in _symbol_entries(_elffile(f)):
            if value != 0 and name:
                table.setdefault(name, Symbol(name, value, size))
    return table


class SymbolNames(NamedTuple):
    functions: frozenset[str]  # the functions the file defines
    undefined: frozenset[str]  # the symbols it refers to and leaves to another object to define


def symbol_names(path: str) -> SymbolNames:
    """The names of the functions PATH defines and of the symbols it leaves undefined, from
    .symtab and .dynsym, without version suffixes (`malloc@GLIBC_2.2.5` is `malloc`); an
    undefined `malloc`, even with a PLT address as its value, is no definition. OSError, or
    pyelftools' errors (of many types) on a malformed file."""
    functions, undefined = set(), set()
    with open(path, "rb") as f:
        for name, function, is_undefined, _value, _size in _symbol_entries(_elffile(f)):
            if not name:
                continue
            if is_undefined:
                undefined.add(name)
            elif function:
                functions.add(name)
    return SymbolNames(frozenset(functions), frozenset(undefined))


_ELF64_SYM = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size
_STT_FUNC = 2
_SHN_UNDEF = 0


def _symbol_entries(elf: ELFFile) -> Iterator[tuple[str, bool, bool, int, int]]:
    """(name without its version, a function?, undefined?, value, size) of each entry of
    ELF's .symtab, then its .dynsym."""
    for section_name in (".symtab", ".dynsym"):
        section = elf.get_section_by_name(section_name)
        if section is None:
            continue
        if elf.elfclass == 64 and elf.little_endian:
            entries = _elf64_symbols(section.data(), elf.get_section(section["sh_link"]).data())
        else:
            entries = (
                (
                    sym.name,
                    sym["st_info"]["type"] == "STT_FUNC",
                    sym["st_shndx"] == "SHN_UNDEF",
                    sym["st_value"],
                    sym["st_size"],
                )
                for sym in section.iter_symbols()
            )
        for name, function, undefined, value, size in entries:
            yield name.split("@")[0], function, undefined, value, size


def _elf64_symbols(data: bytes, strtab: bytes) -> Iterator[tuple[str, bool, bool, int, int]]:
    """(name, a function?, undefined?, value, size) of each Elf64_Sym in DATA, unpacked in
    bulk: pyelftools parses each symbol through construct, ~0.1 s for libc's 3,000, on the
    path of every command's start-up (the bulk read: ~5 ms; same table, tests/unit/test_elf.py)."""
    for st_name, info, _other, shndx, value, size in _ELF64_SYM.iter_unpack(data):
        end = strtab.find(b"\0", st_name)
        name = strtab[st_name : end if end >= 0 else len(strtab)].decode("utf-8", "replace")
        yield name, info & 0xF == _STT_FUNC, shndx == _SHN_UNDEF, value, size


def symbols(path: str) -> dict[str, Symbol]:
    """{name: Symbol} of PATH's .symtab and .dynsym (a name's first definition wins)."""
    try:
        return _symbols(path, os.stat(path).st_mtime_ns)
    except FileNotFoundError:
        raise PymtraceError(f"{path}: no such file") from None
    except Exception as exc:  # pyelftools raises many types on a malformed file; reported
        raise PymtraceError(f"{path}: not a readable ELF file ({exc})") from None


def symbol(path: str, name: str) -> Symbol:
    try:
        return symbols(path)[name]
    except KeyError:
        raise PymtraceError(f"{path} has no symbol {name}") from None


def file_offset(path: str, address: int) -> tuple[int, int]:
    """(file offset, bytes of the segment left) of ELF virtual ADDRESS in PATH's PT_LOAD segments."""
    with open(path, "rb") as f:
        for seg in _elffile(f).iter_segments():
            if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= address < seg["p_vaddr"] + seg["p_filesz"]:
                return seg["p_offset"] + address - seg["p_vaddr"], seg["p_vaddr"] + seg["p_filesz"] - address
    raise PymtraceError(f"{path}: address {address:#x} is not in a loaded segment")


def code_offset(path: str, address: int) -> int:
    """The file offset of ELF virtual ADDRESS of PATH as BCC computes it for a uprobe (the
    executable PT_LOAD segment holding it), from the cached program headers; file_offset's
    pyelftools read where those are not at hand (32-bit or big-endian files)."""
    headers = program_headers(path)
    if headers is not None:
        for seg in headers.segments:
            if seg.type == 1 and seg.flags & 1 and seg.vaddr <= address < seg.vaddr + seg.memsz:  # PT_LOAD, PF_X
                return seg.offset + address - seg.vaddr
    return file_offset(path, address)[0]


def read_code(path: str, address: int, length: int) -> bytes:
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
    def arg_specs(self) -> list[str]:
        return self.args.split() if self.args else []


def parse_stapsdt(elf: "ELFFile") -> list[UsdtProbe]:
    """The USDT probes of an open ELFFile's .note.stapsdt section."""
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
def _usdt_probes(path: str, _mtime: int) -> tuple[UsdtProbe, ...]:
    with open(path, "rb") as f:
        return tuple(parse_stapsdt(_elffile(f)))


def usdt_probes(path: str, provider: str | None = None, prefix: str = "") -> list[UsdtProbe]:
    """USDT probes in PATH's .note.stapsdt (optionally one provider, names with PREFIX)."""
    try:
        probes = _usdt_probes(path, os.stat(path).st_mtime_ns)
    except FileNotFoundError:
        raise PymtraceError(f"{path}: no such file") from None
    except Exception as exc:  # pyelftools raises many types on a malformed file; reported
        raise PymtraceError(f"{path}: not a readable ELF file ({exc})") from None
    return [p for p in probes if (provider is None or p.provider == provider) and p.name.startswith(prefix)]


# ---------------------------------------------------------------- headers, read directly (see above)


def machine(f: IO[bytes]) -> int:
    """e_machine of the open ELF file F; ValueError when F is not ELF."""
    f.seek(0)
    head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    return struct.unpack_from("<H", head, 18)[0]


@functools.lru_cache(maxsize=None)
def own_machine() -> int | None:
    """e_machine of the Python running pymtrace (None if unreadable)."""
    try:
        with open(sys.executable, "rb") as f:
            return machine(f)
    except (OSError, ValueError):
        return None


class Segment(NamedTuple):
    type: int  # p_type: PT_LOAD, PT_DYNAMIC, PT_INTERP, ...
    flags: int  # p_flags: PF_X = 1, PF_W = 2, PF_R = 4
    offset: int
    vaddr: int
    filesz: int
    memsz: int


class ProgramHeaders(NamedTuple):
    position_independent: bool  # ET_DYN: a shared object or a PIE
    segments: tuple[Segment, ...]


def program_headers(path: str) -> ProgramHeaders | None:
    """PATH's program headers (None: unreadable, or not a 64-bit little-endian ELF file),
    cached per file version."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _program_headers(path, (st.st_dev, st.st_ino, st.st_mtime_ns))


@functools.lru_cache(maxsize=256)
def _program_headers(path: str, _key: tuple) -> ProgramHeaders | None:
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
        p_type, p_flags, p_offset, p_vaddr = struct.unpack_from("<IIQQ", table, i * phentsize)
        p_filesz, p_memsz = struct.unpack_from("<QQ", table, i * phentsize + 32)
        segments.append(Segment(p_type, p_flags, p_offset, p_vaddr, p_filesz, p_memsz))
    return ProgramHeaders(e_type == 3, tuple(segments))  # ET_DYN


def interpreter(path: str) -> str | None:
    """PATH's program interpreter (PT_INTERP: the dynamic loader), or None (static, unreadable).
    pyelftools: this runs once per launched command, and reads 32-bit programs too."""
    try:
        with open(path, "rb") as f:
            for seg in _elffile(f).iter_segments():
                if seg["p_type"] == "PT_INTERP":
                    return seg.get_interp_name()
    except Exception:  # pyelftools raises many types on a malformed file: no interpreter known
        return None
    return None


def needed(path: str) -> list[str]:
    """PATH's DT_NEEDED libraries (sonames), [] when it has none or cannot be read."""
    try:
        with open(path, "rb") as f:
            dynamic = _elffile(f).get_section_by_name(".dynamic")
            return [t.needed for t in dynamic.iter_tags("DT_NEEDED")] if dynamic is not None else []
    except Exception:  # pyelftools raises many types on a malformed file
        return []


def image_size(path: str) -> int:
    """End of PATH's highest PT_LOAD segment in memory (ELF virtual address), 0 if none."""
    headers = program_headers(path)
    ends = [s.vaddr + s.memsz for s in headers.segments if s.type == PT_LOAD] if headers else []
    return max(ends) if ends else 0


class DynamicSymbols:
    """Defined-symbol lookups in an open ELF file's .dynsym through its GNU hash table (a
    linear scan without one), reading only what a lookup needs. ValueError (or OSError,
    struct.error) on a file that is not a readable 64-bit little-endian ELF file."""

    def __init__(self, f: IO[bytes]) -> None:
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
        if self.dynsym[6] >= shnum:
            raise ValueError(".dynsym has no string table")
        self.strtab = sections[self.dynsym[6]]
        gnu = next((s for s in sections if s[1] == 0x6FFFFFF6), None)  # SHT_GNU_HASH
        self.gnu = self._read(gnu[4], gnu[5]) if gnu is not None and gnu[5] < (64 << 20) else None

    def _read(self, offset: int, n: int) -> bytes:
        self.f.seek(offset)
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("truncated ELF file")
        return data

    def _entry(self, i: int) -> tuple[bytes, int]:
        """(name, st_shndx) of symbol I."""
        st_name, _info, _other, shndx = struct.unpack("<IBBH", self._read(self.dynsym[4] + 24 * i, 8))
        self.f.seek(self.strtab[4] + st_name)
        return self.f.read(256).split(b"\0", 1)[0], shndx

    def defined(self, name: str) -> bool:
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


def build_id(path: str) -> str | None:
    """The GNU build ID of PATH (NT_GNU_BUILD_ID, lowercase hex), or None if it has none or
    cannot be read: it names the exact libc build a recording was made against."""
    from elftools.common.exceptions import ELFError

    try:
        with open(path, "rb") as f:
            for section in _elffile(f).iter_sections():
                if section.header.sh_type != "SHT_NOTE":
                    continue
                for note in section.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID":
                        return str(note["n_desc"])
    except (OSError, ELFError, ValueError):
        return None
    return None
