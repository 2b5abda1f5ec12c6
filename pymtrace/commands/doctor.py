"""`pymtrace doctor`: can this machine run pymtrace? One table, a fix for each problem.

Every check is real (a syscall, a file the kernel exposes, a BCC program compiled, loaded,
attached and detached), not a guess from the kernel version. Exit status 0 only when
everything pymtrace needs is there; optional items (JIT, BTF, kprobes, malloc USDT probes
in a libc) are reported but never make it fail.

For tests, a requirement can be made to look missing:
    PYMTRACE_DOCTOR_SIMULATE_MISSING=btf,headers pymtrace doctor
    pymtrace doctor --simulate-missing headers          (hidden option, same effect)
Names: see CHECK_IDS (a tracepoint can be named as e.g. kmem:kmem_cache_alloc).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import time
from typing import Collection

from pymtrace.errors import PymtraceError

HELP = """Check that this machine can run pymtrace: root and capabilities, the BPF syscall,
JIT, BTF, tracefs, uprobes, the kmem/exceptions tracepoints, kprobes (informational:
never needed), kernel headers for BCC, a BCC compile/load/attach/detach smoke test, the
libc(s) in use with their malloc USDT probe counts, BPF ring buffer support, and per
kernel feature what this kernel offers and which fallback pymtrace uses (slab cache names
from the tracepoints or by object size; the uretprobe syscall).
Every failed check comes with a fix. Exit status 0 only when everything needed is there."""

EPILOG = """examples:
  sudo pymtrace doctor            the table of checks
  sudo pymtrace doctor --json     the same as one JSON document, for scripts
  pymtrace doctor                 as a normal user: shows that root is what is missing
  PYMTRACE_DOCTOR_SIMULATE_MISSING=headers,btf sudo -E pymtrace doctor
                                  pretend requirements are missing (to test the reporting)

