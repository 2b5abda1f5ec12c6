"""`pymtrace analyze`'s text report: the report (trace/report.py) as plain-text tables."""

from __future__ import annotations

from typing import IO, TYPE_CHECKING

from tabulate import tabulate

from pymtrace.sinks.text import printable

if TYPE_CHECKING:
    from pymtrace.trace.report import Caller, Chain, NeverFreedCaller, Report


def write_text(rep: Report, out: IO[str]) -> None:
    """Write the report REP (trace.analysis.TraceSet.report()) to OUT as text tables."""
    tot, life, live = rep.totals, rep.lifetimes, rep.live
    w = out.write
    for f in rep.files:
        by = f", recorded from {f.allocator}" if f.allocator else ""
        w(f"{printable(f.path)} ({f.format}{by})\n")
    span = f", {tot.span_ns / 1e9:.6f} s" if tot.span_ns is not None else ""
    w(f"{tot.events} events, {tot.threads} threads, {tot.requested_bytes} bytes requested{span}\n\n")
    w("call mix\n")
    rows = [[n, c.count, c.failed, c.requested_bytes] for n, c in rep.calls.items()]
    w(tabulate(rows, ["call", "count", "failed", "requested bytes"]) + "\n")
    if tot.free_null:
        w(f"free(NULL): {tot.free_null}\n")
    sizes = rep.sizes
    w("\nrequest sizes (bytes)\n")
    w(tabulate([[h.label, h.count] for h in sizes.histogram if h.count], ["size", "requests"]) + "\n")
    mm = sizes.mmap_threshold
    w(
        f"mmap threshold {mm.threshold}: {mm.below.count} requests below ({mm.below.requested_bytes} bytes), "
        f"{mm.at_or_above.count} at or above ({mm.at_or_above.requested_bytes} bytes); "
        f"{mm.half_to_threshold} in [threshold/2, threshold), {mm.threshold_to_double} in [threshold, 2x)\n"
    )
    w(f"\nlifetimes: {life.freed} blocks freed, {life.cross_thread_frees} by another thread")
    if life.min_ns is not None:
        w(
            f"; min {life.min_ns} ns, median ~{life.p50_ns} ns, p90 ~{life.p90_ns} ns, "
            f"p99 ~{life.p99_ns} ns, max {life.max_ns} ns\n"
        )
        w(tabulate([[h.label, h.count] for h in life.histogram if h.count], ["lifetime", "blocks"]) + "\n")
    else:
        w(" (the trace has no times)\n")
    if life.releases_of_unknown_blocks or life.allocations_over_live_blocks:
        w(
            f"releases of blocks not allocated in the trace: {life.releases_of_unknown_blocks}; "
            f"allocations at a live block's address (a free missing): {life.allocations_over_live_blocks}\n"
        )
    if live.peak_at is None:
        at = ""
    elif live.unit == "ns":
        at = f" at {seconds(live.peak_at)} from the start"
    else:
        at = f" at {live.peak_at} rows from the start"
    w(f"\nlive requested bytes: peak {live.peak_bytes}{at}, {live.final_bytes} at the end\n")
    th = rep.threads
    w(f"\nthreads: {th.count}\n")
    rows = [
        [
            f"{t.file}:{t.thread}",
            t.calls,
            t.allocations,
            t.frees,
            t.requested_bytes,
            t.cross_thread_frees,
        ]
        for t in th.top
    ]
    w(tabulate(rows, ["file:thread", "calls", "allocations", "frees", "requested bytes", "cross-thread frees"]) + "\n")
    ch = rep.realloc_chains
    w(
        f"\nrealloc chains: {ch.chains} chains of {ch.reallocs_linked} reallocs "
        f"({ch.in_place} in place, {ch.moved} moved; {ch.grew} grew, {ch.shrank} shrank)\n"
    )
    if ch.longest:
        rows = [
            [f"{c.file}:{c.thread}", caller_text(c), c.reallocs, c.first_size, c.final_size, c.moves]
            for c in ch.longest
        ]
        w(tabulate(rows, ["thread", "caller", "reallocs", "first size", "final size", "moves"]) + "\n")
    w("\ntop callers\n")
    if rep.symbols and rep.symbols.files_missing:
        missing = ", ".join(printable(f) for f in rep.symbols.files_missing)
        w(f"(not found on this machine, their callers stay addresses: {missing})\n")
    rows = [
        [caller_text(c), c.calls, c.allocations, c.requested_bytes, c.never_freed, c.never_freed_bytes]
        for c in rep.callers
    ]
    w(tabulate(rows, ["caller", "calls", "allocations", "requested bytes", "never freed", "bytes"]) + "\n")
    if rep.stacks.recorded:
        w("\ntop stacks\n")
        for s in rep.stacks.top:
            w(f"{s.calls} calls, {s.requested_bytes} bytes: {printable(' '.join(s.stack))}\n")
    nf = rep.never_freed
    w(f"\nnever freed: {nf.count} blocks, {nf.requested_bytes} bytes requested\n")
    if nf.by_caller:
        rows = [[caller_text(c), c.count, c.requested_bytes] for c in nf.by_caller]
        w(tabulate(rows, ["caller", "blocks", "requested bytes"]) + "\n")


def seconds(ns: int) -> str:
    """A time from the start in ms below a second, else in s."""
    return f"{ns / 1e6:.3f} ms" if ns < 1e9 else f"{ns / 1e9:.3f} s"


def caller_text(entry: Caller | NeverFreedCaller | Chain) -> str:
    """A caller address, with its function and source line when the report has them."""
    if not entry.function:
        return str(entry.caller)
    text = f"{entry.caller} {entry.function}" + (f" ({entry.source})" if entry.source else "")
    return printable(text)  # names read from binaries a process mapped
