/* Allocation failures that glibc retries in another arena: RLIMIT_AS makes a 2 GiB
 * request fail; a second thread exists so malloc is not on its single-thread path.
 * Prints the requests it made as "key value" lines. */
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

static void *idle(void *arg) {
    (void)arg;
    pause();
    return 0;
}

int main(void) {
    pthread_t t;
    pthread_create(&t, 0, idle, 0);
    struct rlimit rl = {512UL << 20, 512UL << 20};
    setrlimit(RLIMIT_AS, &rl);
    size_t big = 2UL << 30;
    void *small = malloc(100);
    printf("small %p\n", small);
    printf("malloc %zu %p\n", big, malloc(big));
    printf("calloc %zu %p\n", big, calloc(1, big));
    printf("realloc %zu %p\n", big, realloc(small, big));
    printf("memalign %zu %p\n", big, memalign(4096, big));
    fflush(stdout);
    _exit(0);
}
