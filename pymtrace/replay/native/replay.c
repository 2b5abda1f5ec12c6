/* pymtrace-replay: replay a .wl malloc workload, one thread per stream.
 *
 * Built on first use by pymtrace/replay/runner.py (gcc -O2 -pthread).  Usage:
 *   pymtrace-replay [--check] [--json FILE] [--text] [--sync futex|mutex]
 *                   [--timer auto|rdtscp|clock] [--sample-ms N] [--trim N]
 *                   [--mallopt NAME=VALUE]... [--no-fill] [--stall-timeout S] FILE.wl
 *
 * The whole file is validated before any thread starts (opcodes, varints, indices, sync ids,
 * stream bounds, alignments, and a dry run of the sync order that finds deadlocks and sync
 * ids never written), each op once however many threads share it, so in time linear in the
 * file; invalid input exits 2 with one line on stderr, never a crash or hang.
 *
 * Cross-thread order: one 32-bit word per sync id; SYNC_W sets it (and futex-wakes only if a
 * reader went to sleep), SYNC_R spins briefly, then futex-waits.  --sync mutex uses a
 * mutex+condvar per id like upstream trace_run (the baseline for the benchmark).
 *
 * Each call is timed with lfence;rdtsc ... rdtscp;lfence when the CPU has RDTSCP, else with
 * clock_gettime(CLOCK_MONOTONIC) in ns (the report says which).  A slot's pointer and size
 * change as one unit (the pointer word is a lock meanwhile), so even a hostile workload whose
 * threads race on a slot can neither double-free nor fill a block with another's size.
 * Allocated blocks get 0x11 every 8 bytes (like upstream), 0x22 before they are freed.
 * RSS over time: a sampler thread pread()s an already-open /proc/self/statm.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/futex.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <x86intrin.h>
#define HAVE_X86 1
#endif

#include "wl.h"

#define WL_OPNAME(op)  [WL_OP_##op] = #op,
#define WL_OPNARGS(op) [WL_OP_##op] = WL_NARGS_##op,
static const int nargs[WL_NOPS] = {WL_OPS(WL_OPNARGS)};
static const char *const opnames[WL_NOPS] = {WL_OPS(WL_OPNAME)};

#define WL_CALLNAME(c) [WL_CALL_##c] = #c,
static const char *const typenames[WL_NCALLS] = {WL_CALLS(WL_CALLNAME)};

#define DROP_CHUNK (256 << 10) /* replayed workload pages are dropped from the RSS in such steps */
#define NBUCKETS   976         /* log-linear histogram: 16 sub-buckets per power of two */

static const char *progname = "pymtrace-replay";
static const char *wl_name;

