/* Workload for the `pymtrace top` rate and allocator tests: malloc(64)+free pairs at a
 * steady, known rate. argv: RATE (malloc calls per second), SECONDS (0: until stdin is
 * closed), NAME (comm to take; optional).
 * Prints "ready PID" at start; calls are paced in 100 batches per second against
 * absolute deadlines (CLOCK_MONOTONIC), so a late batch is caught up at once and the
 * average rate over any interval of ~1 s or more is RATE. At the end it prints
 * "count N seconds S" (malloc calls made, seconds elapsed) and exits. */
#define _GNU_SOURCE
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    long rate = argc > 1 ? atol(argv[1]) : 10000;
    double seconds = argc > 2 ? atof(argv[2]) : 0;
    if (argc > 3) prctl(PR_SET_NAME, argv[3]);
    char line[128];
    int n = snprintf(line, sizeof(line), "ready %d\n", (int)getpid());
    if (write(1, line, n) != n) return 3;
    long per_batch = rate / 100, count = 0;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    double t0 = now();
    for (;;) {
        for (long i = 0; i < per_batch; i++) {
            void *p = malloc(64);
            if (!p) return 4;
            *(volatile char *)p = 1;
            free(p);
        }
        count += per_batch;
        if (seconds > 0 && now() - t0 >= seconds) break;
        if (seconds <= 0) {
            struct pollfd pfd = {0, POLLIN, 0};
            if (poll(&pfd, 1, 0) > 0) /* stdin closed (or written to): stop */
                break;
        }
        next.tv_nsec += 10 * 1000 * 1000;
        if (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    n = snprintf(line, sizeof(line), "count %ld seconds %.3f\n", count, now() - t0);
    if (write(1, line, n) != n) return 3;
    return 0;
}
