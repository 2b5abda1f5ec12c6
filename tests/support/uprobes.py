"""The uprobes a process holds (bpftool, tracefs, uprobe_multi links), and ProbeWatch, which
proves that a pymtrace process leaves none behind."""

import os
import shutil
import subprocess

from support.needs import missing_or_fail


def bpftool_perf_list():
    """`bpftool -j perf list`: every BPF program attached through a perf event, by holder."""
    import json

    if shutil.which("bpftool") is None:
        missing_or_fail("bpftool is not installed (Debian package bpftool)")
    proc = subprocess.run(["bpftool", "-j", "perf", "list"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"bpftool perf list failed: {proc.stderr}"
    return json.loads(proc.stdout or "[]")


def uprobes_of(pid):
    """Every uprobe the (living) process PID holds, from both places BCC may create one:
    perf events of the uprobe PMU (`bpftool perf list`, by the PID holding the fd: they never
    appear in tracefs) and tracefs uprobe_events (BCC names them ..._bcc_PID). Each is a dict:
    source ("perf" or "tracefs"), file, offset, prog_id (None for tracefs), line (tracefs)."""
    import re

    from pymtrace.bpf import load as bpfload

    probes = [
        {
            "source": "perf",
            "file": e.get("filename"),
            "offset": e.get("offset"),
            "prog_id": e.get("prog_id"),
            "line": None,
        }
        for e in bpftool_perf_list()
        if e.get("pid") == pid and e.get("fd_type") in ("uprobe", "uretprobe")
    ]
    probes += uprobe_links(pid)
    for line in bpfload.own_uprobe_events(pid):
        m = re.search(r" (\S+):0x([0-9a-fA-F]+)", line)
        probes.append(
            {
                "source": "tracefs",
                "file": m.group(1) if m else None,
                "offset": int(m.group(2), 16) if m else None,
                "prog_id": None,
                "line": line.strip(),
            }
        )
    return probes


def uprobe_links(pid):
    """The uprobes of the BPF uprobe_multi links process PID holds (pymtrace.bpf.uprobes), one
    dict per offset as uprobes_of's (source "link", kind "uprobe_multi"/"uretprobe_multi"),
    read from /proc/PID/fdinfo (where the kernel lists no offsets: one dict, offset None)."""
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:bpf_link":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        info = dict(line.split(":", 1) for line in lines if ":" in line)
        kind = info.get("link_type", "").strip()
        if kind not in ("uprobe_multi", "uretprobe_multi"):
            continue
        base = {"source": "link", "kind": kind, "file": info.get("path", "").strip() or None, "line": None}
        base["prog_id"] = int(info["prog_id"]) if "prog_id" in info else None
        offsets = [
            int(parts[1], 16)
            for parts in (line.split() for line in lines)
            if len(parts) == 3 and parts[1].startswith("0x")
        ]
        if not offsets and "link_id" in info:  # kernels before 6.14 list no offsets in fdinfo
            # (nor "uretprobe_multi" as the link type: the link's flags say it)
            base["file"], offsets, ret = _uprobe_multi_info(int(info["link_id"]))
            if ret:
                base["kind"] = "uretprobe_multi"
        out += [dict(base, offset=o) for o in offsets] or [dict(base, offset=None)]
    return out


def _uprobe_multi_info(link_id):
    """(path, [offsets], return probes?) of uprobe_multi link LINK_ID from the kernel's
    bpf_link_info (6.8+; (None, [], False) where it cannot tell): BPF_LINK_GET_FD_BY_ID,
    BPF_OBJ_GET_INFO_BY_FD."""
    import ctypes

    from pymtrace.bpf import stats

    attr = (ctypes.c_uint8 * 128)()
    ctypes.c_uint32.from_buffer(attr, 0).value = link_id
    try:
        fd = stats.call(30, attr)  # BPF_LINK_GET_FD_BY_ID
    except OSError:
        return None, [], False
    try:
        path = ctypes.create_string_buffer(4096)
        offsets = (ctypes.c_uint64 * 4096)()
        info = (ctypes.c_uint8 * 256)()
        for off, value in ((16, ctypes.addressof(path)), (24, ctypes.addressof(offsets))):
            ctypes.c_uint64.from_buffer(info, off).value = value  # uprobe_multi.path, .offsets
        ctypes.c_uint32.from_buffer(info, 48).value = len(path)  # .path_size
        ctypes.c_uint32.from_buffer(info, 52).value = len(offsets)  # .count
        attr = (ctypes.c_uint8 * 128)()
        ctypes.c_uint32.from_buffer(attr, 0).value = fd
        ctypes.c_uint32.from_buffer(attr, 4).value = len(info)
        ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(info)
        try:
            stats.call(15, attr)  # BPF_OBJ_GET_INFO_BY_FD
        except OSError:
            return None, [], False
        count = ctypes.c_uint32.from_buffer(info, 52).value
        ret = bool(ctypes.c_uint32.from_buffer(info, 56).value & 1)  # .flags: BPF_F_UPROBE_MULTI_RETURN
        return path.value.decode(errors="replace") or None, list(offsets[: min(count, len(offsets))]), ret
    finally:
        os.close(fd)


def bpf_prog_exists(prog_id):
    """Whether BPF program PROG_ID still exists (IDs are not reused soon: allocated cyclically)."""
    proc = subprocess.run(
        ["bpftool", "-j", "prog", "show", "id", str(prog_id)], capture_output=True, text=True, timeout=30
    )
    return proc.returncode == 0


class ProbeWatch:
    """Proves a pymtrace process leaves no uprobe behind, in a way that can fail.

    Once the process has exited, bpftool can no longer attribute perf-event uprobes to its
    PID, so `uprobes_of(pid) == []` after exit is hollow. Instead: sample() while it runs
    (records the BPF programs and tracefs events its uprobes use); after it ended,
    assert_gone() checks that none of those programs exists any more (a leaked perf event,
    a forked child or a pin holding it keeps it alive), no uprobe_events line of the PID
    remains, and, if the PID is still alive (in-process use), that it holds no uprobe."""

    def __init__(self, pid):
        self.pid = pid
        self.prog_ids = set()
        self.lines = set()
        self.seen = []
        self._thread = None

    def sample(self):
        probes = uprobes_of(self.pid)
        self.prog_ids.update(p["prog_id"] for p in probes if p["prog_id"] is not None)
        self.lines.update(p["line"] for p in probes if p["line"])
        self.seen.extend(probes)
        return probes

    def wait_attached(self, minimum=1, timeout=60, running=lambda: True):
        """Sample until the process holds at least MINIMUM uprobes; fail if it never does."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            probes = self.sample()
            if len(probes) >= minimum:
                return probes
            assert running() and time.monotonic() < deadline, (
                f"process {self.pid} never held {minimum} uprobe(s) (held {probes})"
            )
            time.sleep(0.1)

    def follow(self, proc):
        """Sample in the background until PROC (a Popen) ends: for runs whose probes
        are attached for too short a time to wait for them."""
        import threading

        self.sample()  # in this thread: a missing bpftool fails (or skips) the test here

        def loop():
            while proc.poll() is None:
                try:
                    self.sample()
                except Exception:  # the PID vanished mid-listing: done
                    pass

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def assert_gone(self, timeout=10):
        """After the process ended: nothing it attached remains (freeing is asynchronous:
        allow TIMEOUT seconds)."""
        import time

        from pymtrace.bpf import load as bpfload

        if self._thread is not None:
            self._thread.join(timeout=60)
        deadline = time.monotonic() + timeout
        while True:
            left = sorted(i for i in self.prog_ids if bpf_prog_exists(i))
            lines = bpfload.own_uprobe_events(self.pid)
            held = uprobes_of(self.pid) if _alive(self.pid) else []
            if not (left or lines or held) or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        assert not left, f"BPF programs of process {self.pid}'s uprobes still exist: {left}"
        assert not lines, f"uprobe_events of process {self.pid} left behind: {lines}"
        assert not held, f"process {self.pid} still holds uprobes: {held}"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    if pid == os.getpid():
        return True
    try:  # a zombie child holds nothing any more
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
