"""glibc's malloc USDT probes as the traced libc carries them: discovery, argument decoding, the
generated BPF code (GlibcSource, pymtrace.sources.glibc, compiles and attaches it).

Probes are discovered from the `.note.stapsdt` of the libc each process really maps
(pymtrace.tracee.libc.process_libc / malloc_probes), never from a hard-coded path. Every probe
site (the same name can sit at several addresses: 37 notes carry 29 names in glibc 2.36)
gets one generated BPF function that decodes the note's argument spec itself, with the
width the spec declares (`-4@%esi` signed 4 bytes, `8@%rdi`, `8@24(%rsp)`,
`8@16+mp_(%rip)`, `8@global_max_fast(%rip)`):

- registers are read from pt_regs;
- memory operands with pm_probe_read_user (bpf_probe_read_user: pymtrace.bpf.load.MODULE_PRELUDE);
- RIP-relative libc globals at run time as ctx->ip + (symbol + offset - probe address):
  for a uprobe, regs->ip is the probed address, so this needs no per-process load
  address. Symbols (mp_, perturb_byte, global_max_fast) come from the libc's .symtab /
  .dynsym; one that cannot be resolved is reported (GlibcSource.warnings, `old=?` in
  the stream) instead of being read from a wrong address.

This covers the 11 memory_mallopt_* / memory_tunable_* probes whose argument code BCC
0.26 fails to generate. Sites are attached as plain uprobes at the probe address, by
library path (every process using that libc; several libcs at once) or per PID.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from pymtrace.bpf import structs
from pymtrace.errors import PymtraceError
from pymtrace.tracee import libc, proc

if TYPE_CHECKING:
    from pymtrace.tracee.launch import Launched

NO_PROBES_REASON = "libc {path} has no USDT probes (Debian builds glibc without --enable-systemtap)"

# argument names of the probes glibc is known to carry (glibc manual + malloc.c)
ARG_NAMES = {
    "memory_sbrk_more": ("brk", "size"),
    "memory_sbrk_less": ("new_brk", "size"),
    "memory_heap_new": ("heap", "size"),
    "memory_heap_more": ("heap", "new_size"),
    "memory_heap_less": ("heap", "new_size"),
    "memory_heap_free": ("heap", "size"),
    "memory_arena_new": ("arena", "size"),
    "memory_arena_reuse_free_list": ("arena",),
    "memory_arena_reuse_wait": ("mutex", "arena", "avoid_arena"),
    "memory_arena_reuse": ("arena", "avoid_arena"),
    "memory_arena_retry": ("bytes", "arena"),
    "memory_malloc_retry": ("bytes",),
    "memory_realloc_retry": ("bytes", "oldmem"),
    "memory_memalign_retry": ("bytes", "alignment"),
    "memory_calloc_retry": ("bytes",),
    "memory_mallopt": ("param", "value"),
    "memory_mallopt_mxfast": ("new", "old"),
    "memory_mallopt_trim_threshold": ("new", "old", "dyn_disabled"),
    "memory_mallopt_top_pad": ("new", "old", "dyn_disabled"),
    "memory_mallopt_mmap_threshold": ("new", "old", "dyn_disabled"),
    "memory_mallopt_mmap_max": ("new", "old", "dyn_disabled"),
    "memory_mallopt_perturb": ("new", "old"),
    "memory_mallopt_arena_test": ("new", "old"),
    "memory_mallopt_arena_max": ("new", "old"),
    "memory_mallopt_free_dyn_thresholds": ("mmap_threshold", "trim_threshold"),
    "memory_mallopt_check_action": ("new", "old"),
    "memory_tunable_tcache_max_bytes": ("new", "old"),
    "memory_tunable_tcache_count": ("new", "old"),
    "memory_tunable_tcache_unsorted_limit": ("new", "old"),
    "memory_tcache_double_free": ("entry", "tc_idx"),
}
POINTER_ARGS = {"brk", "new_brk", "heap", "arena", "mutex", "avoid_arena", "oldmem", "entry"}
MALLOPT_PARAMS = {
    1: "M_MXFAST",
    -1: "M_TRIM_THRESHOLD",
    -2: "M_TOP_PAD",
    -3: "M_MMAP_THRESHOLD",
    -4: "M_MMAP_MAX",
    -5: "M_CHECK_ACTION",
    -6: "M_PERTURB",
    -7: "M_ARENA_TEST",
    -8: "M_ARENA_MAX",
}
PARAM_NAMES = (
    "mxfast",
    "trim_threshold",
    "top_pad",
    "mmap_threshold",
    "mmap_max",
    "perturb",
    "arena_test",
    "arena_max",
    "tcache_max",
    "tcache_count",
    "tcache_unsorted_limit",
    "check_action",
)
# which probe's "old" argument (index 1) reads the parameter's current value from memory
PARAM_PROBES = {
    "mxfast": "memory_mallopt_mxfast",
    "trim_threshold": "memory_mallopt_trim_threshold",
    "top_pad": "memory_mallopt_top_pad",
    "mmap_threshold": "memory_mallopt_mmap_threshold",
    "mmap_max": "memory_mallopt_mmap_max",
    "perturb": "memory_mallopt_perturb",
    "arena_test": "memory_mallopt_arena_test",
    "arena_max": "memory_mallopt_arena_max",
    "tcache_max": "memory_tunable_tcache_max_bytes",
    "tcache_count": "memory_tunable_tcache_count",
    "tcache_unsorted_limit": "memory_tunable_tcache_unsorted_limit",
    "check_action": "memory_mallopt_check_action",
}


def header() -> structs.Header:
    """Structs and constants of bpf/glibc_usdt.h."""
    return structs.header("glibc_usdt")


# why a parameter changed (CAUSE_* of bpf/glibc_usdt.h; CAUSE_NONE: not known)
CAUSES = {
    v: (None if k == "CAUSE_NONE" else k[len("CAUSE_") :].lower())
    for k, v in header().consts.items()
    if k.startswith("CAUSE_")
}
MAX_ARGS = header().consts["MAX_ARGS"]  # arguments decoded per probe hit
EV_ARG_UNREADABLE = header().consts["EV_ARG_UNREADABLE"]  # flags bit of argument 0 (<< N for argument N)


def probe_ids() -> dict[str, int]:
    """{probe name: id} for the probes with a fixed id in bpf/glibc_usdt.h."""
    return {k[len("PROBE_") :]: v for k, v in header().consts.items() if k.startswith("PROBE_memory_")}


# ---------------------------------------------------------------- argument specs

_REGS64 = {
    "rax": "ax",
    "rbx": "bx",
    "rcx": "cx",
    "rdx": "dx",
    "rsi": "si",
    "rdi": "di",
    "rbp": "bp",
    "rsp": "sp",
    "rip": "ip",
}
_REG = {}
for _r64, _f in list(_REGS64.items()):
    _REG[_r64] = (_f, 0)
for _n, _f in (
    ("eax", "ax"),
    ("ebx", "bx"),
    ("ecx", "cx"),
    ("edx", "dx"),
    ("esi", "si"),
    ("edi", "di"),
    ("ebp", "bp"),
    ("esp", "sp"),
    ("ax", "ax"),
    ("bx", "bx"),
    ("cx", "cx"),
    ("dx", "dx"),
    ("si", "si"),
    ("di", "di"),
    ("bp", "bp"),
    ("sp", "sp"),
    ("al", "ax"),
    ("bl", "bx"),
    ("cl", "cx"),
    ("dl", "dx"),
    ("sil", "si"),
    ("dil", "di"),
    ("bpl", "bp"),
    ("spl", "sp"),
):
    _REG[_n] = (_f, 0)
for _n, _f in (("ah", "ax"), ("bh", "bx"), ("ch", "cx"), ("dh", "dx")):
    _REG[_n] = (_f, 8)
for _i in range(8, 16):
    for _suffix in ("", "d", "w", "b"):
        _REG[f"r{_i}{_suffix}"] = (f"r{_i}", 0)

_SPEC = re.compile(r"^(?:(-?\d+)@)?(.+)$")
_MEM = re.compile(r"^(?P<disp>[^()]*)\((?P<base>%\w+)?(?:,(?P<index>%\w+)(?:,(?P<scale>\d+))?)?\)$")
_TERM = re.compile(r"([+-]?)\s*([A-Za-z_.$][\w.$@]*|0[xX][0-9a-fA-F]+|\d+)")


class UnresolvedArg(Exception):
    """An argument whose operand cannot be decoded (unknown symbol or syntax)."""


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One USDT argument: `[-]SIZE@OPERAND`."""

    text: str
    size: int  # bytes
    signed: bool
    kind: str  # "reg", "imm", "mem"
    reg: str = ""  # pt_regs field (reg) or base register field (mem)
    shift: int = 0
    imm: int = 0
    index: str = ""
    scale: int = 1
    disp: int = 0
    symbols: tuple = ()  # ((sign, name), ...) added to the displacement
    rip: bool = False


