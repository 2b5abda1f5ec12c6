"""`pymtrace convert`: between mtrace-bin, mtrace-text and parquet, in every direction."""

import argparse
import os

from pymtrace.errors import PymtraceError
from pymtrace.trace import mappings
from pymtrace.trace.files import atomic_output, check_new
from pymtrace.trace.formats import mtrace_bin, mtrace_text
from pymtrace.trace.formats.autodetect import detect_format, load_records
from pymtrace.tracee import libc

HELP = (
    "Convert a malloc trace between mtrace-bin (dj/malloc records), mtrace-text (glibc MALLOC_TRACE log) "
    "and parquet (columnar, compressed; pymtrace record --format parquet)."
)
EPILOG = """\
examples:
  pymtrace convert mtrace.out.1234 log.txt --to mtrace-text
  pymtrace convert mtrace.out.1234 log.txt --to mtrace-text --maps maps.1234 && mtrace ./prog log.txt
  pymtrace convert log.txt trace.bin --to mtrace-bin
  pymtrace convert mtrace.out.1234 app.parquet --to parquet   # ~20x smaller, for DuckDB/pyarrow
  pymtrace convert app.parquet mtrace.out.1234 --to mtrace-bin # the same bytes as the original

Text has no thread ids, chunk sizes or call types beyond alloc/free/realloc: converting text
to binary gives thread 0 and malloc/free/realloc records only. Binary to text writes callers
as absolute `[0xADDR]` unless --maps gives the process's /proc/PID/maps (saved while it ran),
then as glibc's module-relative `FILE:[0xOFF]`. mtrace-bin -> parquet -> mtrace-bin gives the
same bytes (the MAGIC record's thread and byte order are kept in the Parquet metadata).
The executable mappings a recording keeps (Parquet metadata `pymtrace.maps`, or INPUT.maps)
go along (OUTPUT.maps beside an mtrace-bin or mtrace-text OUTPUT): analyze and dump name the
callers of the output as of the input.
The input format is detected. OVERHEAD: one pass over the file; no BPF; mtrace-bin <-> parquet
is vectorized (millions of records a second).
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--to", required=True, choices=("mtrace-text", "mtrace-bin", "parquet"))
    parser.add_argument("--maps", metavar="FILE", help="a saved /proc/PID/maps to resolve callers for mtrace-text")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT if it exists (never through a symlink)")


def run(args: argparse.Namespace) -> int:
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise PymtraceError("input and output are the same file")
    fmt = detect_format(args.input)
    maps = _maps_of(args.input, fmt)
    side = mappings.side_path(args.output) if maps is not None and args.to != "parquet" else None
    if side is not None:
        check_new(side, args.force)  # before the conversion: it leaves nothing if this fails
    _convert(args, fmt, maps)
    if side is not None:
        with atomic_output(side, args.force, "w") as out:
            out.write(maps)
    return 0


def _convert(args: argparse.Namespace, fmt: str, maps: str | None) -> None:
    if args.to == "parquet" or (fmt == "parquet" and args.to == "mtrace-bin"):
        from pymtrace.trace.formats import parquet  # pyarrow: imported only when needed

        if fmt == "parquet":
            parquet.open_file(args.input)  # a corrupt input fails before OUTPUT is created
        with atomic_output(args.output, args.force) as out:
            if args.to == "parquet":
                extra = {f"pymtrace.{mappings.METADATA_KEY}": maps} if maps is not None and fmt != "parquet" else None
                parquet.convert_to_parquet(args.input, fmt, out, extra)
            else:
                parquet.write_mtrace_bin(args.input, out)
        return
    _, records = load_records(args.input)
    resolver = None
    if args.maps:
        try:
            with open(args.maps) as f:
                saved = libc.parse_maps_text(f.read())
        except (OSError, ValueError) as exc:
            raise PymtraceError(f"cannot read maps file {args.maps}: {exc}") from None
        resolver = mtrace_text.CallerResolver()
        resolver.add_maps(saved)
    text = args.to == "mtrace-text"
    with atomic_output(args.output, args.force, "w" if text else "wb", buffering=1 << 20) as out:
        if text:
            mtrace_text.write(records, out, resolver)
        else:
            w = mtrace_bin.Writer(out)
            for r in records:
                w.write(r)


def _maps_of(path: str, fmt: str) -> str | None:
    """The maps log the trace PATH keeps (Parquet metadata or PATH.maps), checked; None if none."""
    if fmt == "parquet":
        from pymtrace.trace.formats import parquet

        text = parquet.read_metadata(path).get(mappings.METADATA_KEY)
    else:
        side = mappings.side_path(path)
        if not os.path.isfile(side):
            return None
        try:
            with open(side) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise PymtraceError(f"cannot read {side}: {exc}") from None
    if not text:
        return None
    mappings.parse(text.splitlines(), path)  # CorruptFile (one line) if it is not a maps log
    return text
