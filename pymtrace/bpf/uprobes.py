"""Attaching BPF programs to uprobes and uretprobes, and detaching them fast.

Every source attaches through attach(bpf, probes) and detaches through detach(bpf).
Where the kernel has BPF uprobe_multi links (Linux 6.6+, with per-process PID filtering:
see multi_links()), one link per (file, PID, program, entry/return) carries all its
offsets, created with bpf(2) BPF_LINK_CREATE (attach type BPF_TRACE_UPROBE_MULTI); the
programs are loaded with that expected attach type. Elsewhere (Debian 12's 6.1) BCC
attaches one perf event per probe, as before.

Why: closing a uprobe perf event waits for an RCU grace period while perf holds its
global event_mutex, so the closes run one after the other (~85 ms each on 6.18: 5 s for
top's ~58 probes with a C++ process running), whatever thread closes them. Releasing a
uprobe_multi link takes neither that mutex nor a grace period per offset (one per link),
and the links are closed from threads so that their grace periods overlap.

The link's PID filter also means its return program runs only in that process, which a
perf uretprobe filtered by PID did not guarantee on older kernels (see MS_RET_ONCE in
bpf/malloc_stats.bpf.c, kept for the fallback).

No library does this for Python: Debian 12's libbpf (1.1) predates uprobe_multi (1.3),
and BCC 0.26 has no uprobe_multi attach; the bpf(2) calls are a few fixed structs.
For TESTS ONLY, PYMTRACE_FAKE_NO_UPROBE_MULTI=1 makes multi_links() False (BCC's perf
events, the path of kernels without uprobe_multi).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import time
import typing
import weakref
from concurrent.futures import ThreadPoolExecutor

from pymtrace.bpf import load as bpfload
from pymtrace.bpf import stats

FAKE_NO_MULTI_ENV = "PYMTRACE_FAKE_NO_UPROBE_MULTI"

BPF_PROG_LOAD = 5
BPF_LINK_CREATE = 28
BPF_PROG_TYPE_KPROBE = 2
BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type
BPF_F_UPROBE_MULTI_RETURN = 1
_ATTR_SIZE = 128  # covers every field used; the kernel wants the tail it does not know zero


class Probe(typing.NamedTuple):
    """One uprobe (RET False) or uretprobe (RET True) of BCC program FN_NAME.

    path: the file as this process sees it (with a PID, opened as /proc/PID/root/PATH, as
    BCC does); address: the ELF virtual address (BCC's `addr`); offset: the same place as
    a file offset (what the kernel wants); pid: the process (a thread group), -1 for all;
    what: the function, for errors."""

    path: str
    address: int
    offset: int
    fn_name: str
    pid: int = -1
    ret: bool = False
    what: str = ""


# BCC module -> [link fd]: the links attach() made for it, closed by detach()
_links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _attr() -> ctypes.Array:
    return (ctypes.c_uint8 * _ATTR_SIZE)()


def _put(attr: ctypes.Array, offset: int, ctype: type, value: int) -> None:
    ctype.from_buffer(attr, offset).value = value


def _link_create(prog_fd: int, path: bytes, offsets: typing.Sequence[int], pid: int, ret: bool) -> int:
    """BPF_LINK_CREATE of a uprobe_multi link: its fd, or OSError."""
    c_path = ctypes.create_string_buffer(path)
    c_offsets = (ctypes.c_uint64 * len(offsets))(*offsets)
    attr = _attr()
    _put(attr, 0, ctypes.c_uint32, prog_fd)  # link_create.prog_fd
    _put(attr, 8, ctypes.c_uint32, BPF_TRACE_UPROBE_MULTI)  # attach_type
    _put(attr, 16, ctypes.c_uint64, ctypes.addressof(c_path))  # uprobe_multi.path
    _put(attr, 24, ctypes.c_uint64, ctypes.addressof(c_offsets))  # .offsets (ref_ctr_offsets, cookies: none)
    _put(attr, 48, ctypes.c_uint32, len(offsets))  # .cnt
    _put(attr, 52, ctypes.c_uint32, BPF_F_UPROBE_MULTI_RETURN if ret else 0)  # .flags
    _put(attr, 56, ctypes.c_uint32, pid & 0xFFFFFFFF)  # .pid (0: every process)
    return stats.call(BPF_LINK_CREATE, attr)


def load_tail_program(bpf: typing.Any, fn_name: str) -> typing.Any:
    """Load FN_NAME of BPF as a program the uprobe programs attach() loads can tail-call: the
    kernel wants the same program type and expected attach type on both sides of a program
    array (uprobe_multi links' programs are loaded with BPF_TRACE_UPROBE_MULTI)."""
    if multi_links():
        try:
            return bpf.load_func(fn_name.encode(), bpf.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
        except TypeError:  # a BCC whose load_func takes no attach type: attach() loads the same way
            pass
    return bpf.load_func(fn_name.encode(), bpf.KPROBE)


@functools.lru_cache(maxsize=1)
def multi_links() -> bool:
    """Whether this kernel has uprobe_multi links that filter by process: asked of the
    kernel itself with a two-instruction program, as libbpf does (probe_uprobe_multi_link).
    A link on "/" (not a regular file) fails with EBADF where the link type exists; the
    first kernels with it filtered by thread, not process, and those accept an invalid PID
    where fixed ones refuse it with EINVAL. ~0.1 ms."""
    if os.environ.get(FAKE_NO_MULTI_ENV):
        return False
    try:
        prog = empty_program(multi=True)
    except OSError:
        return False
    try:
        for pid, wanted in ((0, errno.EBADF), (-1, errno.EINVAL)):
            try:
                os.close(_link_create(prog, b"/", [0], pid, False))
                return False  # a link on "/": not the kernel code this test knows
            except OSError as exc:
                if exc.errno != wanted:
                    return False
        return True
    finally:
        os.close(prog)


def empty_program(multi: bool) -> int:
    """A loaded kprobe-type program of two instructions (r0 = 0; exit), for a uprobe_multi
    link (MULTI) or a perf-event uprobe: its fd (the caller closes it), or OSError."""
    insns = (ctypes.c_uint64 * 2)(0xB7, 0x95)
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = _attr()
    _put(attr, 0, ctypes.c_uint32, BPF_PROG_TYPE_KPROBE)
    _put(attr, 4, ctypes.c_uint32, 2)  # insn_cnt
    _put(attr, 8, ctypes.c_uint64, ctypes.addressof(insns))
    _put(attr, 16, ctypes.c_uint64, ctypes.addressof(license_))
    if multi:
        _put(attr, 68, ctypes.c_uint32, BPF_TRACE_UPROBE_MULTI)  # expected_attach_type
    return stats.call(BPF_PROG_LOAD, attr)


def attach_program(prog_fd: int, path: str, offsets: typing.Sequence[int], pid: int, ret: bool) -> list[int]:
    """Program PROG_FD (from empty_program(multi_links())) at file OFFSETS of PATH in process
    PID, as uprobes or uretprobes (RET), the way attach() would: one link, or one perf event
    per offset. Returns the fds to close (closing detaches); OSError on failure."""
    kernel_path = _kernel_path(path, pid)
    if multi_links():
        return [_link_create(prog_fd, kernel_path, list(offsets), pid, ret)]
    fds = []
    try:
        for off in offsets:
            fds.append(_perf_uprobe(prog_fd, kernel_path, off, pid, ret))
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _kernel_path(path: str, pid: int) -> bytes:
    """The path the kernel opens: the process's own view of PATH with a PID (BCC's rule)."""
    if pid > 0 and not path.startswith("/proc"):
        path = f"/proc/{pid}/root{path}"
    return os.fsencode(path)


class Attached(typing.NamedTuple):
    """What one attach() call added to its module: link fds and BCC perf-event names
    (release() detaches exactly these, leaving the module's other probes attached)."""

    links: tuple
    events: tuple


def attach(bpf: typing.Any, probes: typing.Iterable[Probe]) -> Attached:
    """Attach PROBES to the BCC module BPF. With uprobe_multi links: one link per (file, PID,
    program, entry/return), created in the order of their first probe (so a caller that lists
    return probes first gets them attached first); else one BCC perf event per probe, in order.
    Raises OSError (links) or BCC's Exception (perf events), naming the functions, after
    detaching what this call attached: all of PROBES or none (a caller can leave a file out
    and go on without half of its functions counted). A program is loaded on first use, for
    one of the two ways only. Returns what it attached (for release())."""
    probes = list(probes)
    links = _links.setdefault(bpf, [])
    links_before = len(links)
    events_before = set(getattr(bpf, "uprobe_fds", {}))
    try:
        _attach(bpf, probes, links)
    except BaseException:
        _undo(bpf, links, links_before, events_before)
        raise
    events = tuple(k for k in getattr(bpf, "uprobe_fds", {}) if k not in events_before)
    return Attached(tuple(links[links_before:]), events)


def release(bpf: typing.Any, attached: typing.Iterable[Attached]) -> float:
    """Detach what the attach() calls ATTACHED added to BPF, concurrently (as detach() does),
    and nothing else. Returns the CPU seconds the closing threads spent (a duty cycle counts
    them as its cost; the wall time is mostly RCU grace periods, no CPU)."""
    attached = list(attached)
    fds = {fd for a in attached for fd in a.links}
    names = [name for a in attached for name in a.events]
    links = _links.get(bpf, [])
    links[:] = [fd for fd in links if fd not in fds]
    table = getattr(bpf, "uprobe_fds", {})
    jobs = [(os.close, fd) for fd in fds] + [(_close_bcc, (name, table[name])) for name in names if name in table]
    cpu = _close_concurrently(jobs)
    for name in names:
        try:
            bpf._del_uprobe_fd(name)  # keeps BCC's open-probe count right
        except (AttributeError, KeyError):
            pass
    return cpu


def _undo(bpf: typing.Any, links: list[int], links_before: int, events_before: set) -> None:
    """Close the links after the first LINKS_BEFORE and BCC's perf events not in EVENTS_BEFORE."""
    for fd in links[links_before:]:
        try:
            os.close(fd)
        except OSError:
            pass
    del links[links_before:]
    for ev_name, fd in [(k, v) for k, v in getattr(bpf, "uprobe_fds", {}).items() if k not in events_before]:
        try:
            _close_bcc((ev_name, fd))
            bpf._del_uprobe_fd(ev_name)
        except (ImportError, AttributeError, KeyError, OSError):
            pass


def _attach(bpf: typing.Any, probes: list[Probe], links: list[int]) -> None:
    if not multi_links():
        for p in probes:
            _attach_bcc(bpf, p)
        return
    groups: dict[tuple, list[Probe]] = {}
    for p in probes:
        groups.setdefault((p.path, max(p.pid, 0), p.fn_name, p.ret), []).append(p)
    for (path, pid, fn_name, ret), group in groups.items():
        try:
            fn = bpf.load_func(fn_name.encode(), bpf.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
        except TypeError:  # a BCC whose load_func takes no attach type: its own way
            for p in group:
                _attach_bcc(bpf, p)
            continue
        kernel_path = _kernel_path(path, pid)
        try:
            links.append(_link_create(fn.fd, kernel_path, [p.offset for p in group], pid, ret))
            continue
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise _link_error(exc, group) from None
        # EINVAL: most likely a uprobe some BCC tool holds at one of these places with the
        # stray ref_ctr_offset BCC 0.26's Python binding passes (bcc issue #5236); the kernel
        # refuses a second registration with another one. Those places are attached BCC's own
        # way (with that value: a perf event of ours would be refused the same way).
        for p in group:
            try:
                links.append(_link_create(fn.fd, kernel_path, [p.offset], pid, ret))
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise _link_error(exc, [p]) from None
                _attach_bcc_way(bpf, p, refused=True)


def _attach_bcc(bpf: typing.Any, p: Probe) -> None:
    """P through a perf-event uprobe (PMU "uprobe", one file descriptor), kept in BCC's
    table so that BCC's cleanup and detach() close it. Opened here with ref_ctr_offset 0:
    BCC 0.26's attach_uprobe leaves that argument out (bcc issue #5236), and the stray value
    it passes would then refuse every link at this place, ours included, for as long as the
    kernel keeps the uprobe. A place already held with that stray value refuses ours
    (EINVAL): there, and with a BCC without these internals, BCC attaches its own way."""
    name, fn_name = os.fsencode(p.path), p.fn_name.encode()
    try:
        fn = bpf.load_func(fn_name, bpf.KPROBE)
        ev_name = bpf._get_uprobe_evname(b"r" if p.ret else b"p", name, p.address, p.pid)
        add_fd = bpf._add_uprobe_fd
        fd = _perf_uprobe(fn.fd, _kernel_path(p.path, p.pid), p.offset, p.pid, p.ret)
    except AttributeError:
        fd = None
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            kind = "uretprobe" if p.ret else "uprobe"
            raise OSError(exc.errno, f"{kind} at {p.what or hex(p.address)}: {_why(exc, [p])}") from None
        _attach_bcc_way(bpf, p, refused=True)
        return
    if fd is None:
        _attach_bcc_way(bpf, p)
        return
    add_fd(ev_name, fd)


def _attach_bcc_way(bpf: typing.Any, p: Probe, refused: bool = False) -> None:
    """P through BCC's own attach_u(ret)probe (its stray ref_ctr_offset included). REFUSED:
    the kernel refused our registration at this place (EINVAL); if BCC's is refused too,
    another tool holds the place with a reference counter of its own: said so."""
    attach = bpf.attach_uretprobe if p.ret else bpf.attach_uprobe
    try:
        attach(name=os.fsencode(p.path), addr=p.address, fn_name=p.fn_name.encode(), pid=p.pid)
    except Exception:  # BCC raises plain Exception ("Failed to attach BPF to uprobe")
        if not refused:
            raise
        kind = "uretprobe" if p.ret else "uprobe"
        raise OSError(
            errno.EINVAL,
            f"{kind} at {p.what or hex(p.address)} refused by the kernel (Invalid argument): another "
            "tool holds a uprobe there with a reference counter of its own",
        ) from None


PERF_FLAG_FD_CLOEXEC = 8
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_BPF = 0x40042408
_SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}


@functools.lru_cache(maxsize=1)
def _uprobe_pmu() -> tuple[int, int]:
    """(PMU type, config bit that makes a uretprobe) of the kernel's uprobe PMU (sysfs)."""
    base = "/sys/bus/event_source/devices/uprobe"
    with open(f"{base}/type") as f:
        pmu_type = int(f.read())
    with open(f"{base}/format/retprobe") as f:
        bit = int(f.read().strip().split(":")[1])  # "config:0"
    return pmu_type, bit


def perf_uprobe_event(path: bytes, offset: int, pid: int, ret: bool, ref_ctr_offset: int = 0) -> int:
    """A perf-event uprobe at file OFFSET of PATH (PID: that process only, -1 all), with
    REF_CTR_OFFSET in config bits 32-63 (what libbcc's bpf_attach_uprobe opens), not yet
    running a program: its fd. OSError on failure; nothing printed."""
    nr = _SYS_PERF_EVENT_OPEN.get(os.uname().machine)
    if nr is None:
        raise AttributeError("perf_event_open: system call number unknown here")  # BCC's way
    pmu_type, ret_bit = _uprobe_pmu()
    c_path = ctypes.create_string_buffer(path)
    attr = _attr()  # struct perf_event_attr, PERF_ATTR_SIZE_VER5 and more: zeros
    _put(attr, 0, ctypes.c_uint32, pmu_type)
    _put(attr, 4, ctypes.c_uint32, _ATTR_SIZE)
    _put(attr, 8, ctypes.c_uint64, (ref_ctr_offset << 32) | ((1 << ret_bit) if ret else 0))  # config
    _put(attr, 16, ctypes.c_uint64, 1)  # sample_period
    _put(attr, 48, ctypes.c_uint32, 1)  # wakeup_events
    _put(attr, 56, ctypes.c_uint64, ctypes.addressof(c_path))  # config1: uprobe_path
    _put(attr, 64, ctypes.c_uint64, offset)  # config2: probe_offset
    return stats.libc_syscall(
        nr, ctypes.byref(attr), pid if pid > 0 else -1, 0 if pid <= 0 else -1, -1, PERF_FLAG_FD_CLOEXEC
    )


def _perf_uprobe(prog_fd: int, path: bytes, offset: int, pid: int, ret: bool) -> int:
    """perf_uprobe_event() with ref_ctr_offset 0, running PROG_FD, enabled: its fd."""
    import fcntl

    fd = perf_uprobe_event(path, offset, pid, ret)
    try:
        fcntl.ioctl(fd, PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
    except OSError:
        os.close(fd)
        raise
    return fd


ENOTSUPP = 524  # the kernel's own "not supported" (include/linux/errno.h): no name in user space


def _link_error(exc: OSError, group: list[Probe]) -> OSError:
    where = ", ".join(sorted({p.what or f"{p.address:#x}" for p in group}))
    kind = "uretprobe" if group[0].ret else "uprobe"
    return OSError(exc.errno, f"{kind} link of {group[0].fn_name} at {where}: {_why(exc, group)}")


def _why(exc: OSError, probes: list[Probe]) -> str:
    """EXC's reason in words: its strerror, but what ENOTSUPP means ("Unknown error 524"
    would tell the user nothing), with the instructions at PROBES' places."""
    if exc.errno != ENOTSUPP:
        return exc.strerror
    return (
        f"the kernel will not put a uprobe on the instruction there{_instructions(probes)} (ENOTSUPP: "
        "x86 uprobes refuse an instruction with a LOCK or segment prefix, and the few others they "
        "can neither emulate nor single-step); none of the probes in this file is attached, so "
        "no call is seen entering its functions"
    )


def _instructions(group: list[Probe]) -> str:
    """', `lock add ...` at malloc': the instructions at GROUP's places, decoded from the
    file (x86-64), or '' when they cannot be read or decoded."""
    try:
        import capstone

        md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        texts = []
        for p in sorted(set(group), key=lambda p: p.offset)[:3]:
            with open(p.path, "rb") as f:
                f.seek(p.offset)
                insn = next(md.disasm(f.read(16), p.address), None)
            if insn is not None:
                texts.append(f"`{insn.mnemonic} {insn.op_str}`" + (f" at {p.what}" if p.what else ""))
        return ", " + ", ".join(texts) if texts else ""
    except (ImportError, OSError):
        return ""


def own_links() -> list[dict[str, str]]:
    """The fdinfo ({key: value}: link_type, prog_id, ...) of each BPF link this process holds."""
    out = []
    for fd, target in stats.own_anon_fds().items():
        if target == "anon_inode:bpf_link":
            info = stats.fdinfo(fd)
            if info is not None:
                out.append(info)
    return out


def _close_concurrently(jobs: list[tuple[typing.Callable, typing.Any]]) -> float:
    """Run each closing job (function, argument), from threads when there are several (os.close
    and BCC's ctypes calls release the GIL: the links' RCU grace periods overlap). A job that
    fails is left to BCC's own sequential cleanup (BCC without these internals). Returns the
    CPU seconds the jobs took."""

    def run(job: tuple[typing.Callable, typing.Any]) -> float:
        began = time.thread_time()
        try:
            job[0](job[1])
        except (ImportError, AttributeError, OSError):
            pass
        return time.thread_time() - began

    if len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=min(32, len(jobs))) as pool:
            return sum(pool.map(run, jobs))
    return sum(run(job) for job in jobs)


def _close_bcc(item: tuple[bytes, int]) -> None:
    from bcc import lib

    ev_name, fd = item
    lib.bpf_close_perf_event_fd(fd)
    lib.bpf_detach_uprobe(ev_name)  # removes a tracefs event if BCC made one


def detach(bpf: typing.Any) -> None:
    """Detach every uprobe of BPF concurrently (links, and BCC's perf events), then everything
    else (bpfload.detach_all); safe to call twice.

    Closing from threads (os.close and BCC's ctypes calls release the GIL) lets the links'
    RCU grace periods overlap. BCC's perf events still end one after the other in the kernel
    (event_mutex, module docstring), but a tracefs event BCC made is removed in parallel."""
    if bpf is None:
        return
    links = _links.pop(bpf, [])
    try:
        items = list(bpf.uprobe_fds.items())
    except AttributeError:  # not a BCC module as we know it: its own cleanup does the work
        items = []
    jobs = [(os.close, fd) for fd in links] + [(_close_bcc, item) for item in items]
    if len(jobs) > 1:
        _close_concurrently(jobs)
        for ev_name, _ in items:
            try:
                bpf._del_uprobe_fd(ev_name)  # keeps BCC's open-probe count right
            except (AttributeError, KeyError):
                break
    else:
        _close_concurrently(jobs[: len(links)])
    bpfload.detach_all(bpf)