static void die(int code, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
static void die(int code, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    /* one write() so the line is not interleaved, then _exit: other threads may be mid-call */
    char line[1200];
    int n = snprintf(line, sizeof line, "%s: %s\n", progname, buf);
    if (write(2, line, n) < 0) {
    }
    _exit(code);
}

/* ---------- the workload ---------- */
static const unsigned char *data;
static size_t n_data;
static uint64_t n_ptrs, n_syncs, n_threads;
static uint64_t *thread_off;
static int upstream_sync_sizing;

/* A slot's block, its requested size and its footprint (see footprint()) change together:
   with several threads the pointer word doubles as a lock (SLOT_BUSY) while they are
   exchanged, so a thread never takes one thread's block with another's size, even when a
   hostile workload has unsynchronised threads share a slot. */
struct slot {
    _Atomic(uintptr_t) p;
    uint64_t size, foot;
};
#define SLOT_BUSY ((uintptr_t)1) /* no allocator returns an odd address */
static struct slot *slots;
static _Atomic uint32_t *syncs;  /* futex mode: 0 unset, 1 set, 2 unset + sleepers */
static pthread_mutex_t *mutexes; /* mutex mode */
static pthread_cond_t *conds;
static unsigned char *msyncs;
static int sync_mutex;

/* varint reader with bounds checks (validation pass) */
static int get_int_checked(size_t *pos, uint64_t *out) {
    uint64_t v = 0;
    size_t p = *pos;
    for (;;) {
        if (p >= n_data) return -1;
        unsigned char c = data[p++];
        if (v >> 57) return -2; /* the shift would lose bits */
        v = (v << 7) | (c & 0x7f);
        if (!(c & 0x80)) break;
    }
    *pos = p;
    *out = v;
    return 0;
}

/* trusted reader (after validation) */
static inline uint64_t get_int(const unsigned char **cp) {
    uint64_t v = 0;
    for (;;) {
        unsigned char c = *(*cp)++;
        v = (v << 7) | (c & 0x7f);
        if (!(c & 0x80)) return v;
    }
}

static void *map_zeroed(uint64_t count, size_t elem, const char *what) {
    if (count == 0) count = 1;
    if (count > (uint64_t)SIZE_MAX / elem)
        die(WL_EXIT_RESOURCE, "%s: %" PRIu64 " %s do not fit in memory", wl_name, count, what);
    void *p =
        mmap(NULL, count * elem, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        die(WL_EXIT_RESOURCE, "%s: cannot reserve memory for %" PRIu64 " %s: %s", wl_name, count, what,
            strerror(errno));
    return p;
}

static uint64_t phys_bytes;

static void read_op(size_t *pos, int *op, uint64_t *args) {
    size_t start = *pos;
    if (*pos >= n_data) die(WL_EXIT_INVALID, "%s: truncated at byte %zu", wl_name, start);
    int o = data[(*pos)++];
    if (o >= WL_NOPS) die(WL_EXIT_INVALID, "%s: byte %zu: unknown opcode %d", wl_name, start, o);
    for (int i = 0; i < nargs[o]; i++) {
        size_t at = *pos;
        int r = get_int_checked(pos, &args[i]);
        if (r == -1)
            die(WL_EXIT_INVALID, "%s: truncated: varint at byte %zu runs off the end of the file", wl_name,
                at);
        if (r == -2) die(WL_EXIT_INVALID, "%s: varint at byte %zu exceeds 64 bits", wl_name, at);
    }
    *op = o;
}

/* Bitmaps over the file's byte positions: which positions are the start of an op already
   decoded (every op is decoded once however many threads share it, so validation is linear
   in the file, not threads x stream). */
static inline int bit_get(const uint64_t *b, size_t i) {
    return (b[i >> 6] >> (i & 63)) & 1;
}
static inline void bit_set(uint64_t *b, size_t i) {
    b[i >> 6] |= (uint64_t)1 << (i & 63);
}
static inline void bit_clr(uint64_t *b, size_t i) {
    b[i >> 6] &= ~((uint64_t)1 << (i & 63));
}
static uint64_t *bitmap_new(void) {
    return map_zeroed((n_data + 63) / 64, sizeof(uint64_t), "bytes of workload");
}
static void bitmap_free(uint64_t *b) {
    munmap(b, ((n_data + 63) / 64 ? (n_data + 63) / 64 : 1) * sizeof(uint64_t));
}

static uint64_t max_sync_id; /* the largest sync id any stream uses: the sync tables' size */
static int any_sync;
/* mutex mode: the tables exist before the dry run, which initialises each id it meets */
static void init_sync_id(uint64_t id) {
    if (sync_mutex) {
        pthread_mutex_init(&mutexes[id], NULL);
        pthread_cond_init(&conds[id], NULL);
    }
}
/* the replay's sync tables: as many entries as the largest id used (not as ALLOC_SYNCS
   declares), reserved lazily, so only the ids really used take memory */
static void alloc_sync_tables(uint64_t n_ids) {
    if (sync_mutex) {
        msyncs = map_zeroed(n_ids, 1, "sync ids");
        mutexes = map_zeroed(n_ids, sizeof *mutexes, "sync mutexes");
        conds = map_zeroed(n_ids, sizeof *conds, "sync condvars");
    } else {
        syncs = map_zeroed(n_ids, sizeof *syncs, "sync ids");
    }
}

struct dry {
    size_t pos;
    int32_t next_waiter;
    unsigned char parked;
};

/* is sync id ID the operand of a SYNC_W anywhere in the streams?  (one linear pass) */
static int written_anywhere(uint64_t id) {
    uint64_t *seen = bitmap_new();
    int found = 0;
    for (uint64_t t = 0; t < n_threads && !found; t++) {
        size_t p = thread_off[t];
        while (!bit_get(seen, p)) {
            int o;
            uint64_t b[3];
            bit_set(seen, p);
            read_op(&p, &o, b);
            if (o == WL_OP_DONE) break;
            if (o == WL_OP_SYNC_W && b[0] == id) {
                found = 1;
                break;
            }
        }
    }
    bitmap_free(seen);
    return found;
}

/* Validate header and streams; dry-run the sync order to find deadlocks. */
static void validate(int check_only) {
    size_t pos = 0;
    int op;
    uint64_t a[3];
    int have_ptrs = 0, have_nthreads = 0;
    uint64_t started = 0, cap = 16;
    thread_off = malloc(cap * sizeof *thread_off);
    for (;;) {
        size_t start = pos;
        if (pos >= n_data) die(WL_EXIT_INVALID, "%s: truncated: the header has no DONE", wl_name);
        read_op(&pos, &op, a);
        if (op == WL_OP_DONE) break;
        switch (op) {
        case WL_OP_NOP:
            break;
        case WL_OP_ALLOC_PTRS:
            n_ptrs = a[0];
            have_ptrs = 1;
            break;
        case WL_OP_ALLOC_SYNCS:
            n_syncs = a[0];
            break;
        case WL_OP_NTHREADS:
            if (a[0] > WL_MAX_THREADS)
                die(WL_EXIT_INVALID, "%s: byte %zu: %" PRIu64 " threads (at most %d supported)", wl_name,
                    start, a[0], WL_MAX_THREADS);
            n_threads = a[0];
            have_nthreads = 1;
            break;
        case WL_OP_START_THREAD:
            if (started >= WL_MAX_THREADS)
                die(WL_EXIT_INVALID, "%s: byte %zu: more than %d threads", wl_name, start, WL_MAX_THREADS);
            if (started == cap) {
                cap *= 2;
                thread_off = realloc(thread_off, cap * sizeof *thread_off);
                if (!thread_off) die(WL_EXIT_RESOURCE, "out of memory");
            }
            thread_off[started++] = a[0];
            break;
        default:
            die(WL_EXIT_INVALID, "%s: byte %zu: opcode %s is not allowed in the header", wl_name, start,
                opnames[op]);
        }
    }
    size_t header_end = pos;
    if (!have_ptrs) die(WL_EXIT_INVALID, "%s: the header has no ALLOC_PTRS", wl_name);
    if (have_nthreads && n_threads != started)
        die(WL_EXIT_INVALID, "%s: NTHREADS says %" PRIu64 " but the header starts %" PRIu64 " threads",
            wl_name, n_threads, started);
    n_threads = started;
    if (n_ptrs > WL_MAX_TABLE) die(WL_EXIT_INVALID, "%s: ALLOC_PTRS %" PRIu64 " is absurd", wl_name, n_ptrs);
    if (n_syncs > WL_MAX_TABLE)
        die(WL_EXIT_INVALID, "%s: ALLOC_SYNCS %" PRIu64 " is absurd", wl_name, n_syncs);
    for (uint64_t t = 0; t < n_threads; t++)
        if (thread_off[t] < header_end || thread_off[t] >= n_data)
            die(WL_EXIT_INVALID,
                "%s: thread %" PRIu64 " stream offset %" PRIu64 " is outside the file body (%zu..%zu)",
                wl_name, t, thread_off[t], header_end, n_data ? n_data - 1 : 0);

    /* pass 1: decode and check every op once (a stream reaching an op already decoded from
     another start shares the rest: decoding is deterministic) */
    uint64_t *seen = bitmap_new();
    for (uint64_t t = 0; t < n_threads; t++) {
        size_t p = thread_off[t];
        for (;;) {
            size_t start = p;
            if (p >= n_data)
                die(WL_EXIT_INVALID, "%s: truncated: the stream of thread %" PRIu64 " has no DONE", wl_name,
                    t);
            if (bit_get(seen, p)) break;
            bit_set(seen, p);
            read_op(&p, &op, a);
            if (op == WL_OP_DONE) break;
            switch (op) {
            case WL_OP_NOP:
                break;
            case WL_OP_SYNC_W:
            case WL_OP_SYNC_R:
                if (a[0] > n_syncs)
                    die(WL_EXIT_INVALID,
                        "%s: byte %zu: sync id %" PRIu64 " out of range (ALLOC_SYNCS %" PRIu64 ")", wl_name,
                        start, a[0], n_syncs);
                if (a[0] == n_syncs) upstream_sync_sizing = 1;
                if (a[0] > max_sync_id) max_sync_id = a[0];
                any_sync = 1;
                break;
            case WL_OP_MALLOC:
            case WL_OP_CALLOC:
            case WL_OP_FREE:
            case WL_OP_VALLOC:
            case WL_OP_PVALLOC:
            case WL_OP_MEMALIGN:
            case WL_OP_REALLOC:
                if (a[0] >= n_ptrs)
                    die(WL_EXIT_INVALID,
                        "%s: byte %zu: pointer index %" PRIu64 " out of range (ALLOC_PTRS %" PRIu64 ")",
                        wl_name, start, a[0], n_ptrs);
                if (op == WL_OP_REALLOC && a[1] >= n_ptrs)
                    die(WL_EXIT_INVALID,
                        "%s: byte %zu: pointer index %" PRIu64 " out of range (ALLOC_PTRS %" PRIu64 ")",
                        wl_name, start, a[1], n_ptrs);
                if (op == WL_OP_MEMALIGN && a[0] && a[1] > WL_MAX_ALIGN)
                    die(WL_EXIT_INVALID, "%s: byte %zu: alignment %" PRIu64 " is absurd (more than 2**40)",
                        wl_name, start, a[1]);
                {
                    uint64_t sz =
                        op == WL_OP_MALLOC || op == WL_OP_CALLOC || op == WL_OP_VALLOC || op == WL_OP_PVALLOC
                            ? a[1]
                            : a[2];
                    if (op == WL_OP_FREE) sz = 0;
                    if (a[0] != 0 && phys_bytes && sz > phys_bytes)
                        die(WL_EXIT_INVALID,
                            "%s: byte %zu: %s of %" PRIu64 " bytes exceeds this machine's memory", wl_name,
                            start, opnames[op], sz);
                }
                break;
            default:
                die(WL_EXIT_INVALID, "%s: byte %zu: opcode %s is not allowed in a thread stream", wl_name,
                    start, opnames[op]);
            }
        }
    }

    /* pass 2: dry-run the sync order.  Sync flags never reset, so the state only grows and the
     outcome holds for every schedule.  A position is executed once: a thread reaching a
     position another thread already reached stops there and shares that thread's fate. */
    memset(seen, 0, ((n_data + 63) / 64) * sizeof(uint64_t));
    uint64_t n_ids = any_sync ? max_sync_id + 1 : 1;
    if (!check_only) alloc_sync_tables(n_ids);
    unsigned char *state = map_zeroed(n_ids, 1, "sync ids");           /* 0 unseen, 1 seen, 2 written */
    int32_t *waiters = map_zeroed(n_ids, sizeof(int32_t), "sync ids"); /* head+1, 0 = none */
    struct dry *d = calloc(n_threads ? n_threads : 1, sizeof *d);
    int32_t *runq = malloc((n_threads ? n_threads : 1) * sizeof *runq);
    if (!d || !runq) die(WL_EXIT_RESOURCE, "out of memory");
    uint64_t nrun = 0;
    for (uint64_t t = 0; t < n_threads; t++) {
        d[t].pos = thread_off[t];
        runq[nrun++] = (int32_t)t;
    }
    while (nrun) {
        int32_t t = runq[--nrun];
        size_t p = d[t].pos;
        int resumed = d[t].parked;
        d[t].parked = 0;
        for (;;) {
            size_t start = p;
            if (!resumed) {
                if (bit_get(seen, p)) break; /* merged: resolved below */
                bit_set(seen, p);
            }
            resumed = 0;
            read_op(&p, &op, a);
            if (op == WL_OP_DONE) break;
            if (op != WL_OP_SYNC_W && op != WL_OP_SYNC_R) continue;
            uint64_t id = a[0];
            if (!state[id]) {
                state[id] = 1;
                if (!check_only) init_sync_id(id);
            }
            if (op == WL_OP_SYNC_W) {
                if (state[id] != 2) {
                    state[id] = 2;
                    int32_t w = waiters[id];
                    while (w) {
                        runq[nrun++] = w - 1;
                        w = d[w - 1].next_waiter;
                    }
                    waiters[id] = 0;
                }
            } else if (state[id] != 2) {
                d[t].pos = start; /* park on this SYNC_R */
                d[t].parked = 1;
                d[t].next_waiter = waiters[id];
                waiters[id] = t + 1;
                break;
            }
        }
    }
    /* fates, from the end of the file backwards (an op's successor lies after it): a position
     finishes if it is DONE or its successor finishes; a position still parked does not */
    for (uint64_t t = 0; t < n_threads; t++)
        if (d[t].parked) bit_clr(seen, d[t].pos);
    for (size_t w = (n_data + 63) / 64; w-- > 0;) {
        uint64_t bits = seen[w];
        while (bits) {
            int b = 63 - __builtin_clzll(bits);
            bits &= ~((uint64_t)1 << b);
            size_t p = w * 64 + b, q = p;
            read_op(&q, &op, a);
            if (op != WL_OP_DONE && !bit_get(seen, q)) bit_clr(seen, p);
        }
    }
    uint64_t stuck = 0;
    for (uint64_t t = 0; t < n_threads; t++) stuck += !bit_get(seen, thread_off[t]);
    if (stuck) {
        char msg[700];
        int n = 0, shown = 0;
        for (uint64_t t = 0; t < n_threads && shown < 4; t++) {
            if (bit_get(seen, thread_off[t])) continue;
            size_t p = thread_off[t], start; /* where it waits: the first SYNC_R of an id never written */
            uint64_t id;
            for (;;) {
                start = p;
                read_op(&p, &op, a);
                if (op == WL_OP_SYNC_R && state[a[0]] != 2) {
                    id = a[0];
                    break;
                }
            }
            n += snprintf(msg + n, sizeof msg - n,
                          "%sthread %" PRIu64 " waits at byte %zu for sync id %" PRIu64 " (%s)",
                          shown ? "; " : "", t, start, id,
                          written_anywhere(id) ? "written only by a thread that is itself stuck"
                                               : "never written");
            shown++;
        }
        die(WL_EXIT_DEADLOCK, "%s: deadlock: %s; %" PRIu64 " of %" PRIu64 " threads can never finish",
            wl_name, msg, stuck, n_threads);
    }
    bitmap_free(seen);
    munmap(state, n_ids);
    munmap(waiters, n_ids * sizeof(int32_t));
    free(d);
    free(runq);
}

/* ---------- timing ---------- */
static int use_rdtscp;
static inline uint64_t t_start(void) {
#ifdef HAVE_X86
    if (use_rdtscp) {
        _mm_lfence();
        return __rdtsc();
    }
#endif
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + ts.tv_nsec;
}
static inline uint64_t t_end(void) {
#ifdef HAVE_X86
    if (use_rdtscp) {
        unsigned aux;
        uint64_t t = __rdtscp(&aux);
        _mm_lfence();
        return t;
    }
#endif
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + ts.tv_nsec;
}
static int cpu_has_rdtscp(void) {
#ifdef HAVE_X86
    unsigned a, b, c, d;
    if (__get_cpuid(0x80000001, &a, &b, &c, &d)) return (d >> 27) & 1;
#endif
    return 0;
}

static inline int bucket_of(uint64_t v) {
    if (v < 16) return (int)v;
    int e = 63 - __builtin_clzll(v);
    return (e - 3) * 16 + (int)((v >> (e - 4)) & 15);
}
static uint64_t bucket_value(int b) /* midpoint of the bucket */
{
    if (b < 16) return b;
    int e = b / 16 + 3, m = b % 16;
    uint64_t lo = ((uint64_t)(16 + m)) << (e - 4);
    return lo + (((uint64_t)1 << (e - 4)) >> 1);
}

/* ---------- per thread ---------- */
struct tstats {
    uint64_t count[WL_NCALLS], skipped[WL_NCALLS], total[WL_NCALLS], min[WL_NCALLS], max[WL_NCALLS];
    uint64_t hist[WL_NCALLS][NBUCKETS];
    uint64_t handoffs, waits, sleeps, overwrites;
    int64_t cpu_ns;
};
struct thread {
    pthread_t id;
    const unsigned char *start;
    struct tstats *st;
    _Atomic uint64_t progress __attribute__((aligned(64)));
    _Atomic int state; /* 0 running, 1 waiting for a sync, 2 done */
    char pad[64];
};
static struct thread *threads;
/* separate cache lines: ideal_live bounces between replay threads, ideal_peak is mostly read */
static _Atomic int64_t ideal_live __attribute__((aligned(64)));
static _Atomic int64_t ideal_peak __attribute__((aligned(64)));
static int fill = 1;
static uint64_t trim_every;
static int spin_iters = 32; /* short: on oversubscribed CPUs spinning only delays the writer */

/* The allocator under test may lack some entry points (jemalloc has no pvalloc): glibc's would
   then allocate from glibc's heap and the allocator's free() would crash on the block.  Such
   calls are emulated with the allocator's own functions (pvalloc/valloc -> memalign with the
   page size; memalign -> posix_memalign) and listed in the report. */
typedef void *(*memalign_fn)(size_t, size_t);
typedef void *(*valloc_fn)(size_t);
typedef int (*posix_memalign_fn)(void **, size_t, size_t);
static memalign_fn f_memalign;
static valloc_fn f_valloc, f_pvalloc;
static posix_memalign_fn f_posix_memalign;
static char emulated[128];
static size_t page_size = 4096;

static const char *object_of(void *fn) {
    Dl_info info;
    return fn && dladdr(fn, &info) && info.dli_fname ? info.dli_fname : "";
}
static void *same_object(const char *name, const char *malloc_obj) {
    void *fn = dlsym(RTLD_DEFAULT, name);
    if (fn && !strcmp(object_of(fn), malloc_obj)) return fn;
    size_t n = strlen(emulated);
    snprintf(emulated + n, sizeof emulated - n, "%s%s", n ? " " : "", name);
    return NULL;
}
static void *posix_memalign_wrap(size_t align, size_t n) {
    void *p = NULL;
    if (align < sizeof(void *)) align = sizeof(void *);
    return f_posix_memalign(&p, align, n) == 0 ? p : NULL;
}
static void *valloc_emul(size_t n) {
    return f_memalign(page_size, n);
}
static void *pvalloc_emul(size_t n) {
    if (n > SIZE_MAX - page_size) return NULL;
    return f_memalign(page_size, n ? (n + page_size - 1) & ~(page_size - 1) : page_size);
}
static void resolve_allocator(void) {
    const char *mobj = object_of(dlsym(RTLD_DEFAULT, "malloc"));
    f_posix_memalign = same_object("posix_memalign", mobj);
    f_memalign = same_object("memalign", mobj);
    if (!f_memalign) f_memalign = f_posix_memalign ? posix_memalign_wrap : memalign;
    if (!f_posix_memalign) f_posix_memalign = posix_memalign; /* unused beyond the wrapper */
    f_valloc = same_object("valloc", mobj);
    if (!f_valloc) f_valloc = valloc_emul;
    f_pvalloc = same_object("pvalloc", mobj);
    if (!f_pvalloc) f_pvalloc = pvalloc_emul;
}

/* Is someone's uprobe on an allocator function (a running `pymtrace record` or `top`, perf,
   bpftrace)?  Uprobes are per-inode, so every process mapping the library traps: the int3
   shows in our own copy of the code.  Compare the first bytes of each function with the
   library file; bytes that differ and read 0xCC in memory are breakpoints. */
static char uprobed[160];
static void check_uprobes(void) {
    static const char *const fns[] = {"malloc",         "free",   "calloc",  "realloc",     "memalign",
                                      "posix_memalign", "valloc", "pvalloc", "malloc_trim", "aligned_alloc"};
    const char *mobj = object_of(dlsym(RTLD_DEFAULT, "malloc"));
    uprobed[0] = 0;
    for (size_t i = 0; i < sizeof fns / sizeof *fns; i++) {
        void *fn = dlsym(RTLD_DEFAULT, fns[i]);
        Dl_info info;
        if (!fn || !dladdr(fn, &info) || !info.dli_fname || !info.dli_fname[0]) continue;
        if (strcmp(info.dli_fname, mobj)) continue; /* not the allocator under test (emulated) */
        int fd = open(info.dli_fname, O_RDONLY);
        if (fd < 0) continue;
        unsigned char disk[256];
        ssize_t n = pread(fd, disk, sizeof disk, (char *)fn - (char *)info.dli_fbase);
        close(fd);
        if (n <= 0) continue;
        const unsigned char *mem = fn;
        int same = 0, traps = 0;
        for (ssize_t k = 0; k < n; k++) {
            if (mem[k] == disk[k])
                same++;
            else if (mem[k] == 0xcc)
                traps++;
        }
        if (traps && same >= n * 3 / 4) { /* the file offsets match the code: a real breakpoint */
            size_t len = strlen(uprobed);
            snprintf(uprobed + len, sizeof uprobed - len, "%s%s", len ? " " : "", fns[i]);
        }
    }
}

static inline void record(struct tstats *st, int type, uint64_t dt) {
    st->count[type]++;
    st->total[type] += dt;
    if (dt < st->min[type]) st->min[type] = dt;
    if (dt > st->max[type]) st->max[type] = dt;
    st->hist[type][bucket_of(dt)]++;
}

static inline void wmem(void *ptr, uint64_t n, unsigned char v) {
    unsigned char *p = ptr;
    if (!p || !fill) return;
    for (uint64_t i = 0; i < n; i += 8) p[i] = v;
}

static int single_thread; /* one replay thread: plain loads/stores instead of atomics */
static int64_t ideal_live_1, ideal_peak_1;

static int64_t memory_limit; /* what the live blocks may take: MemAvailable, cgroup limits (see main) */
static char memory_limit_from[200] = "physical memory";
static _Atomic int64_t foot_live __attribute__((aligned(64)));
static _Atomic int64_t foot_peak __attribute__((aligned(64)));
static int64_t foot_live_1, foot_peak_1;

/* What a block really costs, for the memory guard (meant never to be less than what glibc,
   jemalloc, tcmalloc or mimalloc and the kernel charge for it): a 16-byte header, rounding to
   16 bytes and a 32-byte minimum, alignment padding; a block that allocators map by itself
   (>= 128 KiB, or aligned to a page or more) takes whole pages, the page its header lies in
   and a page of kernel bookkeeping, and with alignments of 2 MiB / 1 GiB the header and the
   block fall in different page tables / page directories, each a page (measured: 200,000 x
   memalign(2**30, 1) cost 27 KiB each in a cgroup's usage, 12 KiB of it RSS).
   Where transparent huge pages are "always" (Debian's and Ubuntu's kernels; thp_size), a
   mapping that can hold an aligned huge page gets one at the first touch of that range: each
   range the block's bytes touch, and the one its header lies in, may take a whole huge page
   (measured on Debian 12's 6.1: 200,000 x memalign(2**30, 1) in a 64 MiB cgroup met the OOM
   killer at ~30 blocks while the page-based count allowed ~1,900). */
static uint64_t thp_size; /* huge page size when THP is "always", else 0 (find_memory_limit) */
static inline uint64_t footprint(uint64_t size, uint64_t align) {
    if (align < 16) align = 16;
    if (size + align < (128 << 10) && align < page_size) {
        uint64_t f = (size + 16 + 15) & ~(uint64_t)15;
        return (f < 32 ? 32 : f) + (align > 16 ? align : 0);
    }
    uint64_t f = ((size + page_size - 1) & ~(uint64_t)(page_size - 1)) + 2 * page_size;
    if (align >= ((uint64_t)2 << 20)) f += 2 * page_size;
    if (align >= ((uint64_t)1 << 30)) f += 3 * page_size;
    if (thp_size && size + align + page_size >= thp_size) {
        /* huge-page ranges SIZE bytes can touch (1 byte: 1; thp_size bytes: 2), + the header's */
        uint64_t ranges = (size ? (size + thp_size - 2) / thp_size + 1 : 0) + 1;
        uint64_t huge = ranges * thp_size + 7 * page_size; /* + the page-table pages above */
        if (huge > f) f = huge;
    }
    return f;
}

static void too_much(int64_t now) __attribute__((noreturn, cold));
static void too_much(int64_t now) {
    int64_t req = single_thread ? ideal_live_1 : atomic_load(&ideal_live);
    die(WL_EXIT_RESOURCE,
        "%s: the workload keeps %" PRId64 " bytes live (%" PRId64 " requested, plus allocator overhead and "
        "alignment), more than the %" PRId64 " bytes of memory available here (%s)",
        wl_name, now, req, memory_limit, memory_limit_from);
}

/* before an allocation is made and filled: would it take the live footprint past the limit? */
static inline void check_room(uint64_t foot) {
    if (!memory_limit) return;
    int64_t cur = single_thread ? foot_live_1 : atomic_load_explicit(&foot_live, memory_order_relaxed);
    if (cur + (int64_t)foot > memory_limit) too_much(cur + (int64_t)foot);
}

static inline void peak_max(_Atomic int64_t *peak, int64_t now) {
    int64_t old = atomic_load_explicit(peak, memory_order_relaxed);
    while (now > old && !atomic_compare_exchange_weak_explicit(peak, &old, now, memory_order_relaxed,
                                                               memory_order_relaxed)) {
    }
}

/* requested bytes (the ideal RSS) and footprint (the guard) of the live blocks */
static inline void live_add(int64_t req, int64_t foot) {
    if (single_thread) {
        ideal_live_1 += req;
        foot_live_1 += foot;
        if (ideal_live_1 > ideal_peak_1) ideal_peak_1 = ideal_live_1;
        if (foot_live_1 > foot_peak_1) {
            foot_peak_1 = foot_live_1;
            if (memory_limit && foot_live_1 > memory_limit) too_much(foot_live_1);
        }
        return;
    }
    int64_t now = atomic_fetch_add_explicit(&ideal_live, req, memory_order_relaxed) + req;
    int64_t fnow = atomic_fetch_add_explicit(&foot_live, foot, memory_order_relaxed) + foot;
    if (req > 0 || foot > 0) {
        peak_max(&ideal_peak, now);
        peak_max(&foot_peak, fnow);
        if (memory_limit && fnow > memory_limit) too_much(fnow);
    }
}

static inline uintptr_t slot_lock(struct slot *s) {
    for (unsigned spins = 0;; spins++) {
        uintptr_t v = atomic_load_explicit(&s->p, memory_order_relaxed);
        if (v != SLOT_BUSY && atomic_compare_exchange_weak_explicit(
                                  &s->p, &v, SLOT_BUSY, memory_order_acquire, memory_order_relaxed))
            return v;
        if (spins >= 64) sched_yield(); /* the holder may be preempted */
#ifdef HAVE_X86
        else
            _mm_pause();
#endif
    }
}

/* store a fresh block in slot IDX; a block still there (hostile or odd workloads) is freed
   outside the timed region so memory stays bounded */
static inline void put(struct tstats *st, uint64_t idx, void *p, uint64_t size, uint64_t foot) {
    struct slot *s = &slots[idx];
    uintptr_t old = single_thread ? atomic_load_explicit(&s->p, memory_order_relaxed) : slot_lock(s);
    uint64_t osize = s->size, ofoot = s->foot;
    s->size = size;
    s->foot = foot;
    atomic_store_explicit(&s->p, (uintptr_t)p, single_thread ? memory_order_relaxed : memory_order_release);
    if (p) live_add((int64_t)size, (int64_t)foot);
    if (old) {
        st->overwrites++;
        live_add(-(int64_t)osize, -(int64_t)ofoot);
        free((void *)old);
    }
}
static inline void *take(uint64_t idx, uint64_t *size, uint64_t *foot) {
    struct slot *s = &slots[idx];
    uintptr_t p;
    if (single_thread)
        p = atomic_load_explicit(&s->p, memory_order_relaxed);
    else if (!atomic_load_explicit(&s->p, memory_order_relaxed))
        return NULL; /* empty: nothing to claim */
    else
        p = slot_lock(s);
    *size = s->size;
    *foot = s->foot;
    atomic_store_explicit(&s->p, 0, single_thread ? memory_order_relaxed : memory_order_release);
    if (p) live_add(-(int64_t)*size, -(int64_t)*foot);
    return (void *)p;
}

static long futex(_Atomic uint32_t *uaddr, int op, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, (uint32_t *)uaddr, op, val, ts, NULL, 0);
}

static void sync_write(uint64_t id) {
    if (sync_mutex) {
        pthread_mutex_lock(&mutexes[id]);
        msyncs[id] = 1;
        pthread_cond_broadcast(&conds[id]);
        pthread_mutex_unlock(&mutexes[id]);
        return;
    }
    uint32_t old = atomic_exchange_explicit(&syncs[id], 1, memory_order_release);
    if (old == 2) futex(&syncs[id], FUTEX_WAKE_PRIVATE, INT_MAX, NULL);
}

static void sync_read(struct thread *me, struct tstats *st, uint64_t id) {
    st->handoffs++;
    if (sync_mutex) {
        pthread_mutex_lock(&mutexes[id]);
        if (!msyncs[id]) {
            st->waits++;
            atomic_store_explicit(&me->state, 1, memory_order_relaxed);
            while (!msyncs[id]) pthread_cond_wait(&conds[id], &mutexes[id]);
            atomic_store_explicit(&me->state, 0, memory_order_relaxed);
        }
        pthread_mutex_unlock(&mutexes[id]);
        return;
    }
    if (atomic_load_explicit(&syncs[id], memory_order_acquire) == 1) return;
    st->waits++;
    for (int i = 0; i < spin_iters; i++) {
#ifdef HAVE_X86
        _mm_pause();
#endif
        if (atomic_load_explicit(&syncs[id], memory_order_acquire) == 1) return;
    }
    atomic_store_explicit(&me->state, 1, memory_order_relaxed);
    for (;;) {
        uint32_t v = atomic_load_explicit(&syncs[id], memory_order_acquire);
        if (v == 1) break;
        if (v == 0 && !atomic_compare_exchange_strong_explicit(&syncs[id], &v, 2, memory_order_acq_rel,
                                                               memory_order_acquire)) {
            if (v == 1) break;
        }
        st->sleeps++;
        futex(&syncs[id], FUTEX_WAIT_PRIVATE, 2, NULL);
    }
    atomic_store_explicit(&me->state, 0, memory_order_relaxed);
}

static void *thread_main(void *arg) {
    struct thread *me = arg;
    struct tstats *st = me->st;
    const unsigned char *cp = me->start;
    uint64_t since_trim = 0, t0, dt, a, b, sz, osz = 0, ofoot = 0, foot;
    void *p, *q;
    struct timespec c0, c1;
    /* the workload's pages already replayed are dropped from this process (MADV_DONTNEED; they
     stay in the page cache), so its RSS holds at most DROP_CHUNK of the file per thread */
    const unsigned char *dropped = (const unsigned char *)((uintptr_t)cp & ~(uintptr_t)(page_size - 1));
    const unsigned char *drop_at = dropped + DROP_CHUNK;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
    for (;;) {
        if (__builtin_expect(cp >= drop_at, 0)) {
            const unsigned char *upto = (const unsigned char *)((uintptr_t)cp & ~(uintptr_t)(page_size - 1));
            madvise((void *)dropped, upto - dropped, MADV_DONTNEED);
            dropped = upto;
            drop_at = upto + DROP_CHUNK;
        }
        int op = *cp++;
        switch (op) {
        case WL_OP_NOP:
            continue;
        case WL_OP_DONE:
            goto done;
        case WL_OP_MALLOC:
        case WL_OP_CALLOC:
        case WL_OP_VALLOC:
        case WL_OP_PVALLOC: {
            int type = op == WL_OP_MALLOC   ? WL_CALL_malloc
                       : op == WL_OP_CALLOC ? WL_CALL_calloc
                       : op == WL_OP_VALLOC ? WL_CALL_valloc
                                            : WL_CALL_pvalloc;
            a = get_int(&cp);
            sz = get_int(&cp);
            if (!a) {
                st->skipped[type]++;
                break;
            }
            foot = footprint(sz, op == WL_OP_VALLOC || op == WL_OP_PVALLOC ? page_size : 0);
            check_room(foot);
            t0 = t_start();
            switch (op) {
            case WL_OP_MALLOC:
                p = malloc(sz);
                break;
            case WL_OP_CALLOC:
                p = calloc(sz, 1);
                break;
            case WL_OP_VALLOC:
                p = f_valloc(sz);
                break;
            default:
                p = f_pvalloc(sz);
                break;
            }
            dt = t_end() - t0;
            record(st, type, dt);
            wmem(p, sz, 0x11);
            put(st, a, p, sz, foot);
            break;
        }
        case WL_OP_MEMALIGN:
            a = get_int(&cp);
            b = get_int(&cp);
            sz = get_int(&cp);
            if (!a) {
                st->skipped[WL_CALL_memalign]++;
                break;
            }
            /* like glibc's memalign: at least a word, rounded up to a power of two (validated <= 2**40) */
            if (b < sizeof(void *)) b = sizeof(void *);
            if (b & (b - 1)) b = (uint64_t)1 << (64 - __builtin_clzll(b));
            foot = footprint(sz, b);
            check_room(foot);
            t0 = t_start();
            p = f_memalign(b, sz);
            dt = t_end() - t0;
            record(st, WL_CALL_memalign, dt);
            wmem(p, sz, 0x11);
            put(st, a, p, sz, foot);
            break;
        case WL_OP_REALLOC:
            a = get_int(&cp);
            b = get_int(&cp);
            sz = get_int(&cp);
            if (!a && sz) {
                st->skipped[WL_CALL_realloc]++;
                break;
            } /* failed in the trace: the block stays */
            q = b ? take(b, &osz, &ofoot) : NULL;
            if (q) wmem(q, osz, 0x22);
            if (!a) { /* realloc(p, 0) freed p: replayed as free() so every allocator frees */
                t0 = t_start();
                free(q);
                dt = t_end() - t0;
                record(st, WL_CALL_realloc, dt);
                break;
            }
            foot = footprint(sz, 0);
            check_room(foot);
            t0 = t_start();
            p = realloc(q, sz);
            dt = t_end() - t0;
            record(st, WL_CALL_realloc, dt);
            if (!p && q && sz) {
                put(st, b, q, osz, ofoot);
                break;
            } /* failed now: keep the old block */
            wmem(p, sz, 0x11);
            put(st, a, p, sz, foot);
            break;
        case WL_OP_FREE:
            a = get_int(&cp);
            p = a ? take(a, &osz, &ofoot) : NULL;
            if (p) wmem(p, osz, 0x22);
            t0 = t_start();
            free(p);
            dt = t_end() - t0;
            record(st, WL_CALL_free, dt);
            break;
        case WL_OP_SYNC_W:
            sync_write(get_int(&cp));
            break;
        case WL_OP_SYNC_R:
            sync_read(me, st, get_int(&cp));
            break;
        }
        atomic_store_explicit(&me->progress, atomic_load_explicit(&me->progress, memory_order_relaxed) + 1,
                              memory_order_relaxed);
        if (trim_every && op != WL_OP_SYNC_W && op != WL_OP_SYNC_R && ++since_trim >= trim_every) {
            since_trim = 0;
            t0 = t_start();
            malloc_trim(0);
            record(st, WL_CALL_malloc_trim, t_end() - t0);
        }
    }
done:
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
    st->cpu_ns = (int64_t)(c1.tv_sec - c0.tv_sec) * 1000000000 + (c1.tv_nsec - c0.tv_nsec);
    atomic_store(&me->state, 2);
    return NULL;
}

/* ---------- RSS sampler / watchdog ---------- */
struct sample {
    uint64_t t_us;
    uint64_t rss_kb;
    uint64_t anon_kb;
};
static struct sample *samples;
static size_t n_samples, cap_samples = 1 << 20;
static long sample_ms = 5;
static int statm_fd = -1;
static long page_kb;
static _Atomic int sampler_stop;
static struct timespec t_begin;
static double stall_timeout = 0;

static int read_statm(uint64_t *rss_kb, uint64_t *anon_kb) {
    char buf[256];
    ssize_t n = pread(statm_fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    unsigned long size, res, shared;
    if (sscanf(buf, "%lu %lu %lu", &size, &res, &shared) != 3) return -1;
    *rss_kb = res * page_kb;
    *anon_kb = (res - shared) * page_kb;
    return 0;
}

/* VmHWM: the peak RSS of this process image.  getrusage's ru_maxrss is not usable alone: Linux
   carries it over exec(), so it starts at the peak of the (Python) parent that forked us. */
static int status_fd = -1;
static long read_hwm_kb(void) {
    char buf[4096];
    if (status_fd < 0) return -1;
    ssize_t n = pread(status_fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strstr(buf, "VmHWM:");
    return p ? atol(p + 6) : -1;
}

static uint64_t since_begin_us(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)(now.tv_sec - t_begin.tv_sec) * 1000000 + (now.tv_nsec - t_begin.tv_nsec) / 1000;
}

static void take_sample(void) {
    uint64_t r, an;
    if (statm_fd < 0 || read_statm(&r, &an) < 0) return;
    if (n_samples == cap_samples) { /* halve the resolution */
        for (size_t i = 0; i < cap_samples / 2; i++) samples[i] = samples[2 * i];
        n_samples = cap_samples / 2;
        sample_ms *= 2;
    }
    samples[n_samples++] = (struct sample){since_begin_us(), r, an};
}

static void *sampler_main(void *arg) {
    (void)arg;
    uint64_t *last = calloc(n_threads ? n_threads : 1, sizeof *last);
    double stalled = 0;
    while (!atomic_load(&sampler_stop)) {
        struct timespec ts = {sample_ms / 1000, (sample_ms % 1000) * 1000000};
        nanosleep(&ts, NULL);
        take_sample();
        if (stall_timeout > 0 && last) {
            int moved = 0, alive = 0;
            for (uint64_t t = 0; t < n_threads; t++) {
                uint64_t p = atomic_load_explicit(&threads[t].progress, memory_order_relaxed);
                if (atomic_load(&threads[t].state) != 2) alive++;
                if (p != last[t]) moved = 1;
                last[t] = p;
            }
            stalled = (moved || !alive) ? 0 : stalled + sample_ms / 1000.0;
            if (stalled >= stall_timeout)
                die(WL_EXIT_DEADLOCK,
                    "%s: replay stalled: no thread made progress for %.1f s (%d threads alive)", wl_name,
                    stalled, alive);
        }
    }
    free(last);
    return NULL;
}

/* ---------- report ---------- */
static char *comma(int64_t x, char *buf) {
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, "%" PRId64, x), j = 0, neg = tmp[0] == '-';
    for (int i = 0; i < n; i++) {
        buf[j++] = tmp[i];
        int left = n - 1 - i;
        if (left && left % 3 == 0 && !(neg && i == 0)) buf[j++] = ',';
    }
    buf[j] = 0;
    return buf;
}

/* nearest-rank percentile from the histogram (bucket midpoint, clamped to [min, max]):
   within 1/32 of the true value for values >= 16 */
static uint64_t percentile_raw(const uint64_t *hist, uint64_t count, double q) {
    if (!count) return 0;
    uint64_t rank = (uint64_t)(q * (count - 1)) + 1, seen = 0;
    for (int b = 0; b < NBUCKETS; b++) {
        seen += hist[b];
        if (seen >= rank) return bucket_value(b);
    }
    return 0;
}
static uint64_t clamp_min, clamp_max;
static uint64_t percentile(const uint64_t *hist, uint64_t count, double q) {
    uint64_t v = percentile_raw(hist, count, q);
    if (v < clamp_min) v = clamp_min;
    if (v > clamp_max) v = clamp_max;
    return v;
}

static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            fprintf(f, "\\%c", *s);
        else if ((unsigned char)*s < 0x20)
            fprintf(f, "\\u%04x", *s);
        else
            fputc(*s, f);
    }
    fputc('"', f);
}

