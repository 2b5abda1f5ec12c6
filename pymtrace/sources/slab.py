"""SlabSource: per-cache slab counters from the kmem tracepoints (system-wide)."""

from __future__ import annotations

import time
from typing import Any, Iterable

from pymtrace.bpf import kfeatures
from pymtrace.sources.base import (
    Source,
    lost_counts,
    lost_names,
    percpu_items,
    skipped_runs,
    struct_fields,
    sum_percpu,
)

# lost cause -> the programs whose skipped runs it counts (pymtrace.bpf.stats.recursion_misses)
# (the raw tracepoint programs where BTF allows them, else the kmem:* tracepoint programs)
SKIPPED = {
    "slab_skipped_allocs": ["raw_tracepoint__kmem_cache_alloc", "tracepoint__kmem__kmem_cache_alloc"],
    "slab_skipped_frees": ["raw_tracepoint__kmem_cache_free", "tracepoint__kmem__kmem_cache_free"],
}


class SlabSource(Source):
    """Per-cache slab counters from kmem:kmem_cache_alloc/free (system-wide).

    How caches are identified depends on the kernel (pymtrace.bpf.kfeatures.slab_source(), read
    from its BTF and the tracepoints' format files in prepare()): by the name in the struct
    kmem_cache the raw tracepoints pass, where BTF gives its layout; else by the `name` field
    where the tracepoints have it; otherwise allocations are keyed by object size, under the key
    "size N", whose value also lists the caches of that size from /proc/slabinfo
    ("caches": [...]), and frees (by name, when kmem_cache_free has it) are added to the row
    of their cache's size (a cache /proc/slabinfo no longer lists keeps a row of its own).
    The snapshot says which: "slab_source" (kfeatures.SLAB_BY_BTF / SLAB_BY_NAME / SLAB_BY_SIZE)."""

    program = "slab"
    what = "tracing slab caches"

    def __init__(
        self, pids: Iterable[int | str] | None = None, track_exits: bool = False, max_caches: int = 2048
    ) -> None:
        super().__init__(None, False)  # slab activity is not attributed to processes
        self.max_caches = max_caches
        self.fields = struct_fields(self.program, "slab_stats")
        self.source = None
        self.raw_rejected = None  # why this kernel rejected the raw tracepoint programs

    def fallback(self, reason: str) -> bool:
        """The raw tracepoint programs rejected: the kmem:* tracepoints' fields instead."""
        if self.source is None or self.source.source != kfeatures.SLAB_BY_BTF:
            return False
        self.source = kfeatures.slab_source(use_btf=False)
        self.raw_rejected = reason
        return True

    def prepare(self) -> None:
        self.source = kfeatures.slab_source()  # PymtraceError: this kernel cannot do it at all
        super().prepare()

    def _defines(self):
        if self.source is None:
            self.source = kfeatures.slab_source()
        return {"SLAB_MAX_CACHES": self.max_caches, **self.source.defines()}

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        caches = {}
        by_size = self.source.source == kfeatures.SLAB_BY_SIZE
        sizes = kfeatures.slab_sizes() if by_size else {}
        fields = self.fields if self.source.frees else [f for f in self.fields if f != "frees"]
        for key, values in percpu_items(self.bpf[b"slab_stats"]):
            name = bytes(key.name).split(b"\0", 1)[0].decode("utf-8", "replace")
            s = sum_percpu(values, self.fields)
            if by_size:  # allocations come keyed by size, frees by name
                size = int(key.size) if not name else sizes.get(name)
                name = kfeatures.size_key(size) if size is not None else name
            row = caches.setdefault(name, dict.fromkeys(fields, 0))
            for f in fields:
                row[f] += int(s[f])
        if by_size:
            names = {}
            for cache, size in sorted(sizes.items()):
                names.setdefault(kfeatures.size_key(size), []).append(cache)
            for key, row in caches.items():
                row["caches"] = names.get(key, [])
        lost = lost_counts(self.bpf[b"slab_lost"], {i: "slab_" + n for i, n in lost_names("slab", "SLAB").items()})
        # Events the kernel gave no program (another BPF program or a bpf() map access was
        # running on that CPU: frees in RCU callbacks at an interrupt's end, more often in
        # an emulated VM): the rows lack them, the view says how many.
        for cause, functions in SKIPPED.items():
            n = skipped_runs(self.bpf, functions)
            if n is not None:
                lost[cause] = n
        maps = {"slab_stats": {"entries": len(caches), "max_entries": self.max_caches}}
        snap = {
            "time": now,
            "start": self.start,
            "slab": caches,
            "slab_source": self.source.source,
            "lost": lost,
            "maps": maps,
        }
        if by_size or not self.source.frees or self.raw_rejected:
            # what the fallback in use means, for the view
            rejected = self.raw_rejected and "this kernel rejected the raw tracepoint programs, so "
            snap["slab_note"] = (rejected or "") + self.source.detail
        return snap
