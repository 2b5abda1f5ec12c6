"""The kernel's own accounting of this process's BPF programs and maps.

Used by the exporter's self-metrics: per-program run count and run time (kernel BPF
stats), and how full each map is. Everything is read from file descriptors this process
holds (`/proc/self/fd` -> `anon_inode:bpf-prog` / `anon_inode:bpf-map`) through their
`/proc/self/fdinfo` entries and the bpf(2) syscall, so it covers whatever programs the
sources loaded without knowing their internals, and needs neither bpftool nor BCC.

Run-time statistics cost a little on every program run, so the kernel keeps them off by
default. `enable()` turns them on with BPF_ENABLE_STATS, which holds them on only while the
returned file descriptor is open (so they go off again when the exporter exits, even if it
is killed); on kernels without it (< 5.8) it falls back to the sysctl
kernel.bpf_stats_enabled, restored on close().
"""

from __future__ import annotations

import ctypes
import os
import platform
import typing

_SYS_BPF = {
    "x86_64": 321,
    "aarch64": 280,
    "ppc64le": 361,
    "s390x": 351,
    "riscv64": 280,
    "armv7l": 386,
    "i686": 357,
    "i386": 357,
}
BPF_MAP_GET_NEXT_KEY = 4
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_ENABLE_STATS = 32
BPF_STATS_RUN_TIME = 0
# map types whose entries come and go (hash maps); arrays are always "full"
HASH_MAP_TYPES = {1: "hash", 5: "percpu_hash", 9: "lru_hash", 10: "lru_percpu_hash", 13: "hash_of_maps"}
SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"

BPF_MAP_LOOKUP_BATCH = 24
PERCPU_MAP_TYPES = {5, 10}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_NR = _SYS_BPF.get(platform.machine())


def call(cmd: int, attr: ctypes.Array) -> int:
    """The bpf(2) system call CMD with ATTR (a ctypes buffer): its result, or OSError."""
    if _NR is None:
        raise OSError(38, "bpf syscall number unknown for this architecture")
    return libc_syscall(_NR, ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))


def libc_syscall(nr: int, *args: typing.Any) -> int:
    """System call NR with ARGS (ints, or ctypes pointers): its result, or OSError."""
    ret = _libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def fdinfo(fd: int) -> dict[str, str] | None:
    out = {}
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        return None
    return out


def recursion_misses(fd: int) -> int | None:
    """How often the kernel skipped the BPF program FD instead of running it (fdinfo's
    recursion_misses, Linux 5.12+), or None where the kernel does not say. A tracepoint or
    kprobe program is skipped when its event fires while any BPF program, or a bpf() map
    access from user space, is already running on that CPU: e.g. a slab free in an RCU
    callback at the end of an interrupt that came during such a section."""
    info = fdinfo(fd)
    if not info or "recursion_misses" not in info:
        return None
    return int(info["recursion_misses"])


def own_anon_fds() -> dict[int, str]:
    """{fd: 'anon_inode:...' target} of this process's anonymous-inode descriptors (BPF
    programs and maps, perf events, ...)."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("anon_inode:"):
            out[int(name)] = target
    return out


_BPF_KINDS = {"anon_inode:bpf-prog": "prog", "anon_inode:bpf-map": "map"}


def own_bpf_fds() -> list[tuple[int, str]]:
    """[(fd, 'prog'|'map')] for the BPF objects this process holds open."""
    return [(fd, _BPF_KINDS[t]) for fd, t in own_anon_fds().items() if t in _BPF_KINDS]


def obj_name(fd: int, kind: str) -> str | None:
    """The object's name (bpf_prog_info.name at offset 64, bpf_map_info.name at offset 24)."""
    info = (ctypes.c_uint8 * 256)()
    attr = (ctypes.c_uint8 * 16)()
    ctypes.c_uint32.from_buffer(attr, 0).value = fd
    ctypes.c_uint32.from_buffer(attr, 4).value = ctypes.sizeof(info)
    ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(info)
    try:
        call(BPF_OBJ_GET_INFO_BY_FD, attr)
    except OSError:
        return None
    off = 64 if kind == "prog" else 24
    return bytes(info[off : off + 16]).split(b"\0", 1)[0].decode("ascii", "replace")


def _possible_cpus():
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            n = 0
            for part in f.read().strip().split(","):
                lo, _, hi = part.partition("-")
                n += int(hi or lo) - int(lo) + 1
            return n
    except (OSError, ValueError):
        return os.cpu_count() or 1


_CPUS = _possible_cpus()