struct mallopt_setting {
    char name[64];
    int param;
    long value;
    int result;
};
static struct mallopt_setting mallopts[32];
static int n_mallopts;

/* the names --mallopt knows, from wl.h; each number is <malloc.h>'s */
#define WL_MALLOPT_ENTRY(name) {"M_" #name, WL_MALLOPT_##name},
#define WL_MALLOPT_SAME(name)                                                                                \
    _Static_assert(WL_MALLOPT_##name == M_##name, "wl.h disagrees with <malloc.h>: M_" #name);
WL_MALLOPTS(WL_MALLOPT_SAME)
static const struct {
    const char *name;
    int param;
} mallopt_names[WL_NMALLOPTS] = {WL_MALLOPTS(WL_MALLOPT_ENTRY)};

/* VmHWM back to the current RSS (Linux >= 4.0), so that it measures the replay only, not the
   validation pass that read the whole file; 0 if the kernel refuses */
static int reset_hwm(void) {
    int fd = open("/proc/self/clear_refs", O_WRONLY);
    if (fd < 0) return 0;
    int ok = write(fd, "5", 1) == 1;
    close(fd);
    return ok;
}

static int64_t read_number_file(const char *dir, const char *name) /* -1: absent or "max" */
{
    char path[4200], buf[64];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *end;
    long long v = strtoll(buf, &end, 10);
    return end == buf || v < 0 ? -1 : (int64_t)v;
}

static int64_t stat_field(const char *dir, const char *field) /* a "name value" line of memory.stat */
{
    char path[4200], line[256];
    size_t len = strlen(field);
    snprintf(path, sizeof path, "%s/memory.stat", dir);
    FILE *f = fopen(path, "r");
    int64_t v = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, len) && line[len] == ' ') {
            v = atoll(line + len + 1);
            break;
        }
    if (f) fclose(f);
    return v;
}

