/* Allocates forever in two threads (malloc/realloc/free of a small ring of blocks, with a
 * short pause every 64 calls) until killed; prints "ready" once running. For attach tests. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static void *loop(void *arg) {
    void *ring[32] = {0};
    unsigned long i = (unsigned long)arg;
    struct timespec ts = {0, 200000};
    for (;;) {
        unsigned k = i % 32;
        if (ring[k] && i % 3 == 0)
            ring[k] = realloc(ring[k], 16 + (i % 500));
        else {
            free(ring[k]);
            ring[k] = malloc(16 + (i % 700));
        }
        if (++i % 64 == 0) nanosleep(&ts, NULL);
    }
    return NULL;
}

int main(void) {
    pthread_t t;
    pthread_create(&t, NULL, loop, (void *)7);
    printf("ready\n");
    fflush(stdout);
    loop(0);
    return 0;
}
