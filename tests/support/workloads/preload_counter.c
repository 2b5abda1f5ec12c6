/* An LD_PRELOAD counter of the tests' own: the ground truth pymtrace's interposer is checked
 * against. Counts every outermost malloc-API call (and C++ operator new/delete) reaching it
 * by dj/malloc type (new -> malloc, aligned new -> memalign, delete -> free, aligned_alloc ->
 * memalign, reallocarray -> realloc), in COUNTER_DIR/PID: 9 u64 counters indexed by type,
 * a shared mapping updated live (so exit paths, exec and _exit lose nothing). A call made
 * inside a counted operator new/delete (its malloc/free, new[] -> new) is not counted again;
 * the C functions keep no such guard (glibc's never call back into the malloc API), so a
 * signal handler interrupting one is counted.
 * Build: gcc -O2 -shared -fPIC -o preload_counter.so preload_counter.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static __thread int depth, resolving;
static uint64_t *counts;
static pid_t counted_pid;
static char arena[65536];
static size_t used;

static void *boot(size_t n) {
    size_t start = (used + 15) & ~(size_t)15;
    if (start + n > sizeof arena) return NULL;
    used = start + n;
    return arena + start;
}

static void *next(const char *name) {
    depth++;
    resolving++;
    void *f = dlsym(RTLD_NEXT, name);
    resolving--;
    depth--;
    return f;
}

static void count(int type) {
    pid_t pid = getpid();
    if (!counts || counted_pid != pid) { /* first call, or a fork child: its own file */
        const char *dir = getenv("COUNTER_DIR");
        char path[4096];
        if (!dir) return;
        snprintf(path, sizeof path, "%s/%d", dir, (int)pid);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd < 0) return;
        if (ftruncate(fd, 9 * sizeof(uint64_t)) == 0)
            counts = mmap(NULL, 9 * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (counts == MAP_FAILED) counts = NULL;
        counted_pid = pid;
        if (!counts) return;
    }
    __atomic_fetch_add(&counts[type], 1, __ATOMIC_RELAXED);
}

#define WRAP(ret, name, params, args, type, bootstrap, nest)                                                 \
    ret name params {                                                                                        \
        static ret(*fn) params;                                                                              \
        if (!fn) {                                                                                           \
            if (resolving) bootstrap;                                                                        \
            fn = (ret(*) params)next(#name);                                                                 \
        }                                                                                                    \
        if (!depth) count(type);                                                                             \
        depth += nest;                                                                                       \
        ret r = fn args;                                                                                     \
        depth -= nest;                                                                                       \
        return r;                                                                                            \
    }

#define WRAP_VOID(name, params, args, type, nest)                                                            \
    void name params {                                                                                       \
        static void(*fn) params;                                                                             \
        if (p >= (void *)arena && p < (void *)(arena + sizeof arena)) return;                                \
        if (!fn) fn = (void(*) params)next(#name);                                                           \
        if (!depth) count(type);                                                                             \
        depth += nest;                                                                                       \
        fn args;                                                                                             \
        depth -= nest;                                                                                       \
    }

WRAP(void *, malloc, (size_t n), (n), 1, return boot(n), 0)
WRAP(void *, calloc, (size_t n, size_t s), (n, s), 2, return boot(n * s), 0)
WRAP(void *, realloc, (void *p, size_t n), (p, n), 4, return NULL, 0)
WRAP(void *, memalign, (size_t a, size_t n), (a, n), 5, return NULL, 0)
WRAP(void *, aligned_alloc, (size_t a, size_t n), (a, n), 5, return NULL, 0)
WRAP(int, posix_memalign, (void **p, size_t a, size_t n), (p, a, n), 8, return 12, 0)
WRAP(void *, valloc, (size_t n), (n), 6, return NULL, 0)
WRAP(void *, pvalloc, (size_t n), (n), 7, return NULL, 0)
WRAP_VOID(free, (void *p), (p), 3, 0)

void *reallocarray(void *p, size_t n, size_t s) {
    size_t bytes;
    if (__builtin_mul_overflow(n, s, &bytes)) {
        errno = ENOMEM;
        return NULL;
    }
    return realloc(p, bytes);
}

typedef const void *nt_ref;
WRAP(void *, _Znwm, (size_t n), (n), 1, return NULL, 1)
WRAP(void *, _Znam, (size_t n), (n), 1, return NULL, 1)
WRAP(void *, _ZnwmRKSt9nothrow_t, (size_t n, nt_ref t), (n, t), 1, return NULL, 1)
WRAP(void *, _ZnamRKSt9nothrow_t, (size_t n, nt_ref t), (n, t), 1, return NULL, 1)
WRAP(void *, _ZnwmSt11align_val_t, (size_t n, size_t a), (n, a), 5, return NULL, 1)
WRAP(void *, _ZnamSt11align_val_t, (size_t n, size_t a), (n, a), 5, return NULL, 1)
WRAP(void *, _ZnwmSt11align_val_tRKSt9nothrow_t, (size_t n, size_t a, nt_ref t), (n, a, t), 5, return NULL, 1)
WRAP(void *, _ZnamSt11align_val_tRKSt9nothrow_t, (size_t n, size_t a, nt_ref t), (n, a, t), 5, return NULL, 1)
WRAP_VOID(_ZdlPv, (void *p), (p), 3, 1)
WRAP_VOID(_ZdaPv, (void *p), (p), 3, 1)
WRAP_VOID(_ZdlPvRKSt9nothrow_t, (void *p, nt_ref t), (p, t), 3, 1)
WRAP_VOID(_ZdaPvRKSt9nothrow_t, (void *p, nt_ref t), (p, t), 3, 1)
WRAP_VOID(_ZdlPvm, (void *p, size_t n), (p, n), 3, 1)
WRAP_VOID(_ZdaPvm, (void *p, size_t n), (p, n), 3, 1)
WRAP_VOID(_ZdlPvSt11align_val_t, (void *p, size_t a), (p, a), 3, 1)
WRAP_VOID(_ZdaPvSt11align_val_t, (void *p, size_t a), (p, a), 3, 1)
WRAP_VOID(_ZdlPvmSt11align_val_t, (void *p, size_t n, size_t a), (p, n, a), 3, 1)
WRAP_VOID(_ZdaPvmSt11align_val_t, (void *p, size_t n, size_t a), (p, n, a), 3, 1)
WRAP_VOID(_ZdlPvSt11align_val_tRKSt9nothrow_t, (void *p, size_t a, nt_ref t), (p, a, t), 3, 1)
WRAP_VOID(_ZdaPvSt11align_val_tRKSt9nothrow_t, (void *p, size_t a, nt_ref t), (p, a, t), 3, 1)
