"""The lines of `pymtrace probes`: one per probe hit (text or JSON), and the --list of the
malloc probes each libc carries."""

import json
import time
from collections.abc import Iterable, Iterator

from pymtrace.sinks.text import printable
from pymtrace.sources import usdt
from pymtrace.sources.glibc import ProbeHit
from pymtrace.tracee import libc

TEXT_HEADER = f"{'TIME':<15} {'PID':>7} {'TID':>7} {'COMM':<15} PROBE ARGS\n"


def hit_line(hit: ProbeHit, wall_offset: float, as_json: bool) -> str:
    """One output line for HIT (newline included); WALL_OFFSET turns its monotonic time into wall time."""
    if as_json:
        return json.dumps(hit.as_dict(wall_offset)) + "\n"
    t = hit.ts / 1e9 + wall_offset
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1e6) % 1000000:06d}"
    return f"{stamp} {hit.pid:>7} {hit.tid:>7} {printable(hit.comm):<15} {hit.probe} {hit.format_args()}\n"


def probe_listing(paths: Iterable[str]) -> Iterator[str]:
    """Lines (no newline) listing the malloc probes of each libc in PATHS: sites and argument specs."""
    for path in paths:
        st = usdt.libc_status(path)
        if not st["probes"]:
            yield printable(f"{path}: {st['reason']}")
            continue
        yield printable(f"{path}: {st['probes']} malloc probes at {st['sites']} sites")
        for p in libc.malloc_probes(path):
            names = usdt.arg_names(p.name, len(p.arg_specs))
            spec = " ".join(f"{n}={a}" for n, a in zip(names, p.arg_specs))
            yield f"  {p.address:#08x} {p.name} {spec}"
