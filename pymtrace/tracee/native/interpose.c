/* pymtrace's LD_PRELOAD interposer: every malloc-API call of the process, forwarded to the
 * next definition (glibc, or a preloaded/linked jemalloc, tcmalloc, mimalloc), written as
 * the record `record` writes (bpf/record.h) into a shared-memory ring (interpose.h) that
 * pymtrace drains. Built by pymtrace/sources/interposer.py (pymtrace.nativebuild).
 *
 * Environment (set by the consumer): PYMTRACE_RING=OWNER:FOLLOW:SLOTS:FRAMES:DIR, one variable
 * (a program that copies its environment allocates for each one): OWNER the consumer's pid,
 * FOLLOW 0 (only the first process to register, and its execs, is traced) or 1, SLOTS per
 * ring, FRAMES (record --stacks: each allocating call's stack, at most FRAMES return
 * addresses, unwound here by libunwind and interned in the ring's stack table; 0: none), DIR
 * the private ring directory (last: it may hold a colon). Absent: only forwards.
 *
 * Sampling mode (`heap`; no ring): PYMTRACE_SAMPLE=PARENT:FOLLOW:BYTES:LIVE:PATH draws heap's
 * Poisson sampling, a sample per BYTES allocated on average, per thread in-process
 * (bpf/heap.bpf.c's draw, the same arithmetic); only a sampled allocation fires the USDT probe
 * pymtrace:heap_alloc, and only the free (or realloc away) of a sampled block
 * pymtrace:heap_free, which heap's BPF program is attached to. The sampled blocks still
 * allocated are kept in a bounded lock-free pointer set (at most LIVE). FOLLOW 0: only an image
 * whose parent is PARENT (pymtrace: the launched command and its execs) samples. PATH: heap's
 * credits file (interpose.h): a probe waits for room in heap's ring rather than be lost.
 *
 * What makes it safe where interposers break (docs/internals.md, "The interposer"):
 * - dlsym bootstrap: while a thread resolves the next definitions, its allocations come
 *   from a static arena (never freed, never recorded).
 * - a thread's calls made inside the forwarded allocator (operator new -> malloc, an
 *   allocator's own internal use) are not recorded again: a per-thread depth.
 * - a signal handler interrupting its thread's ring write leaves its records in a small
 *   per-thread buffer written right after (a ring write is never nested in itself).
 * - fork: the child unmaps the parent's ring and registers its own (or, not followed,
 *   records nothing). exec: the new image registers again (a later PID.STAMP). vfork: the child
 *   runs on the parent's memory and thread state; what it allocates lands in the parent's
 *   heap and is recorded in the parent's ring as the parent thread's, through the same
 *   multi-producer protocol (nothing the parent holds is half-written: vfork is not called
 *   from inside a wrapper).
 * - no file descriptor stays open, errno is kept, nothing is printed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/types.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sdt.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "record.h"
#include "interpose.h"

#define EXPORT      __attribute__((visibility("default")))
#define TLS         __thread __attribute__((tls_model("initial-exec")))
#define LIKELY(x)   __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#define CALLER      ((__u64)__builtin_return_address(0))
/* A call forwarded to another allocator than glibc may call the malloc API itself (at its
 * initialisation, say): those inner calls are not the program's. glibc's never do. */
#define FORWARD(expr)                                                                                        \
    ({                                                                                                       \
        __typeof__(expr) r_;                                                                                 \
        if (LIKELY(glibc_chunks)) {                                                                          \
            r_ = (expr);                                                                                     \
        } else {                                                                                             \
            ts.depth++;                                                                                      \
            r_ = (expr);                                                                                     \
            ts.depth--;                                                                                      \
        }                                                                                                    \
        r_;                                                                                                  \
    })

_Static_assert(sizeof(struct record_event) == RING_EVENT_SIZE, "record_event layout");
_Static_assert(sizeof(struct ring_header) <= RING_HEADER_SIZE, "ring header size");
_Static_assert(offsetof(struct ring_header, head) == 512, "head on its own line");
_Static_assert(offsetof(struct ring_header, tail) == 576, "tail on its own line");
_Static_assert(sizeof(struct stack_module) == 256, "stack_module layout");

/* ---- the next definitions ------------------------------------------------------------- */
typedef void *(*malloc_fn)(size_t);
typedef void *(*calloc_fn)(size_t, size_t);
typedef void *(*realloc_fn)(void *, size_t);
typedef void (*free_fn)(void *);
typedef void *(*memalign_fn)(size_t, size_t);
typedef int (*posix_memalign_fn)(void **, size_t, size_t);
typedef size_t (*usable_fn)(void *);

static struct {
    malloc_fn malloc;
    calloc_fn calloc;
    realloc_fn realloc;
    free_fn free;
    memalign_fn memalign;
    memalign_fn aligned_alloc;
    posix_memalign_fn posix_memalign;
    malloc_fn valloc;
    malloc_fn pvalloc;
    usable_fn usable;
} real;

static char allocator_path[RING_PATH_MAX];
static int glibc_chunks;
static __u64 page_size = 4096;

/* ---- per-thread state ----------------------------------------------------------------- */
struct tstate {
    __s32 tid;       /* cached gettid() (reset in a fork child) */
    __u32 depth;     /* > 0: inside a forwarded call whose inner calls are not recorded */
    __u32 writing;   /* > 0: a ring write is under way (a signal handler defers) */
    __u32 resolving; /* > 0: inside dlsym: allocations come from the arena */
    __u32 dcount;
    struct record_event deferred[RING_DEFER];
    __u32 capturing, ncaught; /* inside an outermost operator new: its inner mallocs, kept */
    struct {
        __u64 ptr, size, caller;
    } caught[4];
    __u32 unwinding; /* > 0: this thread is taking a stack (a signal handler's call takes none) */
    __s64 left;      /* sampling mode: bytes until this thread's next sample */
    __u64 rng;       /* its random state (0: not seeded yet) */
};
static TLS struct tstate ts;

/* ---- the bootstrap arena (dlsym may allocate before malloc is known) -------------------- */
#define ARENA_SIZE (256 * 1024)
static char arena[ARENA_SIZE] __attribute__((aligned(64)));
static size_t arena_used;

static int in_arena(const void *p) {
    return (const char *)p >= arena && (const char *)p < arena + ARENA_SIZE;
}

