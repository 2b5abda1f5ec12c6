/* slab: allocations/frees per kmem cache name, from tracepoints only (no kprobes).
 * Defines: SLAB_MAX_CACHES; SLAB_ALLOC_BY_NAME, SLAB_FREE_BY_NAME (1: the tracepoint has
 * the `name` field; pymtrace.bpf.kfeatures.slab_source() reads that from the kernel's format
 * files). Cache names come from the tracepoints' __data_loc `name` field; merged caches
 * (see /sys/kernel/slab/NAME -> :A-...) report the name of the cache they were merged
 * into, as the kernel does. Without `name` in kmem_cache_alloc (e.g. Linux 6.1), an
 * allocation is keyed by its object size (bytes_alloc) instead, and user space labels the
 * sizes with the caches of /proc/slabinfo; without it in kmem_cache_free, frees are not
 * counted at all (no probe). */
#include "slab.h"

#ifndef SLAB_MAX_CACHES
#define SLAB_MAX_CACHES 2048
#endif
#ifndef SLAB_ALLOC_BY_NAME
#define SLAB_ALLOC_BY_NAME 1
#endif
#ifndef SLAB_FREE_BY_NAME
#define SLAB_FREE_BY_NAME 1
#endif

/* LRU, like the per-process maps (cache names are few, ~200: it never fills in practice). */
BPF_TABLE("lru_percpu_hash", struct slab_key, struct slab_stats, slab_stats, SLAB_MAX_CACHES);
BPF_PERCPU_ARRAY(slab_lost, u64, SLAB_LOST_N);

static __always_inline struct slab_stats *slab_for(struct slab_key *key) {
    struct slab_stats *s = slab_stats.lookup(key);
    if (s) return s;
    struct slab_stats zero = {};
    slab_stats.insert(key, &zero);
    s = slab_stats.lookup(key);
    if (!s) {
        int idx = SLAB_LOST_FULL;
        u64 *v = slab_lost.lookup(&idx);
        if (v) (*v)++;
    }
    return s;
}

TRACEPOINT_PROBE(kmem, kmem_cache_alloc) {
    struct slab_key key = {};
#if SLAB_ALLOC_BY_NAME
    TP_DATA_LOC_READ_STR(&key.name, name, sizeof(key.name));
#else
    key.size = args->bytes_alloc;
#endif
    struct slab_stats *s = slab_for(&key);
    if (s) {
        s->allocs++;
        s->bytes_alloc += args->bytes_alloc;
        s->bytes_req += args->bytes_req;
    }
    return 0;
}

#if SLAB_FREE_BY_NAME
TRACEPOINT_PROBE(kmem, kmem_cache_free) {
    struct slab_key key = {};
    TP_DATA_LOC_READ_STR(&key.name, name, sizeof(key.name));
    struct slab_stats *s = slab_for(&key);
    if (s) s->frees++;
    return 0;
}
#endif
