/* Workload for tests/live/test_top_faults.py: page faults with a known cause.
 * "ready PID", wait for stdin; calloc a 64 MiB block (glibc mmaps it: calloc does not touch
 * it) and write one byte per page; read() a file into a second fresh block (faults taken
 * in kernel mode, by copy_to_user); print one JSON line with the block's bounds and the
 * page count; wait for stdin; exit. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#define BLOCK  (64UL << 20)
#define RBLOCK (1UL << 20)

static void wait_stdin(void) {
    char c;
    if (read(0, &c, 1) != 1) _exit(2);
}

int main(void) {
    char line[512];
    long page = sysconf(_SC_PAGESIZE);
    /* THP off for the whole process, before calloc writes the chunk header: where THP is
     * "always" and the kernel aligns large anonymous mappings to 2 MiB, that first write
     * would fault in a huge page before the madvise below could prevent it */
    prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
    int n = snprintf(line, sizeof(line), "ready %d\n", (int)getpid());
    if (write(1, line, n) != n) return 3;
    wait_stdin();

    char *p = calloc(1, BLOCK);
    if (!p) return 4;
    /* no transparent huge pages: one fault per 4 KiB page */
    uintptr_t lo = ((uintptr_t)p + page - 1) & ~(uintptr_t)(page - 1);
    madvise((void *)lo, ((uintptr_t)p + BLOCK - lo) & ~(uintptr_t)(page - 1), MADV_NOHUGEPAGE);
    unsigned long pages = 0;
    for (unsigned long off = lo - (uintptr_t)p; off < BLOCK; off += page) {
        p[off] = 1;
        pages++;
    }
    char *r = calloc(1, RBLOCK);
    int fd = open("/proc/self/exe", O_RDONLY);
    ssize_t got = fd >= 0 ? read(fd, r, RBLOCK) : -1;
    n = snprintf(line, sizeof(line), "{\"start\": %lu, \"end\": %lu, \"pages\": %lu, \"read\": %ld}\n",
                 (unsigned long)p, (unsigned long)p + BLOCK, pages, (long)got);
    if (write(1, line, n) != n) return 3;
    wait_stdin();
    return 0;
}
