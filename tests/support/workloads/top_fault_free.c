/* Workload for tests/live/test_top_faults.py: faults on a block that is gone by the next
 * snapshot. "ready PID", wait for stdin; calloc a 48 MiB block (glibc mmaps it), write one
 * byte per page, free it at once (glibc munmaps it); print one JSON line with the block's
 * bounds and the page count; wait for stdin; exit. */
#define _GNU_SOURCE
#include "touched_block.h"

#define BLOCK (48UL << 20)

int main(void) {
    char line[256];
    ready();
    unsigned long pages;
    char *p = touched_block(BLOCK, &pages);
    free(p);
    int n = snprintf(line, sizeof(line), "{\"start\": %lu, \"end\": %lu, \"pages\": %lu}\n", (unsigned long)p,
                     (unsigned long)p + BLOCK, pages);
    if (write(1, line, n) != n) return 3;
    wait_stdin();
    return 0;
}
