/* An "allocator" whose malloc(12345) never returns (the rest goes to glibc): the simulator's
 * stall watchdog and pymtrace replay's --timeout must end such a run with a clear message.
 * Built with -shared -fPIC. */
#include <stddef.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);

void *malloc(size_t n) {
    if (n == 12345)
        for (;;) pause();
    return __libc_malloc(n);
}
