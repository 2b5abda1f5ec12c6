/* sbrk growth and trim on the main arena, deterministic:
 * mallopt(M_MMAP_THRESHOLD) keeps every block in the heap (no mmapped chunks),
 * mallopt(M_TOP_PAD, 0) makes each growth exactly what is needed (page-rounded),
 * M_TRIM_THRESHOLD small so freeing the top block trims. Prints what it did. */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 8;
    size_t size = argc > 2 ? strtoul(argv[2], 0, 0) : 200000;
    void *blocks[64];
    mallopt(M_MMAP_THRESHOLD, 4 * 1024 * 1024);
    mallopt(M_TOP_PAD, 0);
    mallopt(M_TRIM_THRESHOLD, 65536);
    printf("start_brk %p\n", sbrk(0));
    for (int i = 0; i < n && i < 64; i++) {
        blocks[i] = malloc(size);
        memset(blocks[i], 1, size);
    }
    printf("grown_brk %p\n", sbrk(0));
    for (int i = (n < 64 ? n : 64) - 1; i >= 0; i--) free(blocks[i]);
    printf("final_brk %p\n", sbrk(0));
    fflush(stdout);
    return 0;
}
