/* bench/stacks_inprocess.py: N malloc(64)+free pairs, each malloc D frames deep; prints its
 * own ns per pair. usage: deep_calls N D */
#include <stdlib.h>
#include <stdio.h>
#include <time.h>
__attribute__((noinline)) void *lvl(int d, size_t n) {
    if (d) {
        void *p = lvl(d - 1, n);
        __asm__ volatile("" ::: "memory");
        return p;
    }
    return malloc(n);
}
int main(int argc, char **argv) {
    int N = atoi(argv[1]), D = atoi(argv[2]);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < N; i++) free(lvl(D, 64));
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.1f ns/pair\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / N);
}
