/* The workloads' side of support.top.Workload's protocol: say() writes a line on stdout with
 * write(2) (no stdio buffer, no malloc), wait_stdin() waits for the tracer's byte. */
#ifndef WORKLOAD_PROTOCOL_H
#define WORKLOAD_PROTOCOL_H

#include <string.h>
#include <unistd.h>

static void say(const char *s) {
    if (write(1, s, strlen(s)) < 0) _exit(3);
}

static void wait_stdin(void) {
    char c;
    if (read(0, &c, 1) != 1) _exit(2);
}

#endif
