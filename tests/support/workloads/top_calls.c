/* Workload for tests/live/test_top_malloc.py: exactly known malloc-API calls in 4 threads.
 *
 * Protocol: prints "ready PID\n", waits for a byte on stdin (the tracer is attached), then
 * the threads make their calls, then it prints ONE line of JSON with what it did (call
 * counts per type, requested bytes, chunk bytes allocated/freed computed from
 * malloc_usable_size + 8 (+ 16 for mmapped chunks, cross-checked with the chunk header),
 * size_log2 histogram) and waits for another byte before exiting. Threads stay alive until
 * then (a thread's exit frees its tcache through free(), which would add calls).
 * Nothing between the two waits calls a malloc-API function except the counted calls:
 * output goes through snprintf into a stack buffer and write(2).
 *
 * Built with -DANY_ALLOCATOR (tests/live/test_top_allocators.py) it runs on any malloc
 * (LD_PRELOADed jemalloc, tcmalloc, mimalloc; top_calls_own.c's own): no chunk header is
 * read; allocated/freed are the REQUESTED sizes of the blocks (kept per block in a small
 * per-thread table, as top keeps them in BPF), pvalloc is left out (jemalloc has none: the call would
 * reach glibc's), and a realloc(p, 0) that returns a block (mimalloc) has it freed. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "protocol.h"

#define NTHREADS 4

enum { MALLOC, CALLOC, REALLOC, FREE, FREE_NULL, MEMALIGN, POSIX_MEMALIGN, VALLOC, PVALLOC, NTYPES };
static const char *names[NTYPES] = {"malloc",   "calloc",         "realloc", "free",   "free_null",
                                    "memalign", "posix_memalign", "valloc",  "pvalloc"};

struct tally {
    unsigned long calls[NTYPES];
    unsigned long requested, allocated, freed, failed;
    unsigned long log2[65];
};

static struct tally tallies[NTHREADS];
/* NULL the compiler cannot see through. gcc without -fno-builtin (any build but the tests')
 * rewrites realloc(NULL, n) as malloc(n) and drops free(NULL) as a no-op; read from a
 * volatile, the calls reach libc however this file is built. */
static void *volatile no_block = NULL;
static pthread_barrier_t start_barrier, done_barrier, exit_barrier;

static unsigned bitlen(unsigned long v) {
    unsigned n = 0;
    while (v) {
        n++;
        v >>= 1;
    }
    return n;
}

#ifndef ANY_ALLOCATOR
static unsigned long chunk(void *p) {
    size_t hdr = ((size_t *)p)[-1];
    unsigned long by_header = hdr & ~7UL;
    unsigned long by_usable = malloc_usable_size(p) + ((hdr & 2) ? 16 : 8);
    if (by_header != by_usable) abort();
    return by_usable;
}
#endif

#ifdef ANY_ALLOCATOR
/* block -> requested size, per thread (each thread frees only its own blocks); open
 * addressing, TOMB marks a removed slot */
#define NSLOTS 4096
#define TOMB   ((void *)1)
static __thread struct {
    void *p;
    unsigned long n;
} sizes[NSLOTS];

static void size_put(void *p, unsigned long n) {
    unsigned h = ((uintptr_t)p >> 4) % NSLOTS;
    while (sizes[h].p && sizes[h].p != TOMB) h = (h + 1) % NSLOTS;
    sizes[h].p = p;
    sizes[h].n = n;
}

static unsigned long size_take(void *p) {
    for (unsigned h = ((uintptr_t)p >> 4) % NSLOTS; sizes[h].p; h = (h + 1) % NSLOTS)
        if (sizes[h].p == p) {
            sizes[h].p = TOMB;
            return sizes[h].n;
        }
    abort();
}
#endif

/* The bytes block P (just returned for N requested bytes) counts for: its chunk on glibc,
 * N on any other allocator (what top counts there). */
static unsigned long block_new(void *p, unsigned long n) {
#ifdef ANY_ALLOCATOR
    size_put(p, n);
    return n;
#else
    (void)n;
    return chunk(p);
#endif
}

