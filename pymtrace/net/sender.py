"""`record --to HOST:PORT`: a recording streamed to `pymtrace collect` instead of a file.

The recorder's drain loop hands each batch of raw 64-byte records to NetOutput.write, which
only appends it to a Spool (no network I/O, no encoding: the drain keeps the full traced
rate). A sender thread streams the spool to the collector (pymtrace.net.protocol) and
drops what the collector acknowledges as durable. When the collector is slow or
unreachable the spool grows: in memory up to a bound, then in a private file on disk
(mkstemp in a private mkdtemp directory, mode 0600). The sender reconnects with backoff and
resends from the collector's last acknowledged offset, so nothing is lost and nothing is
written twice (the collector skips offsets it already has).
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
import ssl
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence

from pymtrace.errors import PymtraceError, WriteFailed
from pymtrace.net import protocol as proto
from pymtrace.trace.formats import mtrace_bin

DEFAULT_SPOOL_MEMORY = 64 << 20
CLOSE_WAIT_S = 30.0  # at the end, how long to wait for the collector to take the backlog
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 2.0
CONNECT_TIMEOUT_S = 10.0
_RS = mtrace_bin.RECORD_SIZE


class SpoolFull(PymtraceError):
    """The disk spool cannot be written (disk full): recording stops like a failed write."""


class Spool:
    """Records not yet acknowledged by the collector, in offset order: chunks in memory up
    to MEMORY_LIMIT bytes, then appended to a private file on disk (until everything on
    disk is acknowledged). Thread-safe: the drain appends, the sender reads and acknowledges."""

    def __init__(self, memory_limit: int) -> None:
        self.memory_limit = memory_limit
        self.chunks = collections.deque()  # [first offset, records, bytes or None, disk position]
        self.by_first = {}  # first offset -> chunk
        self.end = 0  # offset after the last record appended
        self.acked = 0  # every record below is durable at the collector
        self.memory_bytes = self.disk_bytes = 0
        self.max_memory_bytes = self.max_disk_bytes = 0
        self.disk_dir = self.disk_fd = self.disk_path = None
        self.disk_end = 0
        self.cond = threading.Condition()

    def append(self, data: bytes, n: int) -> None:
        """Add N records (DATA); SpoolFull when the disk spool cannot take them."""
        with self.cond:
            if self.disk_bytes or self.memory_bytes + len(data) > self.memory_limit:
                chunk = [self.end, n, None, self._to_disk(data)]
                self.disk_bytes += len(data)
                self.max_disk_bytes = max(self.max_disk_bytes, self.disk_bytes)
            else:
                chunk = [self.end, n, data, 0]
                self.memory_bytes += len(data)
                self.max_memory_bytes = max(self.max_memory_bytes, self.memory_bytes)
            self.chunks.append(chunk)
            self.by_first[self.end] = chunk
            self.end += n
            self.cond.notify_all()

    def _to_disk(self, data: bytes) -> int:
        try:
            if self.disk_fd is None:
                self.disk_dir = tempfile.mkdtemp(prefix="pymtrace-spool-")  # private: mode 0700
                fd, self.disk_path = tempfile.mkstemp(dir=self.disk_dir, suffix=".spool")
                self.disk_fd = fd
            pos = self.disk_end
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.pwrite(self.disk_fd, view[done:], pos + done)
        except OSError as exc:
            raise SpoolFull(
                f"cannot write the spool {self.disk_path or tempfile.gettempdir()}: {exc.strerror}"
            ) from None
        self.disk_end += len(data)
        return pos

    def records(self, offset: int, limit: int) -> tuple[int, bytes] | None:
        """(first offset, raw records) of up to LIMIT records from OFFSET, or None when there
        are none yet. Call with cond held."""
        chunk = self.by_first.get(offset)
        if chunk is None:  # OFFSET inside a chunk (after an acknowledgement mid-chunk)
            chunk = next((c for c in self.chunks if c[0] <= offset < c[0] + c[1]), None)
            if chunk is None:
                return None
        first, n, data, pos = chunk
        skip = offset - first
        take = min(n - skip, limit)
        if data is None:
            data = os.pread(self.disk_fd, take * _RS, pos + skip * _RS)
            return offset, data
        return offset, data[skip * _RS : (skip + take) * _RS]

    def ack(self, offset: int) -> None:
        """Drop every chunk wholly below OFFSET."""
        with self.cond:
            if offset <= self.acked:
                return
            self.acked = offset
            while self.chunks and self.chunks[0][0] + self.chunks[0][1] <= offset:
                first, n, data, _ = self.chunks.popleft()
                del self.by_first[first]
                if data is None:
                    self.disk_bytes -= n * _RS
                else:
                    self.memory_bytes -= len(data)
            if not self.disk_bytes and self.disk_end:
                self.disk_end = 0  # all of the disk spool acknowledged: start it again
                try:
                    os.ftruncate(self.disk_fd, 0)
                except OSError:
                    pass
            self.cond.notify_all()

    def unacked(self) -> list[bytes]:
        """Every record not acknowledged, as raw blobs (at the end, to keep them locally)."""
        out = []
        with self.cond:
            for first, n, data, pos in self.chunks:
                skip = max(0, self.acked - first)
                if data is None:
                    out.append(os.pread(self.disk_fd, (n - skip) * _RS, pos + skip * _RS))
                else:
                    out.append(data[skip * _RS :])
        return out

    def close(self) -> None:
        if self.disk_fd is not None:
            os.close(self.disk_fd)
            self.disk_fd = None
            shutil.rmtree(self.disk_dir, ignore_errors=True)


class NetOutput:
    """One traced process's records streamed to a collector; the recorder's Output for
    `--to` (same write/poll/close/summary)."""

    def __init__(
        self,
        address: tuple[str, int],
        config: proto.ClientConfig,
        tgid: int,
        metadata: dict[str, str],
        memory_limit: int = DEFAULT_SPOOL_MEMORY,
        quiet: bool = False,
        close_wait: float = CLOSE_WAIT_S,
    ) -> None:
        self.close_wait = close_wait
        self.address = address
        self.path = f"{address[0]}:{address[1]}"
        self.fmt = "net"
        self.fd = None
        self.tgid = tgid
        self.config = config
        self.counts = [0] * 9
        self.entries = 0
        self.bytes_written = 0
        self.failed = None
        self.quiet = quiet
        self.stream = uuid.uuid4().hex
        self.hello = {
            "stream": self.stream,
            "pid": tgid,
            "host": os.uname().nodename,
            "metadata": metadata,
            "auth": config.auth,
        }
        self.spool = Spool(memory_limit)
        self.closing = False
        self.finished = False  # the collector acknowledged everything after END
        self.state = None  # the last problem reported (one line each time it changes)
        self.reconnects = 0
        self.sender_cpu = 0.0
        self.sock = None
        self.thread = threading.Thread(target=self._run, name=f"pymtrace-send-{tgid}", daemon=True)
        self.thread.start()

    # -- the drain side
    def write(self, data: bytes | bytearray | memoryview, n: int, types: Sequence[int] | None = None) -> None:
        if not isinstance(data, bytes):
            data = bytes(data)  # the reader's buffer may be reused
        try:
            self.spool.append(data, n)
        except SpoolFull as exc:
            self.failed = exc
            raise WriteFailed(str(exc)) from None
        if types is None:
            kinds = data[4 : n * _RS : _RS]
            types = [kinds.count(t) for t in range(9)]
        for t in range(1, 9):
            self.counts[t] += types[t]
        self.entries += n

    def poll(self) -> None:
        """Nothing to do on a poll: the sender thread works on its own."""

    def snapshot_maps(self) -> bool:
        return False

    # -- the sender thread
    def _say(self, state: str, line: str) -> None:
        """Print LINE when the connection's state changes (not on every retry)."""
        if state != self.state:
            self.state = state
            if state != "ok" or not self.quiet:
                print(f"pymtrace: collector {self.path}: {line}", file=sys.stderr, flush=True)

    def _connect(self) -> tuple[socket.socket, int]:
        host, port = self.address
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.config.ssl_context is not None:
                sock = self.config.ssl_context.wrap_socket(sock, server_hostname=self.config.server_name or host)
            sock.sendall(proto.hello_frame(self.hello))
            kind, payload = proto.recv_frame(sock, proto.MAX_HELLO)
            if kind == proto.REFUSED:
                doc = proto.parse_json(payload)
                raise proto.Refused(str(doc.get("code", "")), proto.describe(doc))
            if kind != proto.WELCOME:
                raise proto.ProtocolError(f"unexpected frame {kind} instead of WELCOME")
            acked = int(proto.parse_json(payload).get("acked", 0))
        except BaseException:
            sock.close()
            raise
        return sock, acked

    def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        t0 = time.thread_time()
        try:
            while not self.finished:
                try:
                    sock, acked = self._connect()
                except proto.Refused as exc:
                    self._say(exc.code, f"refused: {exc}; spooling, retrying")
                except (OSError, proto.ProtocolError, ValueError) as exc:
                    what = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
                    self._say("down", f"unreachable ({what}); spooling, retrying")
                else:
                    backoff = BACKOFF_MIN_S
                    self.reconnects += 1
                    if self.state is None:
                        self.state = "ok"
                    self._stream(sock, acked)
                    if self.finished:
                        return
                with self.spool.cond:
                    if self.closing and time.monotonic() > self.close_deadline:
                        return
                    self.spool.cond.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
        finally:
            self.sender_cpu += time.thread_time() - t0

    def _stream(self, sock: socket.socket, acked: int) -> None:
        """Send from ACKED until END is acknowledged or the connection fails."""
        self.sock = sock
        self.spool.ack(acked)
        sent = max(acked, self.spool.acked)
        dead = threading.Event()
        receiver = threading.Thread(target=self._receive, args=(sock, dead), daemon=True)
        receiver.start()
        limit = proto.MAX_FRAME // _RS
        end_sent = False
        try:
            while not dead.is_set() and not self.finished:
                with self.spool.cond:
                    got = self.spool.records(sent, limit)
                    if got is None:
                        if self.closing and not end_sent and sent == self.spool.end:
                            end_sent = True
                            sock.sendall(proto.frame(proto.END, proto.OFFSET.pack(sent)))
                        self.spool.cond.wait(0.2)
                        continue
                first, data = got
                sock.sendall(proto.HEADER.pack(proto.DATA, proto.OFFSET.size + len(data)) + proto.OFFSET.pack(first))
                sock.sendall(data)
                sent = first + len(data) // _RS
        except (OSError, ValueError):
            pass
        finally:
            dead.set()
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            receiver.join(5)
            sock.close()
            self.sock = None

    def _receive(self, sock: socket.socket, dead: threading.Event) -> None:
        """ACKs (and a REFUSED: disk full) from the collector, until the connection ends."""
        try:
            while not dead.is_set():
                kind, payload = proto.recv_frame(sock, proto.MAX_HELLO)
                if kind == proto.ACK:
                    (offset,) = proto.OFFSET.unpack(payload[: proto.OFFSET.size])
                    self.spool.ack(offset)
                    # said once it really works again (a collector with a full disk accepts
                    # the connection, then refuses the data: no line for that)
                    self._say("ok", f"delivering again (acknowledged up to record {offset})")
                    with self.spool.cond:
                        if self.closing and offset >= self.spool.end:
                            self.finished = True
                            self.spool.cond.notify_all()
                            return
                elif kind == proto.REFUSED:
                    doc = proto.parse_json(payload)
                    self._say(str(doc.get("code", "")), f"refused: {proto.describe(doc)}; spooling, retrying")
                    return
        except (OSError, proto.ProtocolError, ValueError, ssl.SSLError):
            pass
        finally:
            dead.set()
            with self.spool.cond:
                self.spool.cond.notify_all()

    # -- the end
    def discard(self) -> None:
        """Stop sending (the recording failed to start): nothing was recorded."""
        with self.spool.cond:
            self.finished = True
            self.spool.cond.notify_all()
        self.thread.join(CONNECT_TIMEOUT_S)
        self.spool.close()

    def begin_close(self) -> None:
        """Start the end: send the rest and END; the close_wait deadline counts from now. The
        recorder calls it on every output (--follow-forks: one per process) before close(), so
        their waits run at once and the end takes one close_wait in all, not one each."""
        with self.spool.cond:
            if self.closing:
                return
            self.close_deadline = time.monotonic() + self.close_wait
            self.closing = True
            self.spool.cond.notify_all()

    def close(self) -> None:
        """Send the rest and wait (up to close_wait seconds from begin_close) until the collector
        has it all; what it never took is kept in a local mtrace-bin file and reported (WriteFailed)."""
        self.begin_close()
        # the sender leaves at the deadline (or within a connect attempt after it)
        self.thread.join(max(0.0, self.close_deadline - time.monotonic()) + CONNECT_TIMEOUT_S)
        self.bytes_written = self.spool.acked * _RS
        if self.finished:
            self.spool.close()
            return
        left = self.spool.end - self.spool.acked
        from pymtrace.trace.files import open_unique

        try:
            path, fd = open_unique(f"mtrace.out.{self.tgid}")
            with os.fdopen(fd, "wb") as f:
                f.write(mtrace_bin.magic_record(self.tgid))
                for blob in self.spool.unacked():
                    f.write(blob)
            kept = f"kept in {path} (mtrace-bin)"
        except (OSError, PymtraceError) as exc:
            kept = f"and could not be kept locally: {exc}"
        finally:
            self.spool.close()
        self.failed = WriteFailed(f"{left} entries never acknowledged by the collector {self.path}, {kept}")
        raise self.failed

    def summary(self) -> dict:
        return {
            "file": self.path,
            "pid": self.tgid,
            "format": "net",
            "entries": self.entries,
            "counts": {mtrace_bin.TYPE_NAMES[t]: self.counts[t] for t in range(1, 9)},
            "bytes_written": self.bytes_written,
            "acknowledged": self.spool.acked,
            "stream": self.stream,
            "connections": self.reconnects,
            "spool_max_memory_bytes": self.spool.max_memory_bytes,
            "spool_max_disk_bytes": self.spool.max_disk_bytes,
            "sender_cpu_s": round(self.sender_cpu, 6),
        }
