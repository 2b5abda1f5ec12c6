"""Loading BCC programs from bpf/ with clear, one-line failures.

Every BPF program is one C file in bpf/ plus one header for the structs it shares with
user space (see pymtrace.bpf.structs). BCC compiles them at run time with clang and the
kernel headers under /lib/modules/$(uname -r)/build.

A compile costs ~0.3 s even for an empty program (BCC's fixed work: its default kernel
headers, parsed twice, and a read of /proc/kallsyms), so a command compiles everything it
loads in ONE BCC module: load_parts() concatenates the programs' sources (each stays its
own bpf/*.bpf.c, compilable alone with load()); their maps, functions and -D switches carry
per-program prefixes so that they can share a module. PYMTRACE_DEBUG_BPF=1 prints one
line per compile on stderr: sources, wall and CPU seconds, the programs (functions) compiled.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time
import types
import typing

from pymtrace.errors import NotRootError, PymtraceError

TRACEFS = "/sys/kernel/tracing"


def bpf_dir() -> pathlib.Path:
    """The directory holding the BPF C sources (source tree or installed package)."""
    src = pathlib.Path(__file__).resolve().parents[2] / "bpf"
    if (src / "common.h").exists():
        return src
    # installed: the package data pymtrace.bpf.programs sits beside this module (a namespace
    # package, whose importlib.resources.files() is a MultiplexedPath, not a path string)
    return pathlib.Path(__file__).resolve().parent / "programs"


def import_bcc() -> types.ModuleType:
    """Import the distro's BCC module, or fail with what to install."""
    try:
        import bcc  # noqa: F401
    except ImportError as exc:
        raise PymtraceError(
            "BCC's Python module is missing: install python3-bpfcc (Debian/Ubuntu) or "
            "python3-bcc (Fedora) and use a Python that sees it (./install.sh does both); "
            f"({exc})"
        ) from None
    if not hasattr(bcc, "BPF"):
        raise PymtraceError(
            f"the `bcc` module at {getattr(bcc, '__file__', '?')} is the unrelated PyPI "
            "package; uninstall it (pip uninstall bcc) and use the distro's python3-bpfcc"
        )
    return bcc


def require_root(what: str = "this command") -> None:
    if os.geteuid() != 0:
        raise NotRootError(what)


def ensure_tracefs() -> None:
    """BCC creates and removes uprobe events through tracefs; mount it if it is not."""
    if os.path.exists(os.path.join(TRACEFS, "uprobe_events")):
        return
    rc = os.system(f"mount -t tracefs nodev {TRACEFS} >/dev/null 2>&1")
    if rc != 0 or not os.path.exists(os.path.join(TRACEFS, "uprobe_events")):
        raise PymtraceError(
            f"tracefs is not mounted at {TRACEFS} and mounting it failed; run: mount -t tracefs nodev {TRACEFS}"
        )


class Part(typing.NamedTuple):
    """One program of a BCC module: bpf/PROGRAM.bpf.c, its -D switches, generated C before it."""

    program: str
    defines: dict = {}
    prelude: str = ""


# C placed once before every module's programs. BCC's rewriter, at each call it sees to a
# function named bpf_probe_read_user(_str), asks its kernel-symbol cache whether the kernel
# has that helper, and that cache rebuilds a hash table of all of /proc/kallsyms (~120k
# names, some repeated, so it never counts as built) on every question: 0.05-0.1 CPU-s per
# call site in the source (2 in malloc_stats, one per memory operand in generated USDT
# readers). The same helpers under other names skip the question; every kernel pymtrace
# supports (5.8+) has them (5.5+). Declared as BCC's helpers.h declares them (int): the
# programs' bytecode is the same instruction for instruction.
MODULE_PRELUDE = """
static int (*pm_probe_read_user)(void *dst, __u32 size, const void *unsafe_ptr) = (void *)BPF_FUNC_probe_read_user;
static int (*pm_probe_read_user_str)(void *dst, __u32 size, const void *unsafe_ptr) =
    (void *)BPF_FUNC_probe_read_user_str;
"""

compiles = []  # (programs, seconds) of each BCC compile made by this process
DEBUG_ENV = "PYMTRACE_DEBUG_BPF"


