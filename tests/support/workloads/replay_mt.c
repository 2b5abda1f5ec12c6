/* Multi-threaded allocation workload for the record -> workload -> replay end-to-end test.
 *
 * NTHREADS workers each allocate blocks with every malloc-API call type and hand half of them
 * to the next worker through a mutex-protected mailbox, which frees them (cross-thread frees);
 * the rest are realloc'd and freed locally. usage: replay_mt [ROUNDS]
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NTHREADS 4
#define BOX      64

struct mailbox {
    pthread_mutex_t lock;
    void *items[BOX];
    int n;
};

static struct mailbox boxes[NTHREADS];
static int rounds = 200;

/* hand P to thread TO; if its mailbox is full, free P here instead (never block) */
static void post(int me, int to, void *p) {
    struct mailbox *b = &boxes[to];
    (void)me;
    pthread_mutex_lock(&b->lock);
    if (b->n < BOX) {
        b->items[b->n++] = p;
        p = NULL;
    }
    pthread_mutex_unlock(&b->lock);
    free(p);
}

static int drain(int me) {
    struct mailbox *b = &boxes[me];
    void *items[BOX];
    int n;
    pthread_mutex_lock(&b->lock);
    n = b->n;
    memcpy(items, b->items, n * sizeof *items);
    b->n = 0;
    pthread_mutex_unlock(&b->lock);
    for (int i = 0; i < n; i++) free(items[i]);
    return n;
}

static void *worker(void *arg) {
    int me = (int)(long)arg, next = (me + 1) % NTHREADS;
    for (int r = 0; r < rounds; r++) {
        void *a = malloc(16 + (r % 7) * 24);
        void *b = calloc(4, 8 + r % 5);
        void *c = memalign(64, 100 + r);
        void *d = NULL;
        if (posix_memalign(&d, 32, 48 + r % 9) != 0) d = NULL;
        void *e = NULL;
        if (r % 20 == 0) {
            e = valloc(200);
            free(pvalloc(100));
        }
        a = realloc(a, 300 + r);
        post(me, next, b);
        post(me, next, d);
        free(a);
        free(c);
        free(e);
        free(NULL);
        drain(me);
    }
    return NULL;
}

int main(int argc, char **argv) {
    pthread_t t[NTHREADS];
    if (argc > 1) rounds = atoi(argv[1]);
    for (int i = 0; i < NTHREADS; i++) pthread_mutex_init(&boxes[i].lock, NULL);
    for (long i = 0; i < NTHREADS; i++) pthread_create(&t[i], NULL, worker, (void *)i);
    for (int i = 0; i < NTHREADS; i++) pthread_join(t[i], NULL);
    for (int i = 0; i < NTHREADS; i++) drain(i);
    printf("done\n");
    return 0;
}