def _reg(name: str) -> tuple[str, int]:
    name = name.lstrip("%")
    if name not in _REG:
        raise UnresolvedArg(f"unknown register %{name}")
    return _REG[name]


def parse_arg(text: str) -> ArgSpec:
    """Parse one argument spec (x86-64 `.note.stapsdt` syntax) into an ArgSpec."""
    m = _SPEC.match(text.strip())
    if not m:
        raise UnresolvedArg(f"cannot parse argument {text!r}")
    size_text, op = m.group(1), m.group(2).strip()
    size = int(size_text) if size_text else 8
    signed, size = size < 0, abs(size)
    if size not in (1, 2, 4, 8):
        raise UnresolvedArg(f"unsupported argument size {size} in {text!r}")
    if op.startswith("%"):
        field, shift = _reg(op)
        return ArgSpec(text, size, signed, "reg", reg=field, shift=shift)
    if op.startswith("$"):
        try:
            return ArgSpec(text, size, signed, "imm", imm=int(op[1:], 0))
        except ValueError:
            raise UnresolvedArg(f"unsupported immediate {op!r}") from None
    mm = _MEM.match(op)
    if not mm:
        raise UnresolvedArg(f"cannot parse operand {op!r}")
    disp, syms = 0, []
    dtext = mm.group("disp").replace(" ", "")
    pos = 0
    while pos < len(dtext):
        t = _TERM.match(dtext, pos)
        if not t or t.end() == pos:
            raise UnresolvedArg(f"cannot parse displacement {dtext!r}")
        sign = -1 if t.group(1) == "-" else 1
        tok = t.group(2)
        if tok[0].isdigit():
            disp += sign * int(tok, 0)
        else:
            syms.append((sign, tok))
        pos = t.end()
    base = mm.group("base")
    rip = base is not None and base.lstrip("%") == "rip"
    if rip and not syms:
        raise UnresolvedArg(f"RIP-relative operand without a symbol: {op!r}")
    field = "" if base is None or rip else _reg(base)[0]
    index = _reg(mm.group("index"))[0] if mm.group("index") else ""
    scale = int(mm.group("scale") or 1)
    return ArgSpec(
        text, size, signed, "mem", reg=field, index=index, scale=scale, disp=disp, symbols=tuple(syms), rip=rip
    )


