"""`pymtrace analyze --html`: the analysis report (trace/report.py) as one self-contained
HTML file. Plots are hand-written inline SVG: no script, no network, nothing to install (the
numbers are exact in the tables; the plots are for looking at)."""

from __future__ import annotations

import html
from typing import IO, TYPE_CHECKING, Sequence

from pymtrace.sinks.analysis_text import caller_text

if TYPE_CHECKING:
    from pymtrace.trace.report import Report

WIDTH, HEIGHT = 760, 240
PAD_L, PAD_B, PAD_T = 70, 60, 10
BAR = "#4e79a7"
LINE = "#e15759"


def _e(v: object) -> str:
    return html.escape(str(v), quote=True)


def _num(n: float | int | None) -> str:
    if n is None:
        return "-"
    return f"{n:,.0f}" if isinstance(n, int) or float(n).is_integer() else f"{n:,.1f}"


def _human(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.3g}"  # a time axis in ms or s can be below 1


def _duration(ns: float | None) -> str:
    if ns is None:
        return "-"
    for unit, div in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= div:
            return f"{ns / div:.3g} {unit}"
    return f"{ns:.0f} ns"


def bar_chart(title: str, labels: Sequence[str], values: Sequence[int], ylabel: str) -> str:
    """An SVG bar chart, one bar per label (value in each bar's tooltip)."""
    n = max(1, len(values))
    top = max(values, default=0) or 1
    plot_w, plot_h = WIDTH - PAD_L - 10, HEIGHT - PAD_B - PAD_T
    step = plot_w / n
    out = [_svg_open(title), _y_axis(top, plot_h, ylabel)]
    for i, (label, v) in enumerate(zip(labels, values)):
        h = plot_h * v / top
        x = PAD_L + i * step
        out.append(
            f'<rect class="bar" x="{x + 1:.1f}" y="{PAD_T + plot_h - h:.1f}" width="{max(1.0, step - 2):.1f}" '
            f'height="{h:.1f}" fill="{BAR}"><title>{_e(label)}: {_num(v)}</title></rect>'
        )
        out.append(
            f'<text x="{x + step / 2:.1f}" y="{PAD_T + plot_h + 8}" font-size="9" text-anchor="end" '
            f'transform="rotate(-45 {x + step / 2:.1f} {PAD_T + plot_h + 8})">{_e(label)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def line_chart(title: str, xs: Sequence[float], ys: Sequence[float], xlabel: str, ylabel: str) -> str:
    """An SVG step line of YS over XS (filled below)."""
    out = [_svg_open(title)]
    plot_w, plot_h = WIDTH - PAD_L - 10, HEIGHT - PAD_B - PAD_T
    top = max(ys, default=0) or 1
    right = max(xs, default=0) or 1
    out.append(_y_axis(top, plot_h, ylabel))
    pts = [(PAD_L, PAD_T + plot_h)]
    for x, y in zip(xs, ys):
        pts.append((PAD_L + plot_w * x / right, PAD_T + plot_h - plot_h * y / top))
    pts.append((pts[-1][0], PAD_T + plot_h))
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
    out.append(f'<polygon class="area" points="{path}" fill="{LINE}" fill-opacity="0.35" stroke="{LINE}"/>')
    for frac in (0, 0.25, 0.5, 0.75, 1):
        x = PAD_L + plot_w * frac
        out.append(
            f'<text x="{x:.1f}" y="{PAD_T + plot_h + 16}" font-size="10" text-anchor="middle">'
            f"{_e(_human(right * frac))}</text>"
        )
    out.append(
        f'<text x="{PAD_L + plot_w / 2}" y="{HEIGHT - 10}" font-size="11" text-anchor="middle">{_e(xlabel)}</text>'
    )
    out.append("</svg>")
    return "".join(out)


def heat_rows(title: str, rows: Sequence[tuple[str, Sequence[int]]]) -> str:
    """An SVG timeline: one row per thread, one cell per time bucket, darker = more calls."""
    if not rows:
        return ""
    cells = max(len(r[1]) for r in rows) or 1
    row_h = 16
    height = PAD_T + row_h * len(rows) + 30
    top = max((max(r[1], default=0) for r in rows), default=0) or 1
    plot_w = WIDTH - PAD_L - 10
    w = plot_w / cells
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img">']
    out.append(f"<title>{_e(title)}</title>")
    for r, (label, counts) in enumerate(rows):
        y = PAD_T + r * row_h
        out.append(f'<text x="{PAD_L - 4}" y="{y + 12}" font-size="10" text-anchor="end">{_e(label)}</text>')
        for c, n in enumerate(counts):
            if n:
                alpha = 0.15 + 0.85 * n / top
                out.append(
                    f'<rect class="cell" x="{PAD_L + c * w:.1f}" y="{y}" width="{w + 0.2:.1f}" height="{row_h - 2}" '
                    f'fill="{BAR}" fill-opacity="{alpha:.2f}"><title>{_e(label)}: {_num(n)} calls</title></rect>'
                )
    out.append(f'<text x="{PAD_L + plot_w / 2}" y="{height - 8}" font-size="11" text-anchor="middle">time</text>')
    out.append("</svg>")
    return "".join(out)


def _svg_open(title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">'
        f"<title>{_e(title)}</title>"
    )


def _y_axis(top: float, plot_h: float, label: str) -> str:
    out = [f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{PAD_T + plot_h}" stroke="#888"/>']
    for frac in (0, 0.5, 1):
        y = PAD_T + plot_h - plot_h * frac
        out.append(
            f'<text x="{PAD_L - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{_e(_human(top * frac))}</text>'
        )
    out.append(
        f'<text x="12" y="{PAD_T + plot_h / 2}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 12 {PAD_T + plot_h / 2})">{_e(label)}</text>'
    )
    return "".join(out)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #eee; }
td:first-child, th:first-child { text-align: left; }
h2 { margin-top: 1.5em; border-bottom: 1px solid #ccc; }
.big { font-size: 1.3em; }
"""


def write_html(rep: Report, out: IO[str], title: str = "pymtrace analyze") -> None:
    """Write the report REP (trace.analysis.TraceSet.report()) to OUT as one HTML page."""
    tot = rep.totals
    life = rep.lifetimes
    live = rep.live
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'\">",
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        "<p>"
        + ", ".join(
            _e(f.path) + f" ({_e(f.format)}" + (f", recorded from {_e(f.allocator)}" if f.allocator else "") + ")"
            for f in rep.files
        )
        + "</p>",
        _table(
            ["events", "threads", "requested bytes", "peak live bytes", "never freed", "span"],
            [
                [
                    _num(tot.events),
                    _num(tot.threads),
                    _num(tot.requested_bytes),
                    _num(live.peak_bytes),
                    _num(rep.never_freed.count),
                    _duration(tot.span_ns),
                ]
            ],
            "big totals",
        ),
        "<h2>Call mix</h2>",
        _table(
            ["call", "count", "failed", "requested bytes"],
            [[n, _num(c.count), _num(c.failed), _num(c.requested_bytes)] for n, c in rep.calls.items()],
            "calls",
        ),
    ]
    sizes = rep.sizes
    hist = [h for h in sizes.histogram]
    while len(hist) > 1 and not hist[-1].count:
        hist.pop()
    mm = sizes.mmap_threshold
    parts += [
        "<h2>Request sizes</h2>",
        bar_chart("request sizes", [h.label for h in hist], [h.count for h in hist], "requests"),
        f"<p>glibc's mmap threshold ({_num(mm.threshold)} bytes by default): "
        f"{_num(mm.below.count)} requests below ({_num(mm.below.requested_bytes)} bytes), "
        f"{_num(mm.at_or_above.count)} at or above ({_num(mm.at_or_above.requested_bytes)} bytes); "
        f"{_num(mm.half_to_threshold)} within half of it below, {_num(mm.threshold_to_double)} up to twice it.</p>",
        "<h2>Lifetimes</h2>",
    ]
    if life.histogram:
        parts.append(
            bar_chart("lifetimes", [h.label for h in life.histogram], [h.count for h in life.histogram], "blocks")
        )
    parts.append(
        _table(
            ["freed", "cross-thread frees", "min", "median", "p90", "p99", "max"],
            [
                [
                    _num(life.freed),
                    _num(life.cross_thread_frees),
                    _duration(life.min_ns),
                    _duration(life.p50_ns),
                    _duration(life.p90_ns),
                    _duration(life.p99_ns),
                    _duration(life.max_ns),
                ]
            ],
            "lifetimes",
        )
    )
    if live.unit == "ns":  # the time axis in ms, or in s for a trace of a second or more
        div, unit = (1e9, "s") if max((p.at for p in live.points), default=0) >= 1e9 else (1e6, "ms")
        peak = _duration(live.peak_at or 0)
    else:
        div, unit = 1, "calls"
        peak = f"{_human(live.peak_at or 0)} calls"
    parts += [
        "<h2>Live requested bytes (ideal RSS)</h2>",
        f"<p>peak {_num(live.peak_bytes)} bytes at {_e(peak)}; {_num(live.final_bytes)} bytes live at the end.</p>",
        line_chart("live bytes", [p.at / div for p in live.points], [p.max_bytes for p in live.points], unit, "bytes"),
        "<h2>Threads</h2>",
        heat_rows(
            "per-thread timeline",
            [(f"{t.file}:{t.thread}", t.calls) for t in rep.threads.timeline.threads],
        ),
        _table(
            ["file:thread", "calls", "allocations", "frees", "requested bytes", "cross-thread frees"],
            [
                [
                    f"{t.file}:{t.thread}",
                    _num(t.calls),
                    _num(t.allocations),
                    _num(t.frees),
                    _num(t.requested_bytes),
                    _num(t.cross_thread_frees),
                ]
                for t in rep.threads.top
            ],
            "threads",
        ),
        "<h2>Top callers</h2>",
    ]
    if rep.symbols and rep.symbols.files_missing:
        missing = ", ".join(rep.symbols.files_missing)
        parts.append(f"<p>Not found on this machine, their callers stay addresses: {_e(missing)}.</p>")
    callers = rep.callers
    parts.append(
        bar_chart(
            "top callers (requested bytes)",
            [caller_text(c) for c in callers],
            [c.requested_bytes for c in callers],
            "bytes",
        )
    )
    parts.append(
        _table(
            ["caller", "calls", "allocations", "requested bytes", "never freed", "never freed bytes"],
            [
                [
                    caller_text(c),
                    _num(c.calls),
                    _num(c.allocations),
                    _num(c.requested_bytes),
                    _num(c.never_freed),
                    _num(c.never_freed_bytes),
                ]
                for c in callers
            ],
            "callers",
        )
    )
    if rep.stacks.recorded:
        parts.append("<h2>Top stacks</h2>")
        parts.append(
            _table(
                ["stack (innermost first)", "calls", "requested bytes"],
                [[" ".join(s.stack), _num(s.calls), _num(s.requested_bytes)] for s in rep.stacks.top],
                "stacks",
            )
        )
    ch = rep.realloc_chains
    nf = rep.never_freed
    parts += [
        "<h2>Realloc chains</h2>",
        f"<p>{_num(ch.chains)} chains, {_num(ch.reallocs_linked)} reallocs ({_num(ch.in_place)} in place, "
        f"{_num(ch.moved)} moved; {_num(ch.grew)} grew, {_num(ch.shrank)} shrank).</p>",
        _table(
            ["thread", "caller", "reallocs", "first size", "final size", "max size", "moves"],
            [
                [
                    f"{c.file}:{c.thread}",
                    caller_text(c),
                    _num(c.reallocs),
                    _num(c.first_size),
                    _num(c.final_size),
                    _num(c.max_size),
                    _num(c.moves),
                ]
                for c in ch.longest
            ],
            "chains",
        ),
        "<h2>Never freed</h2>",
        f"<p>{_num(nf.count)} blocks, {_num(nf.requested_bytes)} bytes requested.</p>",
        _table(
            ["caller", "blocks", "requested bytes"],
            [[caller_text(c), _num(c.count), _num(c.requested_bytes)] for c in nf.by_caller],
            "never-freed",
        ),
        "</body></html>\n",
    ]
    out.write("\n".join(parts))
