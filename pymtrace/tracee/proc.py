"""The traced process as /proc shows it: liveness, exit status, name and cgroup (one definition each)."""

from __future__ import annotations

import os
import time
from typing import Dict, Optional

from pymtrace.errors import ProcessGone


def alive(pid: int) -> bool:
    """Whether PID exists and is neither a zombie nor dead (a zombie's memory is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


def exists(pid: int) -> bool:
    """Whether /proc/PID exists (a zombie counts: it has not been reaped yet)."""
    return os.path.exists(f"/proc/{pid}")


def comm(pid: int, missing: str = "") -> str:
    """The process's name from /proc/PID/comm, or MISSING when it cannot be read (exited)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return missing


def exe(pid: int) -> str | None:
    """The process's executable as it names it (/proc/PID/exe: the path in its own mount
    namespace, as in its maps), or None when it cannot be read (exited, a kernel thread)."""
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def effective_uid(pid: int) -> int | None:
    """The process's effective user id (/proc/PID/status), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


_cgroup_cache = {}


def cgroup(pid: int) -> Optional[str]:
    """The process's cgroup v2 path (or the v1 memory controller's), cached per PID;
    None when /proc/PID/cgroup cannot be read."""
    hit = _cgroup_cache.get(pid)
    if hit is not None:
        return hit
    path = None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and (parts[0] == "0" and parts[1] == "" or "memory" in parts[1].split(",")):
                    path = parts[2] or "/"
                    if parts[0] == "0":
                        break
    except OSError:
        return None
    if len(_cgroup_cache) > 65536:
        _cgroup_cache.clear()
    _cgroup_cache[pid] = path
    return path


def exit_status(code: Optional[int]) -> int:
    """A child's status as a shell reports it: its exit code, or 128 + the killing signal."""
    if code is None:
        return 0
    return code if code >= 0 else 128 - code


def tgid(pid: int) -> int:
    """The process (thread group) thread PID belongs to. Raises ProcessGone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    raise ProcessGone(pid)


def start_stack(pid: int) -> int:
    """The address of the bottom of PID's initial stack (its main thread's stack top:
    /proc/PID/stat's startstack); 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b") ", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(pid) from None
    except PermissionError:
        return 0
    return int(fields[25]) if len(fields) > 25 else 0


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def rss(pid: int) -> Optional[tuple[int, int]]:
    """(resident bytes, anonymous resident bytes) of PID, or None when it cannot be read.

    From /proc/PID/statm: the kernel's per-mm counters (resident = anon + file + shmem
    pages, shared = file + shmem), so resident - shared is exactly status's RssAnon. Chosen
    over /proc/PID/status (the same counters in ~1.4 KB of text: 2x the CPU), smaps_rollup
    (walks every page table: 3.5x for a small process, ~19 ms for one with 1 GiB touched)
    and netlink taskstats (only the peak hiwater_rss: 8x); bench/rss_sources.py."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            fields = f.read().split()
        resident, shared = int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None
    return resident * PAGE_SIZE, (resident - shared) * PAGE_SIZE


def cpu_ns(pid: int) -> Optional[int]:
    """CPU nanoseconds PID (every thread of the process, those exited included) has run, or
    None when it is gone: its process CPU clock (clock_getcpuclockid's id, CPUCLOCK_SCHED:
    the scheduler's own count, not ticks), one system call instead of a /proc read."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)
    except OSError:
        return None


def thread_demand_ns(pid: int) -> Optional[Dict[int, int]]:
    """{tid: ns it ran + ns it waited on a run queue} of each of PID's threads
    (/proc/PID/task/TID/schedstat: the scheduler's own counts), or None when they cannot be
    read (gone, or a kernel without CONFIG_SCHED_INFO). A thread whose demand grows as fast
    as the clock never slept: it would have used more CPU time had it been given it."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                run, wait = f.read().split()[:2]
            out[int(tid)] = int(run) + int(wait)
        except (OSError, ValueError):
            continue
    return out or None


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def host_busy_ns() -> Optional[int]:
    """CPU nanoseconds every CPU has spent busy since boot (/proc/stat's user, nice, system,
    irq and softirq), or None when it cannot be read; a 10 ms resolution per CPU."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        busy = sum(int(fields[i]) for i in (1, 2, 3, 6, 7))
    except (OSError, IndexError, ValueError):
        return None
    return busy * 1_000_000_000 // _CLK_TCK
