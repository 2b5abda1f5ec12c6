"""Heap efficiency: a process's live malloc bytes beside its resident memory, and the flag
for a process whose anonymous RSS is far above them (fragmentation, retained free memory).

Live bytes count since pymtrace attached (blocks from before attach are not in them), so
they are compared with the *growth* of the process's anonymous RSS over the same window:
RssAnon now minus RssAnon when pymtrace began counting the process (read at attach; 0 for a
process started after it). For a process started after attach both are its whole heap.

The flag: anon growth > WASTE_RATIO x live bytes AND growth - live > WASTE_MIN_BYTES.
Why these numbers: a healthy glibc heap of small blocks costs up to ~1.1-1.3x its live
bytes in RSS (the 8-byte chunk header and 16-byte rounding: 2,000 requested bytes take a
2,016-byte chunk; a few partly used pages; the tcache's 7 blocks per size), so 1.5x is
clearly beyond what the allocator's own bookkeeping explains; the absolute floor keeps
small processes, whose few MiB of thread stacks, arenas and tcaches dominate any ratio,
from being flagged: 64 MiB is also one glibc arena heap (HEAP_MAX_SIZE), the granularity in
which a multi-threaded process can hold memory in an arena it no longer uses much.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

WASTE_RATIO = 1.5
WASTE_MIN_BYTES = 64 << 20
# Below this many live bytes no ANON/LIVE ratio is shown: RSS moves in 4 KiB pages and a
# thread's first touch of its stack, arena or tcache costs tens of KiB, so over fewer live
# bytes the ratio measures that noise (480 live bytes beside 110 KiB of growth: 230x).
RATIO_MIN_LIVE_BYTES = 1 << 20

ADVICE = (
    "try: malloc_trim(0) in the process (glibc returns the free pages inside its heaps); "
    "MALLOC_ARENA_MAX=2 / mallopt(M_ARENA_MAX) if it has many threads; "
    "`pymtrace record` it and `pymtrace replay --allocator glibc --allocator jemalloc "
    "--allocator tcmalloc --allocator mimalloc` to compare their RSS on this workload"
)


def assess(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The heap-efficiency fields of a snapshot's process ENTRY (keys of
    pymtrace.sources.snapshot.ProcessStats): anon_growth_bytes (None when the RssAnon at
    attach is unknown), rss_anon_per_live (growth / live bytes; None without live bytes >
    0), wasted_bytes (growth - live), older_freed_bytes (how far frees of blocks allocated
    before attach took live bytes below 0) and heap_flag (bool; None when it cannot be
    judged: no RSS or no live bytes). The flag sets the growth against the live bytes of
    blocks allocated since attach (at least max(live, 0)): freeing old blocks is no waste."""
    live = entry.get("live_bytes")
    anon = entry.get("rss_anon_bytes")
    base = entry.get("rss_anon_base_bytes")
    growth = anon - base if anon is not None and base is not None else None
    out: dict[str, Any] = {
        "anon_growth_bytes": growth,
        "rss_anon_per_live": None,
        "wasted_bytes": None,
        "older_freed_bytes": max(-live, 0) if live is not None else None,
        "heap_flag": None,
    }
    if growth is None or live is None:
        return out
    out["wasted_bytes"] = growth - live
    if live > 0:
        out["rss_anon_per_live"] = growth / live
    live = max(live, 0)
    out["heap_flag"] = growth > WASTE_RATIO * live and growth - live > WASTE_MIN_BYTES
    return out


def flag_line(pid: int, comm: str, entry: Mapping[str, Any], glibc: Optional[Mapping[str, Any]]) -> str:
    """The sentence for a flagged process: what is seen, glibc's own totals where its probes
    exist (GLIBC: the snapshot's glibc entry of the process), what to try."""
    from_glibc = ""
    if glibc and glibc.get("probes", True) and ("sbrk_bytes" in glibc or "heap_bytes" in glibc):
        from_glibc = (
            f"; glibc: main arena grew {_mib(glibc.get('sbrk_bytes', 0))} by sbrk, "
            f"{glibc.get('heaps', 0)} other heaps {_mib(glibc.get('heap_bytes', 0))}, "
            f"{glibc.get('arenas', 0)} arenas"
        )
    a = assess(entry)
    live = max(entry.get("live_bytes") or 0, 0)
    return (
        f"PID {pid} ({comm}): anon RSS grew {_mib(a['anon_growth_bytes'] or 0)} for "
        f"{_mib(live)} live ({_ratio(a['rss_anon_per_live'], live)}){_older(a)}: "
        f"{_mib((a['anon_growth_bytes'] or 0) - live)} resident but not allocated (fragmentation or "
        f"free memory the allocator keeps){from_glibc}; {ADVICE}."
    )


def describe(pid: int, comm: str, entry: Mapping[str, Any], glibc: Optional[Mapping[str, Any]]) -> str:
    """One sentence on ENTRY's heap efficiency: flag_line when flagged, else the numbers."""
    a = assess(entry)
    if a["heap_flag"]:
        return flag_line(pid, comm, entry, glibc)
    if a["heap_flag"] is None:
        return f"PID {pid} ({comm}): no live bytes to set against its RSS."
    live = max(entry["live_bytes"], 0)
    growth = a["anon_growth_bytes"]
    moved = f"grew {_mib(growth)}" if growth >= 0 else f"shrank {_mib(-growth)}"
    return (
        f"PID {pid} ({comm}): anon RSS {moved} for {_mib(live)} live "
        f"({_ratio(a['rss_anon_per_live'], live)}){_older(a)}: not flagged (needs > {WASTE_RATIO:g}x and "
        f"> {WASTE_MIN_BYTES >> 20} MiB resident but not allocated)."
    )


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _ratio(r: Optional[float], live: float) -> str:
    """The ratio as the sentences say it: none over fewer than RATIO_MIN_LIVE_BYTES live."""
    if live < RATIO_MIN_LIVE_BYTES or r is None:
        return f"too few live bytes for a ratio: under {RATIO_MIN_LIVE_BYTES >> 20} MiB"
    return f"{r:.2f}x"


def _older(a: Mapping[str, Any]) -> str:
    """The frees of blocks from before attach, apart (they are not live bytes gone negative)."""
    older = a.get("older_freed_bytes")
    return f"; it also freed {_mib(older)} of blocks allocated before attach" if older else ""
