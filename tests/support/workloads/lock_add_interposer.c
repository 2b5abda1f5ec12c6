/* An LD_PRELOAD library that counts malloc and free and forwards them to the next
 * definition (dlsym RTLD_NEXT): the kind of interposer a user writes. Built -O2 without a
 * frame pointer, each function starts with `lock add` on its counter, an instruction the
 * kernel will not put a uprobe on (x86 uprobes refuse LOCK-prefixed instructions). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

static void *(*next_malloc)(size_t);
static void (*next_free)(void *);
static unsigned long mallocs, frees;

__attribute__((constructor)) static void resolve(void) {
    next_malloc = (void *(*)(size_t))dlsym(RTLD_NEXT, "malloc");
    next_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
}

void *malloc(size_t size) {
    __atomic_fetch_add(&mallocs, 1, __ATOMIC_RELAXED);
    return next_malloc(size);
}

void free(void *ptr) {
    __atomic_fetch_add(&frees, 1, __ATOMIC_RELAXED);
    next_free(ptr);
}

unsigned long lock_add_interposer_calls(void) {
    return mallocs + frees;
}
