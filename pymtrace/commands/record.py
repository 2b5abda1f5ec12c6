"""`pymtrace record`: every malloc-API call of a process into an mtrace-format file.

The arguments and help, turned into the recorder's typed options (RecordOptions); the
recording itself is pymtrace.recorder.
"""

import argparse
import mmap
import sys

from pymtrace.errors import PymtraceError
from pymtrace.net import protocol
from pymtrace.recorder.options import NetworkTarget, RecordOptions
from pymtrace.recorder.recorder import record
from pymtrace.units import parse_bytes

HELP = (
    "Record every malloc-API call of a process (malloc, calloc, realloc, free, memalign, "
    "aligned_alloc, posix_memalign, valloc, pvalloc) into an mtrace-format or Parquet file."
)
EPILOG = """\
examples:
  pymtrace record -p 1234                    # all threads of 1234 until Ctrl-C or its exit
  pymtrace record -p 1234 --duration 10 -o app.trace
  pymtrace record -- ./myprog arg1 arg2      # in-process, from its libraries' initializers on
  pymtrace record -- env LD_PRELOAD=libjemalloc.so.2 ./myprog   # jemalloc's calls, exact
  pymtrace record --format mtrace-text -o log -- ./myprog && mtrace ./myprog log
  pymtrace record -o app.parquet -- ./myprog  # columnar, ~1-6 bytes a call (-o *.parquet: --format parquet)
  pymtrace record --follow-forks -o t -- make -j2   # children go to t.PID
  pymtrace record --stacks -o t -- ./myprog   # + each allocation's call stack, in t.stacks
  pymtrace dump mtrace.out.1234
  pymtrace record -p 1234 --to 127.0.0.1:7300          # to `pymtrace collect` (docs/collect.md)
  pymtrace record -p 1234 --to collector:7300 --web-config client.yml   # TLS + credential

ALLOCATORS: glibc, jemalloc, tcmalloc, mimalloc, a malloc defined in the program, and C++'s
operator new/delete (-> malloc/memalign/free records), where the process's calls resolve.
A launched command is stopped once its loader has mapped its libraries and preloads (and
again after each exec) so its allocator is found before it runs (about 1 ms); pymtrace stays
its ptrace tracer meanwhile (signals pass through). See docs/record.md.

PATHS: -- CMD is recorded in-process: pymtrace preloads its own interposer library, which
writes each call into shared memory (no root needed; a full ring makes the caller wait,
never drops); with --stacks the interposer unwinds each allocation in the process too
(libunwind). -p, --via uprobes, --libc, --stacks on a CPython program (its Python frames are
read in BPF; --native keeps it in-process) and a command the interposer cannot be loaded
into (static, setuid, defines malloc itself: said on stderr with why) are recorded through
uprobes (root). A launched program that execs one running without the interposer
(env -u LD_PRELOAD, a setuid program) is recorded through uprobes from that exec on.

OVERHEAD in-process: 60-150 ns added a call on real programs (python3, sqlite3, a C++
map program: a tenth to a quarter of what heaptrack adds), a malloc storm ~60-120 ns a call
(it waits for pymtrace's drain, never loses a record); pymtrace ~20 ns of CPU a record plus
writing it (docs/benchmarks.md). --stacks in-process: ~0.3-0.4 us more per allocating call
(libunwind's per-thread cache; each distinct stack is stored once, located and named by
pymtrace once), a tenth of what --stacks costs through uprobes.
OVERHEAD through uprobes: each traced call costs the process roughly 1-2.5 us (a uprobe trap, a
uretprobe for allocations, a ring-buffer record): a pure malloc storm runs ~300x slower
while recorded (4.8 ns -> ~1.4-1.6 us a call, docs/record.md), ordinary programs far
less. pymtrace itself needs ~0.1 us of CPU per event (mostly writing 64 bytes per event
to the file) and 64 bytes of disk per event; --format parquet ~0.3-0.4 us and 1.4-4.5
bytes per event (row groups encoded and compressed as it records); --format mtrace-text ~1 us per record
(text written as it is recorded). --follow-forks puts the probes on every process
that uses the same libc (filtered in BPF, after the trap): while it runs, every
malloc-API call of every such process on the machine pays the trap, recorded or not
(an unrelated malloc/free loop: 5.7 ns -> 0.8-1 us a call). --stacks through uprobes adds
~1.5-2.2 us to each allocating call in the traced process (its stack copied, docs/record.md) and ~6-50 us of
pymtrace CPU per allocation to unwind it: an allocation storm outruns the unwinder, and the
allocations whose stacks found the stack ring full get stack id 0 (counted, exit 3).

STOPPING: Ctrl-C, SIGINT (also sent by a script to a background job) or SIGTERM drains
what was recorded, writes it and detaches; more signals while stopping are ignored. A
failed write (disk full) stops the recording; the file keeps every complete record
(parquet: every complete row group). A Parquet recording is a complete Parquet file after
each row group (262,144 rows or more, or 2-10 s after the oldest buffered row): killed with SIGKILL, it
keeps every row group written.

EXIT STATUS: 0 ok; 1 error (also a failed write); 3 events were lost (the ring buffer was
full) or, with --stacks, allocations were left without a stack, unless --allow-drops: make --buffer-size larger. See docs/record.md for details.
"""

_PAGE = mmap.PAGESIZE