def count_entries_batch(fd: int, key_size: int, value_size: int, percpu: bool, batch: int = 512) -> int | None:
    """Number of entries of a hash map read with BPF_MAP_LOOKUP_BATCH (kernel >= 5.6):
    one syscall per BATCH entries. None when the kernel or map does not support it."""
    vsize = ((value_size + 7) // 8 * 8) * _CPUS if percpu else value_size
    keys = (ctypes.c_uint8 * (key_size * batch))()
    values = (ctypes.c_uint8 * (vsize * batch))()
    token_in = (ctypes.c_uint8 * max(key_size, 8))()
    token_out = (ctypes.c_uint8 * max(key_size, 8))()
    attr = (ctypes.c_uint8 * 56)()
    total = 0
    first = True
    while True:
        ctypes.memset(attr, 0, 56)
        ctypes.c_uint64.from_buffer(attr, 0).value = 0 if first else ctypes.addressof(token_in)
        ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(token_out)
        ctypes.c_uint64.from_buffer(attr, 16).value = ctypes.addressof(keys)
        ctypes.c_uint64.from_buffer(attr, 24).value = ctypes.addressof(values)
        ctypes.c_uint32.from_buffer(attr, 32).value = batch
        ctypes.c_uint32.from_buffer(attr, 36).value = fd
        try:
            call(BPF_MAP_LOOKUP_BATCH, attr)
        except OSError as exc:
            if exc.errno == 2:  # ENOENT: the last (partial) batch
                return total + ctypes.c_uint32.from_buffer(attr, 32).value
            return None if first else total
        total += ctypes.c_uint32.from_buffer(attr, 32).value
        ctypes.memmove(token_in, token_out, len(token_in))
        first = False


def count_entries(fd: int, key_size: int, limit: int) -> int:
    """Number of keys in a hash map (walks it with BPF_MAP_GET_NEXT_KEY), at most LIMIT+1."""
    key = (ctypes.c_uint8 * key_size)()
    nxt = (ctypes.c_uint8 * key_size)()
    attr = (ctypes.c_uint8 * 24)()
    ctypes.c_uint32.from_buffer(attr, 0).value = fd
    ctypes.c_uint64.from_buffer(attr, 8).value = 0  # NULL: the first key
    ctypes.c_uint64.from_buffer(attr, 16).value = ctypes.addressof(nxt)
    n = 0
    while n <= limit:
        try:
            call(BPF_MAP_GET_NEXT_KEY, attr)
        except OSError:
            break  # ENOENT: no more keys
        n += 1
        ctypes.memmove(key, nxt, key_size)
        ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(key)
    return n


class BpfStats:
    def __init__(self) -> None:
        self._stats_fd = None
        self._restore_sysctl = False
        self.enabled_by = None  # "BPF_ENABLE_STATS", "sysctl", "already on", or None
        self._names = {}

    def enable(self) -> bool:
        attr = (ctypes.c_uint8 * 8)()
        ctypes.c_uint32.from_buffer(attr, 0).value = BPF_STATS_RUN_TIME
        try:
            self._stats_fd = call(BPF_ENABLE_STATS, attr)
            self.enabled_by = "BPF_ENABLE_STATS"
            return True
        except OSError:
            pass
        try:
            with open(SYSCTL) as f:
                if f.read().strip() == "1":
                    self.enabled_by = "already on"
                    return True
            with open(SYSCTL, "w") as f:
                f.write("1")
            self._restore_sysctl = True
            self.enabled_by = "sysctl"
            return True
        except OSError:
            return False

    def enabled(self) -> bool:
        if self._stats_fd is not None:
            return True
        try:
            with open(SYSCTL) as f:
                return f.read().strip() == "1"
        except OSError:
            return False

    def close(self) -> None:
        if self._stats_fd is not None:
            os.close(self._stats_fd)
            self._stats_fd = None
        if self._restore_sysctl:
            try:
                with open(SYSCTL, "w") as f:
                    f.write("0")
            except OSError:
                pass
            self._restore_sysctl = False

    def _name(self, fd: int, kind: str, ident: str | None) -> str:
        key = (kind, ident)
        if key not in self._names:
            self._names[key] = obj_name(fd, kind) or f"{kind}{ident}"
        return self._names[key]

    def read(self, count_limit: int = 1 << 20) -> dict[str, dict[str, tuple]]:
        """{'progs': {name: (run_cnt, run_time_ns)}, 'maps': {name: (entries|None, max_entries, type)}}."""
        progs, maps = {}, {}
        seen = set()
        for fd, kind in own_bpf_fds():
            info = fdinfo(fd)
            if not info:
                continue
            if kind == "prog":
                ident = info.get("prog_id")
                if ident in seen:
                    continue
                seen.add(ident)
                name = self._name(fd, kind, ident)
                cnt, ns = progs.get(name, (0, 0))
                progs[name] = (cnt + int(info.get("run_cnt", 0)), ns + int(info.get("run_time_ns", 0)))
            else:
                ident = "m" + info.get("map_id", str(fd))
                if ident in seen:
                    continue
                seen.add(ident)
                mtype = int(info.get("map_type", 0))
                if mtype not in HASH_MAP_TYPES:
                    continue
                max_entries = int(info.get("max_entries", 0))
                key_size = int(info.get("key_size", 4))
                entries = count_entries_batch(fd, key_size, int(info.get("value_size", 8)), mtype in PERCPU_MAP_TYPES)
                if entries is None:
                    entries = count_entries(fd, key_size, min(count_limit, max_entries))
                name = self._name(fd, kind, ident)
                if name in maps:  # two maps of one name (two sources): keep both apart
                    name = f"{name}#{ident[1:]}"
                maps[name] = (entries, max_entries, HASH_MAP_TYPES[mtype])
        return {"progs": progs, "maps": maps}
