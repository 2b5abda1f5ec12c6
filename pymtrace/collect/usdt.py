"""glibc's malloc USDT probes: argument decoding, the BPF program, and GlibcCollector.

Probes are discovered from the `.note.stapsdt` of the libc each process really maps
(pymtrace.target.libc.process_libc / malloc_probes), never from a hard-coded path. Every probe
site (the same name can sit at several addresses: 37 notes carry 29 names in glibc 2.36)
gets one generated BPF function that decodes the note's argument spec itself, with the
width the spec declares (`-4@%esi` signed 4 bytes, `8@%rdi`, `8@24(%rsp)`,
`8@16+mp_(%rip)`, `8@global_max_fast(%rip)`):

- registers are read from pt_regs;
- memory operands with bpf_probe_read_user;
- RIP-relative libc globals at run time as ctx->ip + (symbol + offset - probe address):
  for a uprobe, regs->ip is the probed address, so this needs no per-process load
  address. Symbols (mp_, perturb_byte, global_max_fast) come from the libc's .symtab /
  .dynsym; one that cannot be resolved is reported (GlibcCollector.warnings, `old=?` in
  the stream) instead of being read from a wrong address.

This covers the 11 memory_mallopt_* / memory_tunable_* probes whose argument code BCC
0.26 fails to generate. Sites are attached as plain uprobes at the probe address, by
library path (every process using that libc; several libcs at once) or per PID.

GlibcCollector.snapshot() (cumulative since attach, JSON-able; consumed by `pymtrace top` view 4
(pymtrace/sinks/views.py), the exporter and `pymtrace summary`) gives the snapshot keys
"glibc" ({pid: entry}), "lost" ({"glibc_events": n}) and "glibc_collector": their schema is
pymtrace.collect.snapshot's (GlibcProcess, GlibcCollectorInfo).
"""

import ctypes
import dataclasses
import fnmatch
import os
import re
import time

from pymtrace.bpf import load as bpfload
from pymtrace.bpf import structs
from pymtrace.errors import PymtraceError
from pymtrace.target import libc

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
CAUSES = {0: None, 1: "mallopt", 2: "tunable", 3: "dynamic"}
MAX_ARGS = 3


def header():
    return structs.header("glibc_usdt")


def probe_ids():
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


def _reg(name):
    name = name.lstrip("%")
    if name not in _REG:
        raise UnresolvedArg(f"unknown register %{name}")
    return _REG[name]


def parse_arg(text):
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


def _ctype(size, signed):
    return ("s" if signed else "u") + str(size * 8)


def arg_code(spec, i, probe_addr, symtab):
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
        f"{{ {ctype} v = 0; if (bpf_probe_read_user(&v, sizeof(v), (void *){addr})) "
        f"flags |= {1 << i}; a{i} = {cast}v; }}"
    )


def memory_address(spec, probe_addr, symtab, load_bias):
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
    def name(self):
        return self.probe.name

    @property
    def fn(self):
        return f"site_{self.id}"


def arg_names(name, nargs):
    names = ARG_NAMES.get(name, ())
    return tuple(names[i] if i < len(names) else f"arg{i + 1}" for i in range(nargs))


def build_sites(libc_paths, start_id=0, unknown_ids=None):
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
                    lines.append(f"flags |= {1 << i};")
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


def generate(sites):
    """The C prelude put before bpf/glibc_usdt.bpf.c: a forward declaration of glibc_hit
    (defined in the file) and one site_N function per probe site."""
    return (
        "#include <uapi/linux/ptrace.h>\n"
        "static __always_inline int glibc_hit(struct pt_regs *ctx, u32 probe, u32 site, "
        "u64 a0, u64 a1, u64 a2, u32 flags);\n" + "\n".join(s.code for s in sites)
    )


# ---------------------------------------------------------------- libc status


def libc_status(path):
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


def static_exe_with_probes(exe):
    """EXE itself when it is a static program carrying glibc's malloc probes, else None."""
    try:
        return exe if exe and libc.malloc_probes(exe) else None
    except PymtraceError:
        return None


