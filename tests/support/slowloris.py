"""Slowloris clients for the tests of pymtrace's servers (the exporter, the collector): real
sockets on 127.0.0.1, bounded in count and time."""

import select
import socket
import threading
import time


class SlowClients:
    """Slowloris: clients that each send one more byte of PAYLOAD every PERIOD seconds (well
    within a server's per-read timeout; from the start again once all of it is sent) and
    reconnect whenever the server closes them, from the given source addresses; one thread,
    bounded in time. Counts its connections and the closes by the server."""

    def __init__(self, port, sources, payload, period=0.5, duration=10.0):
        self.port, self.sources, self.payload = port, sources, payload
        self.period, self.duration = period, duration
        self.connects = self.closed_by_server = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        socks = {}  # index -> [socket, bytes sent]
        end = time.monotonic() + self.duration
        while not self.stop.is_set() and time.monotonic() < end:
            for i, src in enumerate(self.sources):
                entry = socks.get(i)
                if entry is not None and select.select([entry[0]], [], [], 0)[0]:  # EOF or a reply: closed
                    entry[0].close()
                    self.closed_by_server += 1
                    del socks[i]
                    entry = None
                if entry is None:
                    try:
                        s = socket.create_connection(("127.0.0.1", self.port), timeout=1, source_address=(src, 0))
                    except OSError:
                        continue
                    self.connects += 1
                    entry = socks[i] = [s, 0]
                try:
                    entry[0].send(self.payload[entry[1] : entry[1] + 1])
                    entry[1] = (entry[1] + 1) % len(self.payload)
                except OSError:
                    entry[0].close()
                    del socks[i]
            self.stop.wait(self.period)
        for s, _ in socks.values():
            s.close()

    def close(self):
        self.stop.set()
        self.thread.join(10)
