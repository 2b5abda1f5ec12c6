/* The time stamp counter and CLOCK_MONOTONIC read together: pymtrace/sources/interposer.py maps
 * the counter values the interposer (interpose.c) stamps records with to CLOCK_MONOTONIC ns by
 * interpolating between such pairs. A separate library: the consumer loads it with ctypes, and
 * loading the interposer itself would run its constructor in pymtrace. */
#include <stdint.h>
#include <time.h>

void pymtrace_clock_pair(uint64_t *tsc, uint64_t *ns) {
    struct timespec t;
    uint64_t before = __builtin_ia32_rdtsc();
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint64_t after = __builtin_ia32_rdtsc();
    *tsc = before + (after - before) / 2;
    *ns = (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}
