/* Workload for the overhead-budget tests (top --max-overhead). Prints "ready PID", waits for
 * a byte on stdin, works, prints one JSON line, waits for another byte, exits.
 *
 *   top_budget work N SPIN     N malloc(64)+free pairs, each followed by SPIN iterations of
 *                              arithmetic: a fixed amount of CPU-bound work. Prints
 *                              {"pairs": N, "cpu_ns": its own CPU time for them, "end":
 *                              CLOCK_MONOTONIC seconds when they ended}.
 *   top_budget steps SPIN RATE:SECONDS...   pairs (each with SPIN iterations) at RATE a
 *                              second for SECONDS, step after step, paced in 100 batches a
 *                              second against absolute deadlines. Prints {"steps": [{"rate",
 *                              "start", "end", "calls"}]} (start, end: CLOCK_MONOTONIC
 *                              seconds, the clock of top's snapshot times; calls: mallocs made).
 *                              A byte on stdin ends the steps early (the current one ends
 *                              there, the rest are left out). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long sink;

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void pair(long spin) {
    void *p = malloc(64);
    if (!p) exit(4);
    *(volatile char *)p = 1;
    free(p);
    for (long i = 0; i < spin; i++) sink += i * 7;
}

static int work(long n, long spin) {
    double c0 = now(CLOCK_PROCESS_CPUTIME_ID);
    for (long i = 0; i < n; i++) pair(spin);
    double c1 = now(CLOCK_PROCESS_CPUTIME_ID), end = now(CLOCK_MONOTONIC);
    printf("{\"pairs\": %ld, \"cpu_ns\": %.0f, \"end\": %.6f}\n", n, (c1 - c0) * 1e9, end);
    return 0;
}

/* A byte waiting on stdin: told to stop (read, so that finishing takes the next one). */
static int told_to_stop(void) {
    struct pollfd p = {.fd = 0, .events = POLLIN};
    char c;
    return poll(&p, 1, 0) == 1 && read(0, &c, 1) == 1;
}

static int steps(int argc, char **argv, long spin) {
    int stop = 0;
    printf("{\"steps\": [");
    for (int s = 0; s < argc && !stop; s++) {
        long rate = atol(argv[s]);
        char *colon = strchr(argv[s], ':');
        double seconds = colon ? atof(colon + 1) : 1;
        long per_batch = rate / 100, calls = 0;
        struct timespec next;
        clock_gettime(CLOCK_MONOTONIC, &next);
        double start = now(CLOCK_MONOTONIC), end;
        for (;;) {
            for (long i = 0; i < per_batch; i++) pair(spin);
            calls += per_batch;
            end = now(CLOCK_MONOTONIC);
            if (end - start >= seconds || (stop = told_to_stop())) break;
            next.tv_nsec += 10 * 1000 * 1000;
            if (next.tv_nsec >= 1000000000L) {
                next.tv_nsec -= 1000000000L;
                next.tv_sec++;
            }
            clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
        }
        printf("%s{\"rate\": %ld, \"start\": %.6f, \"end\": %.6f, \"calls\": %ld}", s ? ", " : "", rate,
               start, end, calls);
    }
    printf("]}\n");
    return 0;
}

int main(int argc, char **argv) {
    char c;
    if (argc < 3) return 2;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    if (read(0, &c, 1) != 1) return 3;
    int rc = !strcmp(argv[1], "work") && argc == 4 ? work(atol(argv[2]), atol(argv[3]))
             : !strcmp(argv[1], "steps")           ? steps(argc - 3, argv + 3, atol(argv[2]))
                                                   : 2;
    fflush(stdout);
    if (rc) return rc;
    if (read(0, &c, 1) != 1) return 0;
    return 0;
}