/* LIMIT minus what the cgroup at DIR uses (its page cache is reclaimable: not counted), less
   1/16 of LIMIT of headroom for what the guard does not count (the simulator's own tables
   and stacks, the kernel's charges beyond footprint()) */
static void cgroup_room(const char *dir, const char *rel, const char *limit_name, const char *usage_name,
                        const char *cache_field) {
    int64_t limit = read_number_file(dir, limit_name);
    if (limit < 0 || limit >= ((int64_t)1 << 62)) return; /* "max", or v1's "unlimited" */
    int64_t used = read_number_file(dir, usage_name), cache = stat_field(dir, cache_field);
    if (used < 0) used = 0;
    used = used > cache ? used - cache : 0;
    int64_t room = limit - limit / 16 > used ? limit - limit / 16 - used : 1; /* 0 would mean no limit */
    if (room < memory_limit) {
        memory_limit = room;
        snprintf(memory_limit_from, sizeof memory_limit_from, "%s %" PRId64 " of cgroup %s", limit_name,
                 limit, rel);
    }
}

/* The live blocks may take what is available now (MemAvailable) and what the cgroups this
   process is in still allow (cgroup v2 memory.max and memory.high, v1 memory.limit_in_bytes,
   in every ancestor): beyond either only the OOM killer (or throttling) waits. */
