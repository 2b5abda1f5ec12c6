"""`pymtrace collect`: receive recordings from `record --to` and write a Parquet dataset.

Layout (Hive partitions, read by DuckDB, Spark, Trino as they are):

    DIR/host=H/date=YYYY-MM-DD/pid=P/part-STREAM-OFFSET.parquet

one stream per traced process of one recording; a part holds the records from OFFSET
(the stream's record count before it) on, with the recording's metadata (as a local
Parquet recording's) plus pymtrace.stream and pymtrace.first_offset. A part is written
whole under a hidden temporary name, fsync'ed and renamed: every visible part is complete.
Only then is the part's end acknowledged to the recorder, after the stream's state file
(.stream-STREAM.json, replaced atomically) records it. A recorder that resends after a
collector restart gets the acknowledged offset back and the collector skips any record
below it: each record lands in the dataset exactly once.

Before a client is authenticated it gets bounded resources: a cap on connections, a
deadline for the TLS handshake and the HELLO frame, and a cap on the HELLO's size.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import re
import select
import socket
import ssl
import sys
import tempfile
import threading
import time
from typing import Callable

import numpy

from pymtrace.errors import PymtraceError
from pymtrace.net import protocol as proto
from pymtrace.trace.formats import mtrace_bin, parquet

PART_ROWS = (
    1 << 19
)  # a part is closed at this many rows (32 MiB of records in the recorder's spool: half the default memory spool)
PART_SECONDS = 5.0  # or when its oldest record is this old (the recorder's spool holds it until then)
MAX_CONNECTIONS = 64
HANDSHAKE_TIMEOUT_S = 5.0  # TLS handshake and HELLO, before authentication
COMPACTION_GRACE_S = 10.0  # at a stop, how long compactions in progress may still run
IDLE_TIMEOUT_S = 120.0  # an authenticated connection that sends nothing at all this long is closed
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_DTYPE = mtrace_bin.record_dtype("<")


def _log(line: str) -> None:
    print(f"pymtrace collect: {line}", file=sys.stderr, flush=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Stream:
    """One stream's parts and acknowledged offset, in its partition directory."""

    def __init__(self, root: str, hello: dict) -> None:
        self.id = hello["stream"]
        meta = hello.get("metadata") or {}
        self.metadata = {str(k): str(v) for k, v in meta.items() if str(k).startswith(parquet.META_PREFIX)}
        host = _SAFE.sub("_", str(hello.get("host") or "unknown"))[:128] or "unknown"
        start = str(self.metadata.get(parquet.META_PREFIX + "start_time", ""))
        date = start[:10] if re.fullmatch(r"\d{4}-\d\d-\d\d", start[:10]) else time.strftime("%Y-%m-%d", time.gmtime())
        self.dir = os.path.join(root, f"host={host}", f"date={date}", f"pid={int(hello['pid'])}")
        self.lock = threading.Lock()
        self.owner = None  # the connection streaming it now
        self.error = None  # the last write error reported (one line per change)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.acked = self._recover()
        self.pending = []  # raw record blobs received, not yet in a part
        self.pending_rows = 0
        self.pending_since = None
        self.ended = False  # END acknowledged: the stream is closed (its parts may be compacted)

    def _state_path(self) -> str:
        return os.path.join(self.dir, f".stream-{self.id}.json")

    def _recover(self) -> int:
        """The acknowledged offset: the state file's, moved on past parts renamed before a
        crash let it be updated; temporary files of an interrupted part are removed."""
        acked = read_state(self.dir, self.id).get("acked", 0)
        for first, rows, _ in stream_parts(self.dir, self.id):
            if first == acked:
                acked = first + rows
        return acked

    def add(self, offset: int, blob: bytes) -> None:
        """Records from OFFSET; those below what is already here are skipped (a resend)."""
        n = len(blob) // proto.RECORD_SIZE
        end = self.acked + self.pending_rows
        if offset > end:
            raise proto.ProtocolError(f"records from {offset} but the stream has only {end}: a gap")
        skip = end - offset
        if skip >= n:
            return
        self.pending.append(blob[skip * proto.RECORD_SIZE :] if skip else blob)
        self.pending_rows += n - skip
        if self.pending_since is None:
            self.pending_since = time.monotonic()

    def due(self, now: float) -> bool:
        return self.pending_rows >= PART_ROWS or (
            self.pending_since is not None and now - self.pending_since >= PART_SECONDS
        )

    def flush(self) -> None:
        """Write the pending records as one part, durably, then record the new offset."""
        if not self.pending_rows:
            return
        first = self.acked
        recs = numpy.frombuffer(b"".join(self.pending), _DTYPE)
        meta = dict(self.metadata)
        meta[parquet.META_PREFIX + "stream"] = self.id
        meta[parquet.META_PREFIX + "first_offset"] = str(first)

        def write_part(fd: int) -> None:
            w = parquet.Writer(fd, meta)
            w.write_records(recs)
            w.close()

        _publish(self.dir, self.id, f"part-{self.id}-{first:012d}.parquet", write_part)
        self.acked = first + len(recs)
        self.pending, self.pending_rows, self.pending_since = [], 0, None
        self._write_state()

    def end(self) -> None:
        """END: the rest written, the stream marked closed in its state file."""
        self.flush()
        if not self.ended:
            self.ended = True
            self._write_state()

    def _write_state(self) -> None:
        state = json.dumps({"stream": self.id, "acked": self.acked, "ended": self.ended}).encode()
        _publish(self.dir, self.id, os.path.basename(self._state_path()), lambda fd: os.write(fd, state))


