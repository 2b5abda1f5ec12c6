"""Stack unwinding of the traced process: the types every stage of `pymtrace heap` shares.

Only the identity types live here for now (Module, Frame, Location); the unwinder and the
symbolizer (ProcessImage, Symbolizer) are added beside them by the unwinding part of issue 13.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Module:
    """Identity of one mapped ELF file, the same in every process that maps it."""

    path: str  # as mapped (/proc/PID/maps)
    build_id: str  # lowercase hex, "" when the file has none


@dataclass(frozen=True)
class Frame:
    """One symbolized frame; a pc can yield several (inlined callees, then the function)."""

    function: str  # demangled, "@GLIBC_x" suffix stripped; "libx.so+0x1a2b" if unknown
    file: str = ""  # source file when debug info exists
    line: int = 0
    inlined: bool = False  # True for an inlined callee


# (module, file-relative pc: the return address - 1 for callers)
Location = tuple[Module, int]
