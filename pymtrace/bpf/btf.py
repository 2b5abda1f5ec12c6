"""The kernel's own type information (BTF, /sys/kernel/btf/vmlinux), read for two questions:
where a member lies in a kernel struct, and which argument of a raw tracepoint is a pointer
to a given struct. Both let a BPF program read kernel data whose layout kernel headers do not
give (struct kmem_cache is private to mm/): the offsets are passed to the program as -D
switches, so nothing depends on a kernel version.

    types = Btf.read()                                  # None: no BTF on this kernel
    types.member_offsets("kmem_cache", ["name", "size"])  -> {"name": 96, "size": 24} or None
    types.tracepoint_arg("kmem_cache_free", "kmem_cache")  -> 2 (ctx->args[2]) or None
    types.has_member_path("bpf_link_info", ["kprobe_multi", "missed"])  -> True or False

The format is the kernel's (Documentation/bpf/btf.rst): a header, then type records, then
the strings. Only the records needed are decoded; the walk over the others only measures
their length (~0.02 s for a whole vmlinux). A corrupt blob is refused by read() (None) or
its questions have no answer (None / False): never an exception.
"""

from __future__ import annotations

import array
import functools
import os
import re
import struct
import sys
from typing import Callable, TypeVar

T = TypeVar("T")

VMLINUX = "/sys/kernel/btf/vmlinux"
MAGIC = 0xEB9F

KIND_PTR = 2
KIND_STRUCT = 4
KIND_UNION = 5
KIND_FWD = 7
KIND_TYPEDEF = 8
KIND_VOLATILE = 9
KIND_CONST = 10
KIND_RESTRICT = 11
KIND_FUNC_PROTO = 13
KIND_TYPE_TAG = 18
MODIFIERS = {KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG}

# kind -> (bytes after the 12-byte record, bytes per vlen item)
_EXTRA = {
    1: (4, 0),  # INT
    3: (12, 0),  # ARRAY
    4: (0, 12),  # STRUCT: btf_member
    5: (0, 12),  # UNION
    6: (0, 8),  # ENUM
    13: (0, 8),  # FUNC_PROTO: btf_param
    14: (4, 0),  # VAR
    15: (0, 12),  # DATASEC
    17: (4, 0),  # DECL_TAG
    19: (0, 12),  # ENUM64
}


_parsed: dict[tuple, Btf] = {}  # Btf.read's cache
# What a corrupt blob makes the record readers raise: its questions then have no answer.
_CORRUPT = (struct.error, IndexError, ValueError, RecursionError)


