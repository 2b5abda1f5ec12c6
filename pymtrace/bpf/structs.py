"""The one place where Python mirrors the structs BPF programs share with user space.

Nothing is written twice: the ctypes classes are built from the C headers in bpf/
themselves (`#define NAME NUMBER` constants and plain structs of fixed-width fields),
so a field added to a header is seen by Python at once.

    from pymtrace.bpf import structs
    rec = structs.header("record")            # parses bpf/record.h (+ its #includes)
    Event = rec.structs["record_event"]       # a ctypes.Structure
    rec.consts["CALL_MALLOC"]                 # 1

The native replay simulator's contract is read the same way from pymtrace/replay/native/wl.h
(`native_header("wl")`), the interposer's ring from pymtrace/tracee/native/interpose.h
(`native_header("interpose", "tracee")`).
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import re
from typing import Callable

from pymtrace.bpf.load import bpf_dir

_CTYPES = {
    "__u8": ctypes.c_uint8,
    "u8": ctypes.c_uint8,
    "unsigned char": ctypes.c_uint8,
    "__s8": ctypes.c_int8,
    "s8": ctypes.c_int8,
    "char": ctypes.c_char,
    "__u16": ctypes.c_uint16,
    "u16": ctypes.c_uint16,
    "__s16": ctypes.c_int16,
    "s16": ctypes.c_int16,
    "__u32": ctypes.c_uint32,
    "u32": ctypes.c_uint32,
    "unsigned int": ctypes.c_uint32,
    "__s32": ctypes.c_int32,
    "s32": ctypes.c_int32,
    "int": ctypes.c_int32,
    "__u64": ctypes.c_uint64,
    "u64": ctypes.c_uint64,
    "__s64": ctypes.c_int64,
    "s64": ctypes.c_int64,
}

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.M)
_DEFINE = re.compile(r"^\s*#define\s+(\w+)\s+\(?(-?(?:0x[0-9a-fA-F]+|\d+))[uUlL]*\)?\s*$", re.M)
_STRUCT = re.compile(r"struct\s+(\w+)\s*\{(.*?)\}\s*(?:__attribute__\s*\(\((\w+)\)\))?\s*;", re.S)
_FIELD = re.compile(r"^\s*((?:struct\s+)?[\w ]+?)\s+(\w+)\s*((?:\[\s*\w+\s*\])*)\s*$")


class Header:
    def __init__(self, consts: dict[str, int], structs: dict[str, type[ctypes.Structure]]) -> None:
        self.consts = consts
        self.structs = structs

    def names(self, prefix: str) -> dict[int, str]:
        """{value: name without PREFIX} of the constants named PREFIX..., in value order."""
        found = sorted((v, k) for k, v in self.consts.items() if k.startswith(prefix))
        return {v: k[len(prefix) :] for v, k in found}

    def __getattr__(self, name: str) -> type[ctypes.Structure]:
        try:
            return self.structs[name]
        except KeyError:
            raise AttributeError(name) from None


def parse(
    text: str,
    consts: dict[str, int] | None = None,
    structs: dict[str, type[ctypes.Structure]] | None = None,
    include: Callable[[str], str] | None = None,
) -> tuple[dict[str, int], dict[str, type[ctypes.Structure]]]:
    """Parse header TEXT into (consts, structs); include(name) returns an included header's text."""
    consts = dict(consts or {})
    structs = dict(structs or {})
    text = _COMMENT.sub("", text)
    for inc in _INCLUDE.findall(text):
        if include is not None:
            consts, structs = parse(include(inc), consts, structs, include)
    for name, value in _DEFINE.findall(text):
        consts[name] = int(value, 0)
    for name, body, attr in _STRUCT.findall(text):
        fields = []
        for decl in body.split(";"):
            decl = decl.strip()
            if not decl:
                continue
            m = _FIELD.match(decl)
            if not m:
                raise ValueError(f"struct {name}: cannot parse field {decl!r}")
            ctype_name, field, dims = m.group(1).strip(), m.group(2), m.group(3)
            if ctype_name.startswith("struct "):
                ctype = structs[ctype_name.split()[1]]
            else:
                ctype = _CTYPES[ctype_name]
            for dim in reversed(re.findall(r"\[\s*(\w+)\s*\]", dims)):
                n = consts[dim] if dim in consts else int(dim, 0)
                ctype = ctype * n
            fields.append((field, ctype))
        attrs = {"_fields_": fields}
        if attr == "packed":
            attrs["_pack_"] = 1
        structs[name] = type(name, (ctypes.Structure,), attrs)
    return consts, structs


@functools.lru_cache(maxsize=None)
def header(program: str) -> Header:
    """Parse bpf/PROGRAM.h (following #include "..." within bpf/)."""
    directory = bpf_dir()

    def include(name: str) -> str:
        path = directory / name
        return path.read_text() if path.exists() else ""

    consts, structs = parse(include(f"{program}.h"), include=include)
    return Header(consts, structs)


@functools.lru_cache(maxsize=None)
def native_header(name: str, package: str = "replay") -> Header:
    """Parse pymtrace/PACKAGE/native/NAME.h (the contract a native helper shares with Python)."""
    path = pathlib.Path(__file__).resolve().parents[1] / package / "native" / f"{name}.h"
    consts, structs = parse(path.read_text())
    return Header(consts, structs)
