/* Workload for tests/live/test_top_comm.py: a process that lives a few milliseconds. It makes
 * exactly 10 mallocs and 10 frees, touches 256 pages of a calloc'd 1 MiB block, and exits
 * at once, so it is gone before top's next snapshot: its name must come from BPF. */
#include <stdlib.h>

int main(void) {
    void *p[10];
    for (int i = 0; i < 10; i++) p[i] = malloc(100 + i);
    for (int i = 0; i < 10; i++) free(p[i]);
    char *b = calloc(1, 1 << 20);
    if (!b) return 1;
    for (long off = 0; off < (1 << 20); off += 4096) b[off] = 1;
    free(b);
    return 0;
}