def _ctype(size: int, signed: bool) -> str:
    return ("s" if signed else "u") + str(size * 8)


def arg_code(spec: ArgSpec, i: int, probe_addr: int, symtab: Mapping[str, libc.Symbol]) -> str:
    """C statements that set a{i} from ctx per SPEC (flags bit i on a failed read).

    symtab: {name: Symbol} of the libc; RIP-relative and symbolic operands resolve to
    ctx->ip + (symbol + disp - probe_addr).
    """
    cast = f"(u64)({_ctype(spec.size, spec.signed)})"
    if spec.kind == "reg":
        val = f"ctx->{spec.reg}" + (f" >> {spec.shift}" if spec.shift else "")
        return f"a{i} = {cast}({val});"
    if spec.kind == "imm":
        return f"a{i} = {cast}({spec.imm}LL);"
    # memory operand
    offset = spec.disp
    terms = []
    if spec.symbols:
        for sign, name in spec.symbols:
            sym = symtab.get(name)
            if sym is None:
                raise UnresolvedArg(f"symbol {name} is not in the libc's .symtab/.dynsym")
            offset += sign * sym.address
        # load bias = ctx->ip - probe_addr
        offset -= probe_addr
        terms.append("ctx->ip")
    if spec.reg:
        terms.append(f"ctx->{spec.reg}")
    if spec.index:
        terms.append(f"ctx->{spec.index} * {spec.scale}")
    addr = " + ".join(terms) or "0"
    addr = f"({addr} + ({offset}LL))"
    ctype = _ctype(spec.size, spec.signed)
    return (
        f"{{ {ctype} v = 0; if (pm_probe_read_user(&v, sizeof(v), (void *){addr})) "
        f"flags |= {EV_ARG_UNREADABLE << i}; a{i} = {cast}v; }}"
    )