def _publish(directory: str, stream: str, name: str, write: Callable[[int], object]) -> None:
    """Create NAME in DIRECTORY durably and whole: WRITE(fd) fills a hidden mkstemp file (0600,
    `.STREAM-*.inprogress`), which is fsync'ed and renamed over NAME, then the directory
    fsync'ed. A failure removes the temporary file and raises OSError."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{stream}-", suffix=".inprogress")
    try:
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(directory, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def read_state(directory: str, stream: str) -> dict:
    """The stream's state file ({"acked": N, "ended": bool}; {} when absent or unreadable)."""
    try:
        with open(os.path.join(directory, f".stream-{stream}.json")) as f:
            state = json.load(f)
        return {"acked": int(state["acked"]), "ended": bool(state.get("ended"))}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def stream_parts(directory: str, stream: str) -> list[tuple[int, int, str]]:
    """The stream's parts in DIRECTORY as (first offset, rows, path), in offset order, after
    removing what an interrupted write or compaction left: temporary files, and parts whose
    records a compacted part already holds (a crash between a compaction's rename and its
    removal of the parts it merged). Parts never overlap otherwise."""
    prefix = f"part-{stream}-"
    found = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(f".{stream}-") and name.endswith(".inprogress"):
            os.unlink(path)
        elif name.startswith(prefix) and name.endswith(".parquet") and name[len(prefix) : -8].isdigit():
            found.append((int(name[len(prefix) : -8]), path))
    out: list[tuple[int, int, str]] = []
    end = 0
    removed = False
    for first, path in found:
        rows = parquet.open_file(path).metadata.num_rows
        if out and first < end:
            if first + rows > end:
                raise PymtraceError(f"{path}: overlaps the part before it (records {first}-{first + rows - 1})")
            os.unlink(path)  # merged into the part before it
            removed = True
            continue
        out.append((first, rows, path))
        end = first + rows
    if removed:
        _fsync_dir(directory)
    return out


class CompactionStopped(Exception):
    """The collector is stopping: a compaction not yet committed is abandoned (parts kept)."""


