/* Page faults by region, with transparent huge pages off (one fault per 4 KiB page):
 * glibc_faults HEAP_KB MMAP_KB ARENA_KB [MODE]
 * HEAP_KB of the main heap ([heap], brk), MMAP_KB of one mmapped chunk, ARENA_KB in a
 * thread's arena heap. MODE for the mmapped chunk: touch (calloc, then written page by
 * page; default), calloc (calloc only: glibc knows fresh mmap memory is zero and does
 * not touch it, so no faults), memset (malloc + memset 0: every page faults).
 * Prints what it touched. */
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>

static size_t arena_kb;

static void touch(char *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 4096) p[i] = 1;
}

static void *worker(void *arg) {
    (void)arg;
    char *p = malloc(arena_kb * 1024);
    touch(p, arena_kb * 1024);
    printf("arena %p %zu\n", (void *)p, arena_kb * 1024);
    free(p);
    return 0;
}

int main(int argc, char **argv) {
    size_t heap_kb = argc > 1 ? atol(argv[1]) : 4096;
    size_t mmap_kb = argc > 2 ? atol(argv[2]) : 8192;
    arena_kb = argc > 3 ? atol(argv[3]) : 2048;
    prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
    mallopt(M_MMAP_THRESHOLD, 4 * 1024 * 1024); /* heap_kb, arena_kb below: no mmap */
    mallopt(M_TRIM_THRESHOLD, 64 * 1024 * 1024);
    char *h = malloc(heap_kb * 1024);
    touch(h, heap_kb * 1024);
    printf("heap %p %zu\n", (void *)h, heap_kb * 1024);
    const char *mode = argc > 4 ? argv[4] : "touch";
    char *m;
    if (strcmp(mode, "memset") == 0) {
        m = malloc(mmap_kb * 1024);
        memset(m, 0, mmap_kb * 1024);
    } else {
        m = calloc(1, mmap_kb * 1024); /* above the threshold: its own mmap, not touched by calloc */
        if (strcmp(mode, "touch") == 0) touch(m, mmap_kb * 1024);
    }
    printf("mmap %p %zu\n", (void *)m, mmap_kb * 1024);
    pthread_t t;
    pthread_create(&t, 0, worker, 0);
    pthread_join(t, 0);
    fflush(stdout);
    return 0;
}
