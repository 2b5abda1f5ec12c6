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

Before a client is authenticated it gets bounded resources (pymtrace.net.admission): caps
on connections per address and in total with eviction of the oldest unauthenticated one, a
deadline for the TLS handshake and the HELLO frame together, a cap on the HELLO's size; then
every HELLO field is checked. Everything below the dataset root is opened from its
descriptor without following symlinks. Memory is bounded per stream (a frame and a row
group) and in total (MEMORY_BUDGET, WRITERS_AT_ONCE, COMPACTIONS_AT_ONCE).
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import hmac
import json
import os
import re
import secrets
import select
import socket
import ssl
import stat
import sys
import threading
import time
from typing import Callable

import numpy

from pymtrace import jsonread
from pymtrace.errors import PymtraceError
from pymtrace.net import protocol as proto
from pymtrace.net.admission import Admission, Conn
from pymtrace.trace.formats import mtrace_bin, parquet

PART_ROWS = (
    1 << 19
)  # a part is closed at this many rows (32 MiB of records in the recorder's spool: half the default memory spool)
PART_SECONDS = 5.0  # or when its oldest record is this old (the recorder's spool holds it until then)
MAX_CONNECTIONS = 64
MAX_PENDING_PER_CLIENT = 16  # connections of one address before authentication
HANDSHAKE_TIMEOUT_S = 5.0  # TLS handshake and HELLO, before authentication
COMPACTION_GRACE_S = 10.0  # at a stop, how long compactions in progress may still run
COMPACTIONS_AT_ONCE = 1  # each holds a row group read and one being written (~80 MiB)
WRITERS_AT_ONCE = 2  # parts written at once: encoding a row group takes ~50 MiB beside it
IDLE_TIMEOUT_S = 120.0  # an authenticated connection that sends nothing at all this long is closed
# records in memory, all streams together: DATA frames being read and row groups being filled
MEMORY_BUDGET = 128 << 20
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT
HOST_MAX = 255
STATE_LIMIT = 4096  # a stream's state file is ~60 bytes; anything longer is not one
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_DTYPE = mtrace_bin.record_dtype("<")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _log(line: str) -> None:
    print(f"pymtrace collect: {line}", file=sys.stderr, flush=True)


def _not_private(fd: int, where: str) -> str | None:
    """Why the directory FD is unsafe to write below (None: owned by this user and writable
    by no other; another user could otherwise swap what is below it for symlinks)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return (
            f"{where}: writable by another user (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); "
            "use a directory only this user can write"
        )
    return None


def _check_private(fd: int, where: str) -> None:
    problem = _not_private(fd, where)
    if problem:
        os.close(fd)
        raise PymtraceError(problem)


def open_root(path: str) -> int:
    """The dataset root PATH (created 0700 if missing) as a directory descriptor; PymtraceError
    when another user can write it, or could have made PATH a symlink (in a directory such as
    /tmp). Everything below it is opened from this descriptor."""
    try:
        if os.path.islink(path):
            parent = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                problem = _not_private(parent, path)
            finally:
                os.close(parent)
            if problem and os.lstat(path).st_uid != os.geteuid():
                raise PymtraceError(f"{path}: a symbolic link another user made; give the directory it points to")
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise PymtraceError(f"cannot use {path}: {exc.strerror or exc}") from None
    _check_private(fd, path)
    return fd


def _subdir(parent: int, name: str, where: str) -> int:
    """NAME below the directory PARENT, created 0700 when missing, opened without following
    a symlink; PymtraceError when it is a symlink or not this user's own."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PymtraceError(f"{where}: not a directory (a symbolic link?); not followed") from None
        raise
    _check_private(fd, where)
    return fd


def _read_path(fd: int, name: str) -> str:
    """A path reading NAME in the directory FD, whatever happens to the directory's own path."""
    return f"/proc/self/fd/{fd}/{name}"


