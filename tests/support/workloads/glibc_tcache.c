/* tcache double-free scans.
 * glibc_tcache fake N    N times: frees block A, copies A's tcache key into block B and
 *                        frees B: glibc scans B's tcache bin (memory_tcache_double_free),
 *                        finds no real double free and goes on. Prints "scan ENTRY IDX".
 * glibc_tcache real      a real double free: the scan finds it and glibc aborts. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "fake";
    int n = argc > 2 ? atoi(argv[2]) : 1;
    if (strcmp(mode, "fake") == 0) {
        for (int i = 0; i < n; i++) {
            size_t size = 24 + 16 * i; /* chunk 32 + 16 i: tcache bin i */
            uintptr_t *a = malloc(size), *b = malloc(size);
            free(a);
            uintptr_t key = a[1]; /* tcache_entry.key of a freed block */
            b[1] = key;
            printf("scan %p %d\n", (void *)b, i);
            fflush(stdout);
            free(b);
            free(malloc(size));
        }
    } else {
        void *p = malloc(40); /* chunk 48: bin 1 */
        printf("scan %p %d\n", p, 1);
        fflush(stdout);
        free(p);
        free(p); /* abort: free(): double free detected in tcache 2 */
    }
    fflush(stdout);
    return 0;
}