static void find_memory_limit(void) {
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    char line[4400];
    if (f && fgets(line, sizeof line, f) && strstr(line, "[always]")) {
        FILE *h = fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r");
        unsigned long long n = 0;
        thp_size =
            h && fscanf(h, "%llu", &n) == 1 && n >= page_size && !(n & (n - 1)) ? n : (uint64_t)2 << 20;
        if (h) fclose(h);
    }
    if (f) fclose(f);
    f = fopen("/proc/meminfo", "r");
    while (f && fgets(line, sizeof line, f)) {
        long long kb;
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1 && kb > 0) {
            memory_limit = (int64_t)kb * 1024;
            snprintf(memory_limit_from, sizeof memory_limit_from, "MemAvailable");
            break;
        }
    }
    if (f) fclose(f);
    /* where the hierarchies are mounted */
    char v2root[4096] = "", v1root[4096] = "";
    f = fopen("/proc/self/mountinfo", "r");
    while (f && fgets(line, sizeof line, f)) {
        char mnt[4096], fstype[64], opts[1024];
        const char *sep = strstr(line, " - ");
        if (!sep || sscanf(line, "%*s %*s %*s %*s %4095s", mnt) != 1 ||
            sscanf(sep + 3, "%63s %*s %1023s", fstype, opts) != 2)
            continue;
        if (!strcmp(fstype, "cgroup2") && !v2root[0]) snprintf(v2root, sizeof v2root, "%s", mnt);
        if (!strcmp(fstype, "cgroup") && !v1root[0]) {
            for (char *o = strtok(opts, ","); o; o = strtok(NULL, ","))
                if (!strcmp(o, "memory")) snprintf(v1root, sizeof v1root, "%s", mnt);
        }
    }
    if (f) fclose(f);
    f = fopen("/proc/self/cgroup", "r");
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        int v2 = !strncmp(line, "0::", 3);
        *c2 = 0;
        int v1 = !v2 && (!strcmp(c1 + 1, "memory") || strstr(c1 + 1, "memory,") || strstr(c1 + 1, ",memory"));
        const char *root = v2 ? v2root : v1 ? v1root : NULL, *rel = c2 + 1;
        if (!root || !root[0]) continue;
        char dir[4200];
        snprintf(dir, sizeof dir, "%s%s", root, strcmp(rel, "/") ? rel : "");
        size_t rootlen = strlen(root);
        for (;;) { /* the cgroup and each ancestor up to the mount's root */
            const char *r = dir[rootlen] ? dir + rootlen : "/";
            if (v2) {
                cgroup_room(dir, r, "memory.max", "memory.current", "file");
                cgroup_room(dir, r, "memory.high", "memory.current", "file");
            } else {
                cgroup_room(dir, r, "memory.limit_in_bytes", "memory.usage_in_bytes", "cache");
            }
            char *slash = strrchr(dir + rootlen, '/');
            if (!slash) break;
            *slash = 0;
        }
    }
    if (f) fclose(f);
}

