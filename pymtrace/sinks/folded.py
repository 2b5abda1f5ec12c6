"""`pymtrace heap --format folded`: one line per stack, `root;...;leaf VALUE`.

The collapsed-stack format of Brendan Gregg's flamegraph.pl, read also by speedscope and
inferno. VALUE is one of the profile's four values (rounded; stacks whose value rounds to 0
are left out); stacks whose frames have the same names are one line. A Python function's frame
is named with its file and line (heapprofile.frame_label).
"""

from __future__ import annotations

import re
from typing import BinaryIO

from pymtrace.sources.heapprofile import DEFAULT_VALUE, FrameSource, HeapProfile, frame_label, frames_root_first

# ';' separates frames and a newline ends the line: neither may appear inside a name
# (control characters are replaced too, so a line is always one printable line).
_UNSAFE = re.compile(r"[;\x00-\x1f\x7f]")


def folded_name(function: str) -> str:
    """FUNCTION made safe as one frame of a folded line: ';' and control characters -> '_'."""
    return _UNSAFE.sub("_", function) or "[unknown]"


def folded_lines(profile: HeapProfile, symbolizer: FrameSource, value: str = DEFAULT_VALUE) -> dict[str, int]:
    """Folded stack (root first) -> VALUE summed over the stacks that fold to it; zeros left out."""
    sums: dict[str, float] = {}
    for entry in profile.stacks():
        amount = entry.value(value)
        if not amount:
            continue
        frames = frames_root_first(entry.stack, symbolizer)
        key = ";".join(folded_name(frame_label(f)) for f in frames) or "[unknown]"
        sums[key] = sums.get(key, 0.0) + amount
    return {key: round(amount) for key, amount in sums.items() if round(amount)}


def write_folded(profile: HeapProfile, symbolizer: FrameSource, out: BinaryIO, value: str = DEFAULT_VALUE) -> None:
    """Write PROFILE's stacks with their VALUE to the binary file OUT, largest first."""
    lines = folded_lines(profile, symbolizer, value)
    for key, amount in sorted(lines.items(), key=lambda kv: (-kv[1], kv[0])):
        out.write(f"{key} {amount}\n".encode("utf-8", "backslashreplace"))