OVERHEAD: a one-off check that takes seconds (2.2 s here, mostly BCC compiling the smoke
test's tiny program; longer on a loaded machine). For that moment it attaches one
tracepoint and a uprobe on the system libc's getpid (system-wide: every process calling
getpid takes the trap, the program counts only doctor's own calls), then detaches both.
"""

SIMULATE_ENV = "PYMTRACE_DOCTOR_SIMULATE_MISSING"
TRACEFS = "/sys/kernel/tracing"
TRACEPOINTS = (
    "kmem:kmem_cache_alloc",
    "kmem:kmem_cache_free",
    "exceptions:page_fault_user",
    "exceptions:page_fault_kernel",
)
CHECK_IDS = (
    "root",
    "bpf",
    "jit",
    "btf",
    "tracefs",
    "uprobes",
    "tracepoints",
    "kprobes",
    "headers",
    "bcc",
    "smoke",
    "libc",
    "ringbuf",
    "slab-source",
    "uretprobe",
) + TRACEPOINTS

OK, MISSING, WARN, INFO, SKIPPED = "ok", "MISSING", "warn", "info", "skipped"

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39

_BPF_SYSCALL = {
    "x86_64": 321,
    "aarch64": 280,
    "riscv64": 280,
    "loongarch64": 280,
    "ppc64le": 361,
    "ppc64": 361,
    "s390x": 351,
    "armv7l": 386,
    "i686": 357,
}
BPF_MAP_CREATE = 0
BPF_MAP_TYPE_ARRAY = 2
BPF_MAP_TYPE_RINGBUF = 27


class Check:
    def __init__(self, id: str, name: str, status: str, detail: str = "", fix: str = "", required: bool = True) -> None:
        self.id, self.name, self.status, self.detail, self.fix, self.required = id, name, status, detail, fix, required

    @property
    def failed(self) -> bool:
        return self.required and self.status != OK

    def as_dict(self) -> dict[str, str | bool]:
        return {
            "id": self.id,
            "check": self.name,
            "status": self.status,
            "required": self.required,
            "detail": self.detail,
            "fix": self.fix if self.status != OK else "",
        }


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the checks as one JSON document")
    parser.add_argument("--simulate-missing", metavar="NAMES", default=None, help=argparse_suppress())


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


def simulated(args: argparse.Namespace | None = None) -> set[str]:
    names = os.environ.get(SIMULATE_ENV, "")
    extra = getattr(args, "simulate_missing", None) or ""
    out = {n.strip() for n in (names + "," + extra).split(",") if n.strip()}
    unknown = out - set(CHECK_IDS)
    if unknown:
        raise PymtraceError(
            f"cannot simulate unknown check(s) {', '.join(sorted(unknown))}; known: {', '.join(CHECK_IDS)}"
        )
    return out


# ----------------------------------------------------------------------------- checks


def _cap_eff() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def check_root(sim: Collection[str]) -> Check:
    if "root" in sim:
        return Check(
            "root", "root / capabilities", MISSING, "(simulated) not root", "run pymtrace as root: sudo pymtrace ..."
        )
    caps = _cap_eff()
    have = [
        n
        for n, b in (("CAP_SYS_ADMIN", CAP_SYS_ADMIN), ("CAP_BPF", CAP_BPF), ("CAP_PERFMON", CAP_PERFMON))
        if caps >> b & 1
    ]
    euid = os.geteuid()
    enough = euid == 0 and (caps >> CAP_SYS_ADMIN & 1 or (caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1))
    detail = (
        f"euid {euid}, CapEff {caps:#x}: {', '.join(have) if have else 'none of CAP_SYS_ADMIN/CAP_BPF/CAP_PERFMON'}"
    )
    if enough:
        return Check("root", "root / capabilities", OK, detail)
    fix = (
        "run pymtrace as root: sudo pymtrace ..."
        if euid != 0
        else "root without CAP_SYS_ADMIN (or CAP_BPF+CAP_PERFMON): run outside the restricted container/"
        "namespace or grant the capabilities (e.g. docker run --privileged)"
    )
    return Check("root", "root / capabilities", MISSING, detail, fix)


def _bpf_syscall(map_type: int, key_size: int, value_size: int, max_entries: int) -> int | None:
    """fd, or -errno, of a BPF_MAP_CREATE; None if the syscall number is unknown here."""
    nr = _BPF_SYSCALL.get(platform.machine())
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 32)()  # bpf_attr, zeroed; the map-create part comes first
    attr[0], attr[1], attr[2], attr[3] = map_type, key_size, value_size, max_entries
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(
        ctypes.c_long(nr), ctypes.c_int(BPF_MAP_CREATE), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr))
    )
    if fd < 0:
        return -ctypes.get_errno()
    os.close(fd)
    return fd


def _errno_text(neg: int) -> str:
    import errno

    return f"{errno.errorcode.get(-neg, str(-neg))}: {os.strerror(-neg)}"


def check_bpf(sim: Collection[str]) -> Check:
    name = "BPF syscall"
    if "bpf" in sim:
        return Check(
            "bpf", name, MISSING, "(simulated) bpf() returns ENOSYS", "use a kernel built with CONFIG_BPF_SYSCALL=y"
        )
    r = _bpf_syscall(BPF_MAP_TYPE_ARRAY, 4, 8, 1)
    if r is None:
        return Check("bpf", name, WARN, f"cannot test on {platform.machine()} (unknown syscall number)", "", False)
    if r >= 0:
        return Check("bpf", name, OK, "bpf(BPF_MAP_CREATE) made an array map")
    import errno

    if -r == errno.ENOSYS:
        return Check(
            "bpf", name, MISSING, "bpf() is not implemented (ENOSYS)", "use a kernel built with CONFIG_BPF_SYSCALL=y"
        )
    if -r == errno.EPERM:
        return Check(
            "bpf",
            name,
            MISSING,
            f"bpf() refused ({_errno_text(r)})",
            "run as root (unprivileged BPF is not enough for uprobes/tracepoints)",
        )
    return Check(
        "bpf",
        name,
        MISSING,
        f"bpf(BPF_MAP_CREATE) failed ({_errno_text(r)})",
        "check `ulimit -l` (locked memory) and the kernel's BPF settings",
    )


def check_ringbuf(sim: Collection[str]) -> Check:
    name = "BPF ring buffer"
    fix = "needs Linux 5.8+ (BPF_MAP_TYPE_RINGBUF); `pymtrace record` cannot run without it"
    if "ringbuf" in sim:
        return Check("ringbuf", name, MISSING, "(simulated) BPF_MAP_TYPE_RINGBUF rejected", fix)
    size = os.sysconf("SC_PAGE_SIZE")
    r = _bpf_syscall(BPF_MAP_TYPE_RINGBUF, 0, 0, size)
    if r is None:
        return Check("ringbuf", name, WARN, f"cannot test on {platform.machine()}", "", False)
    if r >= 0:
        return Check("ringbuf", name, OK, f"created a {size}-byte BPF_RINGBUF_OUTPUT map (BPF_MAP_TYPE_RINGBUF)")
    import errno

    if -r == errno.EPERM:
        return Check("ringbuf", name, MISSING, f"cannot test: bpf() refused ({_errno_text(r)})", "run as root")
    return Check("ringbuf", name, MISSING, f"BPF_MAP_TYPE_RINGBUF map creation failed ({_errno_text(r)})", fix)


def check_jit(sim: Collection[str]) -> Check:
    name = "BPF JIT"
    path = "/proc/sys/net/core/bpf_jit_enable"
    fix = f"echo 1 > {path} (BPF programs run interpreted, slower, until then)"
    if "jit" in sim:
        return Check("jit", name, WARN, "(simulated) JIT disabled", fix, False)
    try:
        with open(path) as f:
            v = f.read().strip()
    except OSError as exc:
        return Check("jit", name, WARN, f"cannot read {path} ({exc.strerror})", "", False)
    if v in ("1", "2"):
        return Check("jit", name, OK, f"{path} = {v}", "", False)
    return Check("jit", name, WARN, f"{path} = {v} (interpreter)", fix, False)


def check_btf(sim: Collection[str]) -> Check:
    name = "BTF"
    path = "/sys/kernel/btf/vmlinux"
    fix = "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (BCC works without it, from kernel headers)"
    if "btf" in sim:
        return Check("btf", name, MISSING, f"(simulated) {path} missing", fix, False)
    if os.path.exists(path):
        return Check("btf", name, OK, f"{path} ({os.path.getsize(path) // 1024} KiB)", "", False)
    return Check("btf", name, WARN, f"{path} missing", fix, False)


def check_tracefs(sim: Collection[str], is_root: bool) -> Check:
    name = "tracefs mounted"
    path = os.path.join(TRACEFS, "uprobe_events")
    fix = f"mount -t tracefs nodev {TRACEFS}"
    if "tracefs" in sim:
        return Check("tracefs", name, MISSING, f"(simulated) {path} missing", fix)
    if os.path.exists(path):
        return Check("tracefs", name, OK, f"{TRACEFS} (uprobe_events present)")
    if not is_root:
        if os.path.isdir(TRACEFS) and not os.access(TRACEFS, os.R_OK | os.X_OK):
            return Check("tracefs", name, MISSING, f"{TRACEFS} is not readable without root", "run as root")
        return Check("tracefs", name, MISSING, f"{path} missing", fix + " (as root)")
    from pymtrace.bpf import load as bpfload

    try:
        bpfload.ensure_tracefs()
    except PymtraceError as exc:
        return Check("tracefs", name, MISSING, str(exc), fix)
    return Check("tracefs", name, OK, f"{TRACEFS} was not mounted: mounted it now")


def uprobe_links() -> str:
    """How pymtrace attaches uprobes here (pymtrace.bpf.uprobes), in words."""
    if os.geteuid() != 0:
        return "uprobe_multi links: not checked (needs root)"
    from pymtrace.bpf import uprobes

    if uprobes.multi_links():
        return "uprobe_multi links (fast detach)"
    return "no uprobe_multi links filtering by process: one perf event per probe (~0.1 s each to detach)"


def check_uprobes(sim: Collection[str]) -> Check:
    name = "uprobes"
    path = "/sys/bus/event_source/devices/uprobe"
    fix = "use a kernel built with CONFIG_UPROBE_EVENTS=y (per-call malloc statistics need uprobes)"
    if "uprobes" in sim:
        return Check("uprobes", name, MISSING, f"(simulated) {path} missing", fix)
    if os.path.exists(os.path.join(path, "type")):
        with open(os.path.join(path, "type")) as f:
            pmu = f"uprobe PMU (perf type {f.read().strip()})"
        return Check("uprobes", name, OK, f"{pmu}; {uprobe_links()}")
    return Check("uprobes", name, MISSING, f"{path} missing", fix)


def check_tracepoint(tp: str, sim: Collection[str], tracefs_ok: bool, is_root: bool) -> Check:
    name = f"tracepoint {tp}"
    cat, ev = tp.split(":")
    what = {"kmem": "slab view", "exceptions": "page-fault view"}[cat]
    fix = f"the {what} needs it: use a kernel with CONFIG_TRACEPOINTS" + (
        " (exceptions:* exists on x86 only)" if cat == "exceptions" else ""
    )
    if tp in sim or "tracepoints" in sim:
        return Check(tp, name, MISSING, "(simulated) not in tracefs", fix)
    path = os.path.join(TRACEFS, "events", cat, ev, "id")
    if not tracefs_ok:
        return Check(
            tp,
            name,
            SKIPPED,
            "cannot check: tracefs is not available",
            "run as root" if not is_root else f"mount tracefs at {TRACEFS}",
        )
    if os.path.exists(path):
        with open(path) as f:
            return Check(tp, name, OK, f"id {f.read().strip()}")
    return Check(tp, name, MISSING, f"{path} missing", fix)


def check_kprobes(sim: Collection[str]) -> Check:
    name = "kprobes (not needed)"
    if "kprobes" in sim:
        return Check("kprobes", name, INFO, "(simulated) not available; pymtrace uses tracepoints instead", "", False)
    have = os.path.exists("/sys/bus/event_source/devices/kprobe") or os.path.exists(
        os.path.join(TRACEFS, "kprobe_events")
    )
    detail = (
        "available; pymtrace does not use them"
        if have
        else "not available (CONFIG_KPROBES off); fine: pymtrace uses tracepoints only"
    )
    return Check("kprobes", name, INFO, detail, "", False)


def _headers_version(build: str) -> str | None:
    for rel in ("include/generated/utsrelease.h", "include/config/kernel.release"):
        try:
            with open(os.path.join(build, rel)) as f:
                text = f.read()
        except OSError:
            continue
        if '"' in text:
            return text.split('"')[1]
        return text.strip()
    return None


def check_headers(sim: Collection[str]) -> Check:
    name = "kernel headers for BCC"
    release = os.uname().release
    build = f"/lib/modules/{release}/build"
    fix = (
        "install the headers package for this kernel (linux-headers-$(uname -r) / kernel-devel), "
        "or run ./install.sh, which links the distro's nearest headers in"
    )
    if "headers" in sim:
        return Check("headers", name, MISSING, f"(simulated) {build} missing", fix)
    if os.path.exists(os.path.join(build, "include", "generated", "autoconf.h")) or os.path.exists(
        os.path.join(build, "include", "config", "auto.conf")
    ):
        real = os.path.realpath(build)
        version = _headers_version(build)
        detail = f"{build} -> {real}" if real != build else build
        if version and version != release:
            detail += f" (headers of {version}, kernel {release}: linked in; fine for tracepoints/uprobes)"
        return Check("headers", name, OK, detail)
    if os.path.exists("/sys/kernel/kheaders.tar.xz"):
        return Check("headers", name, OK, "/sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS)")
    if os.path.lexists(build):
        return Check("headers", name, MISSING, f"{build} exists but is incomplete or a dangling link", fix)
    return Check("headers", name, MISSING, f"{build} missing", fix)


def check_bcc(sim: Collection[str]) -> Check:
    name = "BCC Python module"
    fix = "install python3-bpfcc (Debian/Ubuntu) or python3-bcc (Fedora); ./install.sh does it"
    if "bcc" in sim:
        return Check("bcc", name, MISSING, "(simulated) import bcc failed", fix)
    from pymtrace.bpf import load as bpfload

    try:
        bcc = bpfload.import_bcc()
    except PymtraceError as exc:
        return Check("bcc", name, MISSING, str(exc), fix)
    version = getattr(bcc, "__version__", "?")
    return Check("bcc", name, OK, f"bcc {version} from {os.path.dirname(bcc.__file__)}")


SMOKE_PROGRAM = r"""
BPF_ARRAY(hits, u64, 2);
static inline int hit(int slot) {
    if ((bpf_get_current_pid_tgid() >> 32) != SELF_PID)
        return 0;
    u64 *v = hits.lookup(&slot);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}
int on_tracepoint(void *ctx) { return hit(0); }
int on_uprobe(struct pt_regs *ctx) { return hit(1); }
"""


def check_smoke(sim: Collection[str], prerequisites_ok: bool, tracepoints_ok: Collection[str]) -> Check:
    """Compile a tiny program with BCC, load it, attach a tracepoint and a uprobe, see both
    fire for this process, detach, and check no uprobe event is left behind."""
    name = "BCC compile/load/attach smoke test"
    if "smoke" in sim:
        return Check("smoke", name, MISSING, "(simulated) failed", "run `pymtrace doctor` without simulation")
    if not prerequisites_ok:
        return Check("smoke", name, SKIPPED, "not run: a requirement above is missing", "fix the items above first")
    import mmap

    from pymtrace.bpf import load as bpfload
    from pymtrace.tracee import libc

    bcc = bpfload.import_bcc()
    started = time.monotonic()
    b = None
    try:
        b = bcc.BPF(text=SMOKE_PROGRAM.encode(), cflags=[f"-DSELF_PID={os.getpid()}", "-Wno-macro-redefined"])
        compiled = time.monotonic() - started
        tp = next((t for t in ("exceptions:page_fault_user", "kmem:kmem_cache_alloc") if t in tracepoints_ok), None)
        if tp:
            b.attach_tracepoint(tp=tp, fn_name="on_tracepoint")
        system = libc.system_libc()
        b.attach_uprobe(name=system, sym="getpid", fn_name="on_uprobe")
        # make both fire: touch fresh anonymous pages, open a file, call getpid()
        m = mmap.mmap(-1, 64 * mmap.PAGESIZE)
        for off in range(0, len(m), mmap.PAGESIZE):
            m[off] = 1
        m.close()
        with open("/proc/self/stat"):
            pass
        for _ in range(3):
            os.getpid()
        hits = b["hits"]
        tp_hits = hits[ctypes.c_int(0)].value
        up_hits = hits[ctypes.c_int(1)].value
    except Exception as exc:
        return Check(
            "smoke",
            name,
            MISSING,
            f"BCC failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}",
            "see the kernel headers and BCC rows; run with a kernel that allows BPF tracing",
        )
    finally:
        if b is not None:
            bpfload.detach_all(b)
    # both ways a probe can stay attached: a tracefs uprobe event, or (how BCC attaches
    # here) an open perf-event descriptor
    left = bpfload.own_uprobe_events() + bpfload.own_perf_event_fds()
    detail = (
        f"compiled+loaded in {compiled:.1f}s; {tp or 'no tracepoint'}: {tp_hits} hits, "
        f"uprobe {os.path.basename(system)}:getpid: {up_hits} hits; detached"
    )
    if left:
        return Check(
            "smoke",
            name,
            MISSING,
            detail + f", but {len(left)} uprobe(s) left attached",
            f"BCC did not detach: check {TRACEFS}/uprobe_events and `bpftool perf list`",
        )
    if up_hits < 3 or (tp and tp_hits == 0):
        return Check(
            "smoke",
            name,
            MISSING,
            detail + " (probes attached but did not fire)",
            "check that uprobes/tracepoints are not blocked (lockdown, seccomp, LSM)",
        )
    return Check("smoke", name, OK, detail)


def check_libcs(sim: Collection[str]) -> list[Check]:
    from pymtrace.tracee import libc

    if "libc" in sim:
        return [Check("libc", "libc in use", INFO, "(simulated) no libc found", "", False)]
    checks = []
    found = libc.distinct_libcs()  # the system libc first
    system_path = libc.system_libc()
    for path, pids in found[:1] + sorted(found[1:], key=lambda entry: entry[0]):
        try:
            probes = libc.malloc_probes(path)
            n, distinct = len(probes), len({p.name for p in probes})
        except PymtraceError as exc:
            checks.append(Check("libc", f"libc {path}", INFO, f"cannot read: {exc}", "", False))
            continue
        is_system = path == system_path
        label = "system libc" if is_system else "libc"
        users = len(pids - {os.getpid()}) if is_system else len(pids)
        detail = f"{path}: {n} malloc USDT probes" + (f" ({distinct} distinct names)" if n != distinct else "")
        detail += f"; {users} process(es) use it"
        if os.geteuid() != 0:
            detail += " (other users' processes are not visible without root)"
        if n:
            checks.append(Check("libc", label, OK, detail + " (glibc view available)", "", False))
        else:
            checks.append(
                Check(
                    "libc",
                    label,
                    INFO,
                    detail,
                    "no glibc view for its processes (libc built without --enable-systemtap); all other views work",
                    False,
                )
            )
    if not checks:
        checks.append(Check("libc", "libc in use", INFO, "no dynamically linked libc found", "", False))
    return checks


def run_checks(sim: Collection[str] = frozenset()) -> list[Check]:
    is_root = os.geteuid() == 0 and "root" not in sim
    checks = [check_root(sim), check_bpf(sim), check_jit(sim), check_btf(sim)]
    tracefs = check_tracefs(sim, is_root)
    checks += [tracefs, check_uprobes(sim)]
    tps = [check_tracepoint(tp, sim, tracefs.status == OK, is_root) for tp in TRACEPOINTS]
    checks += tps
    checks.append(check_kprobes(sim))
    headers = check_headers(sim)
    bcc = check_bcc(sim)
    checks += [headers, bcc]
    ready = (
        all(c.status == OK for c in (checks[0], tracefs, headers, bcc))
        and checks[5].status == OK
        and checks[1].status == OK
    )
    checks.append(check_smoke(sim, ready, {c.id for c in tps if c.status == OK}))
    checks += check_libcs(sim)
    checks.append(check_ringbuf(sim))
    checks += [check_slab_source(sim, tracefs.status == OK), check_uretprobe(sim)]
    return checks


def check_slab_source(sim: Collection[str], tracefs_ok: bool) -> Check:
    """Which way the slab view identifies caches on this kernel (kfeatures.slab_source)."""
    from pymtrace.bpf import kfeatures

    name = "slab view: cache identification"
    if "slab-source" in sim:
        return Check("slab-source", name, WARN, "(simulated) no cache name in the kmem tracepoints", "", False)
    if not tracefs_ok:
        return Check("slab-source", name, SKIPPED, "cannot check: tracefs is not available", "", False)
    try:
        src = kfeatures.slab_source()
    except PymtraceError as exc:
        return Check(
            "slab-source",
            name,
            WARN,
            f"{exc} (the other views still work)",
            "use a kernel with the kmem tracepoints for the slab view",
            False,
        )
    if src.source in (kfeatures.SLAB_BY_BTF, kfeatures.SLAB_BY_NAME) and src.frees:
        return Check("slab-source", name, OK, f"{src.source}: {src.detail}", "", False)
    return Check("slab-source", name, INFO, f"fallback in use, {src.source}: {src.detail}", "", False)


def check_uretprobe(sim: Collection[str]) -> Check:
    name = "uretprobe syscall"
    if "uretprobe" in sim:
        return Check("uretprobe", name, INFO, "(simulated) not available", "", False)
    from pymtrace.bpf import kfeatures

    have = kfeatures.uretprobe_syscall()
    if have is None:
        return Check("uretprobe", name, SKIPPED, "cannot read /proc/kallsyms", "", False)
    if have:
        return Check("uretprobe", name, OK, "available: malloc's return probes cost one syscall", "", False)
    return Check(
        "uretprobe",
        name,
        INFO,
        "not in this kernel: return probes trap instead (same counts, "
        "higher per-call overhead with `top` per-call probes, `record`, `probes`)",
        "",
        False,
    )


def render(checks: list[Check]) -> str:
    from tabulate import tabulate

    rows = [[c.name, c.status, c.detail, c.fix if c.status != OK else ""] for c in checks]
    return tabulate(rows, headers=["CHECK", "STATUS", "DETAIL", "FIX"], tablefmt="simple", maxcolwidths=[40, 8, 56, 44])


def run(args: argparse.Namespace) -> int:
    sim = simulated(args)
    checks = run_checks(sim)
    failed = [c for c in checks if c.failed]
    ok = not failed
    if getattr(args, "json", False):
        print(
            json.dumps(
                {
                    "ok": ok,
                    "missing": [c.id for c in failed],
                    "simulated": sorted(sim),
                    "checks": [c.as_dict() for c in checks],
                },
                indent=2,
            )
        )
    else:
        print(render(checks))
        print()
        if ok:
            print("pymtrace can run here: every required check passed.")
        else:
            print(
                "pymtrace cannot run here yet; missing: "
                + ", ".join(c.name for c in failed)
                + ". Apply the fixes above."
            )
    return 0 if ok else 1
