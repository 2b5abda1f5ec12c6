"""A BTF blob built by hand, every offset known, for the BTF reader's and the slab source's tests."""

import struct

from pymtrace.bpf.btf import MAGIC

STRINGS = [
    "int",
    "char",
    "kmem_cache",
    "name",
    "size",
    "object_size",
    "btf_trace_kmem_cache_free",
    "flags",
    "btf_trace_kmem_cache_alloc",
]


def blob(alloc=False):
    """struct kmem_cache { unsigned int flags:3; unsigned int size; union { int object_size; };
    char *name; } (offsets 0, 4, 8, 16) and the typedef of a tracepoint
    kmem_cache_free(void *data, int call_site, const struct kmem_cache *s) (and ALLOC: the same
    for kmem_cache_alloc)."""
    strtab, off = b"\0", {}
    for s in STRINGS:
        off[s] = len(strtab)
        strtab += s.encode() + b"\0"

    def t(name, kind, vlen, size_or_type, kind_flag=0):
        return struct.pack("<III", off.get(name, 0), (kind_flag << 31) | (kind << 24) | vlen, size_or_type)

    types = b"".join(
        [
            t("int", 1, 0, 4) + struct.pack("<I", 32),  # 1 INT
            t("char", 1, 0, 1) + struct.pack("<I", 8),  # 2 INT
            t("", 2, 0, 2),  # 3 PTR -> char
            t("", 10, 0, 7),  # 4 CONST -> struct kmem_cache
            t("", 2, 0, 4),  # 5 PTR -> const struct kmem_cache
            t("", 5, 1, 4) + struct.pack("<III", off["object_size"], 1, 0),  # 6 anonymous UNION
            t("kmem_cache", 4, 4, 24, kind_flag=1)  # 7 STRUCT with a bit field (kind_flag offsets)
            + struct.pack("<III", off["flags"], 1, (3 << 24) | 0)
            + struct.pack("<III", off["size"], 1, 32)
            + struct.pack("<III", 0, 6, 64)
            + struct.pack("<III", off["name"], 3, 128),
            t("", 13, 3, 0) + struct.pack("<II", 0, 3) + struct.pack("<II", 0, 1) + struct.pack("<II", 0, 5),  # 8
            t("", 2, 0, 8),  # 9 PTR -> FUNC_PROTO
            t("btf_trace_kmem_cache_free", 8, 0, 9),  # 10 TYPEDEF
        ]
        + ([t("btf_trace_kmem_cache_alloc", 8, 0, 9)] if alloc else [])
    )
    header = struct.pack("<HBBIIIII", MAGIC, 1, 0, 24, 0, len(types), len(types), len(strtab))
    return header + types + strtab
