/* slab: allocations/frees per kmem cache name, from the kmem tracepoints only (no kprobes).
 * Defines (pymtrace.bpf.kfeatures.slab_source() reads what this kernel offers):
 *   SLAB_MAX_CACHES;
 *   SLAB_RAW_ALLOC, SLAB_RAW_FREE (1: raw tracepoint programs, which read the cache from the
 *     tracepoint's `struct kmem_cache *` argument ctx->args[SLAB_ALLOC_CACHE_ARG] /
 *     ctx->args[SLAB_FREE_CACHE_ARG]: its name, size and object_size at the byte offsets
 *     SLAB_OFF_NAME, SLAB_OFF_SIZE, SLAB_OFF_OBJECT_SIZE that the kernel's BTF gives; the
 *     struct is private to mm/, so headers cannot give them). Preferred: the kernel skips a
 *     kmem:* tracepoint program whenever another BPF program or a bpf() map access runs on
 *     the CPU (RCU-callback frees at an interrupt's end often land there), a raw tracepoint
 *     program only when it re-enters itself;
 *   otherwise SLAB_ALLOC_BY_NAME, SLAB_FREE_BY_NAME (1: the tracepoint has the `name` field).
 * Cache names come from the cache itself or the tracepoints' __data_loc `name` field; merged
 * caches (see /sys/kernel/slab/NAME -> :A-...) report the name of the cache they were merged
 * into, as the kernel does. Without either in kmem_cache_alloc (e.g. Linux 6.1 without BTF),
 * an allocation is keyed by its object size (bytes_alloc) instead, and user space labels the
 * sizes with the caches of /proc/slabinfo; without either in kmem_cache_free, frees are not
 * counted at all (no probe). */
#include "slab.h"

#ifndef SLAB_MAX_CACHES
#define SLAB_MAX_CACHES 2048
#endif
#ifndef SLAB_RAW_ALLOC
#define SLAB_RAW_ALLOC 0
#endif
#ifndef SLAB_RAW_FREE
#define SLAB_RAW_FREE 0
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

#if SLAB_RAW_ALLOC || SLAB_RAW_FREE
/* The helpers under names of their own: BCC's rewriter asks its kallsyms cache about every
 * call of bpf_probe_read_kernel* it sees (slow; see pymtrace.bpf.load.MODULE_PRELUDE). */
static long (*slab_read_kernel)(void *dst, __u32 size, const void *src) = (void *)BPF_FUNC_probe_read_kernel;
static long (*slab_read_kernel_str)(void *dst, __u32 size,
                                    const void *src) = (void *)BPF_FUNC_probe_read_kernel_str;

/* The cache's name into KEY (left empty if unreadable). */
static __always_inline void slab_cache_key(struct slab_key *key, u64 cache) {
    u64 name = 0;
    if (slab_read_kernel(&name, sizeof(name), (void *)(cache + SLAB_OFF_NAME)) == 0 && name)
        slab_read_kernel_str(&key->name, sizeof(key->name), (void *)name);
}
#endif

#if SLAB_RAW_ALLOC
RAW_TRACEPOINT_PROBE(kmem_cache_alloc) {
    u64 cache = ctx->args[SLAB_ALLOC_CACHE_ARG];
    struct slab_key key = {};
    u32 size = 0, object_size = 0;
    slab_cache_key(&key, cache);
    /* what the tracepoint reports as bytes_alloc and bytes_req */
    slab_read_kernel(&size, sizeof(size), (void *)(cache + SLAB_OFF_SIZE));
    slab_read_kernel(&object_size, sizeof(object_size), (void *)(cache + SLAB_OFF_OBJECT_SIZE));
    struct slab_stats *s = slab_for(&key);
    if (s) {
        s->allocs++;
        s->bytes_alloc += size;
        s->bytes_req += object_size;
    }
    return 0;
}
#else
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
#endif

#if SLAB_RAW_FREE
RAW_TRACEPOINT_PROBE(kmem_cache_free) {
    struct slab_key key = {};
    slab_cache_key(&key, ctx->args[SLAB_FREE_CACHE_ARG]);
    struct slab_stats *s = slab_for(&key);
    if (s) s->frees++;
    return 0;
}
#elif SLAB_FREE_BY_NAME
TRACEPOINT_PROBE(kmem, kmem_cache_free) {
    struct slab_key key = {};
    TP_DATA_LOC_READ_STR(&key.name, name, sizeof(key.name));
    struct slab_stats *s = slab_for(&key);
    if (s) s->frees++;
    return 0;
}
#endif
