/* Known call chains for the issue-13 prototype.  Built -O2 -fomit-frame-pointer.
 * main -> a -> b -> leaf -> malloc    (N allocations, freed)
 * main -> gamma_ -> lib_outer (libchain.so) -> lib_inner -> malloc   (K leaked)
 * Each callee's result is used after the call, so no call is a tail call. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void *lib_outer(size_t n);               /* in libchain.so */
static void *volatile sink[1 << 16];

__attribute__((noinline)) void *leaf(size_t n) {
    void *p = malloc(n);
    if (p) memset(p, 1, 8);
    return p;
}
__attribute__((noinline)) void *b(size_t n) { void *p = leaf(n); sink[n & 0xffff] = p; return p; }
__attribute__((noinline)) void *a(size_t n) { void *p = b(n); sink[(n + 1) & 0xffff] = p; return p; }
__attribute__((noinline)) void *gamma_(size_t n) { void *p = lib_outer(n); sink[(n + 2) & 0xffff] = p; return p; }

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000, k = argc > 2 ? atol(argv[2]) : 10;
    long pause_ms = argc > 3 ? atol(argv[3]) : 300;
    usleep(pause_ms * 1000);            /* time for the tracer to attach */
    for (long i = 0; i < n; i++) free(a(100 + (i & 7)));
    for (long i = 0; i < k; i++) gamma_(4000);   /* leaked */
    printf("done n=%ld k=%ld\n", n, k);
    return 0;
}
