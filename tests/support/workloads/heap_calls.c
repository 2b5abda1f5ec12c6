/* Known malloc-API calls for the heap source's tests (tests/live/test_heap_source.py),
 * built -O2 -fomit-frame-pointer: stacks without frame pointers.
 *
 * usage: heap_calls calls [fork]   the calls below; `fork`: then fork + exec `heap_calls child`
 *        heap_calls child          one malloc(CHILD_SIZE) from main, then exit
 *        heap_calls sample N SIZE  N malloc(SIZE)+free pairs, then BIG_N blocks of BIG_SIZE
 *
 * Prints `ready PID BASE` (BASE: the load address of this executable), then waits for a line
 * on stdin before making its calls (the tracer attaches meanwhile); prints `leak ADDR` per
 * block it leaks on purpose and `done` at the end. Output is write(2): no stdio buffer is
 * allocated after `ready`. Every call of the `calls` mode is made from a function of its own
 * (noinline, noclone, never a tail call), named by the call, so a test can find it by the
 * return address at the stack pointer:
 *   main -> calls -> chain_a -> chain_b -> chain_leaf: malloc(1000 + i % 8), i < CHAIN_N, all freed
 *   leak_leaf: malloc(5000 + i), i < LEAK_K, leaked
 *   calloc_leaf: calloc(3, 700 + i), i < 5, freed        (size 2100 + 3i)
 *   realloc_leaf: malloc(3000 + i) then realloc to 4000 + i, i < 4, freed; i == 4 leaked
 *   realloc_leaf(NULL): realloc(NULL, 900): a realloc, not a malloc
 *   posix_memalign_leaf: posix_memalign(&p, 64, 6000 + i), i < 3; i == 0 leaked
 *   posix_memalign_leaf: posix_memalign(&p, 16, 6500), leaked (glibc calls malloc inside)
 *   aligned_alloc_leaf: aligned_alloc(128, 7040 + 128 i), i < 3, freed
 *   memalign_leaf: memalign(32, 800), twice, freed (glibc calls malloc inside)
 *   zero_leaf: malloc(0), twice, freed
 *   thread_leaf (second thread): malloc(2500 + i), i < 50, freed; malloc(2600 + i), i < 2, leaked
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHAIN_N    100
#define LEAK_K     7
#define CHILD_SIZE 12345
#define BIG_N      3
#define BIG_SIZE   600000

#define LEAF __attribute__((noinline, noclone))

extern char __executable_start;
static void *volatile sink;
static volatile int after; /* written after each call: no call is a tail call */

static void say(const char *fmt, unsigned long a, unsigned long b) {
    char buf[128];
    int n = snprintf(buf, sizeof buf, fmt, a, b);
    if (write(1, buf, n) != n) _exit(99);
}

static void wait_go(void) {
    char c;
    while (read(0, &c, 1) == 1 && c != '\n') {
    }
}

LEAF void *chain_leaf(size_t n) {
    void *p = malloc(n);
    after++;
    return p;
}

LEAF void *chain_b(size_t n) {
    void *p = chain_leaf(n);
    after++;
    return p;
}

LEAF void *chain_a(size_t n) {
    void *p = chain_b(n);
    after++;
    return p;
}

LEAF void *leak_leaf(size_t n) {
    void *p = malloc(n);
    after++;
    return p;
}

LEAF void *calloc_leaf(size_t n, size_t m) {
    void *p = calloc(n, m);
    after++;
    return p;
}

LEAF void *realloc_leaf(void *old, size_t n) {
    void *p = realloc(old, n);
    after++;
    return p;
}

LEAF void *posix_memalign_leaf(size_t align, size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, align, n) != 0) p = NULL;
    after++;
    return p;
}

LEAF void *aligned_alloc_leaf(size_t align, size_t n) {
    void *p = aligned_alloc(align, n);
    after++;
    return p;
}

LEAF void *memalign_leaf(size_t align, size_t n) {
    void *p = memalign(align, n);
    after++;
    return p;
}

LEAF void *zero_leaf(void) {
    void *p = malloc(0);
    after++;
    return p;
}

LEAF void *thread_leaf(size_t n) {
    void *p = malloc(n);
    after++;
    return p;
}

static void *thread_main(void *arg) {
    (void)arg;
    for (int i = 0; i < 50; i++) free(thread_leaf(2500 + i));
    for (int i = 0; i < 2; i++) say("leak %lx\n", (unsigned long)thread_leaf(2600 + i), 0);
    return NULL;
}

static int calls(int fork_child, const char *self) {
    void *keep[CHAIN_N];
    for (int i = 0; i < CHAIN_N; i++) keep[i] = chain_a(1000 + i % 8);
    for (int i = 0; i < CHAIN_N; i++) free(keep[i]);
    for (int i = 0; i < LEAK_K; i++) say("leak %lx\n", (unsigned long)leak_leaf(5000 + i), 0);
    for (int i = 0; i < 5; i++) free(calloc_leaf(3, 700 + i));
    for (int i = 0; i < 5; i++) {
        void *p = realloc_leaf(chain_leaf(3000 + i), 4000 + i);
        if (i < 4)
            free(p);
        else
            say("leak %lx\n", (unsigned long)p, 0);
    }
    free(realloc_leaf(NULL, 900));
    for (int i = 0; i < 3; i++) {
        void *p = posix_memalign_leaf(64, 6000 + i);
        if (i)
            free(p);
        else
            say("leak %lx\n", (unsigned long)p, 0);
    }
    say("leak %lx\n", (unsigned long)posix_memalign_leaf(16, 6500), 0);
    for (int i = 0; i < 3; i++) free(aligned_alloc_leaf(128, 7040 + 128 * i));
    for (int i = 0; i < 2; i++) free(memalign_leaf(32, 800));
    for (int i = 0; i < 2; i++) free(zero_leaf());
    pthread_t t;
    if (pthread_create(&t, NULL, thread_main, NULL) != 0 || pthread_join(t, NULL) != 0) return 1;
    if (fork_child) {
        pid_t child = fork();
        if (child == 0) {
            execl(self, self, "child", (char *)NULL);
            _exit(127);
        }
        int status;
        if (child < 0 || waitpid(child, &status, 0) != child || status != 0) return 1;
        say("child %lu\n", (unsigned long)child, 0);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "child") == 0) {
        sink = malloc(CHILD_SIZE);
        free(sink);
        return 0;
    }
    say("ready %lu %lx\n", (unsigned long)getpid(), (unsigned long)&__executable_start);
    wait_go();
    int rc = 1;
    if (argc >= 2 && strcmp(argv[1], "calls") == 0) {
        rc = calls(argc >= 3 && strcmp(argv[2], "fork") == 0, argv[0]);
    } else if (argc >= 4 && strcmp(argv[1], "sample") == 0) {
        long n = atol(argv[2]), size = atol(argv[3]);
        for (long i = 0; i < n; i++) {
            sink = malloc(size);
            free(sink);
        }
        for (int i = 0; i < BIG_N; i++) {
            sink = malloc(BIG_SIZE);
            free(sink);
        }
        rc = 0;
    }
    say("done %lu\n", (unsigned long)rc, 0);
    return rc;
}