/* The bytes block P, about to be freed, counted for. */
static unsigned long block_gone(void *p) {
#ifdef ANY_ALLOCATOR
    return size_take(p);
#else
    return chunk(p);
#endif
}

static void req(struct tally *t, int type, unsigned long size) {
    t->calls[type]++;
    t->requested += size;
    t->log2[bitlen(size)]++;
}

static void got(struct tally *t, void *p, unsigned long n) {
    if (p)
        t->allocated += block_new(p, n);
    else
        t->failed++;
}

static void do_free(struct tally *t, void *p) {
    t->calls[FREE]++;
    if (p)
        t->freed += block_gone(p);
    else
        t->calls[FREE_NULL]++;
    free(p);
}

static void *worker(void *arg) {
    long id = (long)arg;
    struct tally *t = &tallies[id];
    void *keep[400];
    int nkeep = 0;
    pthread_barrier_wait(&start_barrier);

    for (int k = 0; k < 100 + 10 * id; k++) { /* malloc */
        size_t n = 1 + 37 * k + id;
        req(t, MALLOC, n);
        void *p = malloc(n);
        got(t, p, n);
        if (k % 3 == 0)
            keep[nkeep++] = p;
        else
            do_free(t, p);
    }
    for (int k = 0; k < 50; k++) { /* calloc */
        size_t a = 3, b = 40 + k;
        req(t, CALLOC, a * b);
        void *p = calloc(a, b);
        got(t, p, a * b);
        if (k % 2)
            keep[nkeep++] = p;
        else
            do_free(t, p);
    }
    for (int k = 0; k < 20; k++) { /* realloc(NULL, n): like malloc */
        size_t n = 100 + k;
        req(t, REALLOC, n);
        void *p = realloc(no_block, n);
        got(t, p, n);
        keep[nkeep++] = p;
    }
    for (int k = 0; k < 30; k++) { /* realloc(p, n) grow/shrink */
        int i = k % nkeep;
        void *old = keep[i];
        size_t n = (k % 2) ? 3000 + 13 * k : 24;
        unsigned long oldc = block_gone(old);
        req(t, REALLOC, n);
        void *p = realloc(old, n);
        if (p) {
            t->freed += oldc;
            t->allocated += block_new(p, n);
            keep[i] = p;
        } else
            t->failed++;
    }
    for (int k = 0; k < 10; k++) { /* realloc(p, 0): frees p */
        void *p = malloc(64 + k);
        req(t, MALLOC, 64 + k);
        got(t, p, 64 + k);
        unsigned long c = block_gone(p);
        req(t, REALLOC, 0);
        void *r = realloc(p, 0);
        t->freed += c;
#ifdef ANY_ALLOCATOR
        if (r) { /* mimalloc: a block of size 0 */
            block_new(r, 0);
            do_free(t, r);
        }
#else
        if (r) abort();
#endif
    }
    for (int k = 0; k < 5; k++) { /* memalign family */
        void *p;
        req(t, MEMALIGN, 100 + k);
        p = memalign(64, 100 + k);
        got(t, p, 100 + k);
        do_free(t, p);
        req(t, MEMALIGN, 200 + k);
        p = memalign(16, 200 + k);
        got(t, p, 200 + k);
        keep[nkeep++] = p; /* -> malloc inside */
        req(t, MEMALIGN, 64 * (k + 1));
        p = aligned_alloc(32, 64 * (k + 1));
        got(t, p, 64 * (k + 1));
        do_free(t, p);
        req(t, POSIX_MEMALIGN, 300 + k);
        if (posix_memalign(&p, 128, 300 + k) == 0)
            got(t, p, 300 + k);
        else {
            t->failed++;
            p = NULL;
        }
        do_free(t, p);
        req(t, POSIX_MEMALIGN, 50 + k);
        if (posix_memalign(&p, 8, 50 + k) == 0)
            got(t, p, 50 + k);
        else {
            t->failed++;
            p = NULL;
        } /* -> malloc inside */
        keep[nkeep++] = p;
        if (k < 3) {
            req(t, VALLOC, 5000 + k);
            p = valloc(5000 + k);
            got(t, p, 5000 + k);
            do_free(t, p);
#ifndef ANY_ALLOCATOR
            req(t, PVALLOC, 100 + k);
            p = pvalloc(100 + k);
            got(t, p, 100 + k);
            keep[nkeep++] = p;
#endif
        }
    }
    for (int k = 0; k < 7; k++) /* free(NULL) */
        do_free(t, no_block);
    for (int k = 0; k < 2; k++) { /* mmapped chunks */
        req(t, MALLOC, 300000 + k);
        void *p = malloc(300000 + k);
        got(t, p, 300000 + k);
        if (k)
            do_free(t, p);
        else
            keep[nkeep++] = p;
    }
#ifdef ANY_ALLOCATOR
#define FAILING (1UL << 60) /* jemalloc reserves 16 TiB of address space without complaint */
#else
#define FAILING (1UL << 44) /* 16 TiB */
#endif
    req(t, MALLOC, FAILING); /* fails, NULL */
    got(t, malloc(FAILING), FAILING);
    for (int i = 0; i < nkeep; i += 2) /* free half of what is kept */
        do_free(t, keep[i]);

    pthread_barrier_wait(&done_barrier);
    pthread_barrier_wait(&exit_barrier);
    return NULL;
}