def memory_address(spec: ArgSpec, probe_addr: int, symtab: Mapping[str, libc.Symbol], load_bias: int) -> int | None:
    """Run-time address of a symbolic/RIP-relative memory operand without registers, or None."""
    if spec.kind != "mem" or spec.reg or spec.index or not spec.symbols:
        return None
    addr = spec.disp + load_bias
    for sign, name in spec.symbols:
        sym = symtab.get(name)
        if sym is None:
            return None
        addr += sign * sym.address
    return addr


# ---------------------------------------------------------------- sites


@dataclasses.dataclass
class Site:
    id: int
    libc: str
    probe: libc.UsdtProbe
    probe_id: int
    specs: list  # ArgSpec or None (unresolved) for the first MAX_ARGS args
    unresolved: dict  # arg index -> reason
    code: str = ""

    @property
    def name(self) -> str:
        return self.probe.name

    @property
    def fn(self) -> str:
        return f"site_{self.id}"


def arg_names(name: str, nargs: int) -> tuple[str, ...]:
    names = ARG_NAMES.get(name, ())
    return tuple(names[i] if i < len(names) else f"arg{i + 1}" for i in range(nargs))


def build_sites(
    libc_paths: Iterable[str], start_id: int = 0, unknown_ids: dict[str, int] | None = None
) -> tuple[list[Site], list[str]]:
    """Sites (with generated C) for every memory_* probe note of each libc in LIBC_PATHS."""
    ids = probe_ids()
    unknown_ids = {} if unknown_ids is None else unknown_ids
    first_unknown = header().consts["PROBE_FIRST_UNKNOWN"]
    sites, warnings = [], []
    for path in libc_paths:
        probes = libc.malloc_probes(path)
        symtab = libc.symbols(path) if probes else {}
        for p in probes:
            pid_ = ids.get(p.name)
            if pid_ is None:
                pid_ = unknown_ids.setdefault(p.name, first_unknown + len(unknown_ids))
            specs, unresolved, lines = [], {}, []
            arg_texts = p.arg_specs
            if len(arg_texts) > MAX_ARGS:
                warnings.append(
                    f"{path}: {p.name} has {len(arg_texts)} arguments; only the first {MAX_ARGS} are decoded"
                )
            for i, text in enumerate(arg_texts[:MAX_ARGS]):
                try:
                    spec = parse_arg(text)
                    lines.append(arg_code(spec, i, p.address, symtab))
                    specs.append(spec)
                except UnresolvedArg as exc:
                    specs.append(None)
                    unresolved[i] = f"{text}: {exc}"
                    lines.append(f"flags |= {EV_ARG_UNREADABLE << i};")
                    warnings.append(f"{path}: {p.name}@{p.address:#x} argument {i + 1} ({text}) not decoded: {exc}")
            site = Site(start_id + len(sites), path, p, pid_, specs, unresolved)
            body = "\n\t".join(lines)
            site.code = (
                f"int {site.fn}(struct pt_regs *ctx)\n{{\n\tu64 a0 = 0, a1 = 0, a2 = 0;\n"
                f"\tu32 flags = 0;\n\t{body}\n"
                f"\treturn glibc_hit(ctx, {pid_}, {site.id}, a0, a1, a2, flags);\n}}\n"
            )
            sites.append(site)
    return sites, warnings