class Stream:
    """One stream's parts and acknowledged offset, in its partition directory (held open as
    a descriptor while a connection streams it). The records of the part being received go
    into its hidden temporary file as they arrive: in memory only the row group being filled."""

    def __init__(self, root: str, hello: dict, root_fd: int | None = None) -> None:
        self.id = hello["stream"]
        meta = hello.get("metadata") or {}
        self.metadata = {k: v for k, v in meta.items() if k.startswith(parquet.META_PREFIX)}
        host = _SAFE.sub("_", hello.get("host") or "unknown")[:128] or "unknown"
        self.names = (f"host={host}", f"date={partition_date(self.metadata)}", f"pid={hello['pid']}")
        self.root = root
        self.dir = os.path.join(root, *self.names)
        self.lock = threading.Lock()
        self.owner = None  # the connection streaming it now
        self.error = None  # the last write error reported (one line per change)
        self.dir_fd = None
        self.part = None  # the part being received: [temporary file descriptor, its name, Writer]
        self.pending_rows = 0
        self.pending_since = None
        self.held = 0  # bytes of records in memory, counted against the collector's budget
        self.ended = False  # END acknowledged: the stream is closed (its parts may be compacted)
        self.open(root_fd)
        try:
            self.acked = self._recover()
        except BaseException:
            self.close()
            raise

    def open(self, root_fd: int | None = None) -> None:
        """Open the partition directory (creating it), from ROOT_FD or the root's path."""
        if self.dir_fd is not None:
            return
        fd = root_fd if root_fd is not None else open_root(self.root)
        try:
            where = self.root
            for name in self.names:
                where = os.path.join(where, name)
                child = _subdir(fd, name, where)
                if fd != root_fd:
                    os.close(fd)
                fd = child
        except BaseException:
            if fd != root_fd:
                os.close(fd)
            raise
        self.dir_fd = fd

    def close(self) -> None:
        """Close the directory (after flush(): no part open)."""
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None

    def _recover(self) -> int:
        """The acknowledged offset: the state file's, moved on past parts renamed before a
        crash let it be updated; temporary files of an interrupted part are removed."""
        acked = read_state(self.dir_fd, self.id).get("acked", 0)
        for first, rows, _ in stream_parts(self.dir, self.id, self.dir_fd):
            if first == acked:
                acked = first + rows
        return acked

    def add(self, offset: int, blob: bytes | bytearray | memoryview) -> None:
        """Records from OFFSET; those below what is already here are skipped (a resend).
        Raises OSError when the part cannot be written."""
        n = len(blob) // proto.RECORD_SIZE
        end = self.acked + self.pending_rows
        if offset > end:
            raise proto.ProtocolError(f"records from {offset} but the stream has only {end}: a gap")
        skip = end - offset
        if skip >= n:
            return
        if self.part is None:
            meta = dict(self.metadata)
            meta[parquet.META_PREFIX + "stream"] = self.id
            meta[parquet.META_PREFIX + "first_offset"] = str(self.acked)
            fd, tmp = _create_temp(self.dir_fd, self.id)
            try:
                self.part = [fd, tmp, parquet.Writer(fd, meta)]
            except BaseException:
                _discard(self.dir_fd, fd, tmp)
                raise
        self.part[2].write_records(numpy.frombuffer(blob, _DTYPE)[skip:])
        self._release_buffer()
        self.pending_rows += n - skip
        if self.pending_since is None:
            self.pending_since = time.monotonic()

    def write_row_group(self) -> None:
        """Write the records buffered for the part's next row group now (to free memory)."""
        if self.part is not None:
            self.part[2].flush()
            self._release_buffer()

    def _release_buffer(self) -> None:
        writer = self.part[2]
        if not writer.pending_rows:  # a row group was written: its 16 MiB buffer is not kept
            writer.pending = numpy.empty((8, 0), numpy.uint64)

    def buffered(self) -> int:
        """Bytes of records buffered in memory for the part's next row group."""
        return self.part[2].pending_rows * proto.RECORD_SIZE if self.part else 0

    def due(self, now: float) -> bool:
        return self.pending_rows >= PART_ROWS or (
            self.pending_since is not None and now - self.pending_since >= PART_SECONDS
        )

    def flush(self) -> None:
        """Finish the part being received, durably, then record the new offset."""
        if not self.pending_rows:
            return
        fd, tmp, writer = self.part
        first = self.acked
        try:
            writer.close()
        except BaseException:
            self.drop()
            raise
        self.part = None
        _commit(self.dir_fd, fd, tmp, f"part-{self.id}-{first:012d}.parquet")
        self.acked = first + self.pending_rows
        self.pending_rows, self.pending_since = 0, None
        self._write_state()

    def drop(self) -> None:
        """Forget the part being received (its records are never acknowledged: resent)."""
        if self.part is not None:
            _discard(self.dir_fd, self.part[0], self.part[1])
            self.part = None
        self.pending_rows, self.pending_since = 0, None

    def end(self) -> None:
        """END: the rest written, the stream marked closed in its state file."""
        self.flush()
        if not self.ended:
            self.ended = True
            self._write_state()

    def _write_state(self) -> None:
        state = json.dumps({"stream": self.id, "acked": self.acked, "ended": self.ended}).encode()
        fd, tmp = _create_temp(self.dir_fd, self.id)
        try:
            os.write(fd, state)
        except BaseException:
            _discard(self.dir_fd, fd, tmp)
            raise
        _commit(self.dir_fd, fd, tmp, f".stream-{self.id}.json")


