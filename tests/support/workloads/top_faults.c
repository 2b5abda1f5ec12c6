/* Workload for tests/live/test_top_faults.py: page faults with a known cause.
 * "ready PID", wait for stdin; calloc a 64 MiB block (glibc mmaps it: calloc does not touch
 * it) and write one byte per page; read() a file into a second fresh block (faults taken
 * in kernel mode, by copy_to_user); print one JSON line with the block's bounds and the
 * page count; wait for stdin; exit. */
#define _GNU_SOURCE
#include <fcntl.h>

#include "touched_block.h"

#define BLOCK  (64UL << 20)
#define RBLOCK (1UL << 20)

int main(void) {
    char line[512];
    ready();
    unsigned long pages;
    char *p = touched_block(BLOCK, &pages);
    char *r = calloc(1, RBLOCK);
    int fd = open("/proc/self/exe", O_RDONLY);
    ssize_t got = fd >= 0 ? read(fd, r, RBLOCK) : -1;
    int n = snprintf(line, sizeof(line), "{\"start\": %lu, \"end\": %lu, \"pages\": %lu, \"read\": %ld}\n",
                     (unsigned long)p, (unsigned long)p + BLOCK, pages, (long)got);
    if (write(1, line, n) != n) return 3;
    wait_stdin();
    return 0;
}
