"""What `pymtrace record` attaches where: the process and the libc or allocator its calls
resolve to, record.bpf.c's switches, the uprobes (glibc's, another allocator's, C++'s
operator new), and per exec of a launched command the new program's allocator."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

from pymtrace.bpf import load as bpfload
from pymtrace.bpf import uprobes
from pymtrace.errors import ProcessGone, PymtraceError, RecordingStopped
from pymtrace.recorder.options import RecordOptions
from pymtrace.recorder.outputs import PAGE, Output
from pymtrace.sources.base import uprobe
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.tracee import allocators, cxxplan, elf, libc, mallocapi, probesite, proc

if TYPE_CHECKING:
    from pymtrace.tracee.launch import Launched

STACK_PAGES = 8  # at most 32 KiB of stack copied per allocation (heap's default too)
CXX_SLOTS = 8  # carried operator news a recording can probe (record.bpf.c enter_cxx_new_<slot>)
_DEBUG_LIB = "libc_malloc_debug.so.0"

Sites = list[tuple[str, str, tuple]]  # [(file, function, entry offsets)] probed


def probe_libraries(libc_path: str, want_debug: bool = True) -> list[tuple[str, bool]]:
    """[(path, outermost)] to probe: glibc, plus glibc's libc_malloc_debug interposer when it
    is installed next to it and WANT_DEBUG (the process maps or will preload it)."""
    libs = [(libc_path, False)]
    debug = os.path.join(os.path.dirname(libc_path), _DEBUG_LIB)
    if want_debug and os.path.exists(debug) and os.path.realpath(debug) != os.path.realpath(libc_path):
        libs.append((debug, True))
    return libs


def uses_debug_lib(pid: int | None = None, launched: "Launched | None" = None) -> bool:
    """Whether to probe libc_malloc_debug. A launched command: always, since it may exec
    other programs (`env LD_PRELOAD=... prog`, `sh -c`, make) and the loader of the one that
    preloads the debug library maps it and runs the program at once, before pymtrace could
    see it (the probes cost a process that does not map the library nothing). A running
    process: only if it maps it, as each probed function adds BCC detach time at exit."""
    if launched is not None:
        return True
    try:
        return any("libc_malloc_debug" in m.path for m in libc.read_maps(pid))
    except PymtraceError:
        return False


def attach(bpf: Any, libs: list[tuple[str, bool]], pid: int, note_bases: bool = False) -> list[tuple[str, str, tuple]]:
    """Attach every probe. glibc: entry + return probes (free: entry only), return probes
    first so that a thread inside a function during attach cannot leave a stale depth.
    An interposer (libc_malloc_debug): entry probes only (see record.bpf.c).
    Returns [(lib, function, offsets)]."""
    plan = []
    for index, (path, outer) in enumerate(libs):
        seen = set()
        for function in mallocapi.FUNCTIONS:
            func = function.name
            if note_bases and func == "malloc":
                entry = f"enter_malloc_{index}"
            elif outer:
                entry = "enter_outer_" + function.call
            else:
                entry = "enter_" + function.call
            try:
                sym = elf.symbol(path, func)
            except PymtraceError:
                continue
            if sym.address in seen:
                continue
            seen.add(sym.address)
            sites = probesite.sites(path, func)
            offsets = (sites.offset,) + tuple(sites.side_paths)
            plan.append((path, func, sym.address, entry, offsets, function.returns and not outer))
    if not any(p == libs[0][0] for p, *_ in plan):
        raise PymtraceError(f"{libs[0][0]}: no malloc/free symbols to probe (not a libc?)")
    probes = [uprobe(path, addr, "leave", pid, True, func) for path, func, addr, _, _, has_ret in plan if has_ret]
    for path, func, addr, entry, offsets, _has_ret in plan:
        probes += [uprobe(path, addr + off, entry, pid, False, func) for off in offsets]
    uprobes.attach(bpf, probes)
    return [(p, f, o) for p, f, _, _, o, _ in plan]


def attach_foreign(bpf: Any, path: str, family: str, pid: int) -> list[tuple[str, str, tuple]]:
    """Attach the probes of another allocator (FAMILY, a target.allocators.FAMILIES key) in
    PATH: top's placement (allocators.probe_plan), record's programs (enter_f_*, `leave`),
    return probes first. A function whose first instruction the kernel refuses (an
    LD_PRELOAD counter's `lock add`) is probed past it where that sees the same calls, so
    that the recording stays exact (docs/record.md). Returns [(path, function, entry offsets)]."""
    return _attach_plan(bpf, path, allocators.probe_plan(path, family, past_refused=True), pid, {})


def attach_cxx(bpf: Any, path: str, plan: cxxplan.CxxPlan, pid: int, first_slot: int) -> list[tuple[str, str, tuple]]:
    """Attach the C++ runtime PATH's operator new/delete probes of PLAN (cxxplan): each carried
    new's entry program enter_cxx_new_<slot>, from FIRST_SLOT on, its function told to BPF
    (cxx_fns) before it is attached. Returns [(path, function, entry offsets)]."""
    slots = {c.function: first_slot + k for k, c in enumerate(plan.carried)}
    table = bpf["cxx_fns"] if plan.carried else None
    for c in plan.carried:
        leaf = table.Leaf()
        leaf.site, leaf.depth, leaf.size = c.offset, c.depth, c.size
        leaf.type = B.MEMALIGN if c.recorded == "memalign" else B.MALLOC
        table[ctypes.c_int(slots[c.function])] = leaf
    return _attach_plan(bpf, path, plan.probes, pid, slots)


def _attach_plan(bpf: Any, path: str, plan: Any, pid: int, slots: dict[str, int]) -> list[tuple[str, str, tuple]]:
    """Attach PLAN ([(function, (allocators.Probe, ...))]) in PATH with record's programs:
    enter_f_* for top's ms_f_*, `leave` at every return probe (attached first), a carried
    new's slot program (SLOTS). Returns [(path, function, entry offsets)]."""
    returns, entries = [], []
    plan = [(function, _free_read_before_return(probes)) for function, probes in plan]
    for function, probes in plan:
        address = elf.symbol(path, function).address
        for p in probes:
            if p.kind == "return":
                returns.append(uprobe(path, address + p.offset, "leave", pid, True, function))
            elif p.kind == "entry":
                entry = (
                    f"enter_cxx_new_{slots[function]}"
                    if function in slots
                    else "enter_f_" + p.program.removeprefix("ms_f_")
                )
                entries.append(uprobe(path, address + p.offset, entry, pid, False, function))
    uprobes.attach(bpf, returns + entries)
    return [(path, f, tuple(p.offset for p in probes if p.kind == "entry")) for f, probes in plan]


def _free_read_before_return(probes: tuple) -> tuple:
    """PROBES of one function, a free-type one with a return probe apart from its entry probes
    (side paths: the return probe at +0) entered where its return probe is: a free is recorded
    at its entry with the return address it reads at [rsp], which the return probe's breakpoint,
    when it is hit first, has already replaced with the uretprobe trampoline's."""
    ret = [p.offset for p in probes if p.kind == "return"]
    entries = [p for p in probes if p.kind == "entry"]
    frees = [p for p in entries if p.program == "ms_f_free_nest" or p.program.startswith("ms_f_delete")]
    if not ret or not frees or all(p.offset == ret[0] for p in entries):
        return probes
    return (dataclasses.replace(entries[0], offset=ret[0]),) + tuple(p for p in probes if p.kind == "return")


def foreign_defines(found: libc.Allocator | None, cxx: cxxplan.CxxPlan | None) -> dict[str, int]:
    """record.bpf.c's switches for its enter_f_* and enter_cxx_new_* programs: only those
    attach_foreign and attach_cxx will attach for the allocator FOUND (None: glibc, probed by
    the libc's programs) and the C++ runtime's plan CXX (None: none probed; its carried news
    in the slots from 0) -- none for a glibc process without C++ (a BCC compile costs ~0.02
    CPU-s a program). Raises PymtraceError as allocators.probe_plan does."""
    wanted = set()
    if found is not None:
        wanted |= {"enter_f_" + p.removeprefix("ms_f_") for p in allocators.programs(found.path, found.family)}
    if cxx is not None:
        wanted |= cxx.programs()
    names = wanted - {"enter_f_return"}  # `leave`: always
    return {"F_SELECT": 1, **{f"WANT_{name}": 1 for name in sorted(names)}}


def recorded_names(libs: list[tuple[str, bool]], found: libc.Allocator | None) -> dict[Any, frozenset[str]]:
    """{file key: the malloc-API names record probes there}: glibc's (and its interposer's)
    for LIBS, the family's for another allocator FOUND -- where a C++ runtime's PLT calls must
    land for its cheaper plan (cxxplan.for_process)."""
    names = {libc.file_key(path): frozenset(f.name for f in mallocapi.FUNCTIONS) for path, _ in libs}
    if found is not None and found.family in allocators.FAMILIES:
        names[libc.file_key(found.path)] = frozenset(f.name for f in allocators.FAMILIES[found.family])
    return names


class ProbePlan:
    """The probes of one recording (OPTIONS): resolve() finds the process (-p, or -- CMD
    launched and stopped with its objects mapped: LAUNCHED), its libc and its allocator;
    load() compiles record.bpf.c for them, attach() puts the uprobes on, enable() starts the
    recording; probe_program() probes a launched command's program after each exec."""

    def __init__(self, options: RecordOptions) -> None:
        self.options = options
        self.follow = options.follow_forks
        self.target = 0
        self.launched: Launched | None = None
        self.libc_path: str | None = None
        self.allocator: libc.Allocator | None = None  # -p on jemalloc, tcmalloc, ...: probed instead of libc
        self.bpf: Any = None
        self.libs: list[tuple[str, bool]] = []  # [(file, outermost)] probed with the libc programs
        self.sites: Sites = []
        self.probed_files: set[tuple[str, str]] = set()  # (path, family) with probes (-- CMD: per exec)
        self.allocator_warned: list[libc.Allocator] = []  # -- CMD: programs whose malloc cannot be recorded
        self._foreign: libc.Allocator | None = None  # -p: the allocator probed instead of glibc
        self._cxx: str | None = None  # -p: the C++ runtime whose operator new is probed
        self._cxx_plan: cxxplan.CxxPlan | None = None  # -p: how
        self.carry = True  # carried operator news (not with --stacks: cxxplan.plan)
        self.cxx_slots = 0  # record.bpf.c's enter_cxx_new_<slot> programs given out

    def resolve(self) -> None:
        """Find the process to record and where its malloc-API calls resolve; -- CMD is
        launched here, stopped before it runs. PymtraceError if it cannot be recorded."""
        options = self.options
        if options.cmd:
            from pymtrace.tracee.launch import Launched

            self.launched = Launched(list(options.cmd))
            self.target = self.launched.pid
            # its objects mapped (LD_PRELOAD too), nothing run yet: resolved as for -p
            self.launched.run_until_loaded()
            libc_path = options.libc or libc.process_libc(self.target) or self.launched.libc_path()
            found = None if options.libc else libc.allocator(self.target)
            if found is not None and found.family not in (None, "glibc"):
                self.allocator = found  # named by the trace; probed beside glibc (probe_program)
        else:
            self.target = proc.tgid(options.pid)  # a thread id means its whole process
            if self.target == os.getpid():
                raise PymtraceError(
                    f"process {self.target} is this pymtrace: recording it would record its own recording without end"
                )
            libc_path = options.libc or libc.process_libc(self.target)
            found = None if options.libc else libc.allocator(self.target)
            if found is not None and not found.traced:
                if found.family is None:
                    raise PymtraceError(libc.untraced_message(self.target, found) + ": nothing to record")
                self.allocator = found  # jemalloc, tcmalloc, mimalloc, a malloc of its own
        self.libc_path = libc_path

    def load(self, pages: int, on_stack_event: Callable[..., int] | None = None, py_frames: int = 0) -> None:
        """Compile and load record.bpf.c for this process, its ring buffer PAGES pages (and,
        --stacks, the stack events' ring, drained by ON_STACK_EVENT; PY_FRAMES > 0: Python
        processes' stack events carry up to that many Python frames)."""
        libc_path = self.libc_path
        defines = {"RB_PAGES": pages, "PAGE_SIZE_BYTES": PAGE, "TARGET_TGID": self.target, "CXX_SLOTS": CXX_SLOTS}
        self.carry = on_stack_event is None
        if self.follow:
            defines["FOLLOW"] = 1
        if self.launched is not None:  # it may exec onto another allocator (probe_program)
            defines["EXEC_ALLOCATORS"] = 1
        if on_stack_event is not None:
            from pymtrace.sources.heap import possible_cpus

            defines.update(STACKS=1, STACK_PAGES=STACK_PAGES, STACK_RB_PAGES=pages, MAX_CPUS=possible_cpus())
            if py_frames:
                defines["PY_FRAMES"] = py_frames
        # -p on another allocator: its functions only (tracee.allocators), no chunk headers;
        # -- CMD: glibc's, and per program (it may exec) its allocator's beside (probe_program)
        found = self.allocator if self.launched is None else None
        if found is not None:
            defines["GLIBC_CHUNKS"] = 0
            defines["LIBC_PROBES"] = 0
            defines["OUTER_PROBES"] = 0
            self.libs = [(found.path, False)]
        else:
            if not os.path.isfile(libc_path):
                raise PymtraceError(f"{libc_path}: no such file")
            want_debug = self.follow or uses_debug_lib(
                pid=None if self.launched is not None else self.target, launched=self.launched
            )
            self.libs = probe_libraries(libc_path, want_debug)
            defines["OUTER_PROBES"] = int(any(outer for _, outer in self.libs))  # only the programs it attaches
            if self.options.format == "mtrace-text":
                defines["NOTE_BASES"] = 1
                for index, (path, _) in enumerate(self.libs):
                    defines[f"MALLOC_SITE_{index}"] = f"{probesite.entry_site(path, 'malloc'):#x}ULL"
            skips = probesite.tcache_shutdown_returns(libc_path)
            if len(skips) == 2:
                site = probesite.entry_site(libc_path, "free")
                defines["FREE_SKIP1"] = f"{skips[0] - site:#x}ULL"
                defines["FREE_SKIP2"] = f"{skips[1] - site:#x}ULL"
        # C++'s operator new/delete where the process's calls resolve (-p: known now; a
        # launched command: per program, probe_program)
        cxx = libc.cxx_runtime(self.target) if self.launched is None else None
        self._foreign, self._cxx = found, cxx
        if cxx is not None:
            self._cxx_plan = self.cxx_plan(self.target, cxx, found)
        if self.launched is None:  # a launched command may exec onto any allocator: all enter_f_*
            defines.update(foreign_defines(found, self._cxx_plan))
        self.bpf = bpfload.load("record", defines=defines, what="pymtrace record")
        if on_stack_event is not None:
            self.bpf["stacks"].open_ring_buffer(on_stack_event)
            if py_frames:  # the program that reads the frames, tail-called by `leave`
                program = uprobes.load_tail_program(self.bpf, "py_output")
                self.bpf["progs"][ctypes.c_int(0)] = ctypes.c_int(program.fd)
        if self.follow:
            self.bpf["traced"][ctypes.c_uint32(self.target)] = ctypes.c_uint32(1)

    def cxx_plan(self, pid: int, path: str, found: libc.Allocator | None) -> cxxplan.CxxPlan:
        """How to probe the operator new/delete of the C++ runtime PATH of process PID, whose
        malloc is FOUND's (None or glibc: the libc's probes): cxxplan's, carried news while
        slots are left."""
        foreign = found if found is not None and found.family not in (None, "glibc") else None
        recorded = recorded_names([] if self._foreign is not None else self.libs, foreign)
        plan = cxxplan.for_process(pid, path, recorded, carry=self.carry)
        if self.cxx_slots + len(plan.carried) > CXX_SLOTS:
            plan = cxxplan.for_process(pid, path, recorded, carry=False)
        return plan

    def _attach_cxx(self, path: str, plan: cxxplan.CxxPlan, pid: int) -> Sites:
        first, self.cxx_slots = self.cxx_slots, self.cxx_slots + len(plan.carried)
        return attach_cxx(self.bpf, path, plan, pid, first)

    def attach(self) -> None:
        """Put the probes load() compiled for on: glibc's (or -p's other allocator's), then
        C++'s operator new where -p's calls resolve it. ProcessGone if the process ended."""
        found, cxx = self._foreign, self._cxx
        probed = found.path if found is not None else self.libc_path
        pid = -1 if self.follow else self.target
        try:
            if found is not None:
                self.sites = attach_foreign(self.bpf, found.path, found.family, pid)
            else:
                self.sites = attach(self.bpf, self.libs, pid, note_bases=self.options.format == "mtrace-text")
        except Exception as exc:  # BCC's attach_uprobe raises plain Exception; reported below
            if isinstance(exc, PymtraceError):
                raise
            if not proc.exists(self.target):
                raise ProcessGone(self.target) from None
            raise PymtraceError(f"cannot attach uprobes to {probed}: {exc}") from None
        if found is not None:
            self.probed_files.add((found.path, found.family))
        if cxx is not None:
            try:
                self.sites += self._attach_cxx(cxx, self._cxx_plan, pid)
            except PymtraceError:
                raise
            except Exception as exc:  # BCC's attach_uprobe raises plain Exception
                if not proc.exists(self.target):
                    raise ProcessGone(self.target) from None
                raise PymtraceError(f"cannot attach uprobes to {cxx}: {exc}") from None

    def enable(self) -> None:
        """From now on the probes record."""
        self.bpf["enabled"][ctypes.c_int(0)] = ctypes.c_uint32(1)

    def disable(self) -> None:
        """From now on the probes record nothing."""
        self.bpf["enabled"][ctypes.c_int(0)] = ctypes.c_uint32(0)

    def probe_program(self, pid: int, at_start: bool = False) -> libc.Allocator | None:
        """-- CMD, stopped with its program's objects mapped (at start and after each exec,
        tracee.launch): probe where its malloc-API and operator new calls resolve (the same
        resolution as -p: libc.allocator, libc.cxx_runtime) unless probed already. Returns
        the allocator its malloc-API calls resolve to, if it is one pymtrace records (glibc's
        family is "glibc"). A file that cannot be probed: PymtraceError at the start (AT_START);
        after an exec the recording is disabled (the trace ends at the exec) and
        RecordingStopped raised. A malloc pymtrace does not trace at all (a static binary) is
        warned of once."""
        try:
            found = None if self.options.libc else libc.allocator(pid)
            cxx = libc.cxx_runtime(pid)
        except PymtraceError:  # gone meanwhile: its end is seen by the drain loop
            return None
        wanted = []
        if found is not None and found.family not in (None, "glibc"):
            wanted.append((found.path, found.family))
        if cxx is not None:
            wanted.append((cxx, allocators.CXX_FAMILY))
        where = -1 if self.follow else self.target
        for path, family in wanted:
            if (path, family) in self.probed_files:
                continue
            self.probed_files.add((path, family))
            try:
                if family == allocators.CXX_FAMILY:
                    self.sites += self._attach_cxx(path, self.cxx_plan(pid, path, found), where)
                else:
                    self.sites += attach_foreign(self.bpf, path, family, where)
            except Exception as exc:  # BCC's attach_uprobe raises plain Exception
                error = exc if isinstance(exc, PymtraceError) else f"cannot attach uprobes to {path}: {exc}"
                if at_start:
                    raise PymtraceError(str(error)) from None
                if not proc.exists(pid):
                    return None  # killed at its exec: its end is seen by the drain loop
                # its calls through PATH would go unrecorded: the recording ends exact, at the exec
                self.disable()
                raise RecordingStopped(str(error)) from None
        if found is None:
            return None
        foreign = found.family not in (None, "glibc")
        self.bpf["foreign"][ctypes.c_int(0)] = ctypes.c_uint32(int(foreign))
        if found.family is None:
            if found not in self.allocator_warned:
                self.allocator_warned.append(found)
                print(f"pymtrace: warning: {libc.untraced_message(pid, found)}", file=sys.stderr)
            return None
        return found

    def note_bases(self, out: Output) -> None:
        """Library load addresses seen by BPF, for a process that exited before /proc was read."""
        try:
            items = list(self.bpf["bases"].items())
        except KeyError:  # the map exists only with NOTE_BASES (mtrace-text)
            return
        for key, base in items:
            tgid, index = key.value >> 32, key.value & 0xFFFFFFFF
            if tgid != out.tgid or index >= len(self.libs):
                continue
            path = self.libs[index][0]
            end = base.value + elf.image_size(path)
            out.resolver.add_maps([libc.Mapping(base.value, end, "r-xp", 0, 0, path)], prefer=False)

    def release(self) -> None:
        """The end: a launched command that never ran traced is killed, one still running
        goes on untraced; the probes come off."""
        if self.launched is not None and not self.launched.resumed:
            self.launched.kill()  # failed before it could run traced: do not let it run
        elif self.launched is not None:
            self.launched.release()  # still running (Ctrl-C, --duration): on, untraced
        uprobes.detach(self.bpf)
