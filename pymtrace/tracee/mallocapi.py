"""The malloc-API functions pymtrace puts uprobes on, and what each probe needs to know.

One table for every attach plan (top's and the exporter's counters, record's trace): which
functions there are, which may be one function in glibc (aligned_alloc is memalign's code
in glibc 2.36: probed once, through memalign's programs; in 2.41 a function of its own,
probed with memalign's programs; counted as memalign either way), which have a
return probe, and which are outer calls (realloc and the memalign family call malloc/free
inside glibc: the BPF programs ignore those inner calls while an outer one runs).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class MallocFunction:
    name: str  # the exported symbol
    call: str  # the call it is counted and recorded as; names its BPF programs
    returns: bool  # probed on return too (everything but free)
    outer: bool  # calls other malloc-API functions inside glibc


# Order matters where functions share an address: the first name is the one probed.
FUNCTIONS: tuple[MallocFunction, ...] = (
    MallocFunction("malloc", "malloc", returns=True, outer=False),
    MallocFunction("calloc", "calloc", returns=True, outer=False),
    MallocFunction("realloc", "realloc", returns=True, outer=True),
    MallocFunction("free", "free", returns=False, outer=False),
    MallocFunction("memalign", "memalign", returns=True, outer=True),
    MallocFunction("aligned_alloc", "memalign", returns=True, outer=True),
    MallocFunction("posix_memalign", "posix_memalign", returns=True, outer=True),
    MallocFunction("valloc", "valloc", returns=True, outer=True),
    MallocFunction("pvalloc", "pvalloc", returns=True, outer=True),
)
