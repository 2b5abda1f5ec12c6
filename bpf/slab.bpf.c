/* slab: allocations/frees per kmem cache name, from tracepoints only (no kprobes).
 * Defines: SLAB_MAX_CACHES. Cache names come from the tracepoints' __data_loc `name`
 * field; merged caches (see /sys/kernel/slab/NAME -> :A-...) report the name of the
 * cache they were merged into, as the kernel does. */
#include "slab.h"

#ifndef SLAB_MAX_CACHES
#define SLAB_MAX_CACHES 2048
#endif

/* LRU, like the per-process maps (cache names are few, ~200: it never fills in practice). */
BPF_TABLE("lru_percpu_hash", struct slab_key, struct slab_stats, slab_stats, SLAB_MAX_CACHES);
BPF_PERCPU_ARRAY(slab_lost, u64, SLAB_LOST_N);

static __always_inline struct slab_stats *slab_for(struct slab_key *key)
{
    struct slab_stats *s = slab_stats.lookup(key);
    if (s)
        return s;
    struct slab_stats zero = {};
    slab_stats.insert(key, &zero);
    s = slab_stats.lookup(key);
    if (!s) {
        int idx = SLAB_LOST_FULL;
        u64 *v = slab_lost.lookup(&idx);
        if (v)
            (*v)++;
    }
    return s;
}

TRACEPOINT_PROBE(kmem, kmem_cache_alloc)
{
    struct slab_key key = {};
    TP_DATA_LOC_READ_STR(&key.name, name, sizeof(key.name));
    struct slab_stats *s = slab_for(&key);
    if (s) {
        s->allocs++;
        s->bytes_alloc += args->bytes_alloc;
        s->bytes_req += args->bytes_req;
    }
    return 0;
}

TRACEPOINT_PROBE(kmem, kmem_cache_free)
{
    struct slab_key key = {};
    TP_DATA_LOC_READ_STR(&key.name, name, sizeof(key.name));
    struct slab_stats *s = slab_for(&key);
    if (s)
        s->frees++;
    return 0;
}
