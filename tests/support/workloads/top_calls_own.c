/* top_calls.c's exactly known calls on an allocator defined in the executable itself: a
 * thread-safe bump allocator exporting malloc, calloc, realloc, free, memalign,
 * aligned_alloc, posix_memalign and valloc (the dynamic linker binds every caller, libc's
 * own included, to these). Blocks carry their size in a 16-byte header; free does nothing.
 * For tests/live/test_top_allocators.py: top must count these as the executable's
 * allocator, exactly. */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* the counted calls are in this translation unit too (top_calls.c below): never inlined */
#define API   __attribute__((noipa))
#define ARENA (64UL << 20)
static _Alignas(4096) unsigned char arena[ARENA];
static size_t used;

static void *bump(size_t align, size_t size) {
    if (align < 16) align = 16;
    if (size > ARENA) return NULL;
    size_t old = __atomic_load_n(&used, __ATOMIC_RELAXED), start, end;
    do {
        start = (old + 16 + align - 1) & ~(align - 1);
        end = start + size;
        if (end > ARENA) {
            errno = ENOMEM;
            return NULL;
        }
    } while (!__atomic_compare_exchange_n(&used, &old, end, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    ((size_t *)(arena + start))[-1] = size;
    return arena + start;
}

API void *malloc(size_t size) {
    return bump(16, size);
}
API void free(void *p) {
    (void)p;
}
API void *calloc(size_t n, size_t size) {
    if (size && n > SIZE_MAX / size) return NULL;
    return bump(16, n * size); /* the arena is zero and never reused */
}
API void *realloc(void *p, size_t size) {
    if (!p) return bump(16, size);
    if (!size) return NULL; /* frees p */
    void *q = bump(16, size);
    if (q) {
        size_t old = ((size_t *)p)[-1];
        memcpy(q, p, old < size ? old : size);
    }
    return q;
}
API void *memalign(size_t align, size_t size) {
    return bump(align, size);
}
API void *aligned_alloc(size_t align, size_t size) {
    return bump(align, size);
}
API void *valloc(size_t size) {
    return bump(4096, size);
}
API int posix_memalign(void **out, size_t align, size_t size) {
    void *p = bump(align, size);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

#define ANY_ALLOCATOR
#include "top_calls.c"
