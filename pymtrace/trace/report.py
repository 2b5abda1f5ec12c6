"""The analysis report as typed data: what `pymtrace analyze` computes (trace/report_sql.py) and
its text, HTML and JSON outputs read (docs/analyze.md lists the sections).

to_json() gives the dict `analyze --json` prints: each field under its name (or its `json`
metadata, e.g. `class`), in declaration order; a field holding ABSENT is left out (the keys
a report has only sometimes: `function` and `source` of a caller once callers are
symbolized, the stack-table keys of `stacks`, and `files`, `settings`, `symbols` and
`totals.allocators`, which a report computed by Spark from a dataset has not).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class _Absent:
    """The value of a field the report leaves out of its JSON (false, like None)."""

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False

    def __copy__(self) -> _Absent:
        return self

    def __deepcopy__(self, memo: dict) -> _Absent:
        return self


ABSENT: Any = _Absent()


def _label() -> Any:  # noqa: ANN401 (a dataclass field)
    return field(metadata={"json": "class"})


def to_json(value: Any) -> Any:  # noqa: ANN401 (any part of a report)
    """VALUE (a report or a part of it) as JSON-ready dicts, lists and scalars."""
    if dataclasses.is_dataclass(value):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if v is not ABSENT:
                out[f.metadata.get("json", f.name)] = to_json(v)
        return out
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


@dataclass(kw_only=True)
class InputFile:
    path: str
    format: str
    allocator: str | None  # the allocator family it says it was recorded from (None: the format cannot say)


@dataclass(kw_only=True)
class Settings:
    memory_limit: str
    mmap_threshold: int
    top: int


@dataclass(kw_only=True)
class Totals:
    events: int
    files: int
    threads: int  # distinct (file, thread)
    requested_bytes: int
    span_ns: int | None
    free_null: int
    allocators: list[str] = ABSENT


@dataclass(kw_only=True)
class CallCount:
    count: int
    failed: int
    requested_bytes: int


@dataclass(kw_only=True)
class SizeClass:
    label: str = _label()
    max: int | None
    count: int


@dataclass(kw_only=True)
class Requests:
    count: int
    requested_bytes: int


@dataclass(kw_only=True)
class MmapSplit:
    threshold: int
    below: Requests
    at_or_above: Requests
    half_to_threshold: int
    threshold_to_double: int


@dataclass(kw_only=True)
class Sizes:
    histogram: list[SizeClass]
    mmap_threshold: MmapSplit


@dataclass(kw_only=True)
class LifetimeClass:
    label: str = _label()
    count: int


@dataclass(kw_only=True)
class Lifetimes:
    unit: str | None
    freed: int
    cross_thread_frees: int
    min_ns: int | None
    max_ns: int | None
    mean_ns: float | None
    p50_ns: int | None
    p90_ns: int | None
    p99_ns: int | None
    histogram: list[LifetimeClass]
    releases_of_unknown_blocks: int
    allocations_over_live_blocks: int


@dataclass(kw_only=True)
class LivePoint:
    bucket: int
    at: int
    max_bytes: int
    end_bytes: int


@dataclass(kw_only=True)
class Live:
    unit: str | None  # "ns", or "row" for a trace without times
    peak_bytes: int
    peak_at: int | None
    final_bytes: int
    points: list[LivePoint]


@dataclass(kw_only=True)
class NeverFreedCaller:
    caller: str | None
    count: int
    requested_bytes: int
    function: str | None = ABSENT  # (function, source: see Caller)
    source: str | None = ABSENT


@dataclass(kw_only=True)
class NeverFreed:
    count: int
    requested_bytes: int
    by_caller: list[NeverFreedCaller]


@dataclass(kw_only=True)
class ThreadStats:
    file: int
    thread: int
    calls: int
    allocations: int
    frees: int
    requested_bytes: int
    first_ns: int | None
    last_ns: int | None
    cross_thread_frees: int


@dataclass(kw_only=True)
class ThreadTimeline:
    file: int
    thread: int
    calls: list[int]


@dataclass(kw_only=True)
class Timeline:
    buckets: int
    bucket_ns: float | None
    threads: list[ThreadTimeline]


@dataclass(kw_only=True)
class Threads:
    count: int
    top: list[ThreadStats]
    timeline: Timeline


@dataclass(kw_only=True)
class ChainLength:
    reallocs: str
    chains: int


@dataclass(kw_only=True)
class Chain:
    file: int
    thread: int
    caller: str | None
    first_call: str
    reallocs: int
    first_size: int
    final_size: int
    max_size: int
    moves: int
    function: str | None = ABSENT  # (function, source: see Caller)
    source: str | None = ABSENT


@dataclass(kw_only=True)
class ReallocChains:
    reallocs_linked: int
    in_place: int
    moved: int
    released: int
    grew: int
    shrank: int
    chains: int
    length_histogram: list[ChainLength]
    longest: list[Chain]


@dataclass(kw_only=True)
class Caller:
    caller: str | None
    calls: int
    allocations: int
    requested_bytes: int
    frees: int
    never_freed: int
    never_freed_bytes: int
    # set on every caller entry once a stack table symbolized the report (None where it knew
    # no frame), absent otherwise
    function: str | None = ABSENT
    source: str | None = ABSENT  # file:line


@dataclass(kw_only=True)
class Stack:
    file: int = ABSENT  # file and stack_id: a stack of a stack table
    stack_id: int = ABSENT
    stack: list[str | None]  # return addresses, or function(file:line) from a stack table; innermost first
    calls: int
    requested_bytes: int


@dataclass(kw_only=True)
class Stacks:
    recorded: bool
    source: str = ABSENT  # "stack table" when the stacks are a stack table's
    calls_with_stack: int = ABSENT
    top: list[Stack]


@dataclass(kw_only=True)
class Symbols:
    source: str | None  # "stack table", "maps" (the executable mappings a trace keeps), both, or None
    callers_symbolized: int
    # with maps: the recorded files found nowhere on this machine (their callers stay addresses)
    files_missing: list[str] = ABSENT


@dataclass(kw_only=True)
class Report:
    """Every number of the analysis (docs/analyze.md, "What it reports")."""

    files: list[InputFile] = ABSENT
    settings: Settings = ABSENT
    totals: Totals
    calls: dict[str, CallCount]  # by count, then name
    sizes: Sizes
    lifetimes: Lifetimes
    live: Live | None  # None: a dataset without times, reported by Spark
    never_freed: NeverFreed
    threads: Threads
    realloc_chains: ReallocChains
    callers: list[Caller]
    stacks: Stacks
    symbols: Symbols = ABSENT

    def to_json(self) -> dict:
        """The dict `analyze --json` prints."""
        return to_json(self)
