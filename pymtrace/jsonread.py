"""JSON that pymtrace did not write itself in this process (stack tables, a peer's frames,
state files, a simulator's report): malformed input, nesting deeper than Python's recursion
limit (`[` x 200,000) included, is one ValueError, never a RecursionError traceback."""

from __future__ import annotations

import json
from typing import IO, Any


def loads(data: str | bytes | bytearray) -> Any:
    """json.loads; ValueError on anything that is not a JSON document."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def load(f: IO, limit: int) -> Any:
    """The JSON document in the open file F, read whole up to LIMIT bytes (characters for a
    text file); ValueError beyond it or on anything that is not JSON."""
    data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"JSON document longer than {limit} bytes")
    return loads(data)
