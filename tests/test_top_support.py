"""Helpers for the `pymtrace top` tests (no tests here): run `pymtrace top` and a workload
as subprocesses, read their output lines with timeouts, check the uprobes are gone."""
import json
import os
import queue
import signal
import subprocess
import threading
import time

from conftest import PYMTRACE
from pymtrace import bpfload


class Lines:
    """A subprocess's stdout read line by line in a thread, with timeouts."""

    def __init__(self, stream):
        self.q = queue.Queue()
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream):
        for line in iter(stream.readline, ""):
            self.q.put(line)
        self.q.put(None)

    def get(self, timeout):
        try:
            line = self.q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output within {timeout} s") from None
        if line is None:
            raise AssertionError("the process closed its output")
        return line


class Workload:
    """A test workload speaking the protocol: "ready PID", wait, work, one result line, wait."""

    def __init__(self, argv):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.out = Lines(self.proc.stdout)
        line = self.out.get(30)
        assert line.startswith("ready "), line
        self.pid = int(line.split()[1])

    def go(self):
        self.proc.stdin.write("g")
        self.proc.stdin.flush()

    def result(self, timeout=60):
        return json.loads(self.out.get(timeout))

    def finish(self):
        self.go()
        return self.proc.wait(timeout=30)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Top:
    """`pymtrace top ARGS` in a subprocess."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(PYMTRACE + ["top", *map(str, args)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.out = Lines(self.proc.stdout)

    def json_doc(self, timeout=90):
        while True:
            line = self.out.get(timeout)
            if line.strip():
                return json.loads(line)

    def json_after(self, t, timeout=30):
        """The first JSON document whose snapshot was taken after monotonic time T."""
        deadline = time.monotonic() + timeout
        while True:
            doc = self.json_doc(max(1, deadline - time.monotonic()))
            if doc["time"] > t:
                return doc

    def block(self, timeout=90):
        """The next batch report (text up to the next header line), as a list of lines."""
        lines = []
        deadline = time.monotonic() + timeout
        while True:
            line = self.out.get(max(1, deadline - time.monotonic()))
            if line.startswith("pymtrace top - ") and lines:
                self.pending = line
                return lines
            lines.append(line.rstrip("\n"))

    def stop(self, sig=signal.SIGINT, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        return rc

    def stderr(self):
        return self.proc.stderr.read()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def own_uprobes(pid):
    return bpfload.own_uprobe_events(pid)


def proc_faults(pid):
    """minflt + majflt of PID from /proc/PID/stat (the kernel's own count)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after "pid (comm)": state=0 ... minflt=7, cminflt=8, majflt=9
    return int(fields[7]) + int(fields[9])


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
