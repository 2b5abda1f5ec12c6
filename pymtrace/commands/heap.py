"""`pymtrace heap`: sampled allocation call stacks of processes, written as one heap profile.

Arguments, help and orchestration; the sampling is pymtrace.sources.heapsession (BPF:
sources.heap, unwinding: tracee.unwind, model: sources.heapprofile), the formats are
pymtrace.sinks.{pprof,folded,flamegraph,heap_text}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from pymtrace.bpf import load as bpfload
from pymtrace.commands import add_budget_arguments, budget_of
from pymtrace.errors import PymtraceError
from pymtrace.sinks.flamegraph import write_html
from pymtrace.sinks.folded import write_folded
from pymtrace.sinks.heap_text import write_text
from pymtrace.sinks.pprof import write_pprof
from pymtrace.sinks.text import printable
from pymtrace.sources import interposer
from pymtrace.sources.heap import (
    DEFAULT_SAMPLE_BYTES,
    DEFAULT_STACK_BYTES,
    INTERPOSER,
    MAX_LIVE,
    MAX_LIVE_EVERY_CALL,
    MAX_LIVE_LIMIT,
    UPROBES,
    check_settings,
    default_max_live,
    ring_pages,
)
from pymtrace.sources.heapprofile import DEFAULT_VALUE, VALUE_TYPES
from pymtrace.sources.heapsession import HeapSession
from pymtrace.trace.files import atomic_output, check_new
from pymtrace.tracee import libc, proc, pyframes
from pymtrace.tracee.launch import Launched
from pymtrace.units import parse_bytes

if TYPE_CHECKING:
    from pymtrace.sources.budget import Budget


HELP = """Sample the allocations of processes with their complete call stacks (no frame pointers
needed) and write one heap profile: bytes and blocks allocated per stack, and those still in
use at the end (leaks)."""

EPILOG = """examples:
  pymtrace heap -o app.pb.gz -- ./app args        # pprof, written when ./app exits
  go tool pprof -top -sample_index=inuse_space app.pb.gz
  pymtrace heap -p 1234 --duration 30 -o leak.html --older 10   # in use, older than 10 s
  pymtrace heap -p 1234 -o stacks.folded --value alloc_space && flamegraph.pl stacks.folded
  pymtrace heap --sample-bytes 1 -o exact.txt -- ./test      # every call (exact, costly)
  pymtrace heap -o je.pb.gz -- env LD_PRELOAD=libjemalloc.so.2 ./app   # jemalloc's calls
  pymtrace heap --via uprobes -o app.pb.gz -- ./app    # the uprobe path, as for -p
  pymtrace heap -p 4321 --duration 60 -o py.html       # a Python service, by Python line
  pymtrace heap -p 1234 --max-overhead 1 --duration 300 -o prod.pb.gz   # estimated, <= 1 % of its CPU

