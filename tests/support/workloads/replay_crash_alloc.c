/* An "allocator" whose free() crashes: pymtrace replay must report the crash in this
 * configuration's row and still run the others. Built with -shared -fPIC. */
#include <stddef.h>

extern void *__libc_malloc(size_t);

void free(void *p) {
    if (p) *(volatile int *)0 = 1; /* SIGSEGV */
}