int main(int argc, char **argv) {
    const char *json_path = NULL;
    int text = 0, check_only = 0;
    const char *timer = "auto";
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
#define NEED()                                                                                               \
    do {                                                                                                     \
        if (i + 1 >= argc) die(WL_EXIT_USAGE, "option %s needs a value", o);                                 \
    } while (0)
        if (!strcmp(o, "--check"))
            check_only = 1;
        else if (!strcmp(o, "--text"))
            text = 1;
        else if (!strcmp(o, "--no-fill"))
            fill = 0;
        else if (!strcmp(o, "--json")) {
            NEED();
            json_path = argv[++i];
        } else if (!strcmp(o, "--sync")) {
            NEED();
            i++;
            if (!strcmp(argv[i], "mutex"))
                sync_mutex = 1;
            else if (strcmp(argv[i], "futex"))
                die(WL_EXIT_USAGE, "--sync is futex or mutex");
        } else if (!strcmp(o, "--timer")) {
            NEED();
            timer = argv[++i];
        } else if (!strcmp(o, "--sample-ms")) {
            NEED();
            sample_ms = atol(argv[++i]);
            if (sample_ms < 1) sample_ms = 1;
        } else if (!strcmp(o, "--trim")) {
            NEED();
            trim_every = strtoull(argv[++i], NULL, 0);
        } else if (!strcmp(o, "--spin")) {
            NEED();
            spin_iters = atoi(argv[++i]);
        } else if (!strcmp(o, "--stall-timeout")) {
            NEED();
            stall_timeout = atof(argv[++i]);
        } else if (!strcmp(o, "--mallopt")) {
            NEED();
            i++;
            if (n_mallopts == 32) die(WL_EXIT_USAGE, "too many --mallopt settings");
            struct mallopt_setting *m = &mallopts[n_mallopts];
            const char *eq = strchr(argv[i], '=');
            if (!eq || eq == argv[i] || (size_t)(eq - argv[i]) >= sizeof m->name)
                die(WL_EXIT_USAGE, "--mallopt wants NAME=VALUE, got %s", argv[i]);
            memcpy(m->name, argv[i], eq - argv[i]);
            m->name[eq - argv[i]] = 0;
            char *end;
            m->value = strtol(eq + 1, &end, 0);
            if (*end || end == eq + 1) die(WL_EXIT_USAGE, "--mallopt %s: value is not a number", argv[i]);
            int found = 0;
            for (size_t k = 0; k < sizeof mallopt_names / sizeof *mallopt_names; k++)
                if (!strcmp(mallopt_names[k].name, m->name)) {
                    m->param = mallopt_names[k].param;
                    found = 1;
                }
            if (!found) {
                m->param = (int)strtol(m->name, &end, 0);
                if (*end)
                    die(WL_EXIT_USAGE,
                        "--mallopt: unknown parameter %s (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD, "
                        "M_MMAP_MAX, M_ARENA_MAX, M_ARENA_TEST, M_MXFAST, M_PERTURB, or a number)",
                        m->name);
            }
            n_mallopts++;
        } else if (o[0] == '-' && o[1])
            die(WL_EXIT_USAGE, "unknown option %s", o);
        else if (wl_name)
            die(WL_EXIT_USAGE, "more than one workload file given");
        else
            wl_name = o;
    }
    if (!wl_name)
        die(WL_EXIT_USAGE,
            "usage: %s [--check] [--json FILE] [--text] [--sync futex|mutex] [--timer auto|rdtscp|clock] "
            "[--sample-ms N] [--trim N] [--mallopt NAME=VALUE] [--no-fill] [--stall-timeout S] FILE.wl",
            progname);

    if (!strcmp(timer, "auto"))
        use_rdtscp = cpu_has_rdtscp();
    else if (!strcmp(timer, "rdtscp")) {
        use_rdtscp = cpu_has_rdtscp();
        if (!use_rdtscp) die(WL_EXIT_USAGE, "this CPU has no RDTSCP");
    } else if (!strcmp(timer, "clock"))
        use_rdtscp = 0;
    else
        die(WL_EXIT_USAGE, "--timer is auto, rdtscp or clock");

    long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psize > 0) phys_bytes = (uint64_t)pages * (uint64_t)psize;
    memory_limit = (int64_t)phys_bytes;
    page_kb = psize / 1024;
    if (psize > 0) page_size = psize;
    find_memory_limit();
    resolve_allocator();

    int fd = open(wl_name, O_RDONLY);
    if (fd < 0) die(WL_EXIT_INVALID, "cannot open %s: %s", wl_name, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode)) die(WL_EXIT_INVALID, "%s: not a regular file", wl_name);
    n_data = sb.st_size;
    if (n_data == 0) die(WL_EXIT_INVALID, "%s: empty file", wl_name);
    data = mmap(NULL, n_data, PROT_READ, MAP_PRIVATE, fd, 0);
    if (data == MAP_FAILED) die(WL_EXIT_RESOURCE, "cannot map %s: %s", wl_name, strerror(errno));
    close(fd);

    validate(check_only);
    if (check_only) {
        printf("%s: ok: %" PRIu64 " threads, %" PRIu64 " pointer slots, %" PRIu64 " sync ids%s\n", wl_name,
               n_threads, n_ptrs, n_syncs,
               upstream_sync_sizing ? " (upstream trace2wl sync sizing: ids up to ALLOC_SYNCS)" : "");
        return 0;
    }
    /* Unlike upstream, the workload is not pre-faulted: validation read it all, so its pages are
     in the page cache; they are dropped from this process now, and each replay thread maps
     its stream as it goes and drops what it has replayed.  The peak RSS (VmHWM, reset here)
     then measures the allocator, not the workload file. */
    madvise((void *)data, n_data, MADV_DONTNEED);
    int hwm_reset = reset_hwm();

    for (int k = 0; k < n_mallopts; k++)
        mallopts[k].result = mallopt(mallopts[k].param, (int)mallopts[k].value);

    slots = map_zeroed(n_ptrs, sizeof *slots, "pointer slots");
    threads = map_zeroed(n_threads, sizeof *threads, "threads");
    struct tstats *stats = map_zeroed(n_threads, sizeof *stats, "thread statistics");
    samples = map_zeroed(cap_samples, sizeof *samples, "RSS samples");
    for (uint64_t t = 0; t < n_threads; t++) {
        threads[t].start = data + thread_off[t];
        threads[t].st = &stats[t];
        for (int k = 0; k < WL_NCALLS; k++) stats[t].min[k] = UINT64_MAX;
    }
    single_thread = n_threads == 1;
    /* the timer's own cost (an empty timed region), reported, not subtracted (upstream neither) */
    uint64_t timer_overhead = UINT64_MAX;
    for (int i = 0; i < 2000; i++) {
        uint64_t a0 = t_start(), a1 = t_end();
        if (a1 - a0 < timer_overhead) timer_overhead = a1 - a0;
    }
    statm_fd = open("/proc/self/statm", O_RDONLY);
    status_fd = open("/proc/self/status", O_RDONLY);

    struct rusage ru0, ru1;
    getrusage(RUSAGE_SELF, &ru0);
    long hwm0 = read_hwm_kb();
    uint64_t rss0 = 0, anon0 = 0;
    if (statm_fd >= 0) read_statm(&rss0, &anon0);
    clock_gettime(CLOCK_MONOTONIC, &t_begin);
    take_sample();
    uint64_t c0 = t_start();

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    for (uint64_t t = 0; t < n_threads; t++) {
        int err = pthread_create(&threads[t].id, &attr, thread_main, &threads[t]);
        if (err)
            die(WL_EXIT_RESOURCE, "cannot start replay thread %" PRIu64 " of %" PRIu64 ": %s", t, n_threads,
                strerror(err));
    }
    pthread_t sampler;
    int have_sampler = pthread_create(&sampler, NULL, sampler_main, NULL) == 0;
    for (uint64_t t = 0; t < n_threads; t++) pthread_join(threads[t].id, NULL);
    uint64_t c1 = t_end();
    struct timespec t_endts;
    clock_gettime(CLOCK_MONOTONIC, &t_endts);
    atomic_store(&sampler_stop, 1);
    if (have_sampler) pthread_join(sampler, NULL);
    take_sample();
    getrusage(RUSAGE_SELF, &ru1);
    long hwm1 = read_hwm_kb();
    if (hwm0 < 0 || hwm1 < 0) {
        hwm0 = ru0.ru_maxrss;
        hwm1 = ru1.ru_maxrss;
        hwm_reset = 0;
    }

    uint64_t wall_us =
        (uint64_t)(t_endts.tv_sec - t_begin.tv_sec) * 1000000 + (t_endts.tv_nsec - t_begin.tv_nsec) / 1000;
    uint64_t user_us =
        (ru1.ru_utime.tv_sec - ru0.ru_utime.tv_sec) * 1000000 + (ru1.ru_utime.tv_usec - ru0.ru_utime.tv_usec);
    uint64_t sys_us =
        (ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) * 1000000 + (ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec);

    /* merge */
    static struct tstats all;
    for (int k = 0; k < WL_NCALLS; k++) all.min[k] = UINT64_MAX;
    int64_t thread_cpu_ns = 0;
    for (uint64_t t = 0; t < n_threads; t++) {
        struct tstats *s = &stats[t];
        for (int k = 0; k < WL_NCALLS; k++) {
            all.count[k] += s->count[k];
            all.skipped[k] += s->skipped[k];
            all.total[k] += s->total[k];
            if (s->min[k] < all.min[k]) all.min[k] = s->min[k];
            if (s->max[k] > all.max[k]) all.max[k] = s->max[k];
            for (int b = 0; b < NBUCKETS; b++) all.hist[k][b] += s->hist[k][b];
        }
        all.handoffs += s->handoffs;
        all.waits += s->waits;
        all.sleeps += s->sleeps;
        all.overwrites += s->overwrites;
        thread_cpu_ns += s->cpu_ns;
    }
    uint64_t peak_anon = 0, peak_rss = 0;
    for (size_t i = 0; i < n_samples; i++) {
        if (samples[i].anon_kb > peak_anon) peak_anon = samples[i].anon_kb;
        if (samples[i].rss_kb > peak_rss) peak_rss = samples[i].rss_kb;
    }
    const char *unit = use_rdtscp ? "cycles" : "ns";
    if (single_thread) {
        atomic_store(&ideal_peak, ideal_peak_1);
        atomic_store(&ideal_live, ideal_live_1);
    }
    check_uprobes();
    int64_t ideal_peak_b = atomic_load(&ideal_peak);
    int64_t foot_peak_b = single_thread ? foot_peak_1 : atomic_load(&foot_peak);

    if (text || !json_path) {
        char b1[40], b2[40], b3[40];
        printf("%s %s%s\n", comma((int64_t)(c1 - c0), b1), unit,
               use_rdtscp ? "" : " (no RDTSCP: clock_gettime)");
        printf("%s usec wall time\n", comma((int64_t)wall_us, b1));
        printf("%s usec across %" PRIu64 " thread%s\n", comma((int64_t)(user_us + sys_us), b1), n_threads,
               n_threads == 1 ? "" : "s");
        printf("%s Kb Max RSS (%s -> %s)\n", comma(hwm1 - hwm0, b1), comma(hwm0, b2), comma(hwm1, b3));
        printf("%s Kb Max Ideal RSS\n", comma(ideal_peak_b / 1024, b1));
        printf("\nsizeof ticks_t is 8\n");
        uint64_t total = 0;
        for (int k = 0; k < WL_NCALLS; k++) {
            if (!all.count[k] && k > WL_CALL_free) continue;
            char label[40];
            snprintf(label, sizeof label, "Avg %s time:", typenames[k]);
            printf("%-18s %6s in %10s calls\n", label,
                   comma(all.count[k] ? (int64_t)(all.total[k] / all.count[k]) : 0, b1),
                   comma((int64_t)all.count[k], b2));
            total += all.total[k];
        }
        printf("Total call time: %s %s\n\n", comma((int64_t)total, b1), unit);
        printf("timer: %s, %" PRIu64 " %s for an empty timed region (included in the times above)\n",
               use_rdtscp ? "lfence;rdtsc..rdtscp;lfence" : "clock_gettime(CLOCK_MONOTONIC), no RDTSCP",
               timer_overhead, unit);
        printf("%s Kb peak anonymous RSS (%s at start), %s Kb peak RSS sampled every %ld ms\n",
               comma((int64_t)peak_anon, b1), comma((int64_t)anon0, b2), comma((int64_t)peak_rss, b3),
               sample_ms);
        printf("%-12s %10s %10s %8s %8s %8s %8s %10s (%s)\n", "call", "count", "skipped", "mean", "p50",
               "p90", "p99", "max", unit);
        for (int k = 0; k < WL_NCALLS; k++) {
            if (!all.count[k] && !all.skipped[k]) continue;
            clamp_min = all.count[k] ? all.min[k] : 0;
            clamp_max = all.max[k];
            printf("%-12s %10" PRIu64 " %10" PRIu64 " %8" PRIu64 " %8" PRIu64 " %8" PRIu64 " %8" PRIu64
                   " %10" PRIu64 "\n",
                   typenames[k], all.count[k], all.skipped[k], all.count[k] ? all.total[k] / all.count[k] : 0,
                   percentile(all.hist[k], all.count[k], .5), percentile(all.hist[k], all.count[k], .9),
                   percentile(all.hist[k], all.count[k], .99), all.max[k]);
        }
        printf("%" PRIu64 " cross-thread handoffs (%s sync), %" PRIu64 " had to wait, %" PRIu64 " slept\n",
               all.handoffs, sync_mutex ? "mutex+condvar" : "futex", all.waits, all.sleeps);
        if (uprobed[0])
            printf("WARNING: uprobes on %s (a tracer is running): the times include the probe traps\n",
                   uprobed);
        if (emulated[0]) printf("emulated with the allocator's own functions (it has none): %s\n", emulated);
        fflush(stdout);
    }
    if (json_path) {
        FILE *f = strcmp(json_path, "-") ? fopen(json_path, "w") : stdout;
        if (!f) die(WL_EXIT_RESOURCE, "cannot write %s: %s", json_path, strerror(errno));
        fprintf(f, "{\"workload\": ");
        json_str(f, wl_name);
        fprintf(f,
                ", \"timer\": \"%s\", \"unit\": \"%s\", \"sync\": \"%s\", \"threads\": %" PRIu64
                ", \"pointer_slots\": %" PRIu64 ", \"sync_ids\": %" PRIu64
                ", \"upstream_sync_sizing\": %s,\n",
                use_rdtscp ? "rdtscp" : "clock_gettime", unit, sync_mutex ? "mutex" : "futex", n_threads,
                n_ptrs, n_syncs, upstream_sync_sizing ? "true" : "false");
        fprintf(f,
                " \"ticks\": %" PRIu64 ", \"wall_us\": %" PRIu64 ", \"cpu_user_us\": %" PRIu64
                ", \"cpu_sys_us\": %" PRIu64 ", \"thread_cpu_us\": %" PRId64 ",\n",
                c1 - c0, wall_us, user_us, sys_us, thread_cpu_ns / 1000);
        fprintf(f,
                " \"max_rss_kb\": %ld, \"max_rss_start_kb\": %ld, \"ideal_rss_peak_bytes\": %" PRId64
                ", \"ideal_rss_end_bytes\": %" PRId64 ", \"anon_rss_start_kb\": %" PRIu64
                ", \"anon_rss_peak_kb\": %" PRIu64 ", \"rss_start_kb\": %" PRIu64
                ", \"rss_peak_kb\": %" PRIu64 ",\n",
                hwm1, hwm0, ideal_peak_b, (int64_t)atomic_load(&ideal_live), anon0, peak_anon, rss0,
                peak_rss);
        fprintf(f,
                " \"max_rss_reset\": %s, \"footprint_peak_bytes\": %" PRId64
                ", \"memory_limit_bytes\": %" PRId64 ", \"memory_limit_from\": ",
                hwm_reset ? "true" : "false", foot_peak_b, memory_limit);
        json_str(f, memory_limit_from);
        fprintf(f, ",\n");
        fprintf(f, " \"timer_overhead\": %" PRIu64 ", \"uprobed\": ", timer_overhead);
        json_str(f, uprobed);
        fprintf(f, ",");
        fprintf(f, " \"ru_maxrss_kb\": %ld, \"emulated\": ", ru1.ru_maxrss);
        json_str(f, emulated);
        fprintf(f, ",\n");
        fprintf(f,
                " \"handoffs\": %" PRIu64 ", \"sync_waits\": %" PRIu64 ", \"sync_sleeps\": %" PRIu64
                ", \"slot_overwrites\": %" PRIu64 ", \"fill\": %s, \"trim_every\": %" PRIu64 ",\n",
                all.handoffs, all.waits, all.sleeps, all.overwrites, fill ? "true" : "false", trim_every);
        fprintf(f, " \"mallopt\": [");
        for (int k = 0; k < n_mallopts; k++) {
            fprintf(f, "%s{\"name\": ", k ? ", " : "");
            json_str(f, mallopts[k].name);
            fprintf(f, ", \"param\": %d, \"value\": %ld, \"result\": %d}", mallopts[k].param,
                    mallopts[k].value, mallopts[k].result);
        }
        fprintf(f, "],\n \"calls\": {");
        int first = 1;
        for (int k = 0; k < WL_NCALLS; k++) {
            if (!all.count[k] && !all.skipped[k]) continue;
            clamp_min = all.count[k] ? all.min[k] : 0;
            clamp_max = all.max[k];
            fprintf(f,
                    "%s\n  \"%s\": {\"count\": %" PRIu64 ", \"skipped\": %" PRIu64 ", \"total\": %" PRIu64
                    ", \"mean\": %.1f, \"min\": %" PRIu64 ", \"p50\": %" PRIu64 ", \"p90\": %" PRIu64
                    ", \"p99\": %" PRIu64 ", \"p999\": %" PRIu64 ", \"max\": %" PRIu64 "}",
                    first ? "" : ",", typenames[k], all.count[k], all.skipped[k], all.total[k],
                    all.count[k] ? (double)all.total[k] / all.count[k] : 0.0, all.count[k] ? all.min[k] : 0,
                    percentile(all.hist[k], all.count[k], .5), percentile(all.hist[k], all.count[k], .9),
                    percentile(all.hist[k], all.count[k], .99), percentile(all.hist[k], all.count[k], .999),
                    all.max[k]);
            first = 0;
        }
        fprintf(f, "},\n \"sample_ms\": %ld, \"rss_samples\": [", sample_ms);
        for (size_t i = 0; i < n_samples; i++)
            fprintf(f, "%s[%" PRIu64 ", %" PRIu64 ", %" PRIu64 "]", i ? ", " : "", samples[i].t_us,
                    samples[i].rss_kb, samples[i].anon_kb);
        fprintf(f, "],\n \"libraries\": [");
        /* which shared objects are mapped: proves which allocator really served the calls */
        FILE *maps = fopen("/proc/self/maps", "r");
        char line[4096], seen[64][512];
        int nseen = 0;
        while (maps && fgets(line, sizeof line, maps)) {
            char *path = strchr(line, '/');
            if (!path) continue;
            path[strcspn(path, "\n")] = 0;
            if (!strstr(path, ".so")) continue;
            int dup = 0;
            for (int k = 0; k < nseen; k++)
                if (!strcmp(seen[k], path)) dup = 1;
            if (dup || nseen == 64) continue;
            snprintf(seen[nseen], sizeof seen[nseen], "%s", path);
            fprintf(f, "%s", nseen ? ", " : "");
            json_str(f, path);
            nseen++;
        }
        if (maps) fclose(maps);
        fprintf(f, "]}\n");
        if (f != stdout)
            fclose(f);
        else
            fflush(f);
    }
    return 0;
}