static void *arena_alloc(size_t n, size_t align) {
    if (align < 16) align = 16;
    size_t old = __atomic_load_n(&arena_used, __ATOMIC_RELAXED), start, end;
    do {
        start = (old + 16 + align - 1) & ~(align - 1); /* 16 bytes before: the block's size */
        end = start + n;
        if (end > ARENA_SIZE || end < start) return NULL;
    } while (!__atomic_compare_exchange_n(&arena_used, &old, end, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    *(size_t *)(arena + start - 16) = n;
    return arena + start;
}

static size_t arena_size(const void *p) {
    return *(const size_t *)((const char *)p - 16);
}

static void sample_setup(void);

/* Resolve the next definitions. Idempotent and lock-free (dlsym takes the loader's recursive
 * lock): every thread that finds them missing resolves them itself. */
static int resolve(void) {
    if (real.free) return 1;
    if (ts.resolving) return 0;
    ts.resolving++;
    ts.depth++;
    int saved = errno;
    real.calloc = (calloc_fn)dlsym(RTLD_NEXT, "calloc");
    real.realloc = (realloc_fn)dlsym(RTLD_NEXT, "realloc");
    real.memalign = (memalign_fn)dlsym(RTLD_NEXT, "memalign");
    real.aligned_alloc = (memalign_fn)dlsym(RTLD_NEXT, "aligned_alloc");
    real.posix_memalign = (posix_memalign_fn)dlsym(RTLD_NEXT, "posix_memalign");
    real.valloc = (malloc_fn)dlsym(RTLD_NEXT, "valloc");
    real.pvalloc = (malloc_fn)dlsym(RTLD_NEXT, "pvalloc");
    real.usable = (usable_fn)dlsym(RTLD_NEXT, "malloc_usable_size");
    malloc_fn m = (malloc_fn)dlsym(RTLD_NEXT, "malloc");
    Dl_info info;
    if (m && dladdr((void *)m, &info) && info.dli_fname) {
        size_t n = strlen(info.dli_fname);
        if (n >= RING_PATH_MAX) n = RING_PATH_MAX - 1;
        memcpy(allocator_path, info.dli_fname, n);
        allocator_path[n] = 0;
        const char *base = strrchr(allocator_path, '/');
        base = base ? base + 1 : allocator_path;
        glibc_chunks = strncmp(base, "libc.so", 7) == 0;
    }
    long pg = sysconf(_SC_PAGESIZE);
    if (pg > 0) page_size = (__u64)pg;
    real.malloc = m;
    sample_setup(); /* before any call is forwarded: none escapes the sampler */
    __atomic_store_n(&real.free, (free_fn)dlsym(RTLD_NEXT, "free"), __ATOMIC_RELEASE);
    errno = saved;
    ts.depth--;
    ts.resolving--;
    return real.free != NULL && real.malloc != NULL;
}

/* ---- the ring ------------------------------------------------------------------------- */
enum { RING_UNINIT, RING_OPENING, RING_READY, RING_OFF };
static int ring_state;
static struct ring_header *ring;
static __u64 *ring_seq;
static struct record_event *ring_ev;
static __u64 ring_mask;
static __u32 self_pid;
static size_t ring_bytes;

/* The next decimal field of *S, ended by a colon or the string's end (DFLT if it is not
 * one); *S moves past it. */
static unsigned long env_field(const char **s, unsigned long dflt) {
    const char *p = *s;
    unsigned long v = 0;
    int digits = 0;
    for (; *p >= '0' && *p <= '9'; p++, digits++) v = v * 10 + (unsigned long)(*p - '0');
    if (*p != ':' && *p) {
        *s = p;
        return dflt;
    }
    *s = *p ? p + 1 : p;
    return digits ? v : dflt;
}

static char *put_number(char *out, unsigned long v) {
    char tmp[24];
    int n = 0;
    do tmp[n++] = (char)('0' + v % 10), v /= 10;
    while (v);
    while (n) *out++ = tmp[--n];
    *out = 0;
    return out;
}

static __u64 now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (__u64)t.tv_sec * 1000000000ull + (__u64)t.tv_nsec;
}

/* A record's time: the time stamp counter where the kernel keeps time by it (its clocksource
 * is "tsc": invariant, the same on every CPU), ~20 ns a call cheaper than clock_gettime; the
 * consumer maps it to CLOCK_MONOTONIC ns (ringtake.c). Else CLOCK_MONOTONIC ns. */
static int use_tsc;

static int clocksource_is_tsc(void) {
    char text[16];
    int fd = open("/sys/devices/system/clocksource/clocksource0/current_clocksource", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, text, sizeof(text));
    close(fd);
    return n == 4 && memcmp(text, "tsc\n", 4) == 0;
}

static inline __u64 stamp(void) {
    return LIKELY(use_tsc) ? __builtin_ia32_rdtsc() : now_ns();
}

/* Not following forks: only the first process to register (the launched command) and the
 * images it execs are traced. "root" holds that process's pid. */
static int is_root(int dirfd, __u32 pid) {
    char text[24];
    int fd = openat(dirfd, "root", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {
        char *end = put_number(text, pid);
        ssize_t w = write(fd, text, (size_t)(end - text));
        close(fd);
        return w == end - text;
    }
    if (errno != EEXIST) return 0;
    fd = openat(dirfd, "root", O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (n <= 0) return 0;
    text[n] = 0;
    unsigned long v = 0;
    for (char *s = text; *s >= '0' && *s <= '9'; s++) v = v * 10 + (unsigned long)(*s - '0');
    return v == pid;
}

/* ---- stacks (record --stacks in-process; the table's layout: interpose.h) --------------- */
typedef int (*backtrace_fn)(void **, int);
static backtrace_fn unwind_backtrace; /* libunwind's unw_backtrace: a cache per thread of each pc's frame */
static int stack_frames;              /* frames kept per stack (PYMTRACE_RING's FRAMES); 0: no stacks */
#define STACK_OFFS_BYTES ((((STACK_IDS + 1) * sizeof(__u32)) + 4095) & ~(size_t)4095)
static int stack_error;
static __u64 *stack_hash;
static __u32 *stack_offs;
static __u64 *stack_words;
static struct stack_module *stack_mods;
static unsigned long long modules_adds; /* dlpi_adds when the modules were last added */
static char self_exe[224];              /* the executable's path (dl_iterate_phdr names it "") */
static uintptr_t self_lo, self_hi;      /* this library's code: its frames are not the program's */

static int find_self(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    uintptr_t here = (uintptr_t)data;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X) && here >= lo && here < lo + ph->p_memsz) {
            self_lo = lo;
            self_hi = lo + ph->p_memsz;
            return 1;
        }
    }
    return 0;
}

/* PYMTRACE_RING's FRAMES (0: no stacks), at most STACK_MAX_FRAMES. Only getenv: the ring's
 * opening reads it too (the table is made with the ring, maybe before the constructor ran:
 * an earlier library's initializer may allocate first). */
static int frames_asked(void) {
    const char *v = getenv("PYMTRACE_RING");
    if (!v) return 0;
    env_field(&v, 0);
    env_field(&v, 1);
    env_field(&v, 0);
    unsigned long frames = env_field(&v, 0);
    return frames > STACK_MAX_FRAMES ? STACK_MAX_FRAMES : (int)frames;
}

static void stacks_load(void);

/* When record asks for stacks, once: from the constructor, or from the first stack if an
 * earlier library's initializer allocated before it. Stacks are taken once both the ring's
 * table and libunwind are there (stack_word); without libunwind records go without stacks
 * and the header says why. */
static int stacks_once; /* 0, 1 while a thread loads libunwind, 2 */

