/* pymtrace demo workload: a small multi-threaded program with a varied, visible
 * allocation pattern, for `pymtrace top --demo` (and for trying the other commands).
 *
 *   churn    malloc/free of mixed sizes over a working set of 256 blocks
 *   vector   a buffer grown by realloc (doubling), calloc'd tables, then freed
 *   aligned  memalign / posix_memalign / aligned_alloc / valloc / pvalloc, freed
 *   leak     a slowly growing leak: a 1-4 KiB block every 200 ms, never freed (capped at 64 MiB)
 *   pager    every 5 s a 32 MiB calloc touched page by page (anonymous page faults), freed 1 s later
 *            (8192 faults of 4 KiB pages: transparent huge pages are off for the demo, see main)
 *   files    opens, reads and closes a few files every 50 ms (slab: filp, dentry, kmalloc-*)
 *
 * Runs until killed (SIGTERM/SIGINT end it cleanly), or for ARGV[1] seconds when given.
 * Rates are modest on purpose (~10-20k allocator calls/s in total) so it is visible without
 * loading a small machine.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/prctl.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

static unsigned rnd(unsigned *s) {
    unsigned x = *s;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return *s = x ? x : 0x9e3779b9u;
}

static void nap_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (!stop && nanosleep(&ts, &ts) != 0)
        ;
}

/* sizes: mostly small, some medium, a few large (a rough log-uniform mix) */
static size_t pick_size(unsigned *s) {
    unsigned r = rnd(s);
    unsigned shift = 3 + r % 12; /* 8 B .. 32 KiB */
    return ((size_t)1 << shift) + (rnd(s) % (1u << shift));
}

static void *churn(void *arg) {
    unsigned seed = 12345u + (unsigned)(uintptr_t)arg;
    void *slots[256] = {0};
    while (!stop) {
        for (int i = 0; i < 200; i++) {
            unsigned k = rnd(&seed) % 256;
            free(slots[k]);
            slots[k] = malloc(pick_size(&seed));
            if (slots[k]) *(volatile char *)slots[k] = 1;
        }
        nap_ms(20);
    }
    for (int k = 0; k < 256; k++) free(slots[k]);
    return NULL;
}

static void *vector(void *arg) {
    unsigned seed = 777u + (unsigned)(uintptr_t)arg;
    while (!stop) {
        char *buf = NULL;
        size_t cap = 16;
        for (int k = 0; k < 12; k++) { /* 32 B .. 64 KiB by doubling */
            cap *= 2;
            char *nb = realloc(buf, cap);
            if (!nb) break;
            buf = nb;
            memset(buf + cap / 2, k, cap / 2);
        }
        free(buf);
        for (int k = 0; k < 20; k++) {
            size_t n = 1 + rnd(&seed) % 64;
            int *table = calloc(n, sizeof(int) * 4);
            if (table) table[0] = (int)n;
            free(table);
        }
        nap_ms(10);
    }
    return NULL;
}

static void *aligned(void *arg) {
    (void)arg;
    while (!stop) {
        for (int k = 0; k < 10; k++) {
            void *a = memalign(64, 256 + k * 32);
            void *b = NULL;
            if (posix_memalign(&b, 4096, 8192) != 0) b = NULL;
            void *c = aligned_alloc(128, 1024);
            void *d = valloc(4096);
            void *e = pvalloc(100);
            free(a);
            free(b);
            free(c);
            free(d);
            free(e);
        }
        nap_ms(50);
    }
    return NULL;
}

struct leak {
    struct leak *next;
    char payload[];
};

static void *leak(void *arg) {
    unsigned seed = 4242u + (unsigned)(uintptr_t)arg;
    struct leak *head = NULL;
    size_t total = 0;
    while (!stop) {
        size_t n = 1024 + rnd(&seed) % 3072;
        if (total + n < (64u << 20)) {
            struct leak *l = malloc(sizeof(*l) + n);
            if (l) {
                memset(l->payload, 0x5a, n);
                l->next = head;
                head = l;
                total += n;
            }
        }
        nap_ms(200);
    }
    return head; /* still reachable: a leak, not garbage */
}

static void *pager(void *arg) {
    (void)arg;
    long page = sysconf(_SC_PAGESIZE);
    nap_ms(1000);
    while (!stop) {
        size_t len = 32u << 20;
        char *big = calloc(1, len); /* above the mmap threshold: fresh zero pages */
        if (big) {
            for (size_t off = 0; off < len && !stop; off += (size_t)page)
                big[off] = 1; /* first touch: one anonymous fault per page */
            nap_ms(1000);
            free(big);
        }
        nap_ms(4000);
    }
    return NULL;
}

static void *files(void *arg) {
    (void)arg;
    static const char *paths[] = {"/proc/self/stat", "/proc/self/status", "/etc/hostname", "/etc/passwd"};
    char buf[4096];
    while (!stop) {
        for (unsigned k = 0; k < sizeof(paths) / sizeof(paths[0]); k++) {
            int fd = open(paths[k], O_RDONLY | O_CLOEXEC);
            if (fd >= 0) {
                while (read(fd, buf, sizeof(buf)) > 0)
                    ;
                close(fd);
            }
        }
        nap_ms(50);
    }
    return NULL;
}

int main(int argc, char **argv) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    long seconds = argc > 1 ? atol(argv[1]) : 0;
    /* Transparent huge pages off for this process. Where THP is "always" (Debian's stock
     * kernels), the pager's 32 MiB block would be faulted in as 2 MiB pages: ~16 huge faults
     * plus 4 KiB ones at the unaligned ends (543 measured in a Debian 12 VM, instead of
     * 8192), and khugepaged may collapse ranges later. The demo is there to show one fault
     * per page, the same on every kernel. (Fault-around does not apply: it maps file pages.) */
    prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);

    void *(*workers[])(void *) = {churn, churn, vector, aligned, leak, pager, files};
    enum { N = sizeof(workers) / sizeof(workers[0]) };
    pthread_t tids[N];
    for (int i = 0; i < N; i++) pthread_create(&tids[i], NULL, workers[i], (void *)(uintptr_t)i);

    printf("pymtrace-demo: pid %d, %d threads%s\n", (int)getpid(), N + 1,
           seconds > 0 ? "" : "; runs until killed");
    fflush(stdout);
    for (long t = 0; !stop && (seconds <= 0 || t < seconds * 10); t++) nap_ms(100);
    stop = 1;
    for (int i = 0; i < N; i++) pthread_join(tids[i], NULL);
    return 0;
}