int main(void) {
    pthread_t th[NTHREADS];
    char line[4096];
    pthread_barrier_init(&start_barrier, NULL, NTHREADS + 1);
    pthread_barrier_init(&done_barrier, NULL, NTHREADS + 1);
    pthread_barrier_init(&exit_barrier, NULL, NTHREADS + 1);
    for (long i = 0; i < NTHREADS; i++) pthread_create(&th[i], NULL, worker, (void *)i);
    snprintf(line, sizeof(line), "ready %d\n", (int)getpid());
    say(line);
    wait_stdin();
    pthread_barrier_wait(&start_barrier);
    pthread_barrier_wait(&done_barrier);

    struct tally sum;
    memset(&sum, 0, sizeof(sum));
    for (int i = 0; i < NTHREADS; i++) {
        for (int k = 0; k < NTYPES; k++) sum.calls[k] += tallies[i].calls[k];
        for (int k = 0; k < 65; k++) sum.log2[k] += tallies[i].log2[k];
        sum.requested += tallies[i].requested;
        sum.allocated += tallies[i].allocated;
        sum.freed += tallies[i].freed;
        sum.failed += tallies[i].failed;
    }
    int n = snprintf(line, sizeof(line), "{\"calls\": {");
    for (int k = 0; k < NTYPES; k++)
        n += snprintf(line + n, sizeof(line) - n, "%s\"%s\": %lu", k ? ", " : "", names[k], sum.calls[k]);
    /* a C program: no C++ operator new/delete call (top counts those as their own types) */
    static const char *cxx[] = {"new",    "new_array",    "new_nothrow",  "new_aligned",
                                "delete", "delete_array", "delete_sized", "delete_aligned"};
    for (int k = 0; k < 8; k++) n += snprintf(line + n, sizeof(line) - n, ", \"%s\": 0", cxx[k]);
    n += snprintf(line + n, sizeof(line) - n,
                  "}, \"requested_bytes\": %lu, \"allocated_bytes\": %lu, \"freed_bytes\": %lu, "
                  "\"failed\": %lu, \"size_log2\": [",
                  sum.requested, sum.allocated, sum.freed, sum.failed);
    for (int k = 0; k < 65; k++)
        n += snprintf(line + n, sizeof(line) - n, "%s%lu", k ? ", " : "", sum.log2[k]);
    snprintf(line + n, sizeof(line) - n, "]}\n");
    say(line);
    wait_stdin();
    pthread_barrier_wait(&exit_barrier);
    for (int i = 0; i < NTHREADS; i++) pthread_join(th[i], NULL);
    return 0;
}