static void stacks_setup(void) {
    int expect = 0;
    if (!frames_asked() ||
        !__atomic_compare_exchange_n(&stacks_once, &expect, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    ts.depth++; /* dlopen's allocations are the library's own */
    stacks_load();
    ts.depth--;
    __atomic_store_n(&stacks_once, 2, __ATOMIC_RELEASE);
}

/* libunwind loaded (RTLD_LOCAL: its own `backtrace` and `_Unwind_Backtrace` stay out of
 * the program's symbol scope), this library's code range found. */
static void stacks_load(void) {
    void *lib = dlopen("libunwind.so.8", RTLD_NOW | RTLD_LOCAL);
    void *bt = lib ? dlsym(lib, "unw_backtrace") : NULL;
    if (!bt) {
        stack_error = STACK_E_NOLIB;
        if (__atomic_load_n(&ring_state, __ATOMIC_ACQUIRE) == RING_READY) ring->stack_error = STACK_E_NOLIB;
        return;
    }
    /* per-thread caches: no lock a signal handler's unwind could wait on (libunwind's
     * unw_set_caching_policy(unw_local_addr_space, UNW_CACHE_PER_THREAD)) */
    void **space = dlsym(lib, "_ULx86_64_local_addr_space");
    int (*policy)(void *, int) = (int (*)(void *, int))dlsym(lib, "_ULx86_64_set_caching_policy");
    if (space && policy) policy(*space, 2);
    dl_iterate_phdr(find_self, (void *)(uintptr_t)stacks_setup);
    __atomic_store_n(&unwind_backtrace, (backtrace_fn)bt, __ATOMIC_RELEASE);
}

static int read_adds(struct dl_phdr_info *info, size_t size, void *data) {
    *(unsigned long long *)data = size >= offsetof(struct dl_phdr_info, dlpi_subs) ? info->dlpi_adds : 0;
    return 1;
}

static int add_module(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    (void)data;
    __u64 lo = ~0ull, hi = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        __u64 a = info->dlpi_addr + (ph->p_vaddr & ~4095ull), b = info->dlpi_addr + ph->p_vaddr + ph->p_memsz;
        if (a < lo) lo = a;
        if (b > hi) hi = b;
    }
    if (hi <= lo) return 0;
    struct ring_header *h = ring;
    __u64 n = __atomic_load_n(&h->module_next, __ATOMIC_ACQUIRE);
    for (__u64 i = 0; i < n && i < STACK_MODULES; i++) /* added already (this image's) */
        if (stack_mods[i].start == lo && stack_mods[i].bias == info->dlpi_addr &&
            __atomic_load_n(&stack_mods[i].ready, __ATOMIC_ACQUIRE))
            return 0;
    __u64 at = __atomic_fetch_add(&h->module_next, 1, __ATOMIC_RELAXED);
    if (at >= STACK_MODULES) return 1;
    struct stack_module *m = &stack_mods[at];
    const char *name = info->dlpi_name && info->dlpi_name[0] ? info->dlpi_name : self_exe;
    size_t len = strlen(name);
    if (len >= sizeof(m->path)) len = sizeof(m->path) - 1;
    memcpy(m->path, name, len);
    m->path[len] = 0;
    m->bias = info->dlpi_addr;
    m->start = lo;
    m->end = hi;
    __atomic_store_n(&m->ready, 1, __ATOMIC_RELEASE);
    return 0;
}

/* Before a new stack: the objects loaded since the last one (a dlopen) added to the modules. */
static void modules_update(void) {
    unsigned long long adds = 0;
    dl_iterate_phdr(read_adds, &adds);
    if (adds && adds == __atomic_load_n(&modules_adds, __ATOMIC_RELAXED)) return;
    dl_iterate_phdr(add_module, NULL);
    __atomic_store_n(&modules_adds, adds, __ATOMIC_RELAXED);
}

static inline __u64 stack_hash_of(void *const *ips, int n) {
    __u64 h = (__u64)n * 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < n; i++) {
        h = (h ^ (__u64)(uintptr_t)ips[i]) * 0xbf58476d1ce4e5b9ull;
        h ^= h >> 31;
    }
    return h;
}

/* A new entry for the stack IPS (N frames), after the objects it may lie in: its id, or 0
 * when the table is full. */
static __u32 stack_add(void *const *ips, int n, int cut) {
    ts.depth++; /* (dl_iterate_phdr allocates nothing: the guarantee) */
    modules_update();
    ts.depth--;
    struct ring_header *h = ring;
    __u64 id = __atomic_add_fetch(&h->stack_next, 1, __ATOMIC_RELAXED);
    __u64 at = __atomic_fetch_add(&h->stack_used, (__u64)n + 1, __ATOMIC_RELAXED);
    if (id > STACK_IDS || at + (__u64)n + 1 > STACK_WORDS) {
        __atomic_fetch_add(&h->stacks_full, 1, __ATOMIC_RELAXED);
        return 0;
    }
    stack_words[at] = (__u64)n | (__u64)(cut ? STACK_F_CUT : 0) << 16;
    memcpy(&stack_words[at + 1], ips, (size_t)n * sizeof(__u64));
    __atomic_store_n(&stack_offs[id], (__u32)(at + 1), __ATOMIC_RELEASE);
    return (__u32)id;
}

/* The id of the calling allocation's stack (0: none), shifted into a type word's bits 8-31.
 * Never inlined: the unwind starts in a frame of this library, skipped like the wrapper's. */
__attribute__((noinline)) static __u32 stack_take(void) {
    struct tstate *t = &ts;
    if (t->unwinding) { /* a signal handler interrupted this thread's unwind */
        __atomic_fetch_add(&ring->stacks_nested, 1, __ATOMIC_RELAXED);
        return 0;
    }
    void *buf[STACK_MAX_FRAMES + 8];
    int saved = errno;
    t->unwinding = 1;
    t->depth++; /* libunwind's own allocations (a thread's first cache) are not the program's */
    int n = unwind_backtrace(buf, stack_frames + 8);
    t->depth--;
    t->unwinding = 0;
    errno = saved;
    int skip = 0;
    while (skip < n && (uintptr_t)buf[skip] >= self_lo && (uintptr_t)buf[skip] < self_hi) skip++;
    void **ips = buf + skip;
    n -= skip;
    int cut = n > stack_frames || skip + n >= stack_frames + 8;
    if (n > stack_frames) n = stack_frames;
    if (n <= 0) return 0;
    __u64 hv = stack_hash_of(ips, n), tag = (hv >> 32) | 1, mask = STACK_HASH_SLOTS - 1;
    __u64 i = hv & mask;
    for (int probe = 0; probe < 64; probe++, i = (i + 1) & mask) {
        __u64 v = __atomic_load_n(&stack_hash[i], __ATOMIC_ACQUIRE);
        if (v == 0) {
            __u32 id = stack_add(ips, n, cut);
            /* published for the next call; lost to another thread's at once: ours stays valid */
            if (id)
                __atomic_compare_exchange_n(&stack_hash[i], &v, tag << 32 | id, 0, __ATOMIC_RELEASE,
                                            __ATOMIC_RELAXED);
            return id << 8;
        }
        if (v >> 32 != tag) continue;
        __u32 id = (__u32)v;
        __u32 off = __atomic_load_n(&stack_offs[id], __ATOMIC_ACQUIRE) - 1;
        const __u64 *e = &stack_words[off];
        if ((e[0] & 0xffff) == (__u64)n && ((e[0] >> 16) & STACK_F_CUT) == (__u64)(cut ? STACK_F_CUT : 0) &&
            memcmp(&e[1], ips, (size_t)n * sizeof(__u64)) == 0)
            return id << 8;
    }
    return stack_add(ips, n, cut) << 8; /* a crowded neighbourhood: an entry of its own */
}

/* An allocation before the constructor ran (another library's initializer: libstdc++'s pool)
 * loads libunwind itself, once; meanwhile other threads' allocations go without a stack. */
static __u32 stack_first(void) {
    stacks_setup();
    return __atomic_load_n(&unwind_backtrace, __ATOMIC_ACQUIRE) ? stack_take() : 0;
}

/* The stack word of an allocating call: its stack's id << 8, or 0 without stacks. */
static inline __u32 stack_word(void) {
    if (LIKELY(stack_words == NULL)) return 0;
    if (LIKELY(__atomic_load_n(&unwind_backtrace, __ATOMIC_ACQUIRE) != NULL)) return stack_take();
    return __atomic_load_n(&stacks_once, __ATOMIC_ACQUIRE) == 0 ? stack_first() : 0;
}

/* Create and map this process image's ring: RING_DIR/PID.STAMP, STAMP its creation time. Only
 * system calls (and getenv): a thread waiting for another's open cannot deadlock with it. */