PATHS: -- CMD is sampled in-process by default: pymtrace preloads its own small library (the
interposer), which draws the samples inside the process and forwards every call to the
program's allocator; only a sampled allocation and the free of a sampled block trap into the
kernel (a USDT probe), where the stack is copied as on the other path. -p processes, commands
the interposer cannot be preloaded into (static, setuid, defining malloc, calling an
allocator's own API) and --via uprobes are sampled by uprobes on their allocator. The first
line and the report (`traced:`) say which path traced each process and, for the uprobes, why.

ALLOCATORS: glibc, jemalloc, tcmalloc, mimalloc or a malloc of the program's own, where its
calls resolve (the interposer forwards to it; the uprobes are put on it); a launched command
is stopped once its loader has mapped its libraries (and after each exec) so its allocator
is found before it runs. See docs/heap.md.

PYTHON: in a CPython 3.10-3.13 process each sample's Python frames are read too (the BPF
program walks the thread's frames, at most 128) and merged into its stack: the interpreter's
evaluation loop replaced by the Python functions it ran (name, file, line), C extensions'
frames kept, the interpreter's own call machinery left out. --native: native stacks only;
--python-only: Python frames only. An interpreter that cannot be read (another version, a
debug or free-threaded build) keeps native stacks, with one line saying why.
--python-allocators also samples PyObject_Malloc/PyMem_Malloc & co. (pymalloc's objects),
through uprobes: every such call traps. See docs/heap.md (Python programs).

FORMATS: pprof (gzip'd profile.proto: go tool pprof, Pyroscope, Parca), folded (flamegraph.pl,
speedscope, inferno), html (one self-contained flame graph), text (top stacks). Chosen by
--format, else by the file name: .pb.gz/.pprof/.pb -> pprof, .folded -> folded, .html ->
html, .txt -> text.

OVERHEAD: for a sampled call only, a copy of the thread's stack (up to --stack-bytes; a main
thread's only up to its stack top) into a ring buffer and its unwinding in pymtrace (~1 us
per frame the first time a stack is seen, then a cache lookup). In-process (-- CMD, the
default), an unsampled call costs a few ns and never traps: at the default --sample-bytes
(512 KiB: on average one sample per 512 KiB allocated) the program's own CPU time is within
0.92-1.13x of untraced on python3, sqlite3, a C++ map program and gcc -O2 -c (uprobes:
2.2-15x). Through uprobes every call traps (~1-3 us: what top costs). --sample-bytes 1
samples every call on either path (a trap per allocation and per free; pymtrace's CPU grows
with the call rate); in-process the program then waits whenever the ring is full, so nothing
is lost and the program runs at the pace pymtrace unwinds (sqlite3: 7.4 s against 2.2 s at
the default sampling). See docs/heap.md and docs/benchmarks.md.

OVERHEAD BUDGET (-p): by default every call of a -p process traps (exact). --max-overhead PCT
attaches the allocating functions' uprobes in windows (--window seconds, at random times)
and detaches them between, so that their measured cost (program runs and BPF run time from
the kernel's statistics, a trap cost calibrated at start, the attach/detach CPU) stays under
PCT % of the traced processes' CPU time. The profile then holds ESTIMATES: alloc_objects and
alloc_space scaled up from the windows' samples to the whole run (each window standing for
the time nearest it); in-use values need every free and are not offered (--value defaults
to alloc_space). The summary says how many windows, what share of the time they covered and
what they cost. See docs/heap.md "Overhead budget".

STOPPING: when the command exits, on Ctrl-C/SIGTERM or after --duration; with -p the
processes keep running. EXIT STATUS: 0 ok; 1 error; 3 samples were lost (the report says
which table was full), unless --allow-drops."""

SUFFIXES = ((".pb.gz", "pprof"), (".pprof", "pprof"), (".pb", "pprof"), (".folded", "folded"))
SUFFIXES += ((".html", "html"), (".htm", "html"), (".txt", "text"))
WRITERS = {"pprof": write_pprof, "folded": write_folded, "html": write_html, "text": write_text}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-p", "--pid", type=int, action="append", metavar="PID", help="a running process to sample (repeatable)"
    )
    parser.add_argument("-o", "--output", metavar="FILE", required=True, help="the profile to write")
    parser.add_argument("--force", action="store_true", help="replace FILE if it exists (never through a symlink)")
    parser.add_argument(
        "--format", choices=tuple(WRITERS), help="output format (default: from FILE's name, else pprof)"
    )
    parser.add_argument(
        "--value",
        choices=VALUE_TYPES,
        help=f"what folded, html and text show (default {DEFAULT_VALUE}, alloc_space with --max-overhead); "
        "pprof holds all four (the two alloc ones with --max-overhead)",
    )
    parser.add_argument(
        "--sample-bytes",
        default=str(DEFAULT_SAMPLE_BYTES),
        metavar="N",
        help=f"one sample per N bytes allocated on average (K/M suffixes; default {DEFAULT_SAMPLE_BYTES}); 1: every call",
    )
    parser.add_argument(
        "--stack-bytes",
        default=str(DEFAULT_STACK_BYTES),
        metavar="N",
        help=f"bytes of each sampled thread's stack copied for unwinding (default {DEFAULT_STACK_BYTES})",
    )
    parser.add_argument(
        "--ring-bytes",
        metavar="N",
        help="the ring buffer samples wait in, a power of two (K/M/G suffixes; default 16M, "
        "64M with --sample-bytes 1); when it is full an in-process command waits, the uprobe "
        "path drops samples",
    )
    parser.add_argument(
        "--max-live",
        type=int,
        metavar="N",
        help=f"sampled blocks remembered until freed (default {MAX_LIVE}, {MAX_LIVE_EVERY_CALL} with "
        "--sample-bytes 1); beyond it a block's free is not seen",
    )
    parser.add_argument(
        "--older", type=float, metavar="S", help="in use: only blocks allocated at least S seconds before the end"
    )
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    add_budget_arguments(
        parser,
        "-p: attach the uprobes in windows so that their measured cost stays under PCT %% of the traced "
        "processes' CPU time (alloc values estimated from the windows, no in-use values; default: every call traps)",
        "with --max-overhead: how long each window keeps the probes attached (longer than the traced "
        "service's request cycle)",
    )
    parser.add_argument("--top", type=int, default=10, metavar="N", help="stacks in the text format (default 10)")
    parser.add_argument("--follow-forks", action="store_true", help="also sample the processes' children")
    parser.add_argument(
        "--via",
        choices=(INTERPOSER, UPROBES),
        help="how -- CMD is sampled: in-process by pymtrace's LD_PRELOAD interposer (the default; "
        "uprobes where it cannot be preloaded, saying why) or by uprobes on its allocator (-p: always)",
    )
    view = parser.add_mutually_exclusive_group()
    view.add_argument(
        "--native",
        action="store_true",
        help="native stacks only, for Python processes too (default: their Python frames merged in)",
    )
    view.add_argument(
        "--python-only",
        action="store_true",
        help="Python frames only for Python processes (samples outside Python keep their native stack)",
    )
    parser.add_argument(
        "--python-allocators",
        action="store_true",
        help="in Python processes, sample the interpreter's allocators too (PyObject_Malloc, PyMem_Malloc, ...): "
        "the objects pymalloc serves from its arenas, not only its calls to malloc (through uprobes: every call traps)",
    )
    parser.add_argument("--allow-drops", action="store_true", help="exit 0 even if samples were lost")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...: launch CMD and sample it")


def python_view(args: argparse.Namespace) -> str:
    """How Python processes' stacks are shown: --native, --python-only, else merged."""
    return pyframes.NATIVE if args.native else pyframes.PYTHON_ONLY if args.python_only else pyframes.MERGED


def output_format(path: str, given: str | None) -> str:
    """--format, else the one FILE's name implies, else pprof."""
    if given:
        return given
    lower = path.lower()
    return next((fmt for suffix, fmt in SUFFIXES if lower.endswith(suffix)), "pprof")


def run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not args.pid and not cmd:
        raise PymtraceError("give -p PID (repeatable) or -- CMD ARGS...")
    if args.pid and cmd:
        raise PymtraceError("give either -p PID or -- CMD, not both")
    sample_bytes = parse_bytes(args.sample_bytes, "--sample-bytes")
    stack_bytes = parse_bytes(args.stack_bytes, "--stack-bytes")
    check_settings(sample_bytes, stack_bytes, "--sample-bytes", "--stack-bytes")  # before launching anything
    pages = (
        None if args.ring_bytes is None else ring_pages(parse_bytes(args.ring_bytes, "--ring-bytes"), "--ring-bytes")
    )
    if args.max_live is not None and not 1 <= args.max_live <= MAX_LIVE_LIMIT:
        raise PymtraceError(f"--max-live must be from 1 to {MAX_LIVE_LIMIT}, not {args.max_live}")
    if args.older is not None and args.older < 0:
        raise PymtraceError("--older: must be 0 or more seconds")
    if args.pid and args.via == INTERPOSER:
        raise PymtraceError("--via interposer samples a launched command (-- CMD); -p processes are sampled by uprobes")
    budget = _budget(args, cmd)
    fmt = output_format(args.output, args.format)
    check_new(args.output, args.force)  # before a long run, not after it
    bpfload.require_root("pymtrace heap")

    launched = lib = credits = None
    why = "--via uprobes" if args.via == UPROBES else None  # why a launched command is not preloaded
    if args.python_allocators and args.via == INTERPOSER:
        raise PymtraceError("--python-allocators samples through uprobes: not with --via interposer")
    if args.python_allocators and why is None:
        why = "--python-allocators: the interpreter's allocators are sampled by uprobes"
    if cmd:
        if why is None:
            why = interposer.not_preloadable(cmd)
            lib = interposer.library() if why is None else None
        env = None
        if lib is not None:
            max_live = args.max_live or default_max_live(sample_bytes)
            options = interposer.SampleOptions(sample_bytes, max_live, args.follow_forks)
            credits = interposer.Credits()  # its probes wait for room in the ring: none lost
            env = interposer.sampling_env(os.environ, lib, options, credits)
        try:
            launched = Launched(cmd, env=env)
        except BaseException:
            if credits is not None:
                credits.close()
            raise
        pids = [launched.pid]
        try:  # its objects mapped (LD_PRELOAD too), nothing run: its allocator resolved as for -p
            launched.run_until_loaded()
        except PymtraceError:
            launched.kill()
            raise
    else:
        pids = sorted({proc.tgid(pid) for pid in args.pid})
        if os.getpid() in pids:
            raise PymtraceError(f"process {os.getpid()} is this pymtrace: it cannot sample itself")
        for pid in pids:  # an allocator heap cannot probe (a static binary) would show nothing
            found = libc.allocator(pid)
            if found is not None and found.family is None:
                raise PymtraceError(libc.untraced_message(pid, found) + ": nothing to sample")
    meta = {"command": " ".join(cmd) if cmd else "", "pids": pids, "time_ns": time.time_ns()}
    meta["exe"] = proc.exe(pids[0]) or ""  # as its maps name it: pprof's first mapping
    session = None
    try:
        session = HeapSession(
            pids,
            sample_bytes=sample_bytes,
            stack_bytes=stack_bytes,
            follow_forks=args.follow_forks,
            meta=meta,
            ring_pages=pages,
            max_live=args.max_live,
            interposer=lib,
            python_view=python_view(args),
            python_allocators=args.python_allocators,
            credits=credits,
            budget=budget,
        )
        if launched is not None and why is not None:
            session.via[launched.pid] = (UPROBES, why)
        try:
            session.attach()
        except PymtraceError as exc:
            if launched is None or why is None or why.startswith("--"):
                raise
            raise PymtraceError(f"{exc} (and no interposer: {why})") from None
        if launched is not None:
            # its maps are read again at its exit; each exec's program gets its allocator probed
            launched.resume(hold_exit=True, on_exec=lambda pid: _probe_program(session, pid))
        if not args.quiet:
            what = f"`{meta['command']}`" if cmd else "PID " + ", ".join(map(str, pids))
            path, why_not = session.via[pids[0]]
            how = f"via {path}" + (f" ({why_not})" if why_not else "")
            line = f"sampling {what} {how}; Ctrl-C to stop and write {args.output}"
            print(f"pymtrace heap: {printable(line)}", file=sys.stderr)
        for line in session.python.problems():  # a CPython whose frames cannot be read: why
            print(f"pymtrace heap: {printable(line)}", file=sys.stderr)
        started = time.monotonic()
        try:
            _loop(session, pids, launched, args.duration)
        except KeyboardInterrupt:
            pass  # stop: the profile is written below
        end_ns = time.monotonic_ns()
        if credits is not None:
            credits.detach()  # sampling ends here: a probe waiting for room must not hold the command
        if launched is not None:
            launched.stop()
        profile = session.finish(args.older, end_ns)
        profile.meta["duration_ns"] = int((time.monotonic() - started) * 1e9)
        if credits is not None:
            profile.meta["ring_waits"], profile.meta["ring_wait_s"] = credits.waits()
    finally:
        if session is not None:
            session.close()
        if credits is not None:
            credits.close()
        if launched is not None:
            launched.kill()
    writer = WRITERS[fmt]
    value = args.value or profile.default_value  # alloc_space under a budget (no in-use values)
    with atomic_output(args.output, args.force, "wb") as out:
        if fmt == "pprof":
            writer(profile, session.symbolizer, out)
        elif fmt == "text":
            writer(profile, session.symbolizer, out, top=args.top, value=value)
        else:
            writer(profile, session.symbolizer, out, value=value)
    if not args.quiet:
        for line in profile.summary_lines():
            print(f"pymtrace heap: {printable(line)}", file=sys.stderr)
        print(f"pymtrace heap: wrote {args.output} ({fmt})", file=sys.stderr)
    if profile.dropped() and not args.allow_drops:
        print(f"pymtrace heap: {lost_line(profile.drops)}; exit status 3", file=sys.stderr)
        return 3
    return 0


def _budget(args: argparse.Namespace, cmd: list[str]) -> Budget | None:
    """--max-overhead's budget (checked), or None: every call sampled by a trap."""
    inuse = args.value is not None and args.value.startswith("inuse")
    live = "--older" if args.older is not None else "--max-live" if args.max_live is not None else None
    return budget_of(
        args,
        [
            (
                cmd,
                "--max-overhead limits the traps of -p's uprobes: a launched command is sampled in-process, "
                "where an unsampled call costs no trap (give -p PID)",
            ),
            (inuse, f"--value {args.value}: in-use values need every free, not measured under --max-overhead"),
            (live, f"{live} concerns blocks in use, not measured under --max-overhead"),
        ],
    )


# what each drop counter (bpf/heap.h HP_LOST_*) means, and the option that avoids it
_REMEDIES = {
    "ringbuf": "samples not written, the ring buffer full: a larger --ring-bytes keeps them",
    "live_full": "sampled blocks whose free went unseen, the live-block map full: a larger --max-live keeps them",
}


def lost_line(drops: dict[str, int]) -> str:
    """The last line of a run that lost samples (shown with -q too): what, how many, and the
    option that keeps them."""
    parts = [
        f"{name} {n}" + (f" ({_REMEDIES[name]})" if name in _REMEDIES else "") for name, n in sorted(drops.items()) if n
    ]
    return "lost: " + ", ".join(parts)


def _probe_program(session: HeapSession, pid: int) -> None:
    """After an exec of the launched command: its new program's allocator probed too; a
    warning when it cannot be (a static program): the profile then lacks its calls."""
    try:
        session.probe_program(pid)
    except PymtraceError as exc:
        print(f"pymtrace heap: warning: {printable(exc)}", file=sys.stderr)


def _loop(session: HeapSession, pids: list[int], launched: Launched | None, duration: float | None) -> None:
    """Poll until the launched command exits, every -p process is gone, or DURATION."""
    deadline = None if duration is None else time.monotonic() + duration
    while True:
        session.poll()
        if launched is not None:
            if launched.service(session.at_exit) is not None:
                return
        elif not any(proc.alive(pid) for pid in pids):
            return
        if deadline is not None and time.monotonic() >= deadline:
            return