class _OnePid(argparse.Action):
    """-p given once: argparse would keep the last of several silently (`record -p A -p B`
    recording B alone)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, option: str | None = None
    ) -> None:
        if getattr(namespace, self.dest) is not None:
            parser.error("-p/--pid is given once: a recording is of one process (run one record per process)")
        setattr(namespace, self.dest, values)


def configure(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "-p", "--pid", type=int, action=_OnePid, help="record the running process PID (all its threads; one -p)"
    )
    parser.add_argument(
        "-o", "--output", metavar="FILE", help="output file (default mtrace.out.PID, with .N appended if it exists)"
    )
    parser.add_argument("--force", action="store_true", help="replace FILE if it exists (never through a symlink)")
    parser.add_argument(
        "--format",
        choices=("mtrace-bin", "mtrace-text", "parquet"),
        default=None,
        help="mtrace-bin: glibc dj/malloc 64-byte records (default); "
        "mtrace-text: glibc's MALLOC_TRACE log, readable by the mtrace script; "
        "parquet: Apache Parquet, one row per call, compressed (default when FILE ends in .parquet)",
    )
    parser.add_argument(
        "--buffer-size",
        default="32M",
        metavar="BYTES",
        help="ring size (K/M/G suffixes; rounded up to a power of two; default 32M): the BPF ring buffer's, "
        "or in-process each process's ring",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        metavar="MS",
        help="drain the ring buffer every MS ms (default: when a large batch is expected, at most 100 ms "
        "apart, sooner for a small --buffer-size; --stacks: every 10 ms)",
    )
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    parser.add_argument("--allow-drops", action="store_true", help="exit 0 even if events were lost")
    parser.add_argument("--follow-forks", action="store_true", help="also record child processes, each into FILE.PID")
    parser.add_argument(
        "--stacks",
        action="store_true",
        help="also the call stack of every allocating call (complete without frame pointers): a stack id "
        "in each record and the stack table FILE.stacks beside the trace (mtrace-bin, parquet); in a CPython "
        "3.10-3.13 process the Python frames are merged in (each _PyEval_EvalFrameDefault frame replaced by "
        "the Python functions it ran)",
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="with --stacks: native stacks only, for Python processes too (their Python frames not read)",
    )
    parser.add_argument("--libc", metavar="PATH", help="the libc to probe (default: the one the process maps)")
    parser.add_argument(
        "--via",
        choices=("auto", "interposer", "uprobes"),
        default="auto",
        help="how -- CMD is recorded: interposer (pymtrace's library preloaded into it: ~20-100 ns a call), "
        "uprobes (a kernel trap per call: ~1-2.5 us); auto (default): the interposer where it can be "
        "preloaded, else uprobes, and says why. -p is always recorded through uprobes",
    )
    parser.add_argument(
        "--to",
        metavar="HOST:PORT",
        help="stream the recording to `pymtrace collect` at HOST:PORT instead of a file (docs/collect.md)",
    )
    parser.add_argument(
        "--web-config",
        metavar="FILE",
        help="with --to: TLS (tls_config: ca_file...) and a credential (basic_auth or authorization)",
    )
    parser.add_argument(
        "--spool-memory",
        default="64M",
        metavar="BYTES",
        help="with --to: records not yet acknowledged kept in memory up to BYTES, then in a private "
        "disk spool (default 64M)",
    )
    parser.add_argument(
        "--send-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="with --to: at the end, wait up to S seconds for the collector to take the backlog; "
        "what it never took is kept in a local mtrace-bin file (default 30)",
    )
    parser.add_argument("--json", action="store_true", help="print the closing summary as JSON on stderr")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...: launch and record CMD")


def network_target(args: argparse.Namespace) -> NetworkTarget:
    """--to, --web-config, --spool-memory, --send-timeout checked. Plain TCP only to
    loopback, and said so."""
    address = protocol.parse_address(args.to, "--to")
    config = protocol.load_client_config(args.web_config)
    if config.ssl_context is None:
        if not protocol.is_loopback(address[0]):
            raise PymtraceError(
                f"--to {args.to}: plain TCP is allowed only to loopback; give --web-config with tls_config"
            )
        if not args.quiet and not args.json:
            print(f"pymtrace: sending to {args.to} over plain TCP (loopback only, no TLS)", file=sys.stderr)
    return NetworkTarget(address, config, parse_bytes(args.spool_memory, "--spool-memory"), args.send_timeout)


def parse_size(text: str) -> int:
    """--buffer-size TEXT in pages, rounded up to a power of two."""
    n = parse_bytes(text, "--buffer-size")
    pages = max(1, -(-n // _PAGE))
    pages = 1 << (pages - 1).bit_length()
    if pages * _PAGE > (1 << 31):
        raise PymtraceError("--buffer-size: at most 2G")
    return pages


def options(args: argparse.Namespace) -> RecordOptions:
    """record's arguments checked and turned into the recorder's options."""
    network = None
    if args.to is not None:
        if args.output or args.format not in (None, "mtrace-bin"):
            raise PymtraceError("--to streams raw records to the collector: no -o or --format with it")
        if args.stacks:  # the protocol carries records, not yet a stack table
            raise PymtraceError("--stacks cannot be combined with --to (the collector takes no stack table yet)")
        network = network_target(args)
    elif args.web_config:
        raise PymtraceError("--web-config is for --to")
    fmt = args.format
    if fmt is None:
        fmt = "parquet" if (args.output or "").endswith(".parquet") else "mtrace-bin"
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    return RecordOptions(
        pages=parse_size(args.buffer_size),
        pid=args.pid,
        cmd=tuple(cmd),
        output=args.output,
        force=args.force,
        format=fmt,
        network=network,
        poll_interval_ms=args.poll_interval,
        duration_s=args.duration,
        allow_drops=args.allow_drops,
        follow_forks=args.follow_forks,
        stacks=args.stacks,
        native=args.native,
        libc=args.libc,
        json=args.json,
        quiet=args.quiet,
        via=args.via,
    )


def run(args: argparse.Namespace) -> int:
    return record(options(args))
