/* 300 malloc/free pairs with their ground truth, for tests/live/test_uprobe_refused.py.
 *
 * Protocol (support.top.Workload): prints "ready PID\n", waits for a byte on stdin (the
 * tracer is attached), makes the pairs (malloc(40 + i), then free of that block), prints ONE
 * line of JSON {"malloc": [[ptr, size], ...], "free": [ptr, ...]} and waits for another byte
 * before exiting. Nothing between the two waits calls a malloc-API function but the pairs:
 * the line is built with snprintf in a static buffer and written with write(2). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "protocol.h"

#define PAIRS 300

static char line[PAIRS * 64 + 64];
static void *blocks[PAIRS];

int main(void) {
    snprintf(line, sizeof(line), "ready %d\n", (int)getpid());
    say(line);
    wait_stdin();
    for (int i = 0; i < PAIRS; i++) {
        blocks[i] = malloc(40 + i);
        free(blocks[i]);
    }
    int n = snprintf(line, sizeof(line), "{\"malloc\": [");
    for (int i = 0; i < PAIRS; i++)
        n += snprintf(line + n, sizeof(line) - n, "%s[%lu, %d]", i ? ", " : "", (unsigned long)blocks[i],
                      40 + i);
    n += snprintf(line + n, sizeof(line) - n, "], \"free\": [");
    for (int i = 0; i < PAIRS; i++)
        n += snprintf(line + n, sizeof(line) - n, "%s%lu", i ? ", " : "", (unsigned long)blocks[i]);
    snprintf(line + n, sizeof(line) - n, "]}\n");
    say(line);
    wait_stdin();
    return 0;
}
