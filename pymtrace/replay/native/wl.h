/* wl.h: the replay contract, defined once.
 *
 * The .wl workload format (docs/formats.md, section 3), the call names the simulator
 * reports, the mallopt() parameters it knows by name, its exit codes and the limits its
 * validator shares with Python's.  replay.c includes this file; pymtrace/trace/formats/wl.py
 * and pymtrace/replay/runner.py read it at import time with pymtrace.bpf.structs.parse,
 * which understands only `#define NAME NUMBER` (so every value here is a plain number: no
 * expressions, no enums).
 */
#ifndef PYMTRACE_WL_H
#define PYMTRACE_WL_H

/* Opcodes: one byte, then WL_NARGS_<name> unsigned big-endian base-128 varints. */
#define WL_OP_NOP          0
#define WL_OP_DONE         1
#define WL_OP_MALLOC       2
#define WL_OP_CALLOC       3
#define WL_OP_REALLOC      4
#define WL_OP_FREE         5
#define WL_OP_SYNC_W       6
#define WL_OP_SYNC_R       7
#define WL_OP_ALLOC_PTRS   8
#define WL_OP_ALLOC_SYNCS  9
#define WL_OP_NTHREADS     10
#define WL_OP_START_THREAD 11
#define WL_OP_MEMALIGN     12
#define WL_OP_VALLOC       13
#define WL_OP_PVALLOC      14
#define WL_NOPS            15 /* opcodes are 0 .. WL_NOPS-1 */

#define WL_NARGS_NOP          0
#define WL_NARGS_DONE         0
#define WL_NARGS_MALLOC       2 /* index, size */
#define WL_NARGS_CALLOC       2 /* index, size (nmemb * size) */
#define WL_NARGS_REALLOC      3 /* new index, old index, size */
#define WL_NARGS_FREE         1 /* index */
#define WL_NARGS_SYNC_W       1 /* sync id */
#define WL_NARGS_SYNC_R       1 /* sync id */
#define WL_NARGS_ALLOC_PTRS   1 /* pointer slots */
#define WL_NARGS_ALLOC_SYNCS  1 /* sync ids */
#define WL_NARGS_NTHREADS     1 /* threads */
#define WL_NARGS_START_THREAD 1 /* file offset of the thread's stream */
#define WL_NARGS_MEMALIGN     3 /* index, alignment, size */
#define WL_NARGS_VALLOC       2 /* index, size */
#define WL_NARGS_PVALLOC      2 /* index, size */

/* X(name) for every opcode, in number order (C builds its name and argument tables from it). */
/* one X per line by hand: clang-format does not settle on a layout for this list */
/* clang-format off */
#define WL_OPS(X) \
    X(NOP) \
    X(DONE) \
    X(MALLOC) \
    X(CALLOC) \
    X(REALLOC) \
    X(FREE) \
    X(SYNC_W) \
    X(SYNC_R) \
    X(ALLOC_PTRS) \
    X(ALLOC_SYNCS) \
    X(NTHREADS) \
    X(START_THREAD) \
    X(MEMALIGN) \
    X(VALLOC) \
    X(PVALLOC)
/* clang-format on */

/* Limits the simulator's validator and wl.parse() both enforce. */
#define WL_MAX_THREADS 65536
#define WL_MAX_TABLE   0x10000000000ULL /* 2**40: ALLOC_PTRS and ALLOC_SYNCS */
#define WL_MAX_ALIGN   0x10000000000ULL /* 2**40: a MEMALIGN alignment (non-NULL index) */

/* The call types the simulator times and reports (the keys of "calls" in its --json report),
   in report order.  Lower case on purpose: the name after WL_CALL_ is the reported name. */
#define WL_CALL_malloc      0
#define WL_CALL_calloc      1
#define WL_CALL_realloc     2
#define WL_CALL_free        3
#define WL_CALL_memalign    4
#define WL_CALL_valloc      5
#define WL_CALL_pvalloc     6
#define WL_CALL_malloc_trim 7
#define WL_NCALLS           8

/* X(name) for every call type, in number order. */
#define WL_CALLS(X) X(malloc) X(calloc) X(realloc) X(free) X(memalign) X(valloc) X(pvalloc) X(malloc_trim)

#define WL_COUNT_(x) +1
_Static_assert(0 WL_OPS(WL_COUNT_) == WL_NOPS, "WL_OPS lists every opcode");
_Static_assert(0 WL_CALLS(WL_COUNT_) == WL_NCALLS, "WL_CALLS lists every call type");

/* The mallopt() parameters `--mallopt M_<name>=VALUE` knows by name (pymtrace replay accepts
   these names, the simulator maps them to these numbers): glibc's <malloc.h> values, which
   replay.c checks at compile time. */
#define WL_MALLOPT_MXFAST         1
#define WL_MALLOPT_NLBLKS         2
#define WL_MALLOPT_GRAIN          3
#define WL_MALLOPT_KEEP           4
#define WL_MALLOPT_TRIM_THRESHOLD -1
#define WL_MALLOPT_TOP_PAD        -2
#define WL_MALLOPT_MMAP_THRESHOLD -3
#define WL_MALLOPT_MMAP_MAX       -4
#define WL_MALLOPT_CHECK_ACTION   -5
#define WL_MALLOPT_PERTURB        -6
#define WL_MALLOPT_ARENA_TEST     -7
#define WL_MALLOPT_ARENA_MAX      -8
#define WL_NMALLOPTS              12

/* X(name) for every mallopt parameter above (C builds its name table from it). */
/* clang-format off */
#define WL_MALLOPTS(X) \
    X(MXFAST) \
    X(NLBLKS) \
    X(GRAIN) \
    X(KEEP) \
    X(TRIM_THRESHOLD) \
    X(TOP_PAD) \
    X(MMAP_THRESHOLD) \
    X(MMAP_MAX) \
    X(CHECK_ACTION) \
    X(PERTURB) \
    X(ARENA_TEST) \
    X(ARENA_MAX)
/* clang-format on */
_Static_assert(0 WL_MALLOPTS(WL_COUNT_) == WL_NMALLOPTS, "WL_MALLOPTS lists every mallopt parameter");

/* The simulator's exit status (a signal: it crashed, e.g. in the allocator under test). */
#define WL_EXIT_OK       0
#define WL_EXIT_USAGE    1 /* bad command line */
#define WL_EXIT_INVALID  2 /* invalid workload: nothing was replayed */
#define WL_EXIT_DEADLOCK 3 /* deadlock found by validation, or a stall during the replay */
#define WL_EXIT_RESOURCE 4 /* out of resources: the memory guard, a table or a thread */

#endif
