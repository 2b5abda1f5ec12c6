/* The benchmarks' single-thread storms (the only one: the scripts in bench/ compile this file).
 *
 * storm            (bench/overhead.py, bench/exporter_bench.py) Reads lines "N SIZE" on stdin;
 *                  for each, runs 1000 warm-up pairs, then N timed malloc(SIZE)+free pairs and
 *                  prints the nanoseconds per pair. Prints "ready PID" first.
 *                  "N 0" instead runs a page-fault storm: N pages of fresh anonymous memory
 *                  (mmap, touch one byte per page, munmap, 1024 pages at a time); prints
 *                  nanoseconds per page.
 * storm fresh      (bench/overhead.py) A page-fault storm on FRESH addresses: like "N 0", but
 *                  every 1024-page chunk is mapped at a new address (MAP_FIXED_NOREPLACE,
 *                  advancing through a 64 TiB-spaced window), so each 64 KiB granule is new.
 *                  Reads lines "N" (pages); prints "ready PID" first, then ns per page.
 * storm touch      (bench/exporter_bench.py) Reads lines "N SIZE": N times malloc(SIZE), touch
 *                  every page, free, with a fixed mmap threshold of 64 KiB (no dynamic
 *                  threshold, so every block above it is mmap + a fault per page + munmap);
 *                  no warm-up; prints "ready PID" first, then ns per iteration.
 * storm once N [SIZE]  (bench/record_bench.py, bench/record_stacks_bench.py) N malloc(SIZE)+free
 *                  pairs (SIZE 64), one byte written into each block; prints
 *                  "pairs N ns_per_pair X cpu_ns_per_pair Y" (Y: the process's CPU time).
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static int storm(void) {
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

static int fresh(void) {
    long n, page = sysconf(_SC_PAGESIZE), chunk = 1024;
    unsigned long next = 0x100000000000UL;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    while (scanf("%ld", &n) == 1) {
        double t0 = now_ns();
        for (long done = 0; done < n; done += chunk) {
            char *p = mmap((void *)next, chunk * page, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
            if (p == MAP_FAILED) return 1;
            next += chunk * page;
            if (next >= 0x500000000000UL) next = 0x100000000000UL;
            madvise(p, chunk * page, MADV_NOHUGEPAGE);
            for (long i = 0; i < chunk; i++) p[i * page] = 1;
            munmap(p, chunk * page);
        }
        printf("%.1f\n", (now_ns() - t0) / n);
        fflush(stdout);
    }
    return 0;
}

static int touch(void) {
    long n, size;
    mallopt(M_MMAP_THRESHOLD, 64 * 1024); /* fixed: no dynamic threshold, every block is mmap'd */
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    while (scanf("%ld %ld", &n, &size) == 2) {
        double t0 = now_ns();
        for (long i = 0; i < n; i++) {
            char *volatile p = malloc(size);
            for (long off = 0; off < size; off += 4096) p[off] = 1;
            free(p);
        }
        printf("%.1f\n", (now_ns() - t0) / n);
        fflush(stdout);
    }
    return 0;
}

static int once(int argc, char **argv) {
    long n = argc > 0 ? atol(argv[0]) : 1000000;
    size_t size = argc > 1 ? (size_t)atol(argv[1]) : 64;
    struct timespec a, b, ca, cb;
    clock_gettime(CLOCK_MONOTONIC, &a);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ca); /* the uprobe traps' kernel time counts too */
    for (long i = 0; i < n; i++) {
        void *p = malloc(size);
        *(volatile char *)p = 1;
        free(p);
    }
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cb);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    double cpu = (cb.tv_sec - ca.tv_sec) * 1e9 + (cb.tv_nsec - ca.tv_nsec);
    printf("pairs %ld ns_per_pair %.1f cpu_ns_per_pair %.1f\n", n, ns / n, cpu / n);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) return storm();
    if (!strcmp(argv[1], "fresh") && argc == 2) return fresh();
    if (!strcmp(argv[1], "touch") && argc == 2) return touch();
    if (!strcmp(argv[1], "once")) return once(argc - 2, argv + 2);
    fprintf(stderr, "usage: storm [fresh | touch | once N [SIZE]]\n");
    return 2;
}
