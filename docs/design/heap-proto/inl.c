/* An inlined step between outer() and malloc: stacks should show inl_mid as an inline frame. */
#include <stdlib.h>
#include <stdio.h>
#include <unistd.h>
static void *volatile sink;
static inline __attribute__((always_inline)) void *inl_mid(size_t n) { void *p = malloc(n); sink = p; return p; }
__attribute__((noinline)) void *outer(size_t n) { void *p = inl_mid(n); sink = p; return p; }
int main(int argc, char **argv) {
    usleep(800 * 1000);
    for (int i = 0; i < 5; i++) free(outer(64));
    puts("inl done");
    return 0;
}