def _or_no_answer(no_answer: object) -> Callable[[Callable[..., T]], Callable[..., T]]:
    def wrap(question: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(question)
        def asked(*args: object) -> T:
            try:
                return question(*args)
            except _CORRUPT:
                return no_answer  # type: ignore[return-value]

        return asked

    return wrap


class Btf:
    """Type records of one BTF blob, indexed by type id (1..n; 0 is void)."""

    def __init__(self, data: bytes) -> None:
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
        if magic != MAGIC:
            raise ValueError("not BTF (bad magic)")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", data, 8)
        self.data = data
        self.types_at = hdr_len + type_off
        self.strings = data[hdr_len + str_off : hdr_len + str_off + str_len]
        if self.types_at + type_len > len(data) or type_len % 4:
            raise ValueError("truncated BTF type section")
        # The walk only measures each record (the type ids are positions), in 32-bit words
        # read through a memoryview: ~0.02 s for a vmlinux's ~127k records (0.05 s with
        # struct.unpack per record), on the way to top's first report.
        words = memoryview(data)[self.types_at : self.types_at + type_len].cast("I")
        sizes = [(3, 0)] * 32  # kind -> (words of the record before its items, words per item)
        for kind, (fixed, per_item) in _EXTRA.items():
            sizes[kind] = (3 + fixed // 4, per_item // 4)
        starts = [0]  # byte offset of each type id's record (id 0: void, unused)
        names = array.array("I", [0])  # each type id's name offset
        add_start, add_name = starts.append, names.append
        w, n, base = 0, len(words) - 2, self.types_at
        while w < n:
            add_start(base + 4 * w)
            add_name(words[w])
            info = words[w + 1]
            fixed, per_item = sizes[(info >> 24) & 0x1F]
            w += fixed + per_item * (info & 0xFFFF)
        self.starts = starts
        self._names = names.tobytes()

    def _ids_named(self, name_off: int) -> list[int]:
        """The type ids whose record has name offset NAME_OFF (a search of the names column)."""
        pattern, found, i = name_off.to_bytes(4, sys.byteorder), [], -1
        while (i := self._names.find(pattern, i + 1)) != -1:
            if i % 4 == 0:
                found.append(i // 4)
        return found

    @classmethod
    def read(cls, path: str = VMLINUX) -> Btf | None:
        """The kernel's BTF, or None when this kernel has none (or it cannot be read). Parsed
        once per process and file (top asks at start-up for the slab layout and again for the
        kernel's features), again if the file changed."""
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                if key not in _parsed:
                    _parsed.clear()  # one file at a time: the vmlinux, or a test's
                    _parsed[key] = cls(f.read())
                return _parsed[key]
        except (OSError, ValueError, struct.error):
            return None

    def _record(self, type_id: int) -> tuple[int, int, int, int, int]:
        """(kind, vlen, kind_flag, name_off, size_or_type) of TYPE_ID."""
        name, info, size = struct.unpack_from("<III", self.data, self.starts[type_id])
        return (info >> 24) & 0x1F, info & 0xFFFF, info >> 31, name, size

    def _items(self, type_id: int, width: int) -> list[tuple[int, ...]]:
        kind, vlen, _flag, _name, _size = self._record(type_id)
        pos = self.starts[type_id] + 12 + _EXTRA.get(kind, (0, 0))[0]
        fmt = "<" + "I" * (width // 4)
        return [struct.unpack_from(fmt, self.data, pos + i * width) for i in range(vlen)]

    def _name_offsets(self, name: str) -> set[int]:
        pattern = re.escape(b"\0" + name.encode() + b"\0")
        found = {m.start() + 1 for m in re.finditer(pattern, self.strings)}
        if self.strings.startswith(name.encode() + b"\0"):
            found.add(0)
        return found

    def _find(self, kind: int, name: str) -> list[int]:
        offsets = self._name_offsets(name)
        if not offsets:
            return []
        return [tid for off in offsets for tid in self._ids_named(off) if self._record(tid)[0] == kind]

    def _strip(self, type_id: int) -> int:
        """TYPE_ID without typedefs and const/volatile/restrict/type tags."""
        for _ in range(32):
            if type_id == 0:
                return 0
            kind, _vlen, _flag, _name, target = self._record(type_id)
            if kind not in MODIFIERS:
                return type_id
            type_id = target
        return type_id

    def _members(self, type_id: int, base: int, out: dict[str, int]) -> None:
        """Member name -> byte offset of a struct/union, anonymous members flattened in."""
        _kind, _vlen, flag, _name, _size = self._record(type_id)
        for name_off, mtype, offset in self._items(type_id, 12):
            bits = offset & 0xFFFFFF if flag else offset
            if bits % 8:
                continue  # a bit field: not addressable
            if name_off == 0:
                inner = self._strip(mtype)
                if self._record(inner)[0] in (KIND_STRUCT, KIND_UNION):
                    self._members(inner, base + bits // 8, out)
                continue
            out.setdefault(self._string(name_off), base + bits // 8)

    def _string(self, off: int) -> str:
        end = self.strings.index(b"\0", off)
        return self.strings[off:end].decode("utf-8", "replace")

    @_or_no_answer(None)
    def member_offsets(self, struct_name: str, members: list[str]) -> dict[str, int] | None:
        """{member: byte offset} in `struct STRUCT_NAME` for every one of MEMBERS, or None
        when the struct or any member is not there (or the definitions disagree)."""
        found = None
        for tid in self._find(KIND_STRUCT, struct_name):
            if self._record(tid)[1] == 0:
                continue  # an empty declaration
            offsets = {}
            self._members(tid, 0, offsets)
            if not all(m in offsets for m in members):
                return None
            mine = {m: offsets[m] for m in members}
            if found is not None and found != mine:
                return None
            found = mine
        return found

    @_or_no_answer(False)
    def has_member_path(self, struct_name: str, path: list[str]) -> bool:
        """Whether `struct STRUCT_NAME` has member PATH[0], whose struct or union has PATH[1],
        and so on (anonymous members flattened in), e.g. ("bpf_link_info", ["kprobe_multi",
        "missed"]): a field a kernel change added tells whether this kernel has the change."""
        for tid in self._find(KIND_STRUCT, struct_name):
            current = tid
            for name in path:
                types = {}
                self._member_types(current, types)
                if name not in types:
                    break
                current = self._strip(types[name])
            else:
                return True
        return False

    def _member_types(self, type_id: int, out: dict[str, int]) -> None:
        """Member name -> type id of a struct/union, anonymous members flattened in."""
        if self._record(type_id)[0] not in (KIND_STRUCT, KIND_UNION):
            return
        for name_off, mtype, _offset in self._items(type_id, 12):
            if name_off == 0:
                self._member_types(self._strip(mtype), out)
            else:
                out.setdefault(self._string(name_off), mtype)

    @_or_no_answer(None)
    def tracepoint_arg(self, tracepoint: str, struct_name: str) -> int | None:
        """Index in a raw tracepoint's ctx->args of its argument that points to `struct
        STRUCT_NAME` (from the typedef btf_trace_TRACEPOINT the kernel declares for each
        tracepoint: a pointer to a function whose first parameter is the probe's data), or
        None when the tracepoint or such an argument is not there."""
        targets = set(self._find(KIND_STRUCT, struct_name)) | set(self._find(KIND_FWD, struct_name))
        for tid in self._find(KIND_TYPEDEF, "btf_trace_" + tracepoint):
            ptr = self._strip(tid)
            kind, _vlen, _flag, _name, proto = self._record(ptr)
            if kind != KIND_PTR or self._record(proto)[0] != KIND_FUNC_PROTO:
                continue
            for index, (_pname, ptype) in enumerate(self._items(proto, 8)[1:]):
                arg = self._strip(ptype)
                if self._record(arg)[0] == KIND_PTR and self._strip(self._record(arg)[4]) in targets:
                    return index
        return None
