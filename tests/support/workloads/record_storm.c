/* Single-thread malloc storm for bench/record_bench.py: N malloc+free pairs of SIZE bytes;
 * prints "pairs N ns_per_pair X". usage: record_storm N [SIZE] */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    size_t size = argc > 2 ? (size_t)atol(argv[2]) : 64;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        void *p = malloc(size);
        *(volatile char *)p = 1;
        free(p);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    printf("pairs %ld ns_per_pair %.1f\n", n, ns / n);
    return 0;
}
