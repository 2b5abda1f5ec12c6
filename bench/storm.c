/* Single-thread malloc+free storm for bench/overhead.py.
 * Reads lines "N SIZE" on stdin; for each, runs 1000 warm-up pairs, then N timed
 * malloc(SIZE)+free pairs and prints the nanoseconds per pair. Prints "ready PID" first. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(void)
{
    long n, size;
    void *volatile sink;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    while (scanf("%ld %ld", &n, &size) == 2) {
        for (int i = 0; i < 1000; i++) {
            sink = malloc(size);
            free(sink);
        }
        double t0 = now_ns();
        for (long i = 0; i < n; i++) {
            sink = malloc(size);
            free(sink);
        }
        double t1 = now_ns();
        printf("%.1f\n", (t1 - t0) / n);
        fflush(stdout);
    }
    return 0;
}
