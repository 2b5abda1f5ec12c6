/* Workload for `heap -p --max-overhead` (tests/live/test_heap_budget_bpf.py): allocations at a paced
 * rate from two known call chains, 3:1 in bytes. Prints "ready PID", waits for a byte on stdin,
 * then 100 batches a second against absolute deadlines for SECONDS (a byte on stdin ends them
 * early), each batch:
 *   main -> alpha_outer -> alpha_alloc: ALPHA_N malloc(BLOCK), each freed
 *   main -> beta_outer -> beta_alloc:   BETA_N malloc(BLOCK), each freed
 * and BURN_US microseconds of its own CPU time (arithmetic: the traced process's work, which
 * earns the overhead budget). Prints {"start", "end" (CLOCK_MONOTONIC seconds), "alpha_bytes",
 * "beta_bytes", "batches"}, waits for another byte, exits.
 *
 * usage: heap_budget SECONDS BURN_US */
#define _GNU_SOURCE
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define BLOCK   4096
#define ALPHA_N 12
#define BETA_N  4

#define NOINLINE __attribute__((noinline, noclone))

static void *volatile sink;
static volatile int after; /* written after each call: never a tail call */
static volatile unsigned long work;

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

NOINLINE static void alpha_alloc(void) {
    void *p = malloc(BLOCK);
    if (!p) exit(4);
    sink = p;
    free(p);
    after++;
}

NOINLINE static void alpha_outer(void) {
    for (int i = 0; i < ALPHA_N; i++) alpha_alloc();
    after++;
}

NOINLINE static void beta_alloc(void) {
    void *p = malloc(BLOCK);
    if (!p) exit(4);
    sink = p;
    free(p);
    after++;
}

NOINLINE static void beta_outer(void) {
    for (int i = 0; i < BETA_N; i++) beta_alloc();
    after++;
}

static void burn(double us) {
    double until = now(CLOCK_THREAD_CPUTIME_ID) + us / 1e6;
    while (now(CLOCK_THREAD_CPUTIME_ID) < until)
        for (int i = 0; i < 1000; i++) work += i * 7;
}

/* A byte waiting on stdin: told to stop (read, so that finishing takes the next one). */
static int told_to_stop(void) {
    struct pollfd p = {.fd = 0, .events = POLLIN};
    char c;
    return poll(&p, 1, 0) == 1 && read(0, &c, 1) == 1;
}

int main(int argc, char **argv) {
    char c;
    if (argc != 3) return 2;
    double seconds = atof(argv[1]), burn_us = atof(argv[2]);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    if (read(0, &c, 1) != 1) return 3;
    long batches = 0;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    double start = now(CLOCK_MONOTONIC), end;
    for (;;) {
        alpha_outer();
        beta_outer();
        burn(burn_us);
        batches++;
        end = now(CLOCK_MONOTONIC);
        if (end - start >= seconds || told_to_stop()) break;
        next.tv_nsec += 10 * 1000 * 1000;
        if (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    printf("{\"start\": %.6f, \"end\": %.6f, \"alpha_bytes\": %ld, \"beta_bytes\": %ld, \"batches\": %ld}\n",
           start, end, batches * ALPHA_N * (long)BLOCK, batches * BETA_N * (long)BLOCK, batches);
    fflush(stdout);
    if (read(0, &c, 1) != 1) return 0;
    return 0;
}
