"""Sizes given on the command line: "64M", "512k", "4096" (binary multiples, optional "iB"/"B")."""

from __future__ import annotations

import re

from pymtrace.errors import PymtraceError


def parse_bytes(text: str, option: str) -> int:
    """TEXT as a number of bytes (K/M/G suffixes are powers of 1024); a PymtraceError naming
    OPTION if it is not one."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[iI]?[bB]?\s*", str(text))
    if not m:
        raise PymtraceError(f"{option}: cannot parse {text!r} (e.g. 64M)")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