def compact_stream(directory: str, stream: str, stopping: Callable[[], bool] | None = None) -> tuple[int, int]:
    """Merge the stream's parts in DIRECTORY into one (the first part's name and metadata, plus
    pymtrace.compacted_parts): (parts merged, rows). Crash-safe and idempotent: the merged file
    is written whole under a temporary name, fsync'ed and renamed over the first part (the
    commit), then the merged parts are removed; a kill at any point leaves every record once
    after stream_parts() runs again (this function or a collector's recovery). A merged part is
    read one row group at a time (memory: one row group). STOPPING(): checked before each part
    is read; true abandons the compaction before its commit (CompactionStopped, parts kept)."""
    parts = stream_parts(directory, stream)
    if len(parts) < 2:
        return 0, sum(rows for _, rows, _ in parts)
    for (first, rows, path), (nxt, _, _) in zip(parts, parts[1:]):
        if first + rows != nxt:
            raise PymtraceError(f"{path}: records {first + rows}-{nxt - 1} are missing; not compacted")
    head = parquet.open_file(parts[0][2]).schema_arrow.metadata or {}
    meta = {k.decode(): v.decode() for k, v in head.items() if k.decode().startswith(parquet.META_PREFIX)}
    meta[parquet.META_PREFIX + "compacted_parts"] = str(len(parts))

    def write_merged(fd: int) -> None:
        w = parquet.Writer(fd, meta)
        for _, _, path in parts:
            if stopping is not None and stopping():
                raise CompactionStopped
            for recs in parquet.iter_arrays(path, 1 << 18):
                w.write_records(recs)
        w.close()

    _publish(directory, stream, os.path.basename(parts[0][2]), write_merged)  # the commit
    for _, _, path in parts[1:]:
        os.unlink(path)
    _fsync_dir(directory)
    return len(parts), sum(rows for _, rows, _ in parts)


def compact(root: str) -> dict[str, int]:
    """Compact every closed stream (END acknowledged) under the dataset ROOT; the counts of
    streams, parts merged and rows. Streams still open (or cut off) are left as they are."""
    done = {"streams": 0, "parts": 0, "rows": 0}
    for directory, _, names in os.walk(root):
        for name in sorted(names):
            m = re.fullmatch(r"\.stream-([0-9a-f]{32})\.json", name)
            if m and read_state(directory, m.group(1)).get("ended"):
                parts, rows = compact_stream(directory, m.group(1))
                if parts:
                    done["streams"] += 1
                    done["parts"] += parts
                    done["rows"] += rows
    return done


