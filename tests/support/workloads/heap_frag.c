/* heap_frag: a fragmented heap (heap efficiency) and its control.
 *
 *   heap_frag frag     100,000 blocks of 2,000 bytes, then every other one freed: 100 MB
 *                      requested and still live, ~200 MB of touched heap pages (no freed
 *                      block has a free neighbour to merge with, so glibc cannot return them)
 *   heap_frag control  50,000 blocks of 2,000 bytes, none freed: the same 100 MB live on
 *                      ~100 MB of heap
 *
 * Protocol (tests/support/top.py Workload): prints "ready PID", waits for a byte on stdin,
 * allocates (memset: every page touched), prints one JSON line {"live_requested": bytes,
 * "blocks": n} and waits for another byte, then exits 0 (the blocks are left to exit).
 * Built with -fno-builtin (tests/conftest.py): every malloc/free is a real call.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NBLOCKS 100000
#define BLOCK   2000

static void *blocks[NBLOCKS];

int main(int argc, char **argv) {
    int frag = argc > 1 && strcmp(argv[1], "frag") == 0;
    int n = frag ? NBLOCKS : NBLOCKS / 2;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    if (getchar() == EOF) return 1;
    for (int i = 0; i < n; i++) {
        blocks[i] = malloc(BLOCK);
        if (!blocks[i]) return 2;
        memset(blocks[i], 0x5a, BLOCK);
    }
    long live = 0, count = 0;
    for (int i = 0; i < n; i++) {
        if (frag && i % 2) {
            free(blocks[i]);
            blocks[i] = NULL;
        } else {
            live += BLOCK;
            count++;
        }
    }
    printf("{\"live_requested\": %ld, \"blocks\": %ld}\n", live, count);
    fflush(stdout);
    if (getchar() == EOF) return 1;
    return 0;
}
