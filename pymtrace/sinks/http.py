"""The exporter's HTTP(S) server: serves a prometheus-client registry on /metrics.

Generic over what the registry holds (pymtrace.sinks.prometheus provides the exporter's
metrics): one thread per connection, TLS and basic auth from a web config
(pymtrace.sinks.webconfig), and bounded resources that keep a scraper served under abuse
(admission with eviction, a per-request deadline, single-flight rendering).
"""

from __future__ import annotations

import gzip
import io
import os
import re
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Dict, Optional, Tuple, Union

from prometheus_client.exposition import choose_encoder

from pymtrace import __version__
from pymtrace.errors import PymtraceError
from pymtrace.net.admission import Admission, Conn

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from pymtrace.sinks.webconfig import WebConfig

INDEX = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>pymtrace exporter</title></head>
<body><h1>pymtrace exporter</h1>
<p>Memory-allocation metrics from eBPF ({mode} mode, series by {label}).</p>
<p><a href="/metrics">Metrics</a></p>
<p>pymtrace {version}</p>
</body></html>
"""


class MetricsServer(ThreadingHTTPServer):
    """One thread per connection, TLS handshakes in that thread, and bounded resources
    that keep a scraper served under abuse:

    * each request (TLS handshake, request line, headers) must arrive whole within
      `request_timeout` of the connection (or of the previous response), not just byte by
      byte within the socket timeout;
    * at most `max_connections` connections, `max_per_client` per client address; a new
      connection beyond a cap evicts the oldest one still waiting for its request or its
      authentication (of an address that never scraped successfully, if there is one), and
      is refused only when every connection is busy with an authenticated request;
    * concurrent /metrics requests share one reading of the maps (single flight).
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        address: Tuple[str, int],
        registry: Optional[CollectorRegistry],
        web: Optional[WebConfig] = None,
        timeout: float = 10.0,
        max_connections: int = 64,
        index_html: str = "",
        request_timeout: float = 5.0,
        max_per_client: int = 16,
    ) -> None:
        host = address[0]
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.registry = registry
        self.web = web
        self.conn_timeout = timeout
        self.request_timeout = request_timeout
        self.index_html = index_html
        self.admission = Admission(self.address_family, max_connections, max_per_client)
        self._render_lock = threading.Lock()
        self._rendered = {}  # content type -> [collection start, body, gzipped body]
        super().__init__(address, MetricsHandler)

    # -- admission (pymtrace.net.admission)

    @property
    def evicted(self) -> int:
        return self.admission.evicted

    def open_connections(self) -> int:
        return self.admission.open_connections()

    def forget(self, conn: Conn) -> None:
        self.admission.forget(conn)

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        conn = self.admission.admit(request, client_address[0])
        if conn is None:
            self.shutdown_request(request)
            return
        t = threading.Thread(target=self._serve, args=(request, client_address, conn), daemon=True)
        try:
            t.start()
        except RuntimeError:  # cannot start a thread: shed this connection
            self.forget(conn)
            self.shutdown_request(request)

    def _serve(self, request: socket.socket, client_address: tuple, conn: Conn) -> None:
        try:
            self.finish_request(request, client_address, conn)
        except (OSError, ValueError):  # reset, broken pipe, TLS error, a socket closed by eviction
            self.handle_error(request, client_address)
        finally:
            self.forget(conn)
            self.shutdown_request(request)

    def finish_request(self, request: socket.socket, client_address: tuple, conn: Optional[Conn] = None) -> None:
        # the handshake counts towards the first request's deadline
        request.settimeout(max(0.001, min(self.conn_timeout, self.request_timeout)))
        ctx = self.web.ssl_context if self.web else None
        if ctx is not None:
            try:
                request = ctx.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
                request.do_handshake()
            except (ssl.SSLError, OSError, ValueError):
                if conn is not None:  # before the descriptor is closed and can be reused
                    self.forget(conn)
                request.close()
                return
        try:
            self.RequestHandlerClass(request, client_address, self, conn=conn)
        finally:
            if ctx is not None:
                if conn is not None:
                    self.forget(conn)
                try:
                    request.close()
                except OSError:
                    pass

    def handle_error(self, request: socket.socket, client_address: tuple) -> None:
        pass  # a client that went away is not an error worth a traceback

    # -- /metrics

    def render(self, accept: Optional[str], gzip_ok: bool) -> Tuple[bytes, str, bool]:
        """(body, content type, gzipped?) of /metrics. Requests that wait while the maps
        are being read share the next reading instead of queueing one each; a reading that
        began before a request arrived is never served to it."""
        encoder, ctype = choose_encoder(accept)
        arrived = time.monotonic()
        with self._render_lock:
            hit = self._rendered.get(ctype)
            if hit is None or hit[0] < arrived:
                started = time.monotonic()
                hit = self._rendered[ctype] = [started, encoder(self.registry), None]
            body = hit[1]
            if gzip_ok and len(body) > 1024:
                if hit[2] is None:
                    hit[2] = gzip.compress(body, compresslevel=5)
                return hit[2], ctype, True
        return body, ctype, False


