/* slab: per-cache counters from the kmem:kmem_cache_alloc/free tracepoints, shared with
 * pymtrace/collect/collectors.py (parsed by pymtrace/bpf/structs.py). */
#ifndef PYMTRACE_SLAB_H
#define PYMTRACE_SLAB_H

/* Cache names longer than this are truncated (the longest on a typical kernel is ~26). */
#define SLAB_NAME_LEN 32

struct slab_key {
    char name[SLAB_NAME_LEN];
    __u64 size; /* object size when the kernel gives no name (SLAB_ALLOC_BY_NAME 0), else 0 */
};

/* Value of the per-CPU LRU hash `slab_stats` keyed by struct slab_key. */
struct slab_stats {
    __u64 allocs;
    __u64 frees;
    __u64 bytes_alloc; /* object size of the cache, summed over allocations */
    __u64 bytes_req;   /* bytes the caller asked for */
};

#define SLAB_LOST_FULL 0 /* event dropped: no slab_stats entry could be made */
#define SLAB_LOST_N    1

#endif
