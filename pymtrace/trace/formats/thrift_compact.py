"""A schema-free reader and writer of Thrift's compact protocol, for Parquet footers.

Parquet's footer (FileMetaData) is a Thrift struct in the compact protocol. pymtrace's
Parquet writer appends row groups to a file that stays readable after each one: pyarrow
writes every row group as a one-row-group file in memory, and the writer moves its bytes
into the real file, so the row group's offsets (relative to the in-memory file) must be
shifted and a footer listing every row group so far written after it. pyarrow can neither
append to a file nor shift offsets, hence this small codec: every compact-protocol value
carries its type, so structs decode without the Parquet schema and re-encode to the same
bytes.

A struct is a list of [field id, type, value]; a list or set is (element type, [values]);
a map is (key type, value type, [(key, value)]); a bool field's value is its type (1 true,
2 false) and its value None. ValueError on bytes that are not a compact-protocol struct.
"""

from __future__ import annotations

from typing import Any

BOOL_TRUE, BOOL_FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(1, 13)
_INTS = (I16, I32, I64)
_MAX_DEPTH = 32


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("thrift: truncated varint")
        c = buf[pos]
        pos += 1
        value |= (c & 0x7F) << shift
        if not c & 0x80:
            return value, pos
        shift += 7
        if shift > 70:
            raise ValueError("thrift: varint too long")


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _unzigzag(v: int) -> int:
    return (v >> 1) ^ -(v & 1)


def _zigzag(v: int) -> int:
    return (v << 1) ^ (v >> 63)


def read_struct(buf: bytes, pos: int = 0, depth: int = 0) -> tuple[list, int]:
    """(fields, position after the struct's stop byte) of the struct at POS in BUF."""
    if depth > _MAX_DEPTH:
        raise ValueError("thrift: structs nested too deep")
    fields = []
    last = 0
    while True:
        if pos >= len(buf):
            raise ValueError("thrift: truncated struct")
        head = buf[pos]
        pos += 1
        if head == 0:
            return fields, pos
        ttype, delta = head & 0x0F, head >> 4
        if delta:
            fid = last + delta
        else:
            raw, pos = _varint(buf, pos)
            fid = _unzigzag(raw)
        last = fid
        if ttype in (BOOL_TRUE, BOOL_FALSE):
            value = None
        else:
            value, pos = _read_value(buf, pos, ttype, depth)
        fields.append([fid, ttype, value])


def _read_value(buf: bytes, pos: int, ttype: int, depth: int) -> tuple[Any, int]:
    if ttype == BYTE:
        if pos >= len(buf):
            raise ValueError("thrift: truncated byte")
        return buf[pos], pos + 1
    if ttype in _INTS:
        raw, pos = _varint(buf, pos)
        return _unzigzag(raw), pos
    if ttype == DOUBLE:
        if pos + 8 > len(buf):
            raise ValueError("thrift: truncated double")
        return buf[pos : pos + 8], pos + 8
    if ttype == BINARY:
        n, pos = _varint(buf, pos)
        if pos + n > len(buf):
            raise ValueError("thrift: truncated binary")
        return bytes(buf[pos : pos + n]), pos + n
    if ttype in (LIST, SET):
        if pos >= len(buf):
            raise ValueError("thrift: truncated list")
        head = buf[pos]
        pos += 1
        size, etype = head >> 4, head & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        items = []
        for _ in range(size):
            if etype in (BOOL_TRUE, BOOL_FALSE):  # in a list a bool is one byte
                if pos >= len(buf):
                    raise ValueError("thrift: truncated list")
                items.append(buf[pos])
                pos += 1
            else:
                item, pos = _read_value(buf, pos, etype, depth + 1)
                items.append(item)
        return (etype, items), pos
    if ttype == MAP:
        size, pos = _varint(buf, pos)
        if not size:
            return (0, 0, []), pos
        if pos >= len(buf):
            raise ValueError("thrift: truncated map")
        kt, vt = buf[pos] >> 4, buf[pos] & 0x0F
        pos += 1
        pairs = []
        for _ in range(size):
            k, pos = _read_value(buf, pos, kt, depth + 1)
            v, pos = _read_value(buf, pos, vt, depth + 1)
            pairs.append((k, v))
        return (kt, vt, pairs), pos
    if ttype == STRUCT:
        return read_struct(buf, pos, depth + 1)
    raise ValueError(f"thrift: unknown type {ttype}")


def write_struct(fields: list, out: bytearray | None = None) -> bytearray:
    """Encode FIELDS (as read_struct returns them, ids ascending) into OUT; returns OUT."""
    out = bytearray() if out is None else out
    last = 0
    for fid, ttype, value in fields:
        delta = fid - last
        if 0 < delta <= 15:
            out.append((delta << 4) | ttype)
        else:
            out.append(ttype)
            _put_varint(out, _zigzag(fid))
        last = fid
        if ttype not in (BOOL_TRUE, BOOL_FALSE):
            _write_value(out, ttype, value)
    out.append(0)
    return out


def _write_value(out: bytearray, ttype: int, value: Any) -> None:
    if ttype == BYTE:
        out.append(value & 0xFF)
    elif ttype in _INTS:
        _put_varint(out, _zigzag(value))
    elif ttype == DOUBLE:
        out += value
    elif ttype == BINARY:
        _put_varint(out, len(value))
        out += value
    elif ttype in (LIST, SET):
        etype, items = value
        if len(items) < 15:
            out.append((len(items) << 4) | etype)
        else:
            out.append(0xF0 | etype)
            _put_varint(out, len(items))
        for item in items:
            if etype in (BOOL_TRUE, BOOL_FALSE):
                out.append(item)
            else:
                _write_value(out, etype, item)
    elif ttype == MAP:
        kt, vt, pairs = value
        _put_varint(out, len(pairs))
        if pairs:
            out.append((kt << 4) | vt)
            for k, v in pairs:
                _write_value(out, kt, k)
                _write_value(out, vt, v)
    elif ttype == STRUCT:
        write_struct(value, out)
    else:
        raise ValueError(f"thrift: unknown type {ttype}")


def field(fields: list, fid: int) -> list | None:
    """The [id, type, value] entry of field FID in a decoded struct, or None."""
    for entry in fields:
        if entry[0] == fid:
            return entry
    return None


def list_header(n: int, etype: int) -> bytes:
    """The compact-protocol header of a list of N elements of ETYPE (for lists written in parts)."""
    out = bytearray()
    if n < 15:
        out.append((n << 4) | etype)
    else:
        out.append(0xF0 | etype)
        _put_varint(out, n)
    return bytes(out)
