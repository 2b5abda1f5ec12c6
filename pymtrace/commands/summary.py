"""`pymtrace summary -p PID`: attach to a process and report glibc allocator internals on Ctrl-C.

The process is traced through glibc's malloc USDT probes plus its user page faults,
mmap/munmap and brk (pymtrace.sources.glibc_report.Tracer); the report is rendered by
pymtrace.sinks.run_report (same report as `pymtrace run`).
"""

import argparse
import sys
import time

from pymtrace.bpf import load as bpfload
from pymtrace.commands import add_report_arguments
from pymtrace.sinks.run_report import ReportOptions, emit
from pymtrace.sources import usdt
from pymtrace.sources.glibc_report import Tracer
from pymtrace.tracee.proc import alive

HELP = """Attach to a running process and, on Ctrl-C (or when it exits), report glibc's
allocator internals seen meanwhile: arena lock waits per thread, arenas and their
threads, heaps, sbrk growth and trims, threshold changes with their cause, retries,
tcache double-free scans and page faults per region. Same report as `pymtrace run`."""

EPILOG = """examples:
  pymtrace summary -p 1234            # Ctrl-C to stop and print the report
  pymtrace summary -p 1234 -d 30 --json

OVERHEAD: as for `pymtrace run`: malloc probes on slow paths only; page faults of the
process cost one event each (--no-faults to turn them off)."""


def configure(parser: argparse.ArgumentParser) -> None:
    add_report_arguments(parser)
    parser.add_argument("-p", "--pid", type=int, required=True, help="the process to trace")
    parser.add_argument(
        "-d",
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds (default: Ctrl-C or process exit)",
    )


def run(args: argparse.Namespace) -> int:
    bpfload.require_root("pymtrace summary")
    pid = args.pid
    path = usdt.probe_file(pid)
    tracer = Tracer(pid, path, faults=not args.no_faults)
    tracer.sample()
    try:
        tracer.attach()
    except BaseException:
        tracer.source.close()
        raise
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        # inside the try: a Ctrl-C right after this line still produces the report
        print(f"pymtrace: tracing PID {pid}; Ctrl-C to stop and report", file=sys.stderr, flush=True)
        while alive(pid):
            tracer.step()
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    doc = tracer.finish()
    emit(doc, ReportOptions(json=args.json, output=args.output))
    return 0
