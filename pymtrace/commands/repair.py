"""`pymtrace repair`: cut a Parquet recording a killed recorder left back to its last complete footer."""

import argparse

HELP = "Make a Parquet recording readable again after its recorder was killed at the wrong moment."
EPILOG = """\
examples:
  pymtrace repair app.parquet      # then DuckDB, pyarrow or Spark read it again

`record --format parquet` keeps its file a complete Parquet file while it runs, so a recorder
killed with SIGKILL (the OOM killer, a crashed machine session) leaves a file every reader reads
up to its last row group. The exception is a kill in the short step of each row group's write
that copies the previous footer to the file's new end: the file then ends in part of a footer,
and readers refuse it (pymtrace says to run this). repair cuts the file back to the end of the
previous footer, which is still whole, keeping every row written before that row group. It
refuses a file that reads as it is, and one with no complete pymtrace footer near its end.
The file is changed in place (truncated); it is opened without following a symlink.
OVERHEAD: reads at most the last 1 GiB of the file, backwards; no BPF, no root needed.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a Parquet recording (record --format parquet)")


def run(args: argparse.Namespace) -> int:
    from pymtrace.trace.formats import parquet  # pyarrow: imported only when needed

    rows, cut = parquet.repair(args.file)
    print(f"{args.file}: {rows} rows kept; {cut} bytes of an unfinished row group write cut off")
    return 0