static void ring_open_locked(void) {
    const char *dir = getenv("PYMTRACE_RING");
    if (!dir) dir = "";
    unsigned long owner = env_field(&dir, 0);
    unsigned long follow = env_field(&dir, 1);
    unsigned long slots = env_field(&dir, RING_SLOTS);
    env_field(&dir, 0); /* FRAMES: frames_asked() */
    if (*dir != '/' || !resolve()) {
        __atomic_store_n(&ring_state, RING_OFF, __ATOMIC_RELEASE);
        return;
    }
    __u32 pid = (__u32)getpid();
    int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dirfd < 0) {
        __atomic_store_n(&ring_state, RING_OFF, __ATOMIC_RELEASE);
        return;
    }
    if (follow == 0 && !is_root(dirfd, pid)) {
        close(dirfd);
        __atomic_store_n(&ring_state, RING_OFF, __ATOMIC_RELEASE);
        return;
    }
    if (slots < RING_MIN_SLOTS || slots > RING_MAX_SLOTS || (slots & (slots - 1))) slots = RING_SLOTS;
    size_t bytes = RING_HEADER_SIZE + slots * (sizeof(__u64) + sizeof(struct record_event));
    size_t stack_at = 0;
    stack_frames = frames_asked();
    if (stack_frames) { /* the stack table, page-aligned after the events */
        stack_at = (bytes + 4095) & ~(size_t)4095;
        bytes = stack_at + STACK_HASH_SLOTS * sizeof(__u64) + STACK_OFFS_BYTES +
                STACK_MODULES * sizeof(struct stack_module) + STACK_WORDS * sizeof(__u64);
    }
    char name[48];
    int fd = -1;
    __u64 stamp = now_ns(); /* a later image of this pid (exec, a reused pid) sorts after */
    for (int tries = 0; tries < 1000; tries++, stamp++) {
        char *p = put_number(name, pid);
        *p++ = '.';
        put_number(p, stamp);
        fd = openat(dirfd, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0 || errno != EEXIST) break;
    }
    close(dirfd);
    void *map = MAP_FAILED;
    if (fd >= 0) {
        if (ftruncate(fd, (off_t)bytes) == 0)
            map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
    }
    if (map == MAP_FAILED) {
        __atomic_store_n(&ring_state, RING_OFF, __ATOMIC_RELEASE);
        return;
    }
    struct ring_header *h = map;
    h->version = RING_VERSION;
    h->header_size = RING_HEADER_SIZE;
    h->slots = (__u32)slots;
    h->event_size = sizeof(struct record_event);
    h->pid = pid;
    use_tsc = clocksource_is_tsc();
    h->flags = (glibc_chunks ? RING_F_GLIBC_CHUNKS : 0) | (use_tsc ? RING_F_TSC : 0);
    h->owner = (__u32)owner;
    h->created_ns = stamp;
    memcpy(h->allocator, allocator_path, sizeof(h->allocator));
    h->stack_error = (__u32)stack_error;
    if (stack_at) {
        stack_hash = (__u64 *)((char *)map + stack_at);
        stack_offs = (__u32 *)(stack_hash + STACK_HASH_SLOTS);
        stack_mods = (struct stack_module *)((char *)stack_offs + STACK_OFFS_BYTES);
        stack_words = (__u64 *)(stack_mods + STACK_MODULES);
        h->stack_offset = stack_at;
        h->stack_frames = (__u32)stack_frames;
        modules_adds = 0; /* this image's modules are added anew (a fork child's ring) */
        ssize_t n = readlink("/proc/self/exe", self_exe, sizeof(self_exe) - 1);
        self_exe[n > 0 ? n : 0] = 0;
    }
    ring_seq = (__u64 *)((char *)map + RING_HEADER_SIZE);
    ring_ev = (struct record_event *)(ring_seq + slots);
    ring_mask = slots - 1;
    ring_bytes = bytes;
    self_pid = pid;
    ring = h;
    __atomic_store_n(&h->magic, RING_MAGIC, __ATOMIC_RELEASE);
    __atomic_store_n(&ring_state, RING_READY, __ATOMIC_RELEASE);
}

static int ring_ready_slow(void) {
    /* this thread is opening the ring (a signal handler's call, say) or is inside a forwarded
     * call: not recorded, and never waiting for itself */
    if (ts.depth) return 0;
    int state = __atomic_load_n(&ring_state, __ATOMIC_ACQUIRE);
    if (state == RING_UNINIT && !ts.resolving) {
        int expect = RING_UNINIT;
        if (__atomic_compare_exchange_n(&ring_state, &expect, RING_OPENING, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            int saved = errno;
            ts.depth++; /* getenv and the system calls never allocate; this is the guarantee */
            ring_open_locked();
            ts.depth--;
            errno = saved;
        }
        state = __atomic_load_n(&ring_state, __ATOMIC_ACQUIRE);
    }
    while (state == RING_OPENING) { /* another thread is opening it: only system calls */
        __builtin_ia32_pause();
        state = __atomic_load_n(&ring_state, __ATOMIC_ACQUIRE);
    }
    return state == RING_READY;
}

/* Whether this call is recorded (the ring is ready and the call is not nested). */
static inline int recording(void) {
    int state = __atomic_load_n(&ring_state, __ATOMIC_ACQUIRE);
    if (UNLIKELY(state != RING_READY) && (state == RING_OFF || !ring_ready_slow())) return 0;
    return LIKELY(!ts.depth);
}

/* Whether process OWNER (pymtrace) has ended: gone, or a zombie its parent has not reaped
 * yet (a killed pymtrace whose shell waits for the pipe the program holds). */
static int owner_gone(__u32 owner) {
    if (kill((pid_t)owner, 0) != 0) return errno == ESRCH;
    char path[32] = "/proc/", text[512];
    memcpy(put_number(path + 6, owner), "/stat", 6);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (n <= 0) return 0;
    text[n] = 0;
    char *end = strrchr(text, ')'); /* after the name, which may hold anything */
    return end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

/* One round of a wait for pymtrace (a full ring, no credit): spin briefly, then sleep 20 us,
 * and every 100 ms see whether OWNER, pymtrace's process, is still there. 0 once it is gone:
 * the program must not hang. */
static int wait_turn(__u32 owner, int *spins, __u64 *checked) {
    if (*spins < 256) {
        (*spins)++;
        __builtin_ia32_pause();
        return 1;
    }
    struct timespec nap = {0, 20000};
    nanosleep(&nap, NULL);
    __u64 now = now_ns();
    if (owner && now - *checked > 100000000ull) {
        *checked = now;
        if (owner_gone(owner)) return 0;
    }
    return 1;
}

/* The consumer has not made room for POS yet: wait until it does (or it detached, or its
 * process is gone: then recording stops). */
static int wait_room(struct ring_header *h, __u64 pos) {
    int saved = errno;
    __u64 t0 = now_ns(), checked = t0;
    __atomic_fetch_add(&h->waits, 1, __ATOMIC_RELAXED);
    int spins = 0, ok = 1;
    while (pos - __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE) > ring_mask) {
        if (__atomic_load_n(&h->detached, __ATOMIC_RELAXED)) {
            ok = 0;
            break;
        }
        if (!wait_turn(h->owner, &spins, &checked)) {
            __atomic_store_n(&h->detached, RING_F_DETACHED, __ATOMIC_RELAXED);
            ok = 0;
            break;
        }
    }
    __atomic_fetch_add(&h->wait_ns, now_ns() - t0, __ATOMIC_RELAXED);
    errno = saved;
    return ok;
}

static inline void ring_put(const struct record_event *e) {
    struct ring_header *h = ring;
    if (UNLIKELY(__atomic_load_n(&h->detached, __ATOMIC_RELAXED))) return;
    __u64 pos = __atomic_fetch_add(&h->head, 1, __ATOMIC_RELAXED);
    if (UNLIKELY(pos - __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE) > ring_mask) && !wait_room(h, pos)) return;
    ring_ev[pos & ring_mask] = *e;
    __atomic_store_n(&ring_seq[pos & ring_mask], pos + 1, __ATOMIC_RELEASE);
}

