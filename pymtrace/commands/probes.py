"""`pymtrace probes`: stream glibc's malloc USDT probe events, one line each."""

from __future__ import annotations

import argparse
import sys
import time

from pymtrace import stopping
from pymtrace.bpf import load as bpfload
from pymtrace.errors import PymtraceError
from pymtrace.sinks.probe_lines import TEXT_HEADER, hit_line, probe_listing
from pymtrace.sinks.text import printable
from pymtrace.sources import glibc, usdt
from pymtrace.tracee import launch, libc, proc

HELP = """Stream every hit of glibc's malloc USDT probes (provider libc, memory_*), one line
each: time, PID, TID, command, probe name and its decoded arguments, e.g.

    13:02:11.402113  4242  4242 myprog   memory_sbrk_more brk=0x55d0c000 size=135168

Probes are found in the .note.stapsdt of the libc each process really maps; every
argument is decoded from its note with its real width, including the mallopt/tunable
probes that read libc globals (mp_, perturb_byte, global_max_fast). A mallopt_* or
tunable_* event says whether the change came from mallopt() or a GLIBC_TUNABLES tunable
(cause=...). Without -p or a command, every process using a libc with probes is traced."""

EPILOG = """examples:
  pymtrace probes                                  # every process, every probe
  pymtrace probes -p 1234 -P 'arena_*'             # one process, arena probes only
  pymtrace probes -P sbrk_more -P sbrk_less -- ./myprog args
  pymtrace probes --json -- ld-linux-x86-64.so.2 --library-path /opt/glibc-sdt ./prog
  pymtrace probes --list                           # which probes each libc carries

Lost events (ring buffer full) are counted in the BPF program and reported on stderr;
nothing is dropped silently.

OVERHEAD: glibc's malloc probes sit on slow paths only (heap growth, arena creation and
contention, mallopt, retries, threshold changes), never on each malloc/free call, so
tracing them costs next to nothing: one uprobe hit (~1 us, the probe site is a 1-byte
nop the kernel emulates) per slow-path event. Safe to leave running system-wide.

EXIT STATUS: with a command, the command's own (128 + N if a signal N killed it);
otherwise 0; 1 on a pymtrace error."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-p", "--pid", type=int, action="append", default=[], help="trace only this process (repeatable)"
    )
    parser.add_argument(
        "-P",
        "--probe",
        action="append",
        default=[],
        metavar="GLOB",
        help="show only probes matching this glob, with or without the memory_ "
        "prefix (repeatable), e.g. 'sbrk_*' or memory_heap_new",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per event")
    parser.add_argument(
        "--libc",
        action="append",
        default=[],
        metavar="PATH",
        help="also attach to this libc (system-wide mode), e.g. one no running process maps yet",
    )
    parser.add_argument(
        "-d", "--duration", type=float, default=None, metavar="SECONDS", help="stop after this many seconds"
    )
    parser.add_argument(
        "--list", action="store_true", help="list the malloc probes (sites and argument specs) of each libc and exit"
    )
    parser.add_argument("cmd", nargs="*", metavar="CMD", help="after --: launch CMD (with its arguments) and trace it")


def _list(args: argparse.Namespace) -> int:
    paths = list(args.libc)
    for pid in args.pid:
        paths.append(libc.process_libc(pid))
    if not paths:
        paths = usdt.all_libcs()
    for line in probe_listing(paths):
        print(line)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _list(args)
    if args.cmd and args.pid:
        raise PymtraceError("give either -p PID or a command after --, not both")
    bpfload.require_root("pymtrace probes")
    out = sys.stdout
    patterns = args.probe
    launched = None
    count = [0]

    def on_event(ev: glibc.ProbeHit) -> None:
        if not usdt.match_probe(ev.probe, patterns):
            return
        count[0] += 1
        out.write(hit_line(ev, source.wall_offset, args.json))

    if args.cmd:
        launched = launch.Launched(args.cmd)
        path = usdt.launched_probe_file(launched)
        source = glibc.GlibcSource(pids=[launched.pid], libcs={launched.pid: path}, on_event=on_event)
    elif args.pid:
        source = glibc.GlibcSource(pids=args.pid, on_event=on_event)
    else:
        source = glibc.GlibcSource(pids=None, libcs=args.libc, on_event=on_event)
    try:
        try:
            source.attach()
        except BaseException:
            if launched is not None:
                launched.kill()
            raise
        if not source.sites:
            if launched is not None:
                launched.kill()
            reasons = (
                "; ".join(usdt.libc_status(i["libc"])["reason"] for i in source.libc_info) or "no process maps a libc"
            )
            raise PymtraceError(f"no malloc USDT probes to trace: {reasons}")
        for w in source.warnings:
            print(f"pymtrace: warning: {printable(w)}", file=sys.stderr)  # they name libc paths
        if launched is not None:
            launched.resume()
        deadline = None if args.duration is None else time.monotonic() + args.duration
        reported_lost = 0
        try:
            print(
                f"pymtrace: tracing {len(source.sites)} malloc probe sites in "
                f"{sum(1 for i in source.libc_info if i['attached'])} libc(s)"
                + (f" for PID {', '.join(map(str, args.pid))}" if args.pid else "")
                + "; Ctrl-C to stop",
                file=sys.stderr,
                flush=True,
            )
            if not args.json:
                out.write(TEXT_HEADER)
                out.flush()
            while True:
                source.poll()
                out.flush()
                lost = source.lost()
                if lost > reported_lost:
                    print(f"pymtrace: {lost - reported_lost} events lost (ring buffer full)", file=sys.stderr)
                    reported_lost = lost
                if launched is not None and launched.proc.poll() is not None:
                    break
                if args.pid and not any(proc.alive(p) for p in args.pid):
                    break  # every traced process has exited
                if deadline is not None and time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except KeyboardInterrupt:
            pass
        source.poll()
        out.flush()
        lost = source.lost()
        if lost > reported_lost:
            print(f"pymtrace: {lost - reported_lost} events lost (ring buffer full)", file=sys.stderr)
        print(f"pymtrace probes: {count[0]} events shown, {lost} lost", file=sys.stderr)
    finally:
        source.close()
        if launched is not None and launched.proc.poll() is None:
            if stopping.stopping():  # SIGINT/SIGTERM: the command ends too, as with Ctrl-C
                launched.stop()
            else:  # --duration: the command runs on, untraced, to its end (or Ctrl-C)
                try:
                    launched.wait()
                except KeyboardInterrupt:
                    launched.kill()
    if launched is not None:
        return proc.exit_status(launched.proc.returncode)
    return 0
