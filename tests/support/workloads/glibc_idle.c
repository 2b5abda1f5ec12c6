/* For attaching to a running process: prints "ready", waits for a line on stdin, then
 * calls mallopt(M_TOP_PAD, 0) and grows the heap by COUNT blocks of SIZE bytes (each an
 * sbrk_more: top_pad 0, mmap threshold fixed above SIZE), prints the break before and
 * after, and exits. */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int count = argc > 1 ? atoi(argv[1]) : 4;
    size_t size = argc > 2 ? strtoul(argv[2], 0, 0) : 100000;
    char line[64];
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    mallopt(M_TRIM_THRESHOLD, 64 << 20);
    printf("ready %d\n", getpid());
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    mallopt(M_TOP_PAD, 0);
    printf("before_brk %p\n", sbrk(0));
    for (int i = 0; i < count; i++) malloc(size);
    printf("after_brk %p\n", sbrk(0));
    fflush(stdout);
    return 0;
}
