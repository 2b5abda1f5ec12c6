/* malloc parameters: every mallopt() parameter, and the dynamic mmap threshold.
 *
 * glibc_params mallopt   calls mallopt for each parameter below (twice for
 *                        M_MMAP_THRESHOLD, so the second call's "old" is the first value)
 *                        and prints "mallopt PARAM VALUE" for each call.
 * glibc_params dyn       frees two mmapped chunks that raise the dynamic thresholds
 *                        (memory_mallopt_free_dyn_thresholds) and prints their chunk sizes;
 *                        then the same size comes from the heap (no mmap); finally
 *                        mallopt(M_MMAP_THRESHOLD, 2 MiB) fixes the threshold.
 * glibc_params idle      only mallocs once (for GLIBC_TUNABLES runs). */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void opt(int param, int value, const char *name) {
    int ok = mallopt(param, value);
    printf("mallopt %s %d %d\n", name, value, ok);
}

/* the size of the mmapped chunk glibc makes for a request (x86-64, 4 KiB pages) */
static unsigned long mmapped_chunk(unsigned long req) {
    unsigned long nb = (req + 8 + 15) & ~15UL;
    return (nb + 8 + 4095) & ~4095UL;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "mallopt";
    if (strcmp(mode, "mallopt") == 0) {
        opt(M_MXFAST, 64, "M_MXFAST");
        opt(M_TRIM_THRESHOLD, 300000, "M_TRIM_THRESHOLD");
        opt(M_TOP_PAD, 65536, "M_TOP_PAD");
        opt(M_MMAP_THRESHOLD, 262144, "M_MMAP_THRESHOLD");
        opt(M_MMAP_THRESHOLD, 524288, "M_MMAP_THRESHOLD");
        opt(M_MMAP_MAX, 1000, "M_MMAP_MAX");
        opt(M_PERTURB, 0x5a, "M_PERTURB");
        opt(M_ARENA_TEST, 4, "M_ARENA_TEST");
        opt(M_ARENA_MAX, 3, "M_ARENA_MAX");
        opt(M_PERTURB, 0, "M_PERTURB");
    } else if (strcmp(mode, "dyn") == 0) {
        unsigned long a = 200000, b = 1000000;
        void *p = malloc(a);
        free(p); /* mmapped (> 128 KiB default): raises the threshold to its size */
        printf("dyn1 %lu %lu\n", mmapped_chunk(a), 2 * mmapped_chunk(a));
        void *q = malloc(b);
        free(q);
        printf("dyn2 %lu %lu\n", mmapped_chunk(b), 2 * mmapped_chunk(b));
        void *r = malloc(a); /* now below the threshold: from the heap */
        free(r);
        opt(M_MMAP_THRESHOLD, 2 * 1024 * 1024, "M_MMAP_THRESHOLD");
    } else {
        void *p = malloc(100);
        free(p);
    }
    fflush(stdout);
    return 0;
}
