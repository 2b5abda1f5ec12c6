/* Arenas, heaps and arena lock contention, deterministically.
 *
 * glibc_arenas new N       N threads, alive at once, each mallocs: N arenas created
 *                          (memory_arena_new + memory_heap_new each); every thread then
 *                          grows its heap by BLOCKS x 100000 bytes and frees them in
 *                          reverse (heap_more ... heap_less); thread 0 first allocates past
 *                          one 64 MiB heap, so a second heap is created and freed
 *                          (heap_new + heap_free). After they exit, N new threads take the
 *                          arenas back from the free list (memory_arena_reuse_free_list).
 * glibc_arenas wait K      mallopt(M_ARENA_MAX, 1); a helper thread holds the main arena's
 *                          lock inside malloc_stats() (its fprintf to stderr blocks on a
 *                          full pipe), K threads then malloc: each waits once
 *                          (memory_arena_reuse_wait) and reuses the main arena.
 * Prints "tid I TID" per worker and facts as "key value" lines. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define BLOCK 100000
static int nthreads;
static pthread_barrier_t barrier;
static pthread_mutex_t print_lock = PTHREAD_MUTEX_INITIALIZER;

static void say_tid(const char *what, int i) {
    pthread_mutex_lock(&print_lock);
    printf("%s %d %ld\n", what, i, (long)syscall(SYS_gettid));
    fflush(stdout);
    pthread_mutex_unlock(&print_lock);
}

static void *creator(void *arg) {
    int i = (int)(long)arg;
    void *first = malloc(64); /* attaches this thread to a new arena */
    say_tid("tid", i);
    pthread_barrier_wait(&barrier); /* all threads hold their arena at once */
    int blocks = i == 0 ? 700 : 20; /* thread 0 needs a second 64 MiB heap */
    void **b = malloc(blocks * sizeof(void *));
    for (int k = 0; k < blocks; k++) b[k] = malloc(BLOCK);
    for (int k = blocks - 1; k >= 0; k--) free(b[k]);
    free(b);
    free(first);
    pthread_barrier_wait(&barrier);
    return 0;
}

static void *reuser(void *arg) {
    int i = (int)(long)arg;
    void *p = malloc(64);
    say_tid("reuse_tid", i);
    pthread_barrier_wait(&barrier);
    free(p);
    return 0;
}

/* The decimal number BUF starts with. Not atoi(): with _GNU_SOURCE, glibc 2.38+ headers bind
   it to __isoc23_strtol, which the probe-carrying glibc 2.36 this runs on (../shared/glibc-sdt)
   lacks, so built on Debian 13 the program would not start there. */
static long leading_number(const char *buf) {
    long v = 0;
    while (*buf >= '0' && *buf <= '9') v = v * 10 + (*buf++ - '0');
    return v;
}

static int pipefd[2];
static pthread_barrier_t go_holder, go_waiters;
static volatile long holder_tid, waiter_tid[64], waiter_released[64];

/* Block until thread TID sits in system call NR (5 s at most), per /proc/self/task. */
static void wait_in_syscall(long tid, int nr) {
    char path[64], buf[64];
    snprintf(path, sizeof path, "/proc/self/task/%ld/syscall", tid);
    for (int i = 0; i < 500; i++) {
        int fd = open(path, O_RDONLY);
        ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
        if (fd >= 0) close(fd);
        if (n > 0) {
            buf[n] = 0;
            if (leading_number(buf) == nr) return;
        }
        usleep(10000);
    }
}

static void *stats_holder(void *arg) {
    (void)arg;
    holder_tid = syscall(SYS_gettid);
    pthread_barrier_wait(&go_holder);
    malloc_stats(); /* locks the main arena, then blocks writing to the full pipe */
    return 0;
}

static void *waiter(void *arg) {
    int i = (int)(long)arg;
    waiter_tid[i] = syscall(SYS_gettid);
    say_tid("wait_tid", i);
    pthread_barrier_wait(&go_waiters);
    waiter_released[i] = 1;
    void *p = malloc(64); /* arena_max 1: reused_arena -> main arena locked -> wait */
    free(p);
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "new";
    nthreads = argc > 2 ? (int)leading_number(argv[2]) : 3;
    pthread_t th[64];
    mallopt(M_MMAP_THRESHOLD, 1024 * 1024); /* 100000-byte blocks stay in the heaps */
    if (strcmp(mode, "new") == 0) {
        pthread_barrier_init(&barrier, 0, nthreads);
        for (int i = 0; i < nthreads; i++) pthread_create(&th[i], 0, creator, (void *)(long)i);
        for (int i = 0; i < nthreads; i++) pthread_join(th[i], 0);
        pthread_barrier_destroy(&barrier);
        pthread_barrier_init(&barrier, 0, nthreads);
        for (int i = 0; i < nthreads; i++) pthread_create(&th[i], 0, reuser, (void *)(long)i);
        for (int i = 0; i < nthreads; i++) pthread_join(th[i], 0);
        printf("arenas_created %d\n", nthreads);
    } else {
        mallopt(M_ARENA_MAX, 1);
        if (pipe(pipefd)) return 2;
        fcntl(pipefd[1], F_SETFL, O_NONBLOCK);
        char junk[4096];
        memset(junk, 'x', sizeof junk);
        while (write(pipefd[1], junk, sizeof junk) > 0)
            ;
        while (write(pipefd[1], junk, 1) > 0)
            ;
        fcntl(pipefd[1], F_SETFL, 0);
        int saved = dup(2);
        printf("mode wait\n"); /* stdout's buffer comes from the main arena now */
        fflush(stdout);
        /* every thread exists before the lock is taken: pthread_create itself
		 * callocs (the new thread's TLS) in the main arena */
        pthread_t holder;
        pthread_barrier_init(&go_holder, 0, 2);
        pthread_barrier_init(&go_waiters, 0, nthreads + 1);
        pthread_create(&holder, 0, stats_holder, 0);
        for (int i = 0; i < nthreads; i++) pthread_create(&th[i], 0, waiter, (void *)(long)i);
        usleep(100000);
        dup2(pipefd[1], 2);
        pthread_barrier_wait(&go_holder);
        /* the holder is blocked in write() with the main arena locked */
        wait_in_syscall(holder_tid, SYS_write);
        pthread_barrier_wait(&go_waiters);
        for (int i = 0; i < nthreads; i++) { /* every waiter blocks on the arena lock */
            while (!waiter_released[i]) usleep(1000);
            wait_in_syscall(waiter_tid[i], SYS_futex);
        }
        char buf[65536];
        fcntl(pipefd[0], F_SETFL, O_NONBLOCK);
        for (int r = 0; r < 50; r++) { /* drain until the holder is done */
            while (read(pipefd[0], buf, sizeof buf) > 0)
                ;
            usleep(10000);
        }
        pthread_join(holder, 0);
        for (int i = 0; i < nthreads; i++) pthread_join(th[i], 0);
        dup2(saved, 2);
        printf("waiters %d\n", nthreads);
    }
    fflush(stdout);
    return 0;
}