class Collector:
    """Accept recorders on (HOST, PORT) and write their streams under DIRECTORY.
    SSL_CONTEXT: TLS (None: plain TCP, loopback only, checked by the caller);
    CHECK_PASSWORD(user, password, client address) and TOKEN: the accepted credentials
    (neither: no authentication)."""

    def __init__(
        self,
        directory: str,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        check_password: Callable[[str, str, str], bool] | None = None,
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.directory = os.path.abspath(directory)
        self.ssl_context = ssl_context
        self.check_password = check_password
        self.token_digest = hashlib.sha256(token.encode()).digest() if token else None
        self.max_connections = max_connections
        self.streams = {}
        self.streams_lock = threading.Lock()
        self.connections = 0
        self.count_lock = threading.Lock()
        self.stopping = threading.Event()
        self.records = 0  # records received (for the closing line)
        self.compacting = 0  # compactions running (shutdown waits for them)
        self.abandon_compactions = threading.Event()
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(128)
        except OSError as exc:
            raise PymtraceError(f"cannot listen on {host}:{port} / use {directory}: {exc.strerror or exc}") from None
        self.address = self.sock.getsockname()[:2]

    @property
    def auth_required(self) -> bool:
        return self.check_password is not None or self.token_digest is not None

    def serve_forever(self) -> None:
        self.sock.settimeout(0.5)
        while not self.stopping.is_set():
            try:
                conn, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.1)
                    continue
                raise
            with self.count_lock:
                if self.connections >= self.max_connections:
                    conn.close()  # before any byte is read: a flood costs nothing more
                    continue
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn, addr[0]), daemon=True).start()

    def shutdown(self) -> None:
        """Stop accepting; write every stream's pending records as parts."""
        self.stopping.set()
        self.sock.close()
        # compactions get COMPACTION_GRACE_S to finish, then stop before their next part (one
        # past its commit finishes removing the parts it merged): exiting in the middle would
        # leave a merged part beside parts it holds until the next `collect --compact`
        deadline = time.monotonic() + COMPACTION_GRACE_S
        while self.compacting and time.monotonic() < deadline + 60:
            if time.monotonic() > deadline:
                self.abandon_compactions.set()
            time.sleep(0.05)
        with self.streams_lock:
            streams = list(self.streams.values())
        for s in streams:
            if s.lock.acquire(timeout=10):
                try:
                    s.flush()
                except OSError as exc:
                    _log(f"cannot write {s.dir}: {exc.strerror}")
                finally:
                    s.lock.release()

    # -- one connection
    def _serve(self, conn: socket.socket, client: str) -> None:
        try:
            self._session(conn, client)
        except (OSError, proto.ProtocolError, ssl.SSLError, ValueError):
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass
            with self.count_lock:
                self.connections -= 1

    def _refuse(self, conn: socket.socket, code: str, message: str, log: str | None = None) -> None:
        _log(log or message)
        try:
            conn.sendall(proto.json_frame(proto.REFUSED, {"code": code, "message": message}))
        except OSError:
            pass

    def _session(self, conn: socket.socket, client: str) -> None:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        if self.ssl_context is not None:
            conn = self.ssl_context.wrap_socket(conn, server_side=True)
        hello = self._read_hello(conn, deadline)
        if hello is None:
            return
        data = hello[1]
        if hello[0] != proto.VERSION:
            self._refuse(
                conn,
                proto.R_VERSION,
                f"protocol version mismatch: the recorder speaks {hello[0]}, this collector {proto.VERSION}; "
                "run the same pymtrace version on both sides",
                f"{client}: refused a recorder speaking protocol version {hello[0]} (this collector: {proto.VERSION})",
            )
            return
        if not self._authenticated(data.get("auth"), client):
            self._refuse(
                conn,
                proto.R_AUTH,
                "credential rejected",
                f"{client}: rejected credential"
                + (
                    f" (user {data['auth'].get('user')!r})"
                    if isinstance(data.get("auth"), dict) and data["auth"].get("user")
                    else ""
                ),
            )
            return
        if not isinstance(data.get("stream"), str) or not re.fullmatch(r"[0-9a-f]{32}", data["stream"]):
            self._refuse(conn, proto.R_BAD, "malformed HELLO: no stream id", f"{client}: malformed HELLO")
            return
        try:
            stream = self._stream(data)
        except (OSError, PymtraceError, ValueError, KeyError, TypeError) as exc:
            msg = exc.strerror if isinstance(exc, OSError) else str(exc)
            self._refuse(
                conn, proto.R_DISK, f"collector cannot open the stream: {msg}", f"{client}: cannot open stream: {msg}"
            )
            return
        conn.settimeout(IDLE_TIMEOUT_S)
        me = object()
        stream.owner = me
        if not stream.lock.acquire(timeout=HANDSHAKE_TIMEOUT_S * 2):
            self._refuse(conn, proto.R_BUSY, "the stream is busy on another connection", f"{client}: stream busy")
            return
        try:
            if stream.owner is not me:
                return  # a newer connection took the stream over meanwhile
            conn.sendall(proto.json_frame(proto.WELCOME, {"version": proto.VERSION, "acked": stream.acked}))
            self._receive(conn, stream, client, me)
        finally:
            try:
                self._flush(conn, stream, client)  # what was received is kept: a resend skips it
            except (OSError, proto.ProtocolError):
                pass
            finally:
                stream.lock.release()

    def _read_hello(self, conn: socket.socket, deadline: float) -> tuple[int, dict] | None:
        head = _recv_deadline(conn, proto.HEADER.size, deadline)
        kind, length = proto.HEADER.unpack(head)
        if kind != proto.HELLO or length > proto.MAX_HELLO or length < proto.VERSION_FIELD.size:
            self._refuse(
                conn,
                proto.R_BAD,
                "not a pymtrace recorder (or HELLO too large)",
                "refused a connection that is not a pymtrace recorder",
            )
            return None
        payload = _recv_deadline(conn, length, deadline)
        magic, version = proto.VERSION_FIELD.unpack_from(payload)
        if magic != proto.MAGIC:
            self._refuse(
                conn, proto.R_BAD, "not a pymtrace recorder", "refused a connection that is not a pymtrace recorder"
            )
            return None
        if version != proto.VERSION:
            return version, {}
        return version, proto.parse_json(payload[proto.VERSION_FIELD.size :])

    def _authenticated(self, auth: object, client: str) -> bool:
        if not self.auth_required:
            return True
        if not isinstance(auth, dict):
            return False
        token = auth.get("token")
        if isinstance(token, str) and self.token_digest is not None:
            return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.token_digest)
        user, password = auth.get("user"), auth.get("password")
        if isinstance(user, str) and isinstance(password, str) and self.check_password is not None:
            return self.check_password(user, password, client)
        return False

    def _stream(self, hello: dict) -> Stream:
        with self.streams_lock:
            stream = self.streams.get(hello["stream"])
            if stream is None:
                stream = Stream(self.directory, hello)
                self.streams[stream.id] = stream
            return stream

    def _receive(self, conn: socket.socket, stream: Stream, client: str, me: object) -> None:
        while not self.stopping.is_set() and stream.owner is me:
            pending_tls = isinstance(conn, ssl.SSLSocket) and conn.pending()
            if not pending_tls:
                ready, _, _ = select.select([conn], [], [], 0.5)
                if not ready:
                    if stream.due(time.monotonic()):
                        self._flush(conn, stream, client)
                    continue
            kind, payload = proto.recv_frame(conn, proto.OFFSET.size + proto.MAX_FRAME)
            if kind == proto.DATA:
                (offset,) = proto.OFFSET.unpack_from(payload)
                blob = payload[proto.OFFSET.size :]
                if len(blob) % proto.RECORD_SIZE:
                    raise proto.ProtocolError("DATA not a whole number of records")
                stream.add(offset, blob)
                self.records += len(blob) // proto.RECORD_SIZE
                if stream.due(time.monotonic()):
                    self._flush(conn, stream, client)
            elif kind == proto.END:
                with self.count_lock:  # counted before the ACK: a stop right after it waits for it
                    self.compacting += 1
                try:
                    self._flush(conn, stream, client, end=True)
                    self._compact(stream)
                finally:
                    with self.count_lock:
                        self.compacting -= 1
                return
            else:
                raise proto.ProtocolError(f"unexpected frame {kind}")

    def _compact(self, stream: Stream) -> None:
        """A closed stream's parts merged into one (after its END is acknowledged: the recorder
        does not wait for it). A failure leaves the parts as they are: one line."""
        try:
            compact_stream(stream.dir, stream.id, self.abandon_compactions.is_set)
        except CompactionStopped:
            pass
        except (OSError, PymtraceError) as exc:
            _log(f"cannot compact {stream.dir} stream {stream.id}: {getattr(exc, 'strerror', None) or exc}")

    def _flush(self, conn: socket.socket, stream: Stream, client: str, end: bool = False) -> None:
        """Write the stream's pending records as a part and acknowledge them. A full disk:
        one line here, REFUSED to the recorder (it keeps spooling and retries); the pending
        records are dropped (never acknowledged, the recorder sends them again). END: the
        stream is also marked closed."""
        try:
            stream.end() if end else stream.flush()
        except OSError as exc:
            stream.pending, stream.pending_rows, stream.pending_since = [], 0, None
            message = f"cannot write {stream.dir}: {exc.strerror or exc}"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                message = f"disk full: {message}"
            if stream.error != message:
                stream.error = message
                _log(f"{message}; the recorder at {client} keeps spooling")
            try:
                conn.sendall(proto.json_frame(proto.REFUSED, {"code": proto.R_DISK, "message": message}))
            except OSError:
                pass
            raise proto.ProtocolError(message) from None
        stream.error = None
        conn.sendall(proto.frame(proto.ACK, proto.OFFSET.pack(stream.acked)))


def _recv_deadline(sock: socket.socket, n: int, deadline: float) -> bytes:
    """N bytes before DEADLINE (a client sending one byte at a time cannot hold a slot longer)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise proto.ProtocolError("handshake timeout")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise proto.ProtocolError("connection closed by the peer")
        buf += chunk
    return bytes(buf)