def generate(sites: Iterable[Site]) -> str:
    """The C prelude put before bpf/glibc_usdt.bpf.c: a forward declaration of glibc_hit
    (defined in the file) and one site_N function per probe site."""
    return (
        "#include <uapi/linux/ptrace.h>\n"
        "static __always_inline int glibc_hit(struct pt_regs *ctx, u32 probe, u32 site, "
        "u64 a0, u64 a1, u64 a2, u32 flags);\n" + "\n".join(s.code for s in sites)
    )


# ---------------------------------------------------------------- libc status


def libc_status(path: str | None) -> dict[str, Any]:
    """{"libc", "probes" (distinct names), "sites", "reason"} for a libc path (None: static)."""
    if path is None:
        return {
            "libc": None,
            "probes": 0,
            "sites": 0,
            "reason": "no dynamically linked libc is mapped (static binary or not a glibc program)",
        }
    try:
        probes = libc.malloc_probes(path)
    except PymtraceError as exc:
        return {"libc": path, "probes": 0, "sites": 0, "reason": str(exc)}
    if not probes:
        return {"libc": path, "probes": 0, "sites": 0, "reason": NO_PROBES_REASON.format(path=path)}
    return {"libc": path, "probes": len({p.name for p in probes}), "sites": len(probes), "reason": None}


def static_exe_with_probes(exe: str | None) -> str | None:
    """EXE itself when it is a static program carrying glibc's malloc probes, else None."""
    try:
        return exe if exe and libc.malloc_probes(exe) else None
    except PymtraceError:
        return None


def process_exe(pid: int) -> str | None:
    """PID's executable as a path reachable from here, or None."""
    own = proc.exe(pid)
    return libc.host_path(pid, own) if own is not None else None


def probe_file(pid: int) -> str | None:
    """The file whose malloc probes cover PID: the libc it maps, or its executable when that
    is a static program carrying them; None if neither."""
    return libc.process_libc(pid) or static_exe_with_probes(process_exe(pid))


def launched_probe_file(launched: Launched) -> str | None:
    """probe_file() of a command stopped at exec (pymtrace.tracee.launch.Launched), whose libc
    is not mapped yet: the one its loader will map."""
    return launched.libc_path() or static_exe_with_probes(launched.exe)


def all_libcs() -> list[str]:
    """Every distinct libc file in use (system-wide attach), the system libc first."""
    return [path for path, _pids in libc.distinct_libcs()]


_file_key = libc.file_key


def load_bias(pid: int, path: str) -> int | None:
    """Where PID maps PATH: start - file offset of its first mapping (None if not mapped)."""
    key = _file_key(path)
    try:
        maps = libc.read_maps(pid)
    except (PymtraceError, OSError):
        return None
    for m in maps:
        if not m.path:
            continue
        if m.path == path or _file_key(libc.host_path(pid, m.path)) == key:
            return m.start - m.offset
    return None


def read_params(pid: int, path: str) -> dict[str, int]:
    """Current malloc parameters of a live PID, read from its memory at the operands of the
    mallopt/tunable probes' "old" argument: {name: value}."""
    probes = libc.malloc_probes(path)
    bias = load_bias(pid, path)
    if bias is None or not probes:
        return {}
    symtab = libc.symbols(path)
    by_name = {}
    for p in probes:
        by_name.setdefault(p.name, p)
    out = {}
    try:
        mem = open(f"/proc/{pid}/mem", "rb")
    except OSError:
        return {}
    with mem:
        for param, probe_name in PARAM_PROBES.items():
            p = by_name.get(probe_name)
            if p is None or len(p.arg_specs) < 2:
                continue
            try:
                spec = parse_arg(p.arg_specs[1])
            except UnresolvedArg:
                continue
            addr = memory_address(spec, p.address, symtab, bias)
            if addr is None:
                continue
            try:
                mem.seek(addr)
                raw = mem.read(spec.size)
            except OSError:
                continue
            if len(raw) != spec.size:
                continue
            out[param] = int.from_bytes(raw, "little", signed=spec.signed)
    return out


def match_probe(name: str, patterns: Sequence[str] | None) -> bool:
    """True if probe NAME matches any glob in PATTERNS (with or without the memory_ prefix)."""
    if not patterns:
        return True
    short = name[len("memory_") :] if name.startswith("memory_") else name
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(short, p) for p in patterns)
