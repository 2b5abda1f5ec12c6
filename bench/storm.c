/* Single-thread malloc+free storm for bench/overhead.py.
 * Reads lines "N SIZE" on stdin; for each, runs 1000 warm-up pairs, then N timed
 * malloc(SIZE)+free pairs and prints the nanoseconds per pair. Prints "ready PID" first.
 * "N 0" instead runs a page-fault storm: N pages of fresh anonymous memory (mmap, touch
 * one byte per page, munmap, 1024 pages at a time); prints nanoseconds per page. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(void) {
    long n, size;
    void *volatile sink;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    while (scanf("%ld %ld", &n, &size) == 2) {
        if (size == 0) {
            long page = sysconf(_SC_PAGESIZE), chunk = 1024;
            double t0 = now_ns();
            for (long done = 0; done < n; done += chunk) {
                char *p =
                    mmap(NULL, chunk * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
                if (p == MAP_FAILED) return 1;
                madvise(p, chunk * page, MADV_NOHUGEPAGE);
                for (long i = 0; i < chunk; i++) p[i * page] = 1;
                munmap(p, chunk * page);
            }
            printf("%.1f\n", (now_ns() - t0) / n);
            fflush(stdout);
            continue;
        }
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
