"""Helpers for the `pymtrace top` tests (no tests here): run `pymtrace top` and a workload
as subprocesses, read their output lines with timeouts, check the uprobes are gone."""

import json
import os
import queue
import signal
import subprocess
import threading
import time

from support.cli import PYMTRACE
from support.uprobes import ProbeWatch, bpftool_perf_list, uprobe_links


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

    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
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
        self.proc = subprocess.Popen(
            PYMTRACE + ["top", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out = Lines(self.proc.stdout)
        self.watch = ProbeWatch(self.proc.pid)

    def probes_attached(self, minimum=1):
        """top's uprobes while it runs (recorded for watch.assert_gone); fails if it holds none."""
        return self.watch.wait_attached(minimum, running=lambda: self.proc.poll() is None)

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

    def json_span(self, start, end, timeout=30):
        """The JSON documents from the first whose snapshot was taken after monotonic time
        START to the first taken after END: together their intervals cover START..END (a slow
        machine may report calls made in that span in any of them, not only the last)."""
        deadline = time.monotonic() + timeout
        docs = [self.json_after(start, timeout)]
        while docs[-1]["time"] <= end:
            docs.append(self.json_doc(max(1, deadline - time.monotonic())))
        return docs

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


def _file_offset(path, vaddr):
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        for seg in ELFFile(f).iter_segments():
            if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= vaddr < seg["p_vaddr"] + seg["p_filesz"]:
                return vaddr - seg["p_vaddr"] + seg["p_offset"]
    raise AssertionError(f"{vaddr:#x} not in a segment of {path}")


def probe_site_bytes(pid, function, offset=0):
    """(byte in PID's memory, byte in the file) at FUNCTION+OFFSET of PID's libc.
    While a uprobe is installed there the process sees 0xcc (int3)."""
    from pymtrace.tracee import libc

    path = libc.process_libc(pid)
    off = _file_offset(path, libc.symbol(path, function).address + offset)
    real = os.path.realpath(path)
    for m in libc.read_maps(pid):
        if os.path.realpath(libc.host_path(pid, m.path)) == real and m.offset <= off < m.offset + (m.end - m.start):
            with open(f"/proc/{pid}/mem", "rb") as mem:
                mem.seek(m.start + off - m.offset)
                in_memory = mem.read(1)[0]
            with open(path, "rb") as f:
                f.seek(off)
                in_file = f.read(1)[0]
            return in_memory, in_file
    raise AssertionError(f"{function} not mapped in {pid}")


def _sites(pid):
    from pymtrace.tracee import libc, probesite

    path = libc.process_libc(pid)
    free = probesite.sites(path, "free")
    return [("malloc", 0), ("free", free.offset)] + [("free", o) for o in free.side_paths]


def assert_probes_installed(top, pid):
    """TOP's uprobes are really in PID: int3 at its probe sites, BPF uprobes held by top
    (recorded in top.watch for assert_probes_gone)."""
    for function, offset in _sites(pid):
        mem, orig = probe_site_bytes(pid, function, offset)
        assert mem == 0xCC and orig != 0xCC, (function, offset, mem, orig)
    top.probes_attached(3)


def _probed_by_others(top_pid, pid, function, offset):
    """Whether another process (other tests, system-wide tracers on this shared machine)
    holds a uprobe at FUNCTION+OFFSET of PID's libc file: then the int3 stays, rightly."""
    from pymtrace.tracee import libc

    path = libc.process_libc(pid)
    ident = os.stat(path)
    off = _file_offset(path, libc.symbol(path, function).address + offset)
    others = [e for e in bpftool_perf_list() if e.get("pid") != top_pid and e.get("fd_type") in ("uprobe", "uretprobe")]
    for other in os.listdir("/proc"):  # uprobe_multi links (pymtrace.bpf.uprobes) held by others
        if other.isdigit() and int(other) != top_pid:
            others += [{"offset": u["offset"], "filename": u["file"]} for u in uprobe_links(int(other))]
    for e in others:
        if e.get("offset") != off:
            continue
        try:
            st = os.stat(e.get("filename") or "")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (ident.st_dev, ident.st_ino):
            return True
    return False


def assert_probes_gone(top, pid):
    """After TOP ended: PID's code is the file's again (unless another tracer on the machine
    probes the same site), nothing of top's remains attached (the BPF programs its perf
    uprobes used while it ran, tracefs uprobe_events)."""
    for function, offset in _sites(pid):
        mem, orig = probe_site_bytes(pid, function, offset)
        if mem != orig:
            assert _probed_by_others(top.proc.pid, pid, function, offset), (function, offset, mem, orig)
    top.watch.assert_gone()


def private_libc(directory):
    """The environment that runs a program on a private copy of the system libc (DIRECTORY/
    libc.so.6, through LD_LIBRARY_PATH): uprobes are per file, so the copy traps only for
    probes placed on it, not for those other tools on this shared machine hold on the system
    libc (each costs every call of every process there; timing tests need it away)."""
    import shutil

    from pymtrace.tracee import libc

    copy = os.path.join(directory, "libc.so.6")
    if not os.path.exists(copy):
        shutil.copy2(libc.system_libc(), copy)
    return dict(os.environ, LD_LIBRARY_PATH=str(directory))
