"""Admission of connections to a server that authenticates its clients (the exporter's
HTTP server, the collector): bounded counts, and room made for a new client by closing
(evicting) a connection still waiting for its request or its authentication.

The server's accept loop calls admit() for each new connection, the connection's thread
set_pending(False) once the client is authenticated (it is then never evicted), mark_known()
after a success from its address, and forget() before it closes the socket (a descriptor
must not be shut down once it may belong to another connection).
"""

from __future__ import annotations

import collections
import socket
import threading
import time


class Conn:
    """One open connection: its descriptor (to shut it down from another thread), client
    address, when it began waiting for its current request, and whether that request is
    still unauthenticated (evictable)."""

    __slots__ = ("fd", "ip", "since", "pending", "evicted")

    def __init__(self, fd: int, ip: str) -> None:
        self.fd, self.ip, self.since = fd, ip, time.monotonic()
        self.pending, self.evicted = True, False


class Admission:
    """At most MAX_CONNECTIONS connections, MAX_PER_CLIENT per client address (all of its
    connections, or with PER_CLIENT_PENDING only those not yet authenticated). A new
    connection beyond a cap evicts the oldest one still waiting (of an address that never
    succeeded, if there is one) and is refused only when every connection of the group is
    authenticated."""

    known_max, known_ttl = 1024, 600.0  # addresses that succeeded, remembered

    def __init__(
        self, family: int, max_connections: int, max_per_client: int, per_client_pending: bool = False
    ) -> None:
        self.family = family
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.per_client_pending = per_client_pending
        self.conns = set()
        self.known = collections.OrderedDict()  # client address -> last success
        self.lock = threading.Lock()
        self.rejected = self.evicted = 0

    def _victim(self, conns: list[Conn], now: float) -> Conn | None:
        waiting = [c for c in conns if c.pending]
        strangers = [c for c in waiting if not self.is_known(c.ip, now)]
        return min(strangers or waiting, key=lambda c: c.since, default=None)

    def _evict(self, conn: Conn) -> None:
        conn.evicted = True
        self.evicted += 1
        try:  # shutdown() on a duplicate of the descriptor wakes the thread blocked on it
            with socket.fromfd(conn.fd, self.family, socket.SOCK_STREAM) as dup:
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def admit(self, sock: socket.socket, ip: str) -> Conn | None:
        """SOCK's Conn, or None: refused (the caller closes it unread)."""
        now = time.monotonic()
        with self.lock:
            live = [c for c in self.conns if not c.evicted]
            if len(self.conns) >= 2 * self.max_connections:  # evicted ones not yet gone
                self.rejected += 1
                return None
            mine = [c for c in live if c.ip == ip and (c.pending or not self.per_client_pending)]
            for group, cap in ((mine, self.max_per_client), (live, self.max_connections)):
                if len(group) >= cap:
                    victim = self._victim(group, now)
                    if victim is None:
                        self.rejected += 1
                        return None
                    self._evict(victim)
                    live.remove(victim)
            conn = Conn(sock.fileno(), ip)
            self.conns.add(conn)
            return conn

    def evict_waiting(self, longer_than: float) -> int:
        """Evict every connection waiting longer than LONGER_THAN seconds (a deadline kept
        however slowly its bytes come); how many."""
        cutoff = time.monotonic() - longer_than
        with self.lock:
            late = [c for c in self.conns if c.pending and not c.evicted and c.since < cutoff]
            for c in late:
                self._evict(c)
        return len(late)

    def open_connections(self) -> int:
        """Connections counted against the caps (evicted ones are on their way out)."""
        with self.lock:
            return sum(1 for c in self.conns if not c.evicted)

    def forget(self, conn: Conn) -> None:
        with self.lock:
            self.conns.discard(conn)

    def set_pending(self, conn: Conn, pending: bool) -> None:
        with self.lock:
            conn.pending = pending
            if pending:
                conn.since = time.monotonic()

    def is_known(self, ip: str, now: float | None = None) -> bool:
        seen = self.known.get(ip)
        return seen is not None and (now or time.monotonic()) - seen < self.known_ttl

    def mark_known(self, ip: str) -> None:
        with self.lock:
            self.known[ip] = time.monotonic()
            self.known.move_to_end(ip)
            while len(self.known) > self.known_max:
                self.known.popitem(last=False)