def load(program: str, defines: dict | None = None, prelude: str = "", what: str | None = None) -> typing.Any:
    """Compile bpf/PROGRAM.bpf.c with BCC and return the bcc.BPF object.

    defines: {NAME: value} passed as -DNAME=value (sizes, feature switches).
    prelude: extra C text placed before the file (generated code, e.g. USDT argument readers).
    """
    return load_parts([Part(program, defines or {}, prelude)], what=what)


def load_parts(parts: typing.Sequence[Part], what: str | None = None) -> typing.Any:
    """Compile several programs (Parts) as ONE BCC module and return the bcc.BPF object.

    Their maps and functions must have distinct names (each program prefixes its own) and
    their -D switches must agree; one compile costs about as much as the largest program
    alone, instead of the sum."""
    names = "+".join(p.program for p in parts)
    require_root(what or f"loading the {names} BPF program")
    bcc = import_bcc()
    ensure_tracefs()
    directory = bpf_dir()
    # -g0: no debug info, so no BTF of the programs (nothing here needs it: no spin locks,
    # kfuncs or BTF-typed maps); measured 0.05-0.12 s less compile CPU for top's module.
    cflags = [f"-I{directory}", "-Wno-macro-redefined", "-Wno-unused-function", "-g0"]
    defines, texts = {}, [MODULE_PRELUDE]
    for part in parts:
        for name, value in part.defines.items():
            if name in defines and str(defines[name]) != str(value):
                raise PymtraceError(f"BPF programs {names} need different values of {name}")
            defines[name] = value
        # #line: compile errors name the program's own file and line
        texts.append(
            f'{part.prelude}\n#line 1 "{part.program}.bpf.c"\n{(directory / f"{part.program}.bpf.c").read_text()}\n'
        )
    cflags += [f"-D{name}={value}" for name, value in defines.items()]
    start, cpu = time.monotonic(), time.thread_time()  # BCC compiles in the calling thread
    try:
        bpf = bcc.BPF(text="".join(texts).encode(), cflags=cflags)
    except Exception as exc:  # BCC raises plain Exception on compile/load failures
        build = f"/lib/modules/{os.uname().release}/build"
        hint = (
            f"kernel headers not found at {build} (run ./install.sh or pymtrace doctor)"
            if not os.path.exists(build)
            else "run `pymtrace doctor` to see which requirement is missing"
        )
        raise PymtraceError(f"cannot compile/load BPF program {names}: {exc}; {hint}") from None
    seconds, cpu = time.monotonic() - start, time.thread_time() - cpu
    compiles.append((names, seconds))
    if os.environ.get(DEBUG_ENV):
        functions = program_names(bpf)
        print(
            f"pymtrace: debug: compiled BPF {names} in {seconds:.2f} s (CPU {cpu:.2f} s), "
            f"{len(functions)} programs: {' '.join(functions)}",
            file=sys.stderr,
            flush=True,
        )
    return bpf


def program_names(bpf: typing.Any) -> list[str]:
    """The names of the BPF programs (functions) a compiled BCC module holds."""
    from bcc import lib

    return [lib.bpf_function_name(bpf.module, i).decode() for i in range(lib.bpf_num_functions(bpf.module))]


def detach_all(bpf: typing.Any) -> None:
    """Detach every probe and free the maps; safe to call twice."""
    if bpf is None:
        return
    try:
        bpf.cleanup()
    except Exception:  # cleanup after a partially failed attach must not mask the real error
        pass


def own_perf_event_fds() -> list[int]:
    """This process's open perf-event descriptors. BCC attaches uprobes through
    perf_event_open (the uprobe PMU), which tracefs's uprobe_events never lists: a probe
    still attached is a perf-event descriptor still open."""
    from pymtrace.bpf.stats import own_anon_fds

    return [fd for fd, target in own_anon_fds().items() if target == "anon_inode:[perf_event]"]


def own_uprobe_events(pid: int | None = None) -> list[str]:
    """uprobe_events lines that belong to this process's BCC (BCC names them ..._bcc_PID)."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(os.path.join(TRACEFS, "uprobe_events")) as f:
            return [line for line in f if f"_bcc_{pid}" in line]
    except OSError:
        return []
