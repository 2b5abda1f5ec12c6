/* malloc+free storm through a 3-deep no-frame-pointer chain; prints ns per pair. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static void *volatile keep;
__attribute__((noinline)) void *s_leaf(size_t n) { void *p = malloc(n); keep = p; return p; }
__attribute__((noinline)) void *s_mid(size_t n) { void *p = s_leaf(n); keep = p; return p; }
__attribute__((noinline)) void *s_top(size_t n) { void *p = s_mid(n); keep = p; return p; }
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    usleep((argc > 2 ? atol(argv[2]) : 500) * 1000);
    struct timespec a, b, ca, cb;
    clock_gettime(CLOCK_MONOTONIC, &a);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ca);
    for (long i = 0; i < n; i++) free(s_top(16 + (i & 255) * 16));
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cb);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    double cns = (cb.tv_sec - ca.tv_sec) * 1e9 + (cb.tv_nsec - ca.tv_nsec);
    printf("storm n=%ld wall_ns_per_pair=%.1f cpu_ns_per_pair=%.1f\n", n, ns / n, cns / n);
    return 0;
}