/* Write the records signal handlers left while this thread was writing, in their order
 * (called with `writing` held). A handler appends at deferred[dcount] and then counts it; the
 * count is reset only by a compare-and-swap from the number written, a single instruction no
 * handler can come between. */
static void flush_deferred(struct tstate *t) {
    /* signals blocked: a handler that finds the buffer full flushes it itself (emit), so it
     * must never interrupt a flush that has taken a record but not yet reserved its slot */
    sigset_t all, old;
    int saved = errno;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    __u32 done = 0;
    for (;;) {
        if (done < __atomic_load_n(&t->dcount, __ATOMIC_RELAXED)) {
            __atomic_signal_fence(__ATOMIC_SEQ_CST);
            struct record_event d = t->deferred[done++];
            d.rec.pad[0] = stamp(); /* timed when written: after the record it interrupted */
            ring_put(&d);
            continue;
        }
        __u32 expect = done;
        if (__atomic_compare_exchange_n(&t->dcount, &expect, 0, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) break;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = saved;
}

static inline void emit(__u32 type, __u64 ptr1, __u64 ptr2, __u64 size, __u64 size2, __u64 size3,
                        __u64 caller) {
    struct tstate *t = &ts;
    if (UNLIKELY(!t->tid)) t->tid = (__s32)syscall(SYS_gettid);
    struct record_event e;
    e.rec.thread = t->tid;
    e.rec.type = type;
    e.rec.ptr1 = ptr1;
    e.rec.ptr2 = ptr2;
    e.rec.size = size;
    e.rec.size2 = size2;
    e.rec.size3 = size3;
    e.rec.pad[1] = caller;
    e.tgid = self_pid;
    if (UNLIKELY(t->writing)) { /* a signal handler interrupted this thread's write */
        /* signals blocked while a slot is taken and filled: a handler of another signal
         * interrupting this one must not take the same slot (rare: a system call pair here) */
        sigset_t all, old;
        int saved = errno;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        __u32 n = t->dcount;
        if (n < RING_DEFER) {
            t->deferred[n] = e;
            __atomic_signal_fence(__ATOMIC_SEQ_CST);
            __atomic_fetch_add(&t->dcount, 1, __ATOMIC_RELAXED);
            __atomic_fetch_add(&ring->deferred, 1, __ATOMIC_RELAXED);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            errno = saved;
            return;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        errno = saved;
        /* the buffer is full: written at once, after the records buffered before it (written
         * first: the thread's order kept; it can only block if the ring is full) */
        t->writing++;
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        flush_deferred(t);
        e.rec.pad[0] = stamp();
        ring_put(&e);
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        t->writing--;
        return;
    }
    t->writing = 1;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    /* a handler that came after a write's last flush, before its `writing` fell, finds records
     * still buffered: older than its own, so written first */
    if (UNLIKELY(__atomic_load_n(&t->dcount, __ATOMIC_RELAXED))) flush_deferred(t);
    /* timed inside the window: a handler's records before it are earlier, deferred ones later */
    e.rec.pad[0] = stamp();
    ring_put(&e);
    for (;;) {
        if (UNLIKELY(__atomic_load_n(&t->dcount, __ATOMIC_RELAXED))) flush_deferred(t);
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        t->writing = 0;
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        /* one that came after the flush but before `writing` fell */
        if (LIKELY(!__atomic_load_n(&t->dcount, __ATOMIC_RELAXED))) return;
        t->writing = 1;
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
    }
}

static inline __u64 chunk(const void *p) {
    return glibc_chunks && p ? *(const __u64 *)((const char *)p - 8) & ~7ull : 0;
}

/* ---- heap's sampling mode -------------------------------------------------------------- */
static __u64 sample_mean; /* 0: not sampling; 1: every call; else the mean bytes between samples */
static __u64 live_max;    /* sampled blocks the live set holds at most (heap's --max-live) */
static int sample_follow = 1;
static int sample_once; /* 0, 1 while a thread reads the environment, 2 */
static __u32 sample_lg[1025];

/* round(2^20 * log2(1 + j / 1024)): sources.heap.log2_table, BPF's hp_lg (ln by its atanh
 * series, converged to double precision: no libm in the traced process) */
static void lg_fill(void) {
    for (int j = 0; j <= 1024; j++) {
        double x = 1.0 + j / 1024.0, z = (x - 1.0) / (x + 1.0), z2 = z * z, term = z, sum = 0.0;
        for (int k = 1; k < 80; k += 2, term *= z2) sum += term / k;
        sample_lg[j] = (__u32)(2.0 * sum / 0.693147180559945309417232121458 * 1048576.0 + 0.5);
    }
}

/* Exp(MEAN) bytes from the random 32-bit X: hp_draw of bpf/heap.bpf.c, the same integers */
static inline __s64 draw_bytes(__u32 x, __u64 mean) {
    x |= 1;
    __u32 k = 31 - (__u32)__builtin_clz(x);
    __u32 m = (x << (31 - k)) & 0x7fffffff;
    __u32 j = (m >> 21) & 1023, rem = (m >> 9) & 4095;
    __u64 lgf = sample_lg[j] + ((__u64)(sample_lg[j + 1] - sample_lg[j]) * rem >> 12);
    __u64 neg = (32ull << 20) - (((__u64)k << 20) + lgf);
    __u64 a = mean * 45426ull;
    return (__s64)(((a >> 16) * neg >> 20) + ((a & 0xffff) * neg >> 36)) + 1;
}

/* the draw for tests (tests/unit/test_heap_draw.py): X's draw at MEAN */
EXPORT __s64 pymtrace_sample_draw(__u32 x, __u64 mean) {
    if (!sample_lg[1024]) lg_fill();
    return draw_bytes(x, mean);
}

static inline __u64 mix64(__u64 z) { /* splitmix64's finalizer */
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline __u32 next_random(struct tstate *t) { /* xorshift64*: its high half */
    __u64 s = t->rng;
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    t->rng = s;
    return (__u32)((s * 0x2545f4914f6cdd1dull) >> 32);
}

/* heap's credits (interpose.h), mapped from PYMTRACE_SAMPLE's PATH; none: probes fire freely
 * (a process that cannot open it, another user's, counts what heap's ring could not take). */
static struct sample_credits *credits;

static void credits_open(const char *path) {
    if (*path != '/') return;
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    void *map = MAP_FAILED;
    if (fstat(fd, &st) == 0 && st.st_size == CREDIT_SIZE)
        map = mmap(NULL, CREDIT_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return;
    if (__atomic_load_n(&((struct sample_credits *)map)->magic, __ATOMIC_ACQUIRE) != CREDIT_MAGIC) {
        munmap(map, CREDIT_SIZE);
        return;
    }
    credits = map;
}

/* Before a probe fires: take the ring bytes its record may need, waiting while heap has not
 * granted them (it is reading the ring), so that no sample is lost. 0: heap has stopped or
 * is gone, fire nothing more. */
static int credit_take(int freeing) {
    struct sample_credits *c = credits;
    if (!c) return 1;
    if (__atomic_load_n(&c->detached, __ATOMIC_RELAXED)) return 0;
    __u64 used = __atomic_add_fetch(&c->used, freeing ? c->free_cost : c->alloc_cost, __ATOMIC_RELAXED);
    if (LIKELY(used <= __atomic_load_n(&c->granted, __ATOMIC_ACQUIRE))) return 1;
    int saved = errno, spins = 0;
    __u64 t0 = now_ns(), checked = t0;
    __atomic_fetch_add(&c->waits, 1, __ATOMIC_RELAXED);
    while (used > __atomic_load_n(&c->granted, __ATOMIC_ACQUIRE) &&
           !__atomic_load_n(&c->detached, __ATOMIC_RELAXED)) {
        if (!wait_turn(c->owner, &spins, &checked)) {
            __atomic_store_n(&c->detached, 1, __ATOMIC_RELAXED);
            break;
        }
    }
    __atomic_fetch_add(&c->wait_ns, now_ns() - t0, __ATOMIC_RELAXED);
    errno = saved;
    return !__atomic_load_n(&c->detached, __ATOMIC_RELAXED);
}

/* The probe credit_take allowed has fired: its record is in the ring (or counted lost). */
static inline void credit_done(int freeing) {
    struct sample_credits *c = credits;
    if (c) __atomic_fetch_add(&c->fired, freeing ? c->free_cost : c->alloc_cost, __ATOMIC_RELEASE);
}

/* Read the environment once per process image (from resolve: before any call goes on). */
static void sample_setup(void) {
    int expect = 0;
    if (!__atomic_compare_exchange_n(&sample_once, &expect, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        while (__atomic_load_n(&sample_once, __ATOMIC_ACQUIRE) == 1) __builtin_ia32_pause();
        return;
    }
    const char *v = getenv("PYMTRACE_SAMPLE");
    if (!v) v = "";
    unsigned long parent = env_field(&v, 0);
    sample_follow = env_field(&v, 1) != 0;
    unsigned long mean = env_field(&v, 0);
    unsigned long live = env_field(&v, 262144);
    if (mean && mean < (1ul << 32)) {
        /* not following: the launched command (pymtrace's child) and its execs only */
        if (sample_follow || (parent && (unsigned long)getppid() == parent)) {
            lg_fill();
            live_max = live;
            credits_open(v); /* the rest: PATH (it may hold a colon) */
            if (live_max < 1) live_max = 1;
            if (live_max > (1ul << 26)) live_max = 1ul << 26;
            __atomic_store_n(&sample_mean, (__u64)mean, __ATOMIC_RELEASE);
        }
    }
    __atomic_store_n(&sample_once, 2, __ATOMIC_RELEASE);
}

/* Whether this thread's call of SIZE bytes is sampled: it uses up the bytes left until its
 * next sample (then a fresh Exp(mean) draw: memoryless), or is at least the mean. */
static inline int sample_take(__u64 mean, __u64 size) {
    if (mean <= 1 || size >= mean) return 1;
    struct tstate *t = &ts;
    if (UNLIKELY(!t->rng)) {
        t->rng = mix64(__builtin_ia32_rdtsc() ^ ((__u64)(uintptr_t)t << 16) ^ self_pid) | 1;
        t->left = draw_bytes(next_random(t), mean);
    }
    t->left -= (__s64)size;
    if (LIKELY(t->left > 0)) return 0;
    t->left = draw_bytes(next_random(t), mean);
    return 1;
}

/* The sampled blocks still allocated: an open-addressed set of pointers, lock-free (a
 * compare-and-swap per insert and removal), so any thread and a signal handler can use it.
 * A pointer lies within LIVE_WINDOW slots of its home slot; a removal leaves a tombstone
 * that a later insert reuses, and a slot never becomes empty again, so a lookup stops at the
 * first empty slot. Full (live_max blocks, or no free slot in the window): the block is
 * sampled but not tracked, and heap counts it as live_full, as when its BPF map is full. */
#define LIVE_EMPTY  0
#define LIVE_GONE   1
#define LIVE_WINDOW 32
enum { LIVE_UNINIT, LIVE_OPENING, LIVE_READY, LIVE_OFF };
static __u64 *live_slots;
static __u64 live_mask;
static int live_shift;
static int live_state;
static __u64 live_count;
static size_t live_bytes;

static __u64 *live_table(void) {
    int state = __atomic_load_n(&live_state, __ATOMIC_ACQUIRE);
    if (LIKELY(state == LIVE_READY)) return live_slots;
    int expect = LIVE_UNINIT;
    if (state == LIVE_UNINIT && __atomic_compare_exchange_n(&live_state, &expect, LIVE_OPENING, 0,
                                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        /* twice the blocks it may hold: mapped lazily, untouched pages cost nothing */
        int bits = 10;
        while ((1ull << bits) < 2 * live_max) bits++;
        size_t bytes = (size_t)8 << bits;
        ts.depth++; /* a signal handler's call meanwhile is not sampled (no wait on ourselves) */
        void *map =
            mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        ts.depth--;
        if (map == MAP_FAILED) {
            __atomic_store_n(&live_state, LIVE_OFF, __ATOMIC_RELEASE);
            return NULL;
        }
        live_slots = map;
        live_bytes = bytes;
        live_mask = (1ull << bits) - 1;
        live_shift = 64 - bits;
        __atomic_store_n(&live_state, LIVE_READY, __ATOMIC_RELEASE);
        return live_slots;
    }
    while ((state = __atomic_load_n(&live_state, __ATOMIC_ACQUIRE)) == LIVE_OPENING) __builtin_ia32_pause();
    return state == LIVE_READY ? live_slots : NULL;
}

static inline __u64 live_home(__u64 p) {
    return ((p >> 4) * 0x9e3779b97f4a7c15ull) >> live_shift;
}

static int live_insert(__u64 p) {
    __u64 *t = live_table();
    if (!t || __atomic_load_n(&live_count, __ATOMIC_RELAXED) >= live_max) return 0;
    __u64 home = live_home(p);
    for (__u64 i = 0; i < LIVE_WINDOW; i++) {
        __u64 *slot = &t[(home + i) & live_mask];
        __u64 v = __atomic_load_n(slot, __ATOMIC_RELAXED);
        while (v <= LIVE_GONE)
            if (__atomic_compare_exchange_n(slot, &v, p, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
                __atomic_fetch_add(&live_count, 1, __ATOMIC_RELAXED);
                return 1;
            }
    }
    return 0;
}

static int live_remove(__u64 p) {
    __u64 *t = live_slots, home = live_home(p); /* live_count > 0: the table is there */
    for (__u64 i = 0; i < LIVE_WINDOW; i++) {
        __u64 *slot = &t[(home + i) & live_mask];
        __u64 v = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
        if (v == p) {
            if (!__atomic_compare_exchange_n(slot, &v, LIVE_GONE, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                return 0; /* another thread freed it at the same time (a double free) */
            __atomic_fetch_sub(&live_count, 1, __ATOMIC_RELAXED);
            return 1;
        }
        if (v == LIVE_EMPTY) return 0;
    }
    return 0;
}

/* The USDT sites heap's BPF program is attached to (pymtrace:heap_alloc, pymtrace:heap_free):
 * one function each, never inlined, so there is one site of each; the stack copy and the
 * registers are taken there, and heap drops this library's frames from the unwound stack. */
__attribute__((noinline, noclone)) static void sample_fire(__u32 type, void *p, __u64 size) {
    int saved = errno;
    __u64 tracked = p ? (__u64)live_insert((__u64)p) : 0;
    STAP_PROBE4(pymtrace, heap_alloc, type, (__u64)p, size, tracked);
    errno = saved;
}

__attribute__((noinline, noclone)) static void sample_gone(void *p) {
    STAP_PROBE1(pymtrace, heap_free, (__u64)p);
}

/* An allocation of the program (not nested in a forwarded call): sampled, or not. */
static inline void sample_alloc(__u32 type, void *p, __u64 size) {
    __u64 mean = __atomic_load_n(&sample_mean, __ATOMIC_RELAXED);
    if (!mean || ts.depth) return;
    if (sample_take(mean, size) && credit_take(0)) {
        sample_fire(type, p, size);
        credit_done(0);
    }
}

/* P is about to be freed: if it is a sampled block, heap is told first (once the allocator
 * has it back, another thread may be given the same address). */
static inline void sample_free(void *p) {
    if (LIKELY(!__atomic_load_n(&live_count, __ATOMIC_RELAXED)) || !p) return;
    if (live_remove((__u64)p) && credit_take(1)) {
        sample_gone(p);
        credit_done(1);
    }
}

/* realloc in sampling mode: the old block, if sampled, is gone before the call (a failed
 * realloc keeps it, no longer in use for heap: rare, and the other order would let another
 * thread's block at the same address be taken for it); the new one is sampled by its size. */
static void *sample_realloc(void *p, size_t n) {
    sample_free(p);
    void *q = FORWARD(real.realloc(p, n));
    sample_alloc(CALL_REALLOC, q, n);
    return q;
}

/* ---- fork ------------------------------------------------------------------------------ */
static void after_fork_child(void) {
    ts.tid = 0;
    ts.rng = 0; /* drawn afresh: the parent's random sequence would repeat */
    /* not followed: it samples nothing */
    if (!sample_follow && sample_mean) {
        __atomic_store_n(&sample_mean, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&live_count, 0, __ATOMIC_RELAXED);
        if (__atomic_load_n(&live_state, __ATOMIC_ACQUIRE) == LIVE_READY) munmap(live_slots, live_bytes);
        __atomic_store_n(&live_state, LIVE_OFF, __ATOMIC_RELEASE);
    }
    int state = __atomic_load_n(&ring_state, __ATOMIC_ACQUIRE);
    if (state == RING_READY) {
        stack_words = NULL; /* (its table goes with the parent's ring: the child's comes with its own) */
        munmap(ring, ring_bytes);
        ring = NULL;
    }
    /* followed: the child registers its own ring on its first call (not following: the
     * root check refuses it); without a ring directory it stays off */
    __atomic_store_n(&ring_state, state == RING_OFF ? RING_OFF : RING_UNINIT, __ATOMIC_RELEASE);
}

__attribute__((constructor)) static void interpose_init(void) {
    resolve();
    ts.depth++; /* its registration may allocate: the library's own call */
    pthread_atfork(NULL, NULL, after_fork_child);
    stacks_setup();
    ts.depth--;
    if (__atomic_load_n(&ring_state, __ATOMIC_ACQUIRE) == RING_UNINIT) ring_ready_slow();
}

/* ---- the C API ------------------------------------------------------------------------ */
EXPORT void *malloc(size_t n) {
    if (UNLIKELY(!real.malloc) && !resolve()) return arena_alloc(n, 16);
    void *p = FORWARD(real.malloc(n));
    if (recording())
        emit(CALL_MALLOC | stack_word(), 0, (__u64)p, n, 0, chunk(p), CALLER);
    else if (UNLIKELY(ts.capturing) && ts.ncaught < 4)
        ts.caught[ts.ncaught++] = (typeof(ts.caught[0])){(__u64)p, n, CALLER};
    else
        sample_alloc(CALL_MALLOC, p, n);
    return p;
}

EXPORT void free(void *p) {
    if (UNLIKELY(in_arena(p))) return;
    if (UNLIKELY(!real.free) && !resolve()) return;
    if (recording()) emit(CALL_FREE, (__u64)p, 0, 0, chunk(p), 0, CALLER);
    sample_free(p);
    if (LIKELY(glibc_chunks)) {
        real.free(p);
    } else {
        ts.depth++;
        real.free(p);
        ts.depth--;
    }
}

EXPORT void *calloc(size_t n, size_t size) {
    if (UNLIKELY(!real.calloc) && !resolve()) {
        size_t bytes;
        return __builtin_mul_overflow(n, size, &bytes) ? NULL : arena_alloc(bytes, 16); /* zeroed */
    }
    void *p = FORWARD(real.calloc(n, size));
    if (recording())
        emit(CALL_CALLOC | stack_word(), 0, (__u64)p, (__u64)n * (__u64)size, 0, chunk(p), CALLER);
    else
        sample_alloc(CALL_CALLOC, p, (__u64)n * (__u64)size);
    return p;
}

static void *do_realloc(void *p, size_t n, __u64 caller) {
    if (UNLIKELY(in_arena(p))) { /* a bootstrap block: moved into a real one */
        void *q = malloc(n);
        size_t old = arena_size(p);
        if (q) memcpy(q, p, old < n ? old : n);
        return q;
    }
    if (UNLIKELY(!real.realloc) && !resolve()) return arena_alloc(n, 16);
    if (!recording())
        return __atomic_load_n(&sample_mean, __ATOMIC_RELAXED) ? sample_realloc(p, n)
                                                               : FORWARD(real.realloc(p, n));
    __u64 old = chunk(p);
    void *q = FORWARD(real.realloc(p, n));
    emit(CALL_REALLOC | stack_word(), (__u64)p, (__u64)q, n, old, chunk(q), caller);
    return q;
}

EXPORT void *realloc(void *p, size_t n) {
    return do_realloc(p, n, CALLER);
}

/* glibc's reallocarray is realloc after an overflow check; done here the same way, so it is
 * recorded as the realloc it is whatever the next allocator (one that defines reallocarray
 * itself would otherwise be called past this library) */
EXPORT void *reallocarray(void *p, size_t n, size_t size) {
    size_t bytes;
    if (__builtin_mul_overflow(n, size, &bytes)) {
        errno = ENOMEM;
        return NULL;
    }
    return do_realloc(p, bytes, CALLER);
}

static void *do_memalign(int aligned_alloc, size_t align, size_t n, __u64 caller) {
    if (UNLIKELY(!real.memalign) && !resolve()) return arena_alloc(n, align);
    memalign_fn fn = aligned_alloc && real.aligned_alloc ? real.aligned_alloc : real.memalign;
    void *p = FORWARD(fn(align, n));
    if (recording())
        emit(CALL_MEMALIGN | stack_word(), 0, (__u64)p, n, align, chunk(p), caller);
    else
        sample_alloc(CALL_MEMALIGN, p, n);
    return p;
}

EXPORT void *memalign(size_t align, size_t n) {
    return do_memalign(0, align, n, CALLER);
}

EXPORT void *aligned_alloc(size_t align, size_t n) {
    return do_memalign(1, align, n, CALLER);
}

EXPORT int posix_memalign(void **out, size_t align, size_t n) {
    if (UNLIKELY(!real.posix_memalign) && !resolve()) {
        void *p = arena_alloc(n, align);
        if (!p) return ENOMEM;
        *out = p;
        return 0;
    }
    int rc = FORWARD(real.posix_memalign(out, align, n));
    if (recording()) {
        void *p = rc == 0 ? *out : NULL;
        emit(CALL_POSIX_MEMALIGN | stack_word(), (__u32)rc, (__u64)p, n, align, chunk(p), CALLER);
    } else {
        sample_alloc(CALL_POSIX_MEMALIGN, rc == 0 ? *out : NULL, n);
    }
    return rc;
}

EXPORT void *valloc(size_t n) {
    if (UNLIKELY(!real.valloc) && !resolve()) return arena_alloc(n, 4096);
    void *p = FORWARD(real.valloc(n));
    if (recording())
        emit(CALL_VALLOC | stack_word(), 0, (__u64)p, n, page_size, chunk(p), CALLER);
    else
        sample_alloc(CALL_VALLOC, p, n);
    return p;
}

EXPORT void *pvalloc(size_t n) {
    if (UNLIKELY(!real.pvalloc) && !resolve()) return arena_alloc(n, 4096);
    void *p = FORWARD(real.pvalloc(n));
    if (recording())
        emit(CALL_PVALLOC | stack_word(), 0, (__u64)p, n, 0, chunk(p), CALLER);
    else
        sample_alloc(CALL_PVALLOC, p, n);
    return p;
}

EXPORT size_t malloc_usable_size(void *p) {
    if (UNLIKELY(in_arena(p))) return arena_size(p);
    if (UNLIKELY(!real.usable) && !resolve()) return 0;
    return real.usable(p);
}

/* ---- C++ operator new/delete (pymtrace.tracee.allocators.CXX) -------------------------
 * Recorded as `record` maps them: new -> malloc, aligned new -> memalign (alignment, size),
 * delete -> free. The runtime's own malloc/free (and new[] -> new) inside are nested.
 * Compiled with -fexceptions: a throwing new unwinds through here, the cleanup restoring
 * the depth (nothing is recorded for it). */
/* An outermost operator new keeps the allocations made inside it: returning, they were its
 * own block (not recorded again); unwinding (it threw), they are the exception object the
 * runtime allocated, which outlives the call and is freed after the catch: recorded then. */
struct new_guard {
    int outer, done;
};

static void new_leave(struct new_guard *g) {
    ts.depth--;
    if (!g->outer) return;
    ts.capturing = 0;
    if (!g->done && recording())
        for (__u32 i = 0; i < ts.ncaught; i++)
            emit(CALL_MALLOC | stack_word(), 0, ts.caught[i].ptr, ts.caught[i].size, 0,
                 chunk((void *)ts.caught[i].ptr), ts.caught[i].caller);
    ts.ncaught = 0;
}

static void depth_leave(__u32 *unused) {
    (void)unused;
    ts.depth--;
}
#define NESTED __attribute__((cleanup(depth_leave), unused)) __u32 nest_guard_ = ts.depth++

/* the next definition; a C++ runtime loaded later (dlopen) is looked up then, in the global
 * scope or, loaded RTLD_LOCAL, by its soname */
static void *cxx_next(void **slot, const char *name) {
    void *f = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (LIKELY(f)) return f;
    ts.depth++; /* the library's own allocations (dlsym's) are not the program's */
    f = dlsym(RTLD_NEXT, name);
    if (!f) {
        void *lib = dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_NOLOAD);
        if (lib) {
            f = dlsym(lib, name);
            dlclose(lib);
        }
    }
    ts.depth--;
    if (f) __atomic_store_n(slot, f, __ATOMIC_RELEASE);
    return f;
}

#define NEW(sym, TYPE, PARAMS, ARGS, SIZE, ALIGN, FALLBACK)                                                  \
    EXPORT void *sym PARAMS {                                                                                \
        static void *next;                                                                                   \
        __u64 caller = CALLER;                                                                               \
        if (UNLIKELY(!real.malloc) && !resolve()) return arena_alloc(SIZE, ALIGN);                           \
        void *(*fn)PARAMS = (void *(*)PARAMS)cxx_next(&next, #sym);                                          \
        /* sampling: the runtime's operator new calls malloc (here), as heap's uprobes see it */             \
        if (__atomic_load_n(&sample_mean, __ATOMIC_RELAXED)) return fn ? fn ARGS : FALLBACK;                 \
        void *p;                                                                                             \
        {                                                                                                    \
            __attribute__((cleanup(new_leave))) struct new_guard g = {!ts.depth, 0};                         \
            ts.depth++;                                                                                      \
            if (g.outer) ts.capturing = 1, ts.ncaught = 0;                                                   \
            p = fn ? fn ARGS : FALLBACK;                                                                     \
            g.done = 1;                                                                                      \
        }                                                                                                    \
        if (recording())                                                                                     \
            emit(TYPE | stack_word(), 0, (__u64)p, SIZE, TYPE == CALL_MEMALIGN ? ALIGN : 0, chunk(p),        \
                 caller);                                                                                    \
        return p;                                                                                            \
    }

#define DELETE(sym, PARAMS, ARGS)                                                                            \
    EXPORT void sym PARAMS {                                                                                 \
        static void *next;                                                                                   \
        if (UNLIKELY(in_arena(p))) return;                                                                   \
        if (UNLIKELY(!real.free) && !resolve()) return;                                                      \
        void(*fn) PARAMS = (void(*) PARAMS)cxx_next(&next, #sym);                                            \
        /* sampling: the runtime's operator delete frees here */                                             \
        if (__atomic_load_n(&sample_mean, __ATOMIC_RELAXED)) {                                               \
            fn ? fn ARGS : free(p);                                                                          \
            return;                                                                                          \
        }                                                                                                    \
        if (recording()) emit(CALL_FREE, (__u64)p, 0, 0, chunk(p), 0, CALLER);                               \
        NESTED;                                                                                              \
        if (fn)                                                                                              \
            fn ARGS;                                                                                         \
        else                                                                                                 \
            real.free(p);                                                                                    \
    }

typedef const void *nothrow_ref; /* const std::nothrow_t & */

NEW(_Znwm, CALL_MALLOC, (size_t n), (n), n, 16, real.malloc(n))
NEW(_Znam, CALL_MALLOC, (size_t n), (n), n, 16, real.malloc(n))
NEW(_ZnwmRKSt9nothrow_t, CALL_MALLOC, (size_t n, nothrow_ref nt), (n, nt), n, 16, real.malloc(n))
NEW(_ZnamRKSt9nothrow_t, CALL_MALLOC, (size_t n, nothrow_ref nt), (n, nt), n, 16, real.malloc(n))
NEW(_ZnwmSt11align_val_t, CALL_MEMALIGN, (size_t n, size_t al), (n, al), n, al, real.memalign(al, n))
NEW(_ZnamSt11align_val_t, CALL_MEMALIGN, (size_t n, size_t al), (n, al), n, al, real.memalign(al, n))
NEW(_ZnwmSt11align_val_tRKSt9nothrow_t, CALL_MEMALIGN, (size_t n, size_t al, nothrow_ref nt), (n, al, nt), n,
    al, real.memalign(al, n))
NEW(_ZnamSt11align_val_tRKSt9nothrow_t, CALL_MEMALIGN, (size_t n, size_t al, nothrow_ref nt), (n, al, nt), n,
    al, real.memalign(al, n))

DELETE(_ZdlPv, (void *p), (p))
DELETE(_ZdaPv, (void *p), (p))
DELETE(_ZdlPvRKSt9nothrow_t, (void *p, nothrow_ref nt), (p, nt))
DELETE(_ZdaPvRKSt9nothrow_t, (void *p, nothrow_ref nt), (p, nt))
DELETE(_ZdlPvm, (void *p, size_t n), (p, n))
DELETE(_ZdaPvm, (void *p, size_t n), (p, n))
DELETE(_ZdlPvSt11align_val_t, (void *p, size_t al), (p, al))
DELETE(_ZdaPvSt11align_val_t, (void *p, size_t al), (p, al))
DELETE(_ZdlPvmSt11align_val_t, (void *p, size_t n, size_t al), (p, n, al))
DELETE(_ZdaPvmSt11align_val_t, (void *p, size_t n, size_t al), (p, n, al))
DELETE(_ZdlPvSt11align_val_tRKSt9nothrow_t, (void *p, size_t al, nothrow_ref nt), (p, al, nt))
DELETE(_ZdaPvSt11align_val_tRKSt9nothrow_t, (void *p, size_t al, nothrow_ref nt), (p, al, nt))
