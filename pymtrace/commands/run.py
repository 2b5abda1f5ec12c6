"""`pymtrace run -- CMD`: run a command and report glibc allocator internals at its exit.

The command is traced through glibc's malloc USDT probes plus its user page faults,
mmap/munmap and brk (pymtrace.sources.glibc_report.Tracer); the report is rendered by
pymtrace.sinks.run_report (same report as `pymtrace summary`).
"""

import argparse
import time

from pymtrace.bpf import load as bpfload
from pymtrace.commands import add_report_arguments
from pymtrace.sinks.run_report import ReportOptions, emit
from pymtrace.sources import usdt
from pymtrace.sources.glibc_report import Tracer
from pymtrace.tracee import launch
from pymtrace.tracee.proc import exit_status

HELP = """Run a command and report glibc's allocator internals when it exits: arena lock
waits per thread, arenas and the threads that used them, heaps and their sizes, total
sbrk growth and trims, every mmap/trim threshold change with its cause (mallopt,
GLIBC_TUNABLES tunable, or the dynamic threshold raised by freeing an mmapped chunk),
retries after allocation failures, tcache double-free scans, and where the process
page-faulted ([heap], arena heaps, mmapped chunks, files, stacks).

The data comes from glibc's malloc USDT probes in the libc the command really loads; if
that libc has none (Debian, Alpine), the report says so and still shows the faults."""

EPILOG = """examples:
  pymtrace run -- ./myprog args
  pymtrace run --json -o report.json -- ./myprog   # -o: the program's own stdout stays apart
  GLIBC_TUNABLES=glibc.malloc.arena_max=2 pymtrace run -- ./threaded
  pymtrace run -- ld-linux-x86-64.so.2 --library-path /opt/glibc-sdt ./myprog   # libc with probes

OVERHEAD: the malloc probes fire on slow paths only (no per-call cost). Page faults are
traced too: each user page fault of the process is one ring-buffer event, which pymtrace
decodes in Python (~3.5 us of its CPU per fault). Measured on a busy 2-core machine, a
loop touching 512 MiB of fresh pages took 3-7 us per fault traced instead of ~1.7 us.
Use --no-faults for fault-heavy programs where that matters.

EXIT STATUS: the command's own (128 + N if a signal N killed it); 1 on a pymtrace error."""


def configure(parser: argparse.ArgumentParser) -> None:
    add_report_arguments(parser)
    parser.add_argument(
        "cmd", nargs="+", metavar="CMD", help="the command (and its arguments) to run and trace, after --"
    )


def run(args: argparse.Namespace) -> int:
    bpfload.require_root("pymtrace run")
    launched = launch.Launched(args.cmd)
    tracer = None
    try:
        path = usdt.launched_probe_file(launched)
        tracer = Tracer(launched.pid, path, faults=not args.no_faults)
        tracer.attach()
    except BaseException:
        launched.kill()
        if tracer is not None:
            tracer.source.close()
        raise
    tracer.sample()  # the executable, the loader and the stack, mapped by exec
    launched.resume()
    interrupted = False
    try:
        while launched.proc.poll() is None:
            tracer.step()
            time.sleep(0.05)
    except KeyboardInterrupt:
        interrupted = True
        launched.stop()  # 5 s to end by itself (Ctrl-C reached it too), then SIGTERM, SIGKILL
    code = launched.proc.wait()
    doc = tracer.finish(command=args.cmd, exit_code=code)
    doc["interrupted"] = interrupted
    emit(doc, ReportOptions(json=args.json, output=args.output))
    return exit_status(code)
