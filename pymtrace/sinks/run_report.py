"""Rendering of the end-of-run report of `pymtrace run` / `pymtrace summary` (the model:
pymtrace.sources.glibc_report): text tables or JSON, to stdout or a file."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from pymtrace.sinks.text import Number, human_bytes, printable


def _fmt_bytes(n: Number | None) -> str:
    """The report's layout of a byte count: one decimal, up to GiB, '-' when unknown."""
    return human_bytes(n, decimals=1, none="-", largest="GiB")


def render_text(doc: dict) -> str:
    """The report DOC (pymtrace.sources.glibc_report.Tracer.finish) as text tables."""
    from tabulate import tabulate

    out = []
    head = f"pymtrace report for PID {doc['pid']} ({printable(doc.get('comm') or '?')})"
    if doc.get("command"):
        head += f": {printable(' '.join(doc['command']))}"
    out.append(head)
    out.append(
        f"libc: {printable(doc.get('libc') or '?')}; traced {doc.get('duration_s', 0):.2f} s"
        + (f"; exit status {doc['exit_code']}" if doc.get("exit_code") is not None else "")
    )
    if not doc.get("probes"):
        out.append("")
        out.append(f"glibc allocator internals unavailable: {printable(doc.get('reason'))}.")
        out.append(
            "Unavailable: arenas, heaps, sbrk, thresholds, retries, tcache scans. "
            "Page faults below still come from the kernel."
        )
    else:
        r = doc["glibc"]
        out.append(f"probe events: {r['events']}; lost events: {doc.get('lost_events', 0)}")
        out.append("")
        out.append("Arena lock waits per thread")
        if r["arena_lock_waits"]:
            out.append(
                tabulate(
                    [[w["tid"], w["waits"], " ".join(w["arenas"])] for w in r["arena_lock_waits"]],
                    headers=["TID", "WAITS", "ARENAS WAITED ON"],
                )
            )
        else:
            out.append("  none")
        out.append("")
        out.append(f"Arenas (main arena + {r['arenas_created']} created)")
        if r["arenas"]:
            out.append(
                tabulate(
                    [
                        [
                            a["arena"] + (" (main)" if a["main"] else ""),
                            a["created_by"] if a["created_by"] is not None else "-",
                            a["size_request"] if a["size_request"] is not None else "-",
                            len(a["threads"]),
                            " ".join(f"{t}" + ("*" if t in a.get("active_threads", ()) else "") for t in a["threads"]),
                            a["waits"],
                        ]
                        for a in r["arenas"]
                    ],
                    headers=["ARENA", "CREATED BY", "REQUEST", "THREADS", "TIDS (* = alive at the end)", "WAITS"],
                )
            )
        else:
            out.append("  only the main arena was used")
        out.append("")
        ht = r["heap_totals"]
        out.append(
            f"Heaps of non-main arenas: {ht['created']} created, {ht['freed']} freed, "
            f"{ht['live']} live ({_fmt_bytes(ht['live_bytes'])})"
        )
        if r["heaps"]:
            out.append(
                tabulate(
                    [
                        [
                            h["heap"],
                            h["created_by"] if h["created_by"] is not None else "-",
                            h["initial_size"] if h["initial_size"] is not None else "-",
                            h["max_size"],
                            h["final_size"],
                            h["grow"],
                            h["shrink"],
                            "yes" if h["freed"] else "no",
                        ]
                        for h in r["heaps"]
                    ],
                    headers=["HEAP", "CREATED BY", "INITIAL", "MAX", "FINAL", "GROWN", "SHRUNK", "FREED"],
                )
            )
        out.append("")
        s = r["sbrk"]
        out.append("Main arena (sbrk)")
        out.append(
            tabulate(
                [
                    ["grown", s["grow_count"], s["grown_bytes"], _fmt_bytes(s["grown_bytes"])],
                    ["trimmed", s["trim_count"], s["trimmed_bytes"], _fmt_bytes(s["trimmed_bytes"])],
                    ["net", "", s["net_bytes"], _fmt_bytes(s["net_bytes"])],
                    ["failed sbrk", s["failed"], "", ""],
                ],
                headers=["", "TIMES", "BYTES", ""],
            )
        )
        out.append("")
        out.append("Threshold and parameter changes")
        if r["thresholds"]:
            out.append(
                tabulate(
                    [
                        [
                            f"{t['time_s']:.6f}",
                            t["tid"],
                            t["param"],
                            "?" if t["old"] is None else t["old"],
                            t["new"],
                            t["cause"],
                        ]
                        for t in r["thresholds"]
                    ],
                    headers=["TIME (s)", "TID", "PARAMETER", "OLD", "NEW", "CAUSE"],
                )
            )
        else:
            out.append("  none (defaults kept)")
        params = doc.get("collector", {}).get("params") or {}
        if params:
            out.append("")
            out.append("Parameters at the end")
            out.append(
                tabulate(
                    [[k, v["value"], v["cause"], v["source"]] for k, v in params.items()],
                    headers=["PARAMETER", "VALUE", "SET BY", "SOURCE"],
                )
            )
        out.append("")
        out.append("Retries after allocation failures")
        out.append(
            tabulate(
                [[k, v["count"], v["bytes"]] for k, v in r["retries"].items()],
                headers=["RETRY", "COUNT", "BYTES REQUESTED"],
            )
        )
        out.append("")
        out.append(f"tcache double-free scans: {r['tcache_double_free_scans']}")
        for d in r["tcache_double_free"][:20]:
            out.append(f"  tid {d['tid']} entry {d['entry']} tc_idx {d['tc_idx']}")
    f = doc.get("faults")
    if doc.get("lost_events"):
        out.append("")
        out.append(f"WARNING: {doc['lost_events']} events were lost (ring buffer full): the counts above are too low")
    out.append("")
    if f is None:
        out.append("Page faults: not traced (--no-faults)")
    else:
        total = f["total"] or 1
        out.append(f"Page faults: {f['total']} (~{_fmt_bytes(f['bytes_faulted_in_approx'])} faulted in)")
        out.append(
            tabulate(
                [[printable(k), v, f"{100.0 * v / total:.1f}%"] for k, v in f["regions"].items() if v],
                headers=["REGION", "FAULTS", "SHARE"],
            )
        )
        if f["files"]:
            files = [[printable(k), v] for k, v in list(f["files"].items())[:10]]
            out.append(tabulate(files, headers=["FILE", "FAULTS"]))
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class ReportOptions:
    """Where the report goes: as one JSON document (JSON) or text tables, into the file
    OUTPUT or on stdout (None)."""

    json: bool = False
    output: str | None = None


def emit(doc: dict, options: ReportOptions) -> None:
    """Write the report DOC as OPTIONS say."""
    text = json.dumps(doc, indent=1, default=str) + "\n" if options.json else render_text(doc)
    if options.output:
        with open(options.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