class _DeadlineReader(io.RawIOBase):
    """The request side of a connection: every read waits at most until the handler's
    deadline, so a request must arrive whole in time, not just each byte."""

    def __init__(self, sock: socket.socket, handler: MetricsHandler) -> None:
        self.sock, self.handler = sock, handler

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:
        idle = self.handler.server.conn_timeout
        deadline = self.handler.deadline
        left = idle if deadline is None else min(idle, deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError("the request did not arrive before its deadline")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buf)
        finally:
            self.sock.settimeout(idle)


class MetricsHandler(BaseHTTPRequestHandler):
    server_version = f"pymtrace-exporter/{__version__}"
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # answer garbage with a real status line, not HTTP/0.9

    def __init__(
        self, request: socket.socket, client_address: tuple, server: MetricsServer, conn: Optional[Conn] = None
    ) -> None:
        self.conn = conn
        self.deadline = (conn.since if conn else time.monotonic()) + server.request_timeout
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.conn_timeout)
        self.rfile.close()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self))

    def handle_one_request(self) -> None:
        if self.deadline is None:  # keep-alive: the next request has its own deadline
            self.deadline = time.monotonic() + self.server.request_timeout
            if self.conn:
                self.server.admission.set_pending(self.conn, True)
        try:
            super().handle_one_request()
        finally:
            self.deadline = None

    def log_message(self, fmt: str, *args: object) -> None:
        if os.environ.get("PYMTRACE_EXPORTER_ACCESS_LOG"):
            super().log_message(fmt, *args)

    def _send(
        self,
        code: int,
        body: Union[str, bytes],
        ctype: str = "text/plain; charset=utf-8",
        extra: Optional[Dict[str, str]] = None,
    ) -> None:
        if isinstance(body, str):
            body = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        web = self.server.web
        if web:
            for k, v in web.headers.items():
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorized(self) -> bool:
        web = self.server.web
        if web is not None and web.auth_required:
            from pymtrace.sinks import webconfig

            result = web.authenticate(self.headers.get("Authorization"), self.client_address[0])
            if result == webconfig.AUTH_LIMITED:
                self.close_connection = True
                self._send(
                    429, "Too Many Requests: too many password checks from this address\n", extra={"Retry-After": "1"}
                )
                return False
            if result != webconfig.AUTH_OK:
                self._send(401, "Unauthorized\n", extra={"WWW-Authenticate": 'Basic realm="pymtrace"'})
                return False
        if self.conn:  # authenticated: no longer evictable
            self.server.admission.set_pending(self.conn, False)
        return True

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return
        if path == "/metrics":
            # prometheus-client picks text 0.0.4 or OpenMetrics from the Accept header.
            try:
                body, ctype, gzipped = self.server.render(
                    self.headers.get("Accept"), "gzip" in (self.headers.get("Accept-Encoding") or "")
                )
            except Exception as exc:  # whatever the registry's collectors raise: told to the client, not fatal
                self._send(500, f"collecting metrics failed: {exc}\n")
                return
            self._send(200, body, ctype, {"Content-Encoding": "gzip"} if gzipped else None)
            self.server.admission.mark_known(self.client_address[0])
        elif path == "/":
            self._send(200, self.server.index_html, "text/html; charset=utf-8")
        else:
            self._send(404, "Not Found: try /metrics\n")

    do_HEAD = do_GET

    def do_POST(self) -> None:
        self._send(405, "Method Not Allowed\n", extra={"Allow": "GET, HEAD"})

    do_PUT = do_DELETE = do_PATCH = do_POST


def parse_listen(text: str) -> Tuple[str, int]:
    """HOST:PORT, :PORT, [V6]:PORT or PORT -> (host, port)."""
    text = text.strip()
    m = re.fullmatch(r"\[([0-9a-fA-F:.%\w]+)\]:(\d+)", text) or re.fullmatch(r"([^:]*):(\d+)", text)
    if m:
        host, port = m.group(1), int(m.group(2))
    elif text.isdigit():
        host, port = "", int(text)
    else:
        raise PymtraceError(f"--listen {text!r}: expected HOST:PORT, :PORT or [IPV6]:PORT")
    if not 0 <= port <= 65535:
        raise PymtraceError(f"--listen {text!r}: port out of range")
    return host, port


def make_server(
    listen: Union[str, Tuple[str, int]],
    registry: Optional[CollectorRegistry],
    web: Optional[WebConfig] = None,
    timeout: float = 10.0,
    index_html: str = "",
    max_connections: int = 64,
    request_timeout: float = 5.0,
    max_per_client: int = 16,
) -> "MetricsServer":
    """A MetricsServer listening on LISTEN (HOST:PORT text or a (host, port) pair) that
    serves REGISTRY (a prometheus_client registry; may be set later as .registry) with the
    TLS/basic-auth settings WEB (pymtrace.sinks.webconfig). A bind failure is a one-line
    PymtraceError."""
    host, port = parse_listen(listen) if isinstance(listen, str) else listen
    try:
        return MetricsServer(
            (host, port),
            registry,
            web=web,
            timeout=timeout,
            index_html=index_html,
            max_connections=max_connections,
            request_timeout=request_timeout,
            max_per_client=max_per_client,
        )
    except OSError as exc:
        raise PymtraceError(f"cannot listen on {host or '*'}:{port}: {exc.strerror or exc}") from None
