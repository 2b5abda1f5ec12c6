"""Command-line entry point: `pymtrace COMMAND ...`.

Each command lives in its own module exposing `configure(parser)` (adds its arguments;
the parser's description and epilog are set from the module's HELP/EPILOG) and
`run(args) -> int`. Modules are imported only when their command runs, so `--help`
and light commands stay fast and do not import BCC.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from typing import Sequence

from pymtrace import __version__, stopping
from pymtrace.errors import PymtraceError

# name -> (module, one-line summary)
COMMANDS = {
    "doctor": ("pymtrace.commands.doctor", "check that this machine can run pymtrace, with a fix for each problem"),
    "top": ("pymtrace.commands.top", "live full-screen view of malloc, slab, page-fault and glibc arena activity"),
    "record": ("pymtrace.commands.record", "record every malloc-API call of a process into an mtrace-format file"),
    "heap": ("pymtrace.commands.heap", "sample allocation call stacks into a heap profile (pprof, flame graph, leaks)"),
    "collect": ("pymtrace.commands.collect", "receive `record --to` streams into a partitioned Parquet dataset"),
    "dump": ("pymtrace.commands.dump", "decode a recorded trace (like upstream trace_dump) with per-type statistics"),
    "convert": ("pymtrace.commands.convert", "convert a trace between mtrace-bin, mtrace-text and parquet"),
    "repair": ("pymtrace.commands.repair", "make a Parquet recording readable again after its recorder was killed"),
    "analyze": ("pymtrace.commands.analyze", "analyze recorded traces with SQL (DuckDB): report, JSON, HTML plots"),
    "workload": ("pymtrace.commands.workload", "convert a trace into a .wl replay workload"),
    "replay": ("pymtrace.commands.replay", "replay a workload against allocators and tunables and compare them"),
    "exporter": ("pymtrace.commands.exporter", "serve the live metrics to Prometheus"),
    "probes": ("pymtrace.commands.probes", "stream glibc's malloc USDT probe events, one line each"),
    "run": ("pymtrace.commands.run", "run a command and report glibc allocator internals at its exit"),
    "summary": ("pymtrace.commands.summary", "attach to a process and report glibc allocator internals on Ctrl-C"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pymtrace",
        description="Memory-allocation observability for Linux with eBPF (BCC).",
        epilog="Run `pymtrace COMMAND --help` for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"pymtrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except MemoryError:  # Python's own allocations, a command's imports too (pyarrow's are checked first)
        print("pymtrace: error: out of memory", file=sys.stderr)
        return 1
    finally:
        if argv is None:
            # pymtrace is exiting: BCC's exit handlers (detach, free maps) and Python's run
            # next, and a SIGINT/SIGTERM now would break them (a traceback) or kill the
            # process half way; an ignored signal stays ignored through Python's finalization
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # SIGINT stops every command like Ctrl-C, even when a non-interactive shell started
    # pymtrace in the background (`pymtrace record ... & kill -INT $!`): such a shell starts
    # the job with SIGINT ignored, and Python keeps an ignored SIGINT ignored. A command
    # launched by pymtrace gets back the disposition pymtrace inherited (pymtrace.tracee.launch, pymtrace.stopping).
    # SIGTERM does the same, so every command's cleanup path (flush, detach) runs for both.
    stopping.install()
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])  # prints help or the "invalid choice" error
        return 2
    name = argv[0]
    module_name, summary = COMMANDS[name]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(
        prog=f"pymtrace {name}",
        description=getattr(module, "HELP", summary),
        epilog=getattr(module, "EPILOG", None),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.configure(sub)
    args = sub.parse_args(argv[1:])
    args.command = name
    try:
        return module.run(args) or 0
    except PymtraceError as exc:
        from pymtrace.sinks.text import printable  # errors name processes' files and comms

        print(f"pymtrace: error: {printable(exc, keep=chr(10))}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        # Commands that trace clean up in their own finally blocks; one that was simply
        # interrupted (a long dump, a conversion) ends quietly, as shells expect.
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
