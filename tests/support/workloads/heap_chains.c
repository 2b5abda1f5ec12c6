/* Known allocation call chains for `pymtrace heap`'s end-to-end tests (tests/live/test_heap.py),
 * built -O2 -fomit-frame-pointer (no frame pointers anywhere, the library included).
 *
 * usage: heap_chains [-w] GAP_MS [STORM_N STORM_SIZE]
 *        heap_chains -l ROUND_MS ROUNDS
 *   the calls below, GAP_MS between the old and the young leaks; -w: print "ready", wait for a
 *   line on stdin before the calls and for EOF on stdin after them (for -p attaches);
 *   STORM_N STORM_SIZE: then main -> storm_leaf: STORM_N malloc(STORM_SIZE), all freed
 *   -l (for `top --stacks`, which reports rates): print "ready", then ROUNDS times the calls
 *   below without the pause (each round leaks its 10 + 3 blocks), ROUND_MS between rounds
 *
 *   main -> alpha -> beta -> leaf_alloc: malloc(100 + i % 8), i < CHAIN_N, all freed
 *   main -> gamma -> lib_outer -> lib_inner (libheapchain.so): malloc(4000), LEAK_OLD leaked
 *   (GAP_MS pause)
 *   main -> delta -> young_leaf: malloc(3000), LEAK_YOUNG leaked
 *   second thread: worker -> thread_leaf: malloc(2500 + i), i < THREAD_N, all freed
 * then prints "done" with write(2) and exits at once (the report is written after its exit).
 * Nothing else allocates after stdio's first use: the output goes through write(2).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define CHAIN_N    200
#define LEAK_OLD   10
#define LEAK_YOUNG 3
#define THREAD_N   50

#define NOINLINE __attribute__((noinline, noclone))

void lib_outer(int n); /* libheapchain.so */

static void *volatile sink;
static volatile int after; /* written after each call: never a tail call */

NOINLINE static void leaf_alloc(int i) {
    void *p = malloc(100 + i % 8);
    after++;
    free(p);
}
NOINLINE static void beta(int i) {
    leaf_alloc(i);
    after++;
}
NOINLINE static void alpha(int i) {
    beta(i);
    after++;
}
NOINLINE static void gamma_(void) {
    lib_outer(LEAK_OLD);
    after++;
}
NOINLINE static void young_leaf(void) {
    sink = malloc(3000);
    after++;
}
NOINLINE static void delta(void) {
    for (int i = 0; i < LEAK_YOUNG; i++) young_leaf();
    after++;
}
NOINLINE static void thread_leaf(int i) {
    void *p = malloc(2500 + i);
    after++;
    free(p);
}
NOINLINE static void *worker(void *arg) {
    (void)arg;
    for (int i = 0; i < THREAD_N; i++) thread_leaf(i);
    after++;
    return NULL;
}

NOINLINE static void storm_leaf(long size) {
    void *p = malloc(size);
    after++;
    free(p);
}

static void wait_stdin(int until_eof) {
    char c;
    while (read(0, &c, 1) == 1)
        if (!until_eof && c == '\n') return;
}

int main(int argc, char **argv) {
    if (argc > 3 && argv[1][0] == '-' && argv[1][1] == 'l') {
        long round_ms = atol(argv[2]), rounds = atol(argv[3]);
        struct timespec pause = {round_ms / 1000, (round_ms % 1000) * 1000000L};
        if (write(1, "ready\n", 6) != 6) return 3;
        for (long r = 0; r < rounds; r++) {
            pthread_t t;
            if (pthread_create(&t, NULL, worker, NULL) != 0) return 2;
            pthread_join(t, NULL);
            for (int i = 0; i < CHAIN_N; i++) alpha(i);
            gamma_();
            delta();
            nanosleep(&pause, NULL);
        }
        if (write(1, "done\n", 5) != 5) return 3;
        return 0;
    }
    int wait = argc > 1 && argv[1][0] == '-' && argv[1][1] == 'w';
    if (wait) {
        argc--;
        argv++;
    }
    long gap_ms = argc > 1 ? atol(argv[1]) : 0;
    long storm_n = argc > 3 ? atol(argv[2]) : 0, storm_size = argc > 3 ? atol(argv[3]) : 0;
    if (wait) {
        if (write(1, "ready\n", 6) != 6) return 3;
        wait_stdin(0);
    }
    pthread_t t;
    if (pthread_create(&t, NULL, worker, NULL) != 0) return 2;
    pthread_join(t, NULL);
    for (int i = 0; i < CHAIN_N; i++) alpha(i);
    gamma_();
    struct timespec ts = {gap_ms / 1000, (gap_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    delta();
    for (long i = 0; i < storm_n; i++) storm_leaf(storm_size);
    if (write(1, "done\n", 5) != 5) return 3;
    if (wait) wait_stdin(1);
    return 0;
}
