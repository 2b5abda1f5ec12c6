"""What this kernel offers pymtrace, read from the kernel itself, never from a version number.

    tracepoint_fields("kmem", "kmem_cache_alloc")  -> {"call_site": "unsigned long", ...} or None
    slab_source()     -> SlabSource: how the slab view identifies caches on this kernel
                         (BTF and raw tracepoints, else the tracepoints' `name`, else sizes)
    has_btf(), uretprobe_syscall()

Tracepoint fields come from /sys/kernel/tracing/events/SYSTEM/NAME/format. For TESTS ONLY,
PYMTRACE_FAKE_TP_FORMAT_DIR=DIR makes DIR/SYSTEM/NAME/format stand in for the kernel's file
when the directory DIR/SYSTEM/NAME exists (without a format file in it: no such tracepoint),
so that a kernel without a field or a tracepoint can be emulated (e.g. Linux 6.1's
kmem_cache_alloc, which has no `name`); BPF programs are still compiled and attached against
the real kernel, so the emulated format must be a subset of the real one.
Struct layouts and tracepoint arguments come from the kernel's BTF (pymtrace.bpf.btf); for
TESTS ONLY, PYMTRACE_FAKE_BTF=PATH reads PATH instead (a missing file: a kernel without BTF).
"""

from __future__ import annotations

import functools
import os
import typing

from pymtrace.bpf import btf as btf_types
from pymtrace.errors import PymtraceError

TRACEFS = "/sys/kernel/tracing"
FAKE_FORMAT_ENV = "PYMTRACE_FAKE_TP_FORMAT_DIR"
FAKE_BTF_ENV = "PYMTRACE_FAKE_BTF"
SLABINFO = "/proc/slabinfo"


def tracepoint_format_path(system: str, name: str) -> str:
    fake = os.environ.get(FAKE_FORMAT_ENV)
    if fake and os.path.isdir(os.path.join(fake, system, name)):
        return os.path.join(fake, system, name, "format")  # none there: no such tracepoint
    return os.path.join(TRACEFS, "events", system, name, "format")


def parse_format(text: str) -> dict[str, str]:
    """{field name: C type} of a tracepoint format file's own fields (common_* left out)."""
    fields = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("field:"):
            continue
        decl = line[len("field:") :].split(";", 1)[0].split()
        if not decl:
            continue
        last = decl[-1]
        fname, _, dims = last.partition("[")
        ftype = " ".join(decl[:-1]) + (f"[{dims}" if dims else "")
        if fname and not fname.startswith("common_"):
            fields[fname] = ftype
    return fields


def tracepoint_fields(system: str, name: str) -> dict[str, str] | None:
    """The tracepoint's fields, or None when this kernel has no such tracepoint (or tracefs
    cannot be read: not root, not mounted)."""
    try:
        with open(tracepoint_format_path(system, name)) as f:
            return parse_format(f.read())
    except OSError:
        return None


def has_btf() -> bool:
    return os.path.exists("/sys/kernel/btf/vmlinux")


def uretprobe_syscall() -> bool | None:
    """True when the kernel has the uretprobe syscall (uretprobes return through one syscall
    instead of a trap), False when not, None when /proc/kallsyms cannot be read."""
    try:
        with open("/proc/kallsyms") as f:
            return any(line.rstrip().endswith("sys_uretprobe") for line in f)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def tracepoint_misses_counted() -> bool:
    """Whether the kernel counts in a tracepoint (or kprobe) program's recursion_misses the
    events it skipped because another BPF program or a bpf() map access was running on the
    CPU (trace_call_bpf). Before that change (Linux 6.7: Debian 12's 6.1 has fdinfo's
    recursion_misses, counted for raw tracepoint programs only) they vanish uncounted. Read
    from the kernel's own BTF: the same change added `missed` to bpf_link_info's kprobe_multi
    record. False without BTF (not known). The real BTF even under the test hook
    PYMTRACE_FAKE_BTF: the question is about this kernel's code, not the emulated layout."""
    btf = btf_types.Btf.read()
    return btf is not None and btf.has_member_path("bpf_link_info", ["kprobe_multi", "missed"])


# --------------------------------------------------------------------------- slab caches

SLAB_BY_BTF = "struct kmem_cache via BTF"
SLAB_BY_NAME = "tracepoint name"
SLAB_BY_SIZE = "object size via /proc/slabinfo"
# members of struct kmem_cache the raw tracepoint programs read (bpf/slab.bpf.c SLAB_OFF_*)
SLAB_CACHE_MEMBERS = ("name", "size", "object_size")


