"""`pymtrace heap --format text`: the top stacks as a plain report, like bcc memleak's.

One block per stack (stacks that print the same summed into one), largest first by the
chosen value: bytes and allocations, then the stack leaf first, one symbolized frame per line
with its module (and source line when the debug info has it); inlined frames are marked. The run's settings and counters head it.
"""

from __future__ import annotations

import os
from typing import BinaryIO

from pymtrace.sinks.text import printable
from pymtrace.sources.heapprofile import DEFAULT_VALUE, VALUE_TYPES, FrameSource, HeapProfile

_SPACE_OF = {"alloc_objects": "alloc_space", "alloc_space": "alloc_space"}
_OBJECTS_OF = {"alloc_objects": "alloc_objects", "alloc_space": "alloc_objects"}


def render_text(profile: HeapProfile, symbolizer: FrameSource, top: int = 10, value: str = DEFAULT_VALUE) -> str:
    """The report of PROFILE's TOP stacks by VALUE."""
    if value not in profile.value_types:
        raise ValueError(f"unknown value {value!r}; choose one of {', '.join(profile.value_types)}")
    space = _SPACE_OF.get(value, "inuse_space")
    objects = _OBJECTS_OF.get(value, "inuse_objects")
    what = "allocated" if space == "alloc_space" else "in use"
    entries = [e for e in _merged(profile, symbolizer) if round(e[0][value])]
    entries.sort(key=lambda e: (-e[0][value], -e[0][space]))
    lines = [profile.title()]
    lines += [f"  {line}" for line in profile.summary_lines()]
    totals = profile.totals()
    lines.append(
        f"{round(totals[space])} bytes in {round(totals[objects])} allocations {what} "
        f"in {len(entries)} stacks; top {min(top, len(entries))} by {value}:"
    )
    for values, frames in entries[:top]:
        lines.append(f"\t{round(values[space])} bytes in {round(values[objects])} allocations from stack")
        lines += frames
    # symbols, paths and the command come from the process: escaped (the layout's tabs kept)
    return "\n".join(printable(line, keep="\t") for line in lines) + "\n"


def _frame_lines(stack: tuple, symbolizer: FrameSource) -> tuple[str, ...]:
    """STACK's lines in the report, leaf first, like memleak."""
    if not stack:
        return ("\t\t[unknown]",)
    lines = []
    for loc in stack:
        module = os.path.basename(loc[0].path) or "?"
        for frame in symbolizer.frames(loc):
            module = "python" if frame.python else module
            source = f" {frame.file}:{frame.line}" if frame.file and frame.line else ""
            inlined = " (inlined)" if frame.inlined else ""
            lines.append(f"\t\t{frame.function} [{module}]{source}{inlined}")
    return tuple(lines)


def _merged(profile: HeapProfile, symbolizer: FrameSource) -> list[tuple[dict[str, float], tuple[str, ...]]]:
    """[(values by VALUE_TYPES name, frame lines)] of PROFILE's stacks, the stacks that print
    the same summed into one: a loop the compiler unrolled calls from several return addresses
    in one function (gcc 14 -O2), which without line numbers read as one stack."""
    merged = {}
    for entry in profile.stacks():
        frames = _frame_lines(entry.stack, symbolizer)
        values = merged.setdefault(frames, dict.fromkeys(VALUE_TYPES, 0.0))
        for name in VALUE_TYPES:
            values[name] += entry.value(name)
    return [(values, frames) for frames, values in merged.items()]


def write_text(
    profile: HeapProfile, symbolizer: FrameSource, out: BinaryIO, top: int = 10, value: str = DEFAULT_VALUE
) -> None:
    """Write the report of PROFILE's TOP stacks by VALUE to the binary file OUT."""
    out.write(render_text(profile, symbolizer, top, value).encode("utf-8", "backslashreplace"))
