/* Shared by the page-fault workloads (top_faults.c, top_fault_free.c): the start handshake
 * and a calloc'd block touched page by page, one fault per 4 KiB page. */
#ifndef TOUCHED_BLOCK_H
#define TOUCHED_BLOCK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

static void wait_stdin(void) {
    char c;
    if (read(0, &c, 1) != 1) _exit(2);
}

/* "ready PID", then wait for stdin; exits 3 if the line cannot be written */
static void ready(void) {
    char line[64];
    /* THP off for the whole process, before calloc writes the chunk header: where THP is
     * "always" and the kernel aligns large anonymous mappings to 2 MiB, that first write
     * would fault in a huge page before the madvise below could prevent it */
    prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
    int n = snprintf(line, sizeof(line), "ready %d\n", (int)getpid());
    if (write(1, line, n) != n) _exit(3);
    wait_stdin();
}

/* calloc(1, SIZE) (glibc mmaps a block this large: calloc does not touch it), one byte
 * written per page; *PAGES: how many pages were written. Exits 4 if calloc fails. */
static char *touched_block(unsigned long size, unsigned long *pages) {
    long page = sysconf(_SC_PAGESIZE);
    char *p = calloc(1, size);
    if (!p) _exit(4);
    /* no transparent huge pages: one fault per 4 KiB page */
    uintptr_t lo = ((uintptr_t)p + page - 1) & ~(uintptr_t)(page - 1);
    madvise((void *)lo, ((uintptr_t)p + size - lo) & ~(uintptr_t)(page - 1), MADV_NOHUGEPAGE);
    *pages = 0;
    for (unsigned long off = lo - (uintptr_t)p; off < size; off += page) {
        p[off] = 1;
        (*pages)++;
    }
    return p;
}

#endif