class SlabSource(typing.NamedTuple):
    source: str  # SLAB_BY_BTF, SLAB_BY_NAME or SLAB_BY_SIZE
    frees: bool  # kmem_cache_free can be attributed to a cache (a cache pointer or `name`)
    detail: str  # one sentence for the view and doctor
    raw: dict[str, int] = {}  # SLAB_BY_BTF: slab.bpf.c's SLAB_RAW_*/SLAB_*_ARG/SLAB_OFF_* switches

    def defines(self) -> dict[str, int]:
        """-D switches of bpf/slab.bpf.c."""
        return {
            "SLAB_ALLOC_BY_NAME": int(self.source != SLAB_BY_SIZE),
            "SLAB_FREE_BY_NAME": int(self.frees),
            **self.raw,
        }


def slab_raw(btf: btf_types.Btf | None) -> dict[str, int]:
    """slab.bpf.c's switches for raw tracepoints that read the cache from the `struct kmem_cache
    *` argument (its name, size and object size at the offsets BTF gives), per tracepoint that
    has one; {} when the allocation tracepoint has none (or there is no BTF). Raw tracepoint
    programs are skipped only when they re-enter themselves, not whenever another BPF program or
    a bpf() map access runs on the CPU as the kmem:* tracepoint programs are."""
    if btf is None:
        return {}
    offsets = btf.member_offsets("kmem_cache", list(SLAB_CACHE_MEMBERS))
    alloc = btf.tracepoint_arg("kmem_cache_alloc", "kmem_cache")
    if offsets is None or alloc is None:
        return {}
    raw = {"SLAB_RAW_ALLOC": 1, "SLAB_ALLOC_CACHE_ARG": alloc}
    raw.update({f"SLAB_OFF_{m.upper()}": off for m, off in offsets.items()})
    free = btf.tracepoint_arg("kmem_cache_free", "kmem_cache")
    if free is not None:
        raw.update({"SLAB_RAW_FREE": 1, "SLAB_FREE_CACHE_ARG": free})
    return raw


def read_btf() -> btf_types.Btf | None:
    """The kernel's BTF (PYMTRACE_FAKE_BTF=PATH, for tests only, reads PATH instead: a path
    that does not exist emulates a kernel without BTF)."""
    return btf_types.Btf.read(os.environ.get(FAKE_BTF_ENV) or btf_types.VMLINUX)


def slab_source(use_btf: bool = True) -> SlabSource:
    """How the slab program can identify caches here (USE_BTF False: without the raw
    tracepoints, e.g. after this kernel rejected them); PymtraceError when it cannot at all."""
    alloc = tracepoint_fields("kmem", "kmem_cache_alloc")
    free = tracepoint_fields("kmem", "kmem_cache_free")
    raw = slab_raw(read_btf()) if alloc is not None and use_btf else {}
    if raw:
        frees = bool(raw.get("SLAB_RAW_FREE")) or (free is not None and "name" in free)
        how = "raw tracepoints" if raw.get("SLAB_RAW_FREE") or not frees else "raw tracepoint (frees: `name`)"
        return SlabSource(
            SLAB_BY_BTF,
            frees,
            f"caches named from the struct kmem_cache argument of the kmem {how}, its layout from BTF"
            + ("" if frees else "; frees not counted (kmem:kmem_cache_free gives no cache here)"),
            raw,
        )
    if alloc is None:
        raise PymtraceError(
            "no slab view: this kernel has no readable kmem:kmem_cache_alloc tracepoint "
            f"({tracepoint_format_path('kmem', 'kmem_cache_alloc')})"
        )
    frees = free is not None and "name" in free
    free_text = "" if frees else "; frees not counted (kmem:kmem_cache_free has no cache name here)"
    if "name" in alloc:
        return SlabSource(SLAB_BY_NAME, frees, "caches named by the kmem tracepoints' `name` field" + free_text)
    if "bytes_alloc" in alloc:
        return SlabSource(
            SLAB_BY_SIZE,
            frees,
            "this kernel's kmem:kmem_cache_alloc has no cache name, so a row is an object "
            "size with the caches of that size in /proc/slabinfo"
            + (" (frees by the name kmem_cache_free gives)" if frees else free_text),
        )
    raise PymtraceError("no slab view: kmem:kmem_cache_alloc has neither `name` nor `bytes_alloc` on this kernel")


def slab_sizes() -> dict[str, int]:
    """{cache name: object size} from /proc/slabinfo (readable by root only): the `objsize`
    column is the cache's object size with its metadata, the value kmem_cache_alloc reports
    as bytes_alloc. Merged caches appear under the cache they were merged into."""
    sizes = {}
    try:
        with open(SLABINFO) as f:
            lines = f.read().splitlines()
    except OSError:
        return sizes
    for line in lines:
        parts = line.split()
        if len(parts) < 4 or line.startswith(("#", "slabinfo")):
            continue
        try:
            sizes[parts[0]] = int(parts[3])
        except ValueError:
            continue
    return sizes


def size_key(size: int) -> str:
    """The snapshot key of the row of objects of SIZE bytes (stable across snapshots)."""
    return f"size {size}"
