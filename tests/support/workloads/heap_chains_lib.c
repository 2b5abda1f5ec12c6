/* libheapchain.so for heap_chains.c: a leak made inside a shared library without frame pointers. */
#include <stdlib.h>

#define NOINLINE __attribute__((noinline, noclone))

void *volatile heapchain_sink;
static volatile int after;

NOINLINE static void lib_inner(void) {
    heapchain_sink = malloc(4000);
    after++;
}
NOINLINE void lib_outer(int n) {
    for (int i = 0; i < n; i++) lib_inner();
    after++;
}
