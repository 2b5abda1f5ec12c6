/* Known malloc-API calls of every type in several threads, with their ground truth.
 *
 * Every call made here prints one line on stdout (write(2), no stdio buffer, no malloc):
 *   CALL tid type ptr1 ptr2 size size2 size3     (hex, the dj/malloc record it must produce)
 * chunk sizes are read from glibc's chunk header (p-8 & ~7) before a block is released.
 * Covers realloc(NULL,n), realloc(p,0), free(NULL), failing posix_memalign (EINVAL),
 * failing malloc/realloc, nested calls (memalign with small alignment -> malloc) and
 * cross-thread frees in both directions. Some blocks are leaked on purpose.
 *
 * usage: record_calls [--mtrace]   (--mtrace: call glibc's mtrace()/muntrace() around it;
 *                                   needs LD_PRELOAD=libc_malloc_debug.so.0 and MALLOC_TRACE)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <mcheck.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NTHREADS 3
#define HUGE     ((size_t)1 << 62)

static size_t chunk(void *p) {
    return p ? (*(size_t *)((char *)p - 8)) & ~(size_t)7 : 0;
}

static void truth(int type, uintptr_t p1, uintptr_t p2, size_t size, size_t s2, size_t s3) {
    char buf[200];
    int n = snprintf(buf, sizeof buf, "CALL %x %x %lx %lx %lx %lx %lx\n", (unsigned)gettid(), type,
                     (unsigned long)p1, (unsigned long)p2, (unsigned long)size, (unsigned long)s2,
                     (unsigned long)s3);
    if (write(1, buf, n) != n) _exit(99);
}

#define U(p) ((uintptr_t)(p))

static void *shared[NTHREADS]; /* allocated by main, freed by worker i */
static void *back[NTHREADS];   /* allocated by worker i, freed by main */

static void *worker(void *arg) {
    long i = (long)arg;
    size_t s;
    for (int round = 0; round < 20; round++) {
        void *a = malloc(24 + i * 8 + round);
        truth(1, 0, U(a), 24 + i * 8 + round, 0, chunk(a));
        void *b = calloc(4, 16 + round);
        truth(2, 0, U(b), 4 * (16 + round), 0, chunk(b));
        s = chunk(a);
        void *c = realloc(a, 200 + round * 10);
        truth(4, U(a), U(c), 200 + round * 10, s, chunk(c));
        s = chunk(b);
        free(b);
        truth(3, U(b), 0, 0, s, 0);
        s = chunk(c);
        free(c);
        truth(3, U(c), 0, 0, s, 0);
    }
    void *m = memalign(128, 64);
    truth(5, 0, U(m), 64, 128, chunk(m));
    void *pm = NULL;
    int rc = posix_memalign(&pm, 32, 40);
    truth(8, rc, U(pm), 40, 32, chunk(pm));
    s = chunk(m);
    free(m);
    truth(3, U(m), 0, 0, s, 0);
    s = chunk(pm);
    free(pm);
    truth(3, U(pm), 0, 0, s, 0);
    /* cross-thread: free main's block, hand one back */
    s = chunk(shared[i]);
    free(shared[i]);
    truth(3, U(shared[i]), 0, 0, s, 0);
    back[i] = malloc(1000 + i);
    truth(1, 0, U(back[i]), 1000 + i, 0, chunk(back[i]));
    return NULL;
}

int main(int argc, char **argv) {
    int use_mtrace = argc > 1 && strcmp(argv[1], "--mtrace") == 0;
    size_t s;
    if (use_mtrace) mtrace();

    void *p1 = malloc(100);
    truth(1, 0, U(p1), 100, 0, chunk(p1));
    void *p2 = calloc(10, 30); /* leaked */
    truth(2, 0, U(p2), 300, 0, chunk(p2));
    void *p3 = realloc(NULL, 50);
    truth(4, 0, U(p3), 50, 0, chunk(p3));
    s = chunk(p3);
    void *p4 = realloc(p3, 5000);
    truth(4, U(p3), U(p4), 5000, s, chunk(p4));
    s = chunk(p1);
    void *r0 = realloc(p1, 0); /* frees p1, returns NULL */
    truth(4, U(p1), U(r0), 0, s, chunk(r0));
    free(NULL);
    truth(3, 0, 0, 0, 0, 0);
    void *m1 = memalign(64, 200);
    truth(5, 0, U(m1), 200, 64, chunk(m1));
    void *m2 = aligned_alloc(256, 512); /* leaked */
    truth(5, 0, U(m2), 512, 256, chunk(m2));
    void *q = NULL;
    int rc = posix_memalign(&q, 128, 300);
    truth(8, rc, U(q), 300, 128, chunk(q));
    void *bad = NULL;
    rc = posix_memalign(&bad, 3, 100); /* EINVAL */
    truth(8, rc, U(bad), 100, 3, 0);
    void *v = valloc(1000);
    truth(6, 0, U(v), 1000, 4096, chunk(v));
    void *pv = pvalloc(5000); /* leaked */
    truth(7, 0, U(pv), 5000, 0, chunk(pv));
    void *huge = malloc(HUGE); /* fails */
    truth(1, 0, U(huge), HUGE, 0, 0);
    s = chunk(p4);
    void *rf = realloc(p4, HUGE); /* fails, p4 stays */
    truth(4, U(p4), U(rf), HUGE, s, 0);
    void *small = memalign(8, 40); /* nested malloc inside: one record */
    truth(5, 0, U(small), 40, 8, chunk(small));
    void *leak = malloc(77); /* leaked */
    truth(1, 0, U(leak), 77, 0, chunk(leak));

    for (int i = 0; i < NTHREADS; i++) {
        shared[i] = malloc(300 + i);
        truth(1, 0, U(shared[i]), 300 + i, 0, chunk(shared[i]));
    }
    pthread_t th[NTHREADS];
    for (long i = 0; i < NTHREADS; i++) pthread_create(&th[i], NULL, worker, (void *)i);
    for (int i = 0; i < NTHREADS; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < NTHREADS; i++) {
        s = chunk(back[i]);
        free(back[i]);
        truth(3, U(back[i]), 0, 0, s, 0);
    }
    s = chunk(p4);
    free(p4);
    truth(3, U(p4), 0, 0, s, 0);
    s = chunk(m1);
    free(m1);
    truth(3, U(m1), 0, 0, s, 0);
    s = chunk(q);
    free(q);
    truth(3, U(q), 0, 0, s, 0);
    s = chunk(v);
    free(v);
    truth(3, U(v), 0, 0, s, 0);
    s = chunk(small);
    free(small);
    truth(3, U(small), 0, 0, s, 0);
    if (use_mtrace) muntrace();
    return 0;
}
