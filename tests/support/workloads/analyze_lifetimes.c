/* Known lifetimes and a known peak of live requested bytes, for `pymtrace analyze`.
 *
 * Makes no malloc-API call but these (write(2) for output, no stdio):
 *   1. NBLOCK blocks of BLOCK bytes, allocated back to back, all live for SLEEP_MS, then freed:
 *      the peak of live requested bytes is exactly NBLOCK * BLOCK, and NBLOCK lifetimes are at
 *      least SLEEP_MS;
 *   2. NSHORT malloc(SHORT)+free pairs (short lifetimes);
 *   3. after everything above is freed, one thread frees NCROSS blocks main allocated
 *      (cross-thread frees).
 * Prints `FACT name value` lines with the numbers to expect, then `done`.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NBLOCK   8
#define BLOCK    50000
#define SLEEP_MS 300
#define NSHORT   1000
#define SHORT    24
#define NCROSS   5
#define CROSS    64

static void fact(const char *name, long value) {
    char buf[100];
    int n = snprintf(buf, sizeof buf, "FACT %s %ld\n", name, value);
    if (write(1, buf, n) != n) _exit(99);
}

static void *cross[NCROSS];

static void *freer(void *arg) {
    (void)arg;
    for (int i = 0; i < NCROSS; i++) free(cross[i]);
    return NULL;
}

int main(void) {
    void *blocks[NBLOCK];
    for (int i = 0; i < NBLOCK; i++) blocks[i] = malloc(BLOCK);
    struct timespec ts = {SLEEP_MS / 1000, (SLEEP_MS % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    for (int i = 0; i < NBLOCK; i++) free(blocks[i]);
    for (int i = 0; i < NSHORT; i++) {
        void *p = malloc(SHORT);
        free(p);
    }
    for (int i = 0; i < NCROSS; i++) cross[i] = malloc(CROSS);
    pthread_t th;
    pthread_create(&th, NULL, freer, NULL);
    pthread_join(th, NULL);
    fact("peak", (long)NBLOCK * BLOCK);
    fact("long_lived", NBLOCK);
    fact("sleep_ns", SLEEP_MS * 1000000L);
    fact("mallocs", NBLOCK + NSHORT + NCROSS);
    fact("frees", NBLOCK + NSHORT + NCROSS);
    fact("cross", NCROSS);
    if (write(1, "done\n", 5) != 5) return 99;
    return 0;
}
