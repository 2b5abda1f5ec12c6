"""`pymtrace collect`: receive `record --to` streams and write a Hive-partitioned Parquet dataset.

The arguments, help and security checks; the server itself is pymtrace.net.collector.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

from pymtrace.errors import PymtraceError
from pymtrace.net import protocol

HELP = (
    "Receive recordings streamed by `pymtrace record --to HOST:PORT` from many hosts and write "
    "them as one Hive-partitioned Parquet dataset (DIR/host=H/date=D/pid=P/part-*.parquet)."
)
EPILOG = """\
examples:
  pymtrace collect --listen 127.0.0.1:7300 --dir /srv/traces      # loopback: plain TCP allowed
  pymtrace collect --listen 0.0.0.0:7300 --dir /srv/traces --web-config web.yml
  pymtrace collect --listen 0.0.0.0:7300 --dir /srv/traces --web-config tls.yml --token-file token
  # on each traced host:
  sudo pymtrace record -p 1234 --to collector.example:7300 --web-config client.yml
  pymtrace collect --compact /srv/traces    # finish compactions a crash interrupted
  # query the dataset:
  python3 -c "import duckdb; print(duckdb.sql(\\"select host, pid, type, count(*) from \\
    read_parquet('/srv/traces/**/*.parquet', hive_partitioning=true) group by all\\"))"

SECURITY: --web-config is the exporter's file (tls_server_config: cert_file, key_file,
client certificates; basic_auth_users: bcrypt hashes). --token-file FILE accepts recorders
sending that token instead. Listening on anything but loopback needs TLS and a credential;
on loopback plain TCP is allowed and said so.

DURABILITY: a part is written whole, fsync'ed and renamed before its records are
acknowledged; a recorder resends from the last acknowledged record after any fault, and
the collector skips what it already has: every call lands in the dataset once, also
across a collector crash and restart. A full disk refuses the stream (one line here and
on the recorder, which keeps spooling and retries). Stop with Ctrl-C or SIGTERM: pending
records are written as parts first. See docs/collect.md.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", metavar="ADDR:PORT", help="address to listen on (port 0: any)")
    parser.add_argument("--dir", metavar="DIR", help="root directory of the dataset")
    parser.add_argument(
        "--compact",
        metavar="DIR",
        help="merge each closed stream's parts under the dataset DIR into one file, then exit "
        "(the collector does it itself at each stream's end; this finishes one a crash interrupted)",
    )
    parser.add_argument("--web-config", metavar="FILE", help="TLS and basic auth (the exporter's web config format)")
    parser.add_argument("--token-file", metavar="FILE", help="also accept recorders sending the token in FILE")
    parser.add_argument("--max-connections", type=int, default=64, metavar="N", help="connections at once (default 64)")


def _read_token(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            if os.fstat(f.fileno()).st_mode & 0o077:
                raise PymtraceError(f"--token-file {path}: readable by others; chmod 600 it")
            token = f.readline().strip()
    except OSError as exc:
        raise PymtraceError(f"cannot read --token-file {path}: {exc.strerror}") from None
    if len(token) < 16:
        raise PymtraceError(f"--token-file {path}: the token must have at least 16 characters")
    return token


def _return_freed_memory() -> None:
    """Freed buffers go back to the system at once: DATA frames and row groups are 16 MiB,
    and glibc's default (a mapping threshold that grows past them once one is freed) and
    Arrow's mimalloc keep them, per thread, long after the streams end. Before Arrow loads."""
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, it no longer grows
    except (OSError, AttributeError):
        pass  # not glibc


def run(args: argparse.Namespace) -> int:
    _return_freed_memory()
    from pymtrace.net.collector import Collector, compact

    if args.compact:
        if args.listen or args.dir:
            raise PymtraceError("--compact DIR goes alone (not with --listen or --dir)")
        if not os.path.isdir(args.compact):
            raise PymtraceError(f"--compact {args.compact}: not a directory")
        try:
            done = compact(args.compact)
        except OSError as exc:
            raise PymtraceError(f"cannot compact {args.compact}: {exc.strerror or exc}") from None
        print(
            f"pymtrace collect: compacted {done['streams']} streams: {done['parts']} parts into "
            f"{done['streams']} files, {done['rows']} records",
            file=sys.stderr,
        )
        return 0
    if not args.listen or not args.dir:
        raise PymtraceError("--listen ADDR:PORT and --dir DIR are required (or --compact DIR)")
    host, port = protocol.parse_address(args.listen, "--listen")
    ssl_context, check_password = None, None
    if args.web_config:
        from pymtrace.sinks import webconfig

        web = webconfig.load(args.web_config)
        ssl_context = web.ssl_context
        if web.auth_required:
            check_password = web.check_password
    token = _read_token(args.token_file) if args.token_file else None
    loopback = protocol.is_loopback(host)
    if not loopback and ssl_context is None:
        raise PymtraceError(
            f"--listen {args.listen}: plain TCP is allowed only on loopback; "
            "give --web-config with tls_server_config to listen on the network"
        )
    if not loopback and check_password is None and token is None:
        raise PymtraceError(
            f"--listen {args.listen}: on the network a credential is required "
            "(basic_auth_users in --web-config, or --token-file)"
        )
    server = Collector(args.dir, host, port, ssl_context, check_password, token, args.max_connections)
    where = f"{server.address[0]}:{server.address[1]}"
    if ssl_context is None:
        print(f"pymtrace collect: plain TCP on loopback {where} (no TLS: this machine only)", file=sys.stderr)
    print(f"pymtrace collect: listening on {where}, writing {server.directory}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    print(f"pymtrace collect: stopped; {server.records} records received", file=sys.stderr)
    return 0
