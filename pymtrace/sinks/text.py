"""Numbers and names for humans: byte sizes, counts and rates, table cells, and names taken
from processes made safe for a terminal (`printable`). One formatter per kind, shared by
`pymtrace top` (its views, full screen and --batch), `heap`'s text report, `probes`, `run`
and `summary`.

(pymtrace.replay.runner formats its table with its own `_fmt`: exact numbers with
thousands separators under unit-named columns, not scaled units; and the dependency rule
keeps replay from importing sinks.)
"""

from typing import Optional, Union

from pymtrace.errors import printable  # noqa: F401  (the views' name for it)

Number = Union[int, float]


UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: Optional[Number], decimals: Optional[int] = None, none: str = "", largest: str = "PiB") -> str:
    """1536 -> '1.50 KiB'; exact below 1 KiB ('512 B'); negative keeps its sign.

    DECIMALS None (top): as many as fit 3 significant digits (2, 1 or 0) and a float below
    1 KiB rounded ('100 B'); a number (summary): that many, and the value below 1 KiB as it
    is. NONE: the text for an unknown value. LARGEST: the largest unit used."""
    if n is None:
        return none
    if isinstance(n, bool):
        n = int(n)
    units = UNITS[: UNITS.index(largest) + 1]
    if decimals is not None:  # summary's layout: 'n B', then one fixed precision
        for unit in units:
            if abs(n) < 1024 or unit == units[-1]:
                return f"{n} B" if unit == "B" else f"{n:.{decimals}f} {unit}"
            n /= 1024.0
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n:.0f} B" if isinstance(n, float) else f"{sign}{n} B"
    for unit in units[1:]:
        n /= 1024.0
        if n < 1024 or unit == units[-1]:
            if n < 10:
                return f"{sign}{n:.2f} {unit}"
            if n < 100:
                return f"{sign}{n:.1f} {unit}"
            return f"{sign}{n:.0f} {unit}"
    return f"{sign}{n}"  # not reached


def human_count(x: Optional[Number]) -> str:
    """A per-second rate or count: '0', '2.5', '812', '12.3k', '4.50M'."""
    if x is None:
        return ""
    if x == 0:
        return "0"
    ax = abs(x)
    if ax < 10 and not float(x).is_integer():
        return f"{x:.1f}"
    if ax < 1000:
        return f"{x:.0f}"
    for div, suffix in ((1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T")):
        v = x / div
        if abs(v) < 1000 or suffix == "T":
            return f"{v:.2f}{suffix}" if abs(v) < 10 else (f"{v:.1f}{suffix}" if abs(v) < 100 else f"{v:.0f}{suffix}")
    return str(x)


def format_cell(kind: str, value: object) -> str:
    """VALUE as text for a column of KIND: "bytes"/"byterate" (human_bytes), "rate"
    (human_count), "int", "pct", "ratio" (2.00x), "allocator" (the name of an untraced allocator), "str".
    None or "" (unknown, not applicable) is blank."""
    if value is None or value == "":
        return ""
    if kind in ("bytes", "byterate"):
        return human_bytes(value)  # type: ignore[arg-type]
    if kind == "rate":
        return human_count(value)  # type: ignore[arg-type]
    if kind == "int":
        return str(int(value)) if isinstance(value, (int, float)) else str(value)
    if kind == "pct":
        return f"{value:.1f}%"
    if kind == "ratio":
        return f"{value:.2f}x"
    if kind == "allocator":
        return f"allocator: {printable(value)} (not traced)"
    return printable(value)