def process_exe(pid):
    """PID's executable as a path reachable from here, or None."""
    try:
        return libc.host_path(pid, os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None


def probe_file(pid):
    """The file whose malloc probes cover PID: the libc it maps, or its executable when that
    is a static program carrying them; None if neither."""
    return libc.process_libc(pid) or static_exe_with_probes(process_exe(pid))


def launched_probe_file(launched):
    """probe_file() of a command stopped at exec (pymtrace.target.launch.Launched), whose libc
    is not mapped yet: the one its loader will map."""
    return launched.libc_path() or static_exe_with_probes(launched.exe)


def all_libcs():
    """Every distinct libc file in use (system-wide attach), the system libc first."""
    return [path for path, _pids in libc.distinct_libcs()]


_file_key = libc.file_key


def load_bias(pid, path):
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


def read_params(pid, path):
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


# ---------------------------------------------------------------- events


class Event:
    """One decoded probe hit (or pseudo-probe from a tracepoint)."""

    __slots__ = (
        "ts",
        "pid",
        "tid",
        "comm",
        "probe",
        "probe_id",
        "site",
        "args",
        "names",
        "flags",
        "cause",
        "unreadable",
        "fd",
        "path",
    )

    def as_dict(self, wall_offset=0.0):
        d = {
            "time": round(self.ts / 1e9 + wall_offset, 6),
            "ts_ns": self.ts,
            "pid": self.pid,
            "tid": self.tid,
            "comm": self.comm,
            "probe": self.probe,
            "args": {n: (None if i in self.unreadable else v) for i, (n, v) in enumerate(zip(self.names, self.args))},
        }
        if self.cause:
            d["cause"] = self.cause
        if self.probe == "memory_mallopt" and self.args:
            d["param_name"] = MALLOPT_PARAMS.get(self.args[0], "unknown")
        if self.unreadable:
            d["unreadable"] = sorted(self.names[i] for i in self.unreadable if i < len(self.names))
        return d

    def format_args(self):
        out = []
        for i, (n, v) in enumerate(zip(self.names, self.args)):
            if i in self.unreadable:
                out.append(f"{n}=?")
            elif self.probe == "memory_mallopt" and n == "param":
                out.append(f"param={MALLOPT_PARAMS.get(v, v)}")
            elif n in POINTER_ARGS:
                out.append(f"{n}={v:#x}")
            else:
                out.append(f"{n}={v}")
        if self.cause:
            out.append(f"cause={self.cause}")
        return " ".join(out)


def _signed(value, size):
    bits = size * 8
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


# ---------------------------------------------------------------- collector


class GlibcCollector:
    """Attach glibc's malloc USDT probes and aggregate per process in BPF maps.

    pids=None: system-wide, by library path, for every libc with probes mapped by a
    running process at attach() time (plus `libcs`: a libc no process maps yet must be
    named there; the program is compiled once, so libcs appearing later are not added). pids=[...]: per PID, on the libc each one maps
    (`libcs={pid: path}` overrides, e.g. for a command launched stopped at exec).
    stream=True: also deliver every event to on_event(Event) from poll().
    faults=True: also emit page faults / mmap / munmap / brk of the traced pids
    (see add_fault_pid; pymtrace run/summary).
    """

    def __init__(self, pids=None, libcs=None, stream=False, on_event=None, faults=False, ringbuf_pages=None):
        self.pids = None if pids is None else [int(p) for p in pids]
        self.libc_override = libcs or {}
        self.stream = stream or on_event is not None or faults
        self.on_event = on_event
        self.faults = faults
        self.ringbuf_pages = ringbuf_pages or (4096 if faults else 256)
        self.bpf = None
        self.owns_bpf = False
        self.prepared = False
        self.compiled = None  # the bpfload.Part of prepare(), None: nothing to compile
        self.with_probes = []
        self.sites = []
        self.site_by_id = {}
        self.warnings = []
        self.pid_libc = {}  # pid -> libc path
        self.libc_info = []  # [{"libc", "probes", "sites", "attached"}]
        self.names = {}  # probe id -> name
        self._status_cache = {}
        self._comm = {}
        self._exit_new, self._exit_pending = set(), set()
        self.wall_offset = time.time() - time.monotonic()
        h = header()
        self.Event = h.structs["glibc_event"]
        self.Stats = h.structs["glibc_pid_stats"]
        self.PathEvent = h.structs["glibc_path_event"]
        self.consts = h.consts

    # -- attach / detach
    def _plan(self):
        """[(libc path, [pid] or None)] to attach."""
        plan = {}
        if self.pids is None:
            paths = (
                list(self.libc_override.values()) if isinstance(self.libc_override, dict) else list(self.libc_override)
            )
            paths += all_libcs()
            for path in paths:
                key = _file_key(path)
                if key is not None and key not in plan:
                    plan[key] = (path, None)
        else:
            for pid in self.pids:
                path = self.libc_override.get(pid) if isinstance(self.libc_override, dict) else None
                if path is None:
                    path = probe_file(pid)
                self.pid_libc[pid] = path
                if path is None:
                    continue
                key = _file_key(path)
                if key is None:
                    continue
                entry = plan.setdefault(key, (path, []))
                entry[1].append(pid)
        return list(plan.values())

    def prepare(self):
        """Find the libcs and probe sites to attach; the bpfload.Part to compile, or None
        when there is nothing to compile (no probes and no faults: a collector that only
        reports why). attach() calls it; pymtrace.collect.collectors.Collectors calls it first to
        compile this program together with the others."""
        self.prepared = True
        plan = self._plan()
        with_probes = []
        for path, pids in plan:
            st = libc_status(path)
            self.libc_info.append(
                {
                    "libc": path,
                    "probes": st["probes"],
                    "sites": st["sites"],
                    "attached": bool(st["probes"]),
                    "pids": pids,
                    "reason": st["reason"],
                }
            )
            if st["probes"]:
                with_probes.append((path, pids))
        self.sites, warnings = build_sites([p for p, _ in with_probes])
        self.warnings.extend(warnings)
        self.site_by_id = {s.id: s for s in self.sites}
        for s in self.sites:
            self.names[s.probe_id] = s.name
        self.with_probes = with_probes
        self.compiled = self.part() if self.sites or self.faults else None
        return self.compiled

    def part(self):
        defines = {"RINGBUF_PAGES": self.ringbuf_pages}
        if self.faults:
            defines["WITH_FAULTS"] = 1
        if not self.stream:
            defines["NO_STREAM"] = 1  # aggregates only: nothing fills the ring buffer
        return bpfload.Part("glibc_usdt", defines, generate(self.sites))

    def attach(self, bpf=None):
        """BPF: a module compiled with part() among others, left for its owner to close."""
        if not self.prepared:
            self.prepare()
        if self.compiled is None:
            return self  # nothing to attach: a collector that only reports why
        self._load(bpf)
        if not self.sites:
            return self
        with_probes = self.with_probes
        sites_by_libc = {}
        for s in self.sites:
            sites_by_libc.setdefault(s.libc, []).append(s)
        try:
            for path, pids in with_probes:
                for s in sites_by_libc.get(path, []):
                    for pid in pids if pids is not None else [-1]:
                        self.bpf.attach_uprobe(name=path, addr=s.probe.address, fn_name=s.fn, pid=pid)
        except Exception as exc:
            self.close()
            raise PymtraceError(f"cannot attach uprobe to a malloc probe of {path}: {exc}") from None
        return self

    def _load(self, bpf=None):
        self.owns_bpf = bpf is None
        self.bpf = bpfload.load_parts([self.compiled], what="tracing glibc's malloc probes") if bpf is None else bpf
        if self.stream:
            self.bpf["events"].open_ring_buffer(self._on_raw)

    def close(self):
        if self.bpf is not None:
            try:
                self.poll()
            except Exception:
                pass
            if self.owns_bpf:
                bpfload.detach_all(self.bpf)
            self.bpf = None

    def __enter__(self):
        return self.attach()

    def __exit__(self, *exc):
        self.close()

    # -- faults
    def add_fault_pid(self, pid):
        if self.bpf is not None and self.faults:
            self.bpf["fault_pids"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    # -- events
    def _on_raw(self, ctx, data, size):
        raw = ctypes.cast(data, ctypes.POINTER(self.Event)).contents
        ev = Event()
        ev.ts = raw.ts
        ev.pid = raw.pid
        ev.tid = raw.tid
        ev.comm = raw.comm.decode("utf-8", "replace")
        self._comm[ev.pid] = ev.comm
        ev.probe_id = raw.probe
        ev.site = raw.site
        ev.flags = raw.flags
        ev.fd = raw.pad
        ev.path = None
        ev.cause = CAUSES.get((raw.flags >> 8) & 0xFF)
        site = self.site_by_id.get(raw.site) if raw.probe < 200 else None
        if site is not None:
            ev.probe = site.name
            n = len(site.probe.arg_specs[:MAX_ARGS])
            ev.names = arg_names(site.name, n)
            args = []
            for i in range(n):
                spec = site.specs[i]
                v = raw.args[i]
                args.append(_signed(v, spec.size) if spec is not None and spec.signed else v)
            ev.args = tuple(args)
            ev.unreadable = frozenset(i for i in range(n) if raw.flags & (1 << i))
        else:
            ev.probe = PSEUDO.get(raw.probe, f"probe{raw.probe}")
            ev.names = PSEUDO_ARGS.get(raw.probe, ())
            ev.args = tuple(raw.args[: len(ev.names)])
            ev.unreadable = frozenset()
            if raw.probe == PROBE_OPEN:
                pe = ctypes.cast(data, ctypes.POINTER(self.PathEvent)).contents
                ev.path = pe.path.decode("utf-8", "replace")
        if self.on_event is not None:
            self.on_event(ev)
        return 0

    def poll(self):
        """Deliver every event waiting in the ring buffer (stream mode)."""
        if self.bpf is not None and self.stream:
            self.bpf.ring_buffer_consume()

    def lost(self):
        if self.bpf is None:
            return 0
        return int(sum(self.bpf["lost"].getvalue(ctypes.c_int(0))))

    def map_full(self):
        if self.bpf is None:
            return {}
        names = ("stats", "heaps", "threads", "arenas")
        vals = {}
        for i, name in enumerate(names):
            n = int(sum(self.bpf["map_full"].getvalue(ctypes.c_int(i))))
            if n:
                vals[name] = n
        return vals

    # -- state
    def libc_of(self, pid):
        if pid in self.pid_libc:
            return self.pid_libc[pid]
        try:
            path = libc.process_libc(pid)
        except (PymtraceError, OSError):
            path = None
        self.pid_libc[pid] = path
        return path

    def _status(self, path):
        if path not in self._status_cache:
            self._status_cache[path] = libc_status(path)
        return self._status_cache[path]

    def forget(self, pid):
        """Drop every BPF map entry of PID (e.g. when it has exited); it is no longer reported."""
        pid = int(pid)
        if self.pids is not None and pid in self.pids:
            self.pids.remove(pid)
        if self.bpf is None:
            return
        try:
            del self.bpf["stats"][ctypes.c_uint32(pid)]
        except KeyError:
            pass
        for name in ("threads", "arenas", "heaps"):
            table = self.bpf[name]
            for k in [k for k in table.keys() if k.pid == pid]:
                try:
                    del table[k]
                except KeyError:
                    pass
        self.pid_libc.pop(pid, None)
        self._comm.pop(pid, None)

    def exited(self, pid):
        """PID has exited (process-events connector): it is reported once more (alive False,
        final values) by the next snapshot() and forgotten at the one after. Thread-safe:
        map entries are only deleted from snapshot()'s thread."""
        self._exit_new.add(int(pid))

    def prune(self):
        """Forget every process that no longer exists."""
        if self.bpf is None:
            return
        for k in list(self.bpf["stats"].keys()):
            if not os.path.exists(f"/proc/{k.value}"):
                self.forget(k.value)

    def snapshot(self, pids=None):
        """The cumulative state (see the module docstring). PIDS: also report these."""
        for pid in self._exit_pending:
            self.forget(pid)
        self._exit_pending, self._exit_new = self._exit_new, set()
        self.poll()
        out = {}
        stats = {}
        threads, arenas, heaps = {}, {}, {}
        if self.bpf is not None and self.sites:
            for k, v in self.bpf["stats"].items():
                stats[k.value] = v
            for k, v in self.bpf["threads"].items():
                threads.setdefault(k.pid, {})[k.tid] = v
            for k, v in self.bpf["arenas"].items():
                arenas.setdefault(k.pid, {})[k.addr] = v
            for k, v in self.bpf["heaps"].items():
                heaps.setdefault(k.pid, {})[k.addr] = v.value
        wanted = set(stats)
        wanted.update(self.pids or [])
        wanted.update(int(p) for p in (pids or []))
        for pid in sorted(wanted):
            out[pid] = self._pid_snapshot(
                pid, stats.get(pid), threads.get(pid, {}), arenas.get(pid, {}), heaps.get(pid, {})
            )
        lost = self.lost()
        return {
            "glibc": out,
            "lost": {"glibc_events": lost},
            "glibc_collector": {
                "lost_events": lost,
                "map_full": self.map_full(),
                "libcs": [{k: v for k, v in i.items() if k != "pids"} for i in self.libc_info],
                "warnings": list(self.warnings),
            },
        }

    def _pid_snapshot(self, pid, s, threads, arenas, heaps):
        alive = os.path.exists(f"/proc/{pid}")
        if alive or pid not in self._comm:
            c = libc.comm(pid)
            if c != "?" or pid not in self._comm:
                self._comm[pid] = c
        path = self.libc_of(pid) if (alive or pid in self.pid_libc) else None
        if path is None and s is not None and s.last_site in self.site_by_id:
            path = self.site_by_id[s.last_site].libc  # exited: the libc its events came from
            self.pid_libc[pid] = path
        st = (
            self._status(path)
            if (path is not None or alive)
            else {"libc": None, "probes": 0, "reason": "process exited before its libc was seen"}
        )
        g = {
            "pid": pid,
            "comm": self._comm.get(pid, "?"),
            "alive": alive,
            "libc": st["libc"],
            "probes": st["probes"],
            "reason": st["reason"],
        }
        if s is None and st["probes"] and path is not None and not self._attached_to(path):
            g["reason"] = f"libc {path} was not mapped by any process when probes were attached"
        if not st["probes"]:
            return g
        s = s if s is not None else self.Stats()
        g.update(
            {
                "events": s.events,
                "arenas": 1 + s.arenas_new,
                "arenas_created": s.arenas_new,
                "arena_reuse": s.arena_reuse,
                "arena_reuse_free_list": s.arena_reuse_free_list,
                "arena_lock_waits": s.arena_reuse_wait,
                "arena_list": [
                    {"arena": f"{a:#x}", "creator_tid": v.creator_tid or None, "attaches": v.attaches, "waits": v.waits}
                    for a, v in sorted(arenas.items())
                ],
                "heaps": len(heaps),
                "heap_bytes": s.heap_bytes,
                "heap_bytes_max": s.heap_bytes_max,
                "heaps_created": s.heaps_new,
                "heaps_freed": s.heaps_freed,
                "heap_grow": s.heap_more,
                "heap_shrink": s.heap_less,
                "heap_list": [{"heap": f"{a:#x}", "size": n} for a, n in sorted(heaps.items())],
                "sbrk_bytes": s.sbrk_more_bytes,
                "sbrk_grow_count": s.sbrk_more_count,
                "sbrk_trimmed_bytes": s.sbrk_less_bytes,
                "sbrk_trim_count": s.sbrk_less_count,
                "sbrk_failed": s.sbrk_failed,
                "dyn_threshold_changes": s.dyn_threshold_changes,
                "mallopt_calls": s.mallopt_calls,
                "tcache_double_free_scans": s.tcache_double_free,
                "retries": {
                    "malloc": s.malloc_retry,
                    "realloc": s.realloc_retry,
                    "calloc": s.calloc_retry,
                    "memalign": s.memalign_retry,
                    "arena": s.arena_retry,
                },
                "lock_waits": {tid: t.waits for tid, t in sorted(threads.items()) if t.waits},
                "threads": {
                    tid: {
                        "lock_waits": t.waits,
                        "arena": f"{t.arena:#x}" if t.arena else None,
                        "arena_switches": t.arena_switches,
                    }
                    for tid, t in sorted(threads.items())
                },
            }
        )
        params = {}
        live = read_params(pid, path) if alive and path else {}
        for i, name in enumerate(PARAM_NAMES):
            if s.params_known >> i & 1:
                params[name] = {
                    "value": s.params[i],
                    "cause": CAUSES.get(s.params_cause[i]) or "initial",
                    "source": "probe",
                }
            elif name in live:
                params[name] = {"value": live[name], "cause": "initial", "source": "memory"}
        for name in ("mmap_threshold", "trim_threshold"):
            if name in live and name in params:
                params[name]["value"] = live[name]
                params[name]["source"] = "memory"
        g["params"] = params
        g["mmap_threshold"] = params.get("mmap_threshold", {}).get("value")
        g["trim_threshold"] = params.get("trim_threshold", {}).get("value")
        return g

    def _attached_to(self, path):
        key = _file_key(path)
        return any(i["attached"] and _file_key(i["libc"]) == key for i in self.libc_info)


PROBE_OPEN = 204
PSEUDO = {200: "page_fault", 201: "mmap", 202: "munmap", 203: "brk", 204: "open"}
PSEUDO_ARGS = {
    200: ("address", "ip", "error_code"),
    201: ("addr", "len", "prot_flags"),
    202: ("addr", "len"),
    203: ("brk",),
    204: ("fd",),
}


def match_probe(name, patterns):
    """True if probe NAME matches any glob in PATTERNS (with or without the memory_ prefix)."""
    if not patterns:
        return True
    short = name[len("memory_") :] if name.startswith("memory_") else name
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(short, p) for p in patterns)
