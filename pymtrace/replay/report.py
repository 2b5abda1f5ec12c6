"""The replay's report: the comparison table (`table_rows`) and the plot (`plot`) of
`pymtrace replay`, from rows of (configuration label, result or None, error or None) where a
result is the simulator's --json report (see pymtrace/replay/runner.py)."""

from __future__ import annotations

import os
from typing import Optional

from pymtrace.errors import PymtraceError
from pymtrace.replay.runner import CALL_TYPES
from pymtrace.trace.files import atomic_output

Row = tuple[str, Optional[dict], Optional[str]]  # (configuration label, result, error)


def _fmt(v: float | None, digits: int = 0) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and digits:
        return f"{v:,.{digits}f}"
    return f"{int(round(v)):,}"


def table_rows(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) for tabulate from [(label, result|None, error|None)]."""
    types = [t for t in CALL_TYPES if any(r and t in r["calls"] and r["calls"][t]["count"] for _, r, _ in rows)]
    headers = [
        "configuration",
        "status",
        "wall ms",
        "cpu ms",
        "Max RSS KiB (no .wl)",
        "peak anon KiB",
        "Ideal KiB",
        "unit",
    ]
    for t in types:
        headers += [f"{t} mean", f"{t} p99"]
    headers += ["calls"]
    out = []
    for label, r, err in rows:
        if r is None:
            out.append([label, err] + [""] * (len(headers) - 2))
            continue
        notes = []
        if r.get("runs", 1) > 1:
            notes.append(f"median of {r['runs']}")
        if r.get("uprobed"):
            notes.append("UPROBED: " + r["uprobed"].split()[0] + "... times include trace traps")
        line = [
            label,
            "ok" + (f" ({'; '.join(notes)})" if notes else ""),
            _fmt(r["wall_us"] / 1000, 1),
            _fmt((r["cpu_user_us"] + r["cpu_sys_us"]) / 1000, 1),
            _fmt(r["max_rss_kb"]),
            _fmt(r["anon_rss_peak_kb"]),
            _fmt(r["ideal_rss_peak_bytes"] / 1024),
            r["unit"],
        ]
        for t in types:
            c = r["calls"].get(t)
            line += [_fmt(c["mean"]) if c and c["count"] else "", _fmt(c["p99"]) if c and c["count"] else ""]
        line.append(_fmt(sum(c["count"] for k, c in r["calls"].items() if k != "malloc_trim")))
        out.append(line)
    return headers, out


def plot(rows: list[Row], path: str, force: bool = False) -> None:
    """Plot RSS over time and the mean cost per call type of each configuration into PATH
    (.png, .svg, ...; an existing PATH is refused unless FORCE, never written through a symlink)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PymtraceError("--plot needs matplotlib (pip install 'pymtrace[plot]')") from None
    ok = [(label, r) for label, r, _ in rows if r is not None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8))
    for label, r in ok:
        xs = [s[0] / 1000 for s in r["rss_samples"]]
        ax1.plot(xs, [s[2] / 1024 for s in r["rss_samples"]], label=label)
    ok = [(label + (" (uprobed: times include traps)" if r.get("uprobed") else ""), r) for label, r in ok]
    ax1.set_xlabel("time (ms)")
    ax1.set_ylabel("anonymous RSS (MiB)")
    ax1.set_title("RSS over time")
    if ok:
        ax1.legend(fontsize="small")
    types = [t for t in CALL_TYPES if any(t in r["calls"] and r["calls"][t]["count"] for _, r in ok)]
    width = 0.8 / max(1, len(ok))
    for i, (label, r) in enumerate(ok):
        vals = [r["calls"][t]["mean"] if t in r["calls"] else 0 for t in types]
        ax2.bar([x + i * width for x in range(len(types))], vals, width, label=label)
    ax2.set_xticks([x + width * (len(ok) - 1) / 2 for x in range(len(types))])
    ax2.set_xticklabels(types)
    ax2.set_ylabel(f"mean {ok[0][1]['unit'] if ok else 'cycles'} per call")
    ax2.set_yscale("log")
    ax2.set_title("cost per call type")
    if ok:
        ax2.legend(fontsize="small")
    fig.tight_layout()
    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    try:
        with atomic_output(path, force) as out:
            fig.savefig(out, format=fmt)
    except (OSError, ValueError) as exc:
        raise PymtraceError(f"cannot write the plot {path}: {exc}") from None
    plt.close(fig)
