"""A real `pymtrace collect` process for the tests, and readers of its dataset."""

import contextlib
import os
import signal
import subprocess
import time

from support.cli import PYMTRACE


class CollectorProcess:
    """`pymtrace collect --listen 127.0.0.1:PORT --dir DIR EXTRA...` (PORT 0: any, then kept
    across restarts). .port once listening; .stderr: everything it printed so far."""

    def __init__(self, directory, *extra, port=0):
        self.directory = str(directory)
        self.extra = [str(e) for e in extra]
        self.port = port
        self.lines = []
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            PYMTRACE + ["collect", "--listen", f"127.0.0.1:{self.port}", "--dir", self.directory, *self.extra],
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise AssertionError("collect exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if "listening on " in line:
                self.port = int(line.split("listening on ")[1].split(",")[0].rsplit(":", 1)[1])
                return
        raise AssertionError("collect did not start:\n" + "".join(self.lines))

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def wait_connected(self, timeout=120):
        """Until a client holds an established TCP connection to the collector (the kernel's
        /proc/net/tcp: state 01 with our port as the local one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open("/proc/net/tcp") as f:
                for line in f.readlines()[1:]:
                    local, _remote, state = line.split()[1:4]
                    if state == "01" and int(local.split(":")[1], 16) == self.port:
                        return
            time.sleep(0.05)
        raise AssertionError(f"no client connected to {self.address} in {timeout} s")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self._reap()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self._reap()

    def _reap(self):
        out = self.proc.communicate(timeout=30)[1]
        self.lines.append(out)

    @property
    def stderr(self):
        """What it printed: all of it once it has stopped, up to its start line before."""
        return "".join(self.lines)

    def close(self):
        if self.proc.poll() is None:
            self.stop()


@contextlib.contextmanager
def collectors(directory):
    """Yields make(*extra): a CollectorProcess on DIRECTORY; every one is stopped at the end."""
    procs = []

    def make(*extra):
        c = CollectorProcess(directory, *extra)
        procs.append(c)
        return c

    try:
        yield make
    finally:
        for c in procs:
            c.close()


def token_file(directory, token):
    """DIRECTORY/token holding TOKEN, private (mode 0600) as `collect --token-file` wants it."""
    path = directory / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def client_config(path, credentials):
    """A client configuration (`record --web-config`) at PATH that presents CREDENTIALS."""
    path.write_text(f"authorization:\n  credentials: {credentials}\n")
    return path


def type_counts(directory, where=""):
    """{type: count} of the dataset under DIRECTORY, read by DuckDB with Hive partitions."""
    import duckdb

    sql = (
        f"select type, count(*) from read_parquet('{directory}/**/*.parquet', hive_partitioning=true) "
        f"{where} group by type"
    )
    return dict(duckdb.sql(sql).fetchall())


def parts(directory):
    """Every part file under DIRECTORY (relative paths)."""
    out = []
    for root, _dirs, files in os.walk(directory):
        out += [os.path.relpath(os.path.join(root, f), directory) for f in files if f.endswith(".parquet")]
    return sorted(out)
