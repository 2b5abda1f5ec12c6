/* Workload for tests/live/test_top_slab.py: drives the kernel's mqueue_inode_cache slab cache
 * (a cache the kernel never merges, and that little else uses): every POSIX message queue
 * created is one inode from it, freed after mq_unlink + mq_close.
 * "ready PID", wait for stdin, create+remove N queues, print {"queues": N}, wait, exit. */
#include <fcntl.h>
#include <mqueue.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void wait_stdin(void) {
    char c;
    if (read(0, &c, 1) != 1) _exit(2);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 500;
    char line[256], name[64];
    int len = snprintf(line, sizeof(line), "ready %d\n", (int)getpid());
    if (write(1, line, len) != len) return 3;
    wait_stdin();
    int done = 0;
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof(name), "/pymtrace-top-test-%d-%d", (int)getpid(), i);
        mqd_t q = mq_open(name, O_CREAT | O_EXCL | O_RDWR, 0600, NULL);
        if (q == (mqd_t)-1) {
            perror("mq_open");
            return 4;
        }
        mq_unlink(name);
        mq_close(q);
        done++;
    }
    len = snprintf(line, sizeof(line), "{\"queues\": %d}\n", done);
    if (write(1, line, len) != len) return 3;
    wait_stdin();
    return 0;
}