def partition_date(metadata: dict) -> str:
    """The recording's start date (UTC, YYYY-MM-DD) from its metadata; today's when it has
    none that is a date in ASCII digits."""
    start = metadata.get(parquet.META_PREFIX + "start_time", "")[:10]
    if re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", start):
        try:
            return datetime.date.fromisoformat(start).isoformat()
        except ValueError:
            pass
    return time.strftime("%Y-%m-%d", time.gmtime())


def _create_temp(dir_fd: int, stream: str) -> tuple[int, str]:
    """A new hidden file `.STREAM-*.inprogress` (0600) in the directory DIR_FD."""
    while True:
        name = f".{stream}-{secrets.token_hex(6)}.inprogress"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return os.open(name, flags, 0o600, dir_fd=dir_fd), name
        except FileExistsError:
            continue


def _discard(dir_fd: int, fd: int, tmp: str) -> None:
    os.close(fd)
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except OSError:
        pass


def _commit(dir_fd: int, fd: int, tmp: str, name: str) -> None:
    """The temporary file TMP (open as FD) fsync'ed and renamed over NAME, then the directory
    fsync'ed: NAME appears whole. A failure removes TMP and raises OSError."""
    try:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.fsync(dir_fd)


def read_state(dir_fd: int, stream: str) -> dict:
    """The stream's state file ({"acked": N, "ended": bool}; {} when absent or unreadable)."""
    try:
        fd = os.open(f".stream-{stream}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd) as f:
            state = jsonread.load(f, STATE_LIMIT)
        return {"acked": int(state["acked"]), "ended": bool(state.get("ended"))}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _open_dir(directory: str, dir_fd: int | None) -> int:
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if dir_fd is None else dir_fd


def stream_parts(directory: str, stream: str, dir_fd: int | None = None) -> list[tuple[int, int, str]]:
    """The stream's parts in DIRECTORY (opened as DIR_FD, when given) as (first offset, rows,
    file name), in offset order, after removing what an interrupted write or compaction left:
    temporary files, and parts whose records a compacted part already holds (a crash between
    a compaction's rename and its removal of the parts it merged). Parts never overlap
    otherwise. Symlinks are not parts."""
    fd = _open_dir(directory, dir_fd)
    try:
        return _stream_parts(directory, stream, fd)
    finally:
        if dir_fd is None:
            os.close(fd)


def _stream_parts(directory: str, stream: str, fd: int) -> list[tuple[int, int, str]]:
    prefix = f"part-{stream}-"
    found = []
    for name in sorted(os.listdir(fd)):
        if name.startswith(f".{stream}-") and name.endswith(".inprogress"):
            os.unlink(name, dir_fd=fd)
        elif name.startswith(prefix) and name.endswith(".parquet") and _digits(name[len(prefix) : -8]):
            if stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                found.append((int(name[len(prefix) : -8]), name))
    out: list[tuple[int, int, str]] = []
    end = 0
    removed = False
    for first, name in found:
        rows = parquet.open_file(_read_path(fd, name)).metadata.num_rows
        if out and first < end:
            if first + rows > end:
                raise PymtraceError(
                    f"{os.path.join(directory, name)}: overlaps the part before it (records {first}-{first + rows - 1})"
                )
            os.unlink(name, dir_fd=fd)  # merged into the part before it
            removed = True
            continue
        out.append((first, rows, name))
        end = first + rows
    if removed:
        os.fsync(fd)
    return out


def _digits(text: str) -> bool:
    return bool(re.fullmatch(r"[0-9]+", text))


class CompactionStopped(Exception):
    """The collector is stopping: a compaction not yet committed is abandoned (parts kept)."""


def compact_stream(
    directory: str, stream: str, stopping: Callable[[], bool] | None = None, dir_fd: int | None = None
) -> tuple[int, int]:
    """Merge the stream's parts in DIRECTORY (opened as DIR_FD, when given) into one (the first
    part's name and metadata, plus pymtrace.compacted_parts): (parts merged, rows). Crash-safe
    and idempotent: the merged file is written whole under a temporary name, fsync'ed and
    renamed over the first part (the commit), then the merged parts are removed; a kill at any
    point leaves every record once after stream_parts() runs again (this function or a
    collector's recovery). A merged part is read one row group at a time (memory: one row
    group). STOPPING(): checked before each part is read; true abandons the compaction before
    its commit (CompactionStopped, parts kept)."""
    fd = _open_dir(directory, dir_fd)
    try:
        return _compact_stream(directory, stream, stopping, fd)
    finally:
        if dir_fd is None:
            os.close(fd)


def _compact_stream(directory: str, stream: str, stopping: Callable[[], bool] | None, fd: int) -> tuple[int, int]:
    parts = _stream_parts(directory, stream, fd)
    if len(parts) < 2:
        return 0, sum(rows for _, rows, _ in parts)
    for (first, rows, name), (nxt, _, _) in zip(parts, parts[1:]):
        if first + rows != nxt:
            raise PymtraceError(
                f"{os.path.join(directory, name)}: records {first + rows}-{nxt - 1} are missing; not compacted"
            )
    head = parquet.open_file(_read_path(fd, parts[0][2])).schema_arrow.metadata or {}
    meta = {k.decode(): v.decode() for k, v in head.items() if k.decode().startswith(parquet.META_PREFIX)}
    meta[parquet.META_PREFIX + "compacted_parts"] = str(len(parts))
    out, tmp = _create_temp(fd, stream)
    try:
        w = parquet.Writer(out, meta)
        for _, _, name in parts:
            if stopping is not None and stopping():
                raise CompactionStopped
            for recs in parquet.iter_arrays(_read_path(fd, name), 1 << 18):
                w.write_records(recs)
        w.close()
    except BaseException:
        _discard(fd, out, tmp)
        raise
    _commit(fd, out, tmp, parts[0][2])  # the commit
    for _, _, name in parts[1:]:
        os.unlink(name, dir_fd=fd)
    os.fsync(fd)
    return len(parts), sum(rows for _, rows, _ in parts)


def compact(root: str) -> dict[str, int]:
    """Compact every closed stream (END acknowledged) under the dataset ROOT; the counts of
    streams, parts merged and rows. Streams still open (or cut off) are left as they are.
    Symlinks below ROOT are not followed."""
    done = {"streams": 0, "parts": 0, "rows": 0}
    for directory, _, names, fd in os.fwalk(root):
        problem = _not_private(fd, directory)
        if problem:
            raise PymtraceError(problem)
        for name in sorted(names):
            m = re.fullmatch(r"\.stream-([0-9a-f]{32})\.json", name)
            if m and read_state(fd, m.group(1)).get("ended"):
                parts, rows = compact_stream(directory, m.group(1), dir_fd=fd)
                if parts:
                    done["streams"] += 1
                    done["parts"] += parts
                    done["rows"] += rows
    return done


class MemoryBudget:
    """Bytes of records in memory across every stream, at most LIMIT: a connection waits
    (reads nothing: TCP holds the recorder back, which spools) until its next frame fits."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()

    def take(self, n: int, timeout: float) -> bool:
        """Count N more bytes, waiting up to TIMEOUT for room; whether they were counted. A
        request larger than the whole budget is granted once nothing else is counted."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.used + n <= self.limit or not self.used, timeout):
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        if n:
            with self.cond:
                self.used -= n
                self.cond.notify_all()


class HelloError(Exception):
    """A HELLO field that is missing or not what the protocol says (one line)."""


def check_hello(data: dict) -> dict:
    """The HELLO's stream fields, validated: {stream, pid, host, metadata}; HelloError names
    the first one that is wrong."""
    stream = data.get("stream")
    if not isinstance(stream, str) or not re.fullmatch(r"[0-9a-f]{32}", stream):
        raise HelloError("no stream id")
    pid = data.get("pid")
    if type(pid) is not int or not 0 < pid <= PID_MAX:  # not bool, float or str
        raise HelloError(f"pid must be an integer from 1 to {PID_MAX}")
    host = data.get("host")
    if host is not None and (not isinstance(host, str) or len(host) > HOST_MAX):
        raise HelloError(f"host must be a string of at most {HOST_MAX} characters")
    meta = data.get("metadata")
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise HelloError("metadata must map strings to strings")
    return {"stream": stream, "pid": pid, "host": host, "metadata": meta}


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
        memory_budget: int = MEMORY_BUDGET,
    ) -> None:
        self.directory = os.path.abspath(directory)
        self.ssl_context = ssl_context
        self.check_password = check_password
        self.token_digest = hashlib.sha256(token.encode()).digest() if token else None
        self.streams = {}
        self.streams_lock = threading.Lock()
        self.count_lock = threading.Lock()
        self.stopping = threading.Event()
        self.records = 0  # records received (for the closing line)
        self.compacting = 0  # compactions running (shutdown waits for them)
        self.compaction_slots = threading.Semaphore(COMPACTIONS_AT_ONCE)
        self.writers = threading.Semaphore(WRITERS_AT_ONCE)
        self.abandon_compactions = threading.Event()
        self.memory = MemoryBudget(memory_budget)
        self.root_fd = open_root(self.directory)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.admission = Admission(family, max_connections, MAX_PENDING_PER_CLIENT, per_client_pending=True)
        try:
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(128)
        except OSError as exc:
            os.close(self.root_fd)
            raise PymtraceError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.address = self.sock.getsockname()[:2]

    @property
    def auth_required(self) -> bool:
        return self.check_password is not None or self.token_digest is not None

    def serve_forever(self) -> None:
        self.sock.settimeout(0.5)
        swept = time.monotonic()
        while not self.stopping.is_set():
            if time.monotonic() - swept >= 0.25:  # the handshake deadline, however slow the bytes
                self.admission.evict_waiting(HANDSHAKE_TIMEOUT_S)
                swept = time.monotonic()
            try:
                conn, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.1)
                    continue
                raise
            slot = self.admission.admit(conn, addr[0])
            if slot is None:
                conn.close()  # every slot holds an authenticated stream: closed unread
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, addr[0], slot), daemon=True).start()
            except RuntimeError:  # cannot start a thread: shed this connection
                self.admission.forget(slot)
                conn.close()

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
                    if s.dir_fd is not None:
                        s.flush()
                        s.close()
                except OSError as exc:
                    _log(f"cannot write {s.dir}: {exc.strerror}")
                finally:
                    s.lock.release()

    # -- one connection
    def _serve(self, conn: socket.socket, client: str, slot: Conn) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            if self.ssl_context is not None:
                # the TLS socket holds the descriptor from here on: closed below, after forget()
                conn = self.ssl_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                conn.do_handshake()
            self._session(conn, client, slot)
        except (OSError, proto.ProtocolError, ssl.SSLError, ValueError):
            pass
        finally:
            self.admission.forget(slot)  # before the descriptor can be reused
            try:
                conn.close()
            except OSError:
                pass

    def _refuse(self, conn: socket.socket, code: str, message: str, log: str | None = None) -> None:
        _log(log or message)
        try:
            conn.sendall(proto.json_frame(proto.REFUSED, {"code": code, "message": message}))
        except OSError:
            pass

    def _session(self, conn: socket.socket, client: str, slot: Conn) -> None:
        hello = self._read_hello(conn, slot.since + HANDSHAKE_TIMEOUT_S)
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
                    if isinstance(data.get("auth"), dict) and isinstance(data["auth"].get("user"), str)
                    else ""
                ),
            )
            return
        self.admission.set_pending(slot, False)  # authenticated: never evicted
        if self.auth_required:
            self.admission.mark_known(client)
        try:
            fields = check_hello(data)
        except HelloError as exc:
            self._refuse(conn, proto.R_BAD, f"malformed HELLO: {exc}", f"{client}: malformed HELLO: {exc}")
            return
        try:
            stream = self._stream(fields)
        except (OSError, PymtraceError) as exc:
            self._cannot_open(conn, client, exc)
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
            try:
                stream.open(self.root_fd)
            except (OSError, PymtraceError) as exc:
                self._cannot_open(conn, client, exc)
                return
            conn.sendall(proto.json_frame(proto.WELCOME, {"version": proto.VERSION, "acked": stream.acked}))
            self._receive(conn, stream, client, me)
        finally:
            try:
                if stream.pending_rows:  # what was received is kept: a resend skips it
                    self._flush(conn, stream, client)
            except (OSError, proto.ProtocolError):
                pass
            finally:
                self._release(stream)
                stream.close()
                stream.lock.release()

    def _cannot_open(self, conn: socket.socket, client: str, exc: OSError | PymtraceError) -> None:
        msg = exc.strerror if isinstance(exc, OSError) else str(exc)
        self._refuse(
            conn, proto.R_DISK, f"collector cannot open the stream: {msg}", f"{client}: cannot open stream: {msg}"
        )

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

    def _stream(self, fields: dict) -> Stream:
        with self.streams_lock:
            stream = self.streams.get(fields["stream"])
            if stream is None:
                stream = Stream(self.directory, fields, self.root_fd)
                stream.close()  # opened again by the connection that streams it
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
            kind, length = proto.HEADER.unpack(proto.recv_exact(conn, proto.HEADER.size))
            if length > proto.OFFSET.size + proto.MAX_FRAME:
                raise proto.ProtocolError(f"frame of {length} bytes is over the limit")
            if kind == proto.DATA:
                if length < proto.OFFSET.size:
                    raise proto.ProtocolError("DATA without an offset")
                self._data(conn, stream, client, length)
                if stream.due(time.monotonic()):
                    self._flush(conn, stream, client)
            elif kind == proto.END:
                proto.recv_exact(conn, length)
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

    def _data(self, conn: socket.socket, stream: Stream, client: str, length: int) -> None:
        """A DATA frame of LENGTH bytes read into memory the budget grants, and added to the
        stream's part (its records then held only as the row group being filled)."""
        if not self.memory.take(length, 0):
            # room is made by others writing their row groups: this stream's own first, so
            # that streams waiting for each other hold nothing
            self._write(conn, stream, client, stream.write_row_group)
            self._release(stream)
            while not self.memory.take(length, 0.5):
                if self.stopping.is_set():
                    raise proto.ProtocolError("stopping")
        try:
            payload = proto.recv_exact(conn, length)
            (offset,) = proto.OFFSET.unpack_from(payload)
            blob = memoryview(payload)[proto.OFFSET.size :]
            if len(blob) % proto.RECORD_SIZE:
                raise proto.ProtocolError("DATA not a whole number of records")
            self._write(conn, stream, client, lambda: stream.add(offset, blob))
            self.records += len(blob) // proto.RECORD_SIZE
        finally:
            held = stream.buffered()
            self.memory.give(length + stream.held - held)
            stream.held = held

    def _release(self, stream: Stream) -> None:
        """Give back what the stream's buffered records counted (its row group was written)."""
        held = stream.buffered()
        self.memory.give(stream.held - held)
        stream.held = held

    def _compact(self, stream: Stream) -> None:
        """A closed stream's parts merged into one (after its END is acknowledged: the recorder
        does not wait for it), COMPACTIONS_AT_ONCE at a time. A failure leaves the parts as
        they are: one line."""
        while not self.compaction_slots.acquire(timeout=0.5):
            if self.abandon_compactions.is_set():
                return
        try:
            compact_stream(stream.dir, stream.id, self.abandon_compactions.is_set, stream.dir_fd)
        except CompactionStopped:
            pass
        except (OSError, PymtraceError) as exc:
            _log(f"cannot compact {stream.dir} stream {stream.id}: {getattr(exc, 'strerror', None) or exc}")
        finally:
            self.compaction_slots.release()

    def _write(self, conn: socket.socket, stream: Stream, client: str, write: Callable[[], object]) -> None:
        """WRITE() the stream's part. A full disk: one line per stream (not per retry),
        REFUSED to the recorder (it keeps spooling and retries) as the connection's last
        frame; the part is dropped (never acknowledged, the recorder sends it again)."""
        try:
            with self.writers:
                write()
        except OSError as exc:
            stream.drop()
            self._release(stream)
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

    def _flush(self, conn: socket.socket, stream: Stream, client: str, end: bool = False) -> None:
        """Write the stream's part and acknowledge it (END: the stream is also marked closed)."""
        self._write(conn, stream, client, stream.end if end else stream.flush)
        self._release(stream)
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
