/* malloc_stats: per-process malloc-API counters, shared between malloc_stats.bpf.c and
 * pymtrace/collect/collectors.py (parsed by pymtrace/bpf/structs.py: fixed-width types only). */
#ifndef PYMTRACE_MALLOC_STATS_H
#define PYMTRACE_MALLOC_STATS_H

#include "common.h"

/* calls[] is indexed by the CALL_* numbers of common.h (1..8); index MS_FREE_NULL counts
 * free(NULL), which is ALSO counted in calls[CALL_FREE] (every free() call once). */
#define MS_FREE_NULL        9
/* C++ operator new/delete (pymtrace/target/allocators.py CXX), each call once: the malloc or
 * free it makes inside is not counted again (its bytes are, on glibc). The CALL_ prefix
 * names them in snapshots (collect/snapshot.py); record maps them onto dj/malloc's codes. */
#define CALL_NEW            10 /* operator new(size) */
#define CALL_NEW_ARRAY      11 /* operator new[](size) */
#define CALL_NEW_NOTHROW    12 /* new and new[] (size, std::nothrow) */
#define CALL_NEW_ALIGNED    13 /* new and new[] (size, std::align_val_t[, nothrow]) */
#define CALL_DELETE         14 /* operator delete(p) (and its nothrow form) */
#define CALL_DELETE_ARRAY   15 /* operator delete[](p) (and its nothrow form) */
#define CALL_DELETE_SIZED   16 /* delete and delete[] (p, size) */
#define CALL_DELETE_ALIGNED 17 /* delete and delete[] (p[, size], std::align_val_t[, nothrow]) */
#define MS_NCALLS           18
/* size_log2[i] counts requests whose size has bit length i: [0] size 0, [1] size 1,
 * [2] 2..3, [3] 4..7, ..., [64] 2^63..2^64-1. */
#define MS_LOG2_BUCKETS     65

/* Value of the per-CPU LRU hash `ms_stats` keyed by tgid (__u32); user space sums the CPUs. */
struct ms_stats {
    __u64 calls[MS_NCALLS];
    __u64 requested_bytes; /* sizes passed in (calloc: nmemb*size) */
    __u64 allocated_bytes; /* chunk sizes of returned blocks (header at ptr-8, & ~7) */
    __u64 freed_bytes;     /* chunk sizes of freed blocks (free, realloc's old block) */
    __u64 failed;          /* calls that returned NULL / an error (size > 0) */
    /* calls counted by the programs for allocators other than glibc (ms_f_*): they read no
     * chunk header; their allocated/freed bytes are REQUESTED bytes of blocks allocated since
     * attach, kept per block in ms_fblocks (freed: only blocks found there) */
    __u64 foreign_calls;
    __u64 size_log2[MS_LOG2_BUCKETS];
    /* The process's name, written at the entry's creation and again at exec (sched_process_exec)
     * into the slot of the CPU that ran it; user space takes the slot with the latest
     * comm_ns. Lets an exited process keep its name without /proc. */
    __u64 comm_ns;
    char comm[TASK_COMM_LEN];
};

/* Per-thread state of an outer call (realloc, memalign family), keyed by pid_tgid.
 * While it exists, the malloc/free probes hit by glibc's internal calls are skipped.
 * Other allocators (ms_f_*): every allocating call is an outer call, nested ones (a
 * forwarder such as posix_memalign in mimalloc -> mi_posix_memalign, an internal call of
 * another probed function) only raise depth; the outermost call ends at the return whose
 * stack pointer is above sp (ms_f_return), not by counting returns. */
struct ms_outer {
    __u64 arg_ptr;   /* realloc: old pointer; posix_memalign: the memptr argument */
    __u64 old_chunk; /* realloc: chunk bytes of the old block */
    __u64 requested;
    __u64 sp;   /* ms_f_*: the stack pointer at the outermost entry */
    __u32 type; /* CALL_* */
    /* ms_f_*: probed calls entered on this thread in the outermost one, + 1 (0: glibc's) */
    __u32 depth;
};

/* Indexes of the per-CPU array `ms_lost`. */
/* MS_LOST_STATS_FULL: event dropped, no ms_stats entry could be made (LRU: only when the kernel
 * cannot allocate one; a full map evicts) */
#define MS_LOST_STATS_FULL  0
#define MS_LOST_OUTER_FULL  1 /* outer-call state not stored: nested calls may count twice */
/* other allocators: a block's size not stored (ms_fblocks full): its bytes stay out of
 * allocated and freed, so live bytes miss it */
#define MS_LOST_BLOCKS_FULL 2
#define MS_LOST_N           3

/* Key of ms_fblocks: a live block of a process counted on another allocator than glibc. */
struct ms_fblock {
    __u64 ptr;
    __u32 tgid;
    __u32 pad;
};

#endif
