/* Known malloc-API calls for pymtrace's LD_PRELOAD interposer (tests/live/test_interposer.py),
 * each group with a size no other group uses, and its truth on stdout (write(2), no stdio):
 *   COUNT PID TYPE SIZE N     N calls of dj/malloc type TYPE (1 malloc, 3 free ...) with SIZE
 *                             (frees: SIZE of the blocks freed) made by process PID
 *
 * usage: interpose_calls MODE [ARG]
 *   threads WAVES   WAVES waves of 4 threads, each 1000 malloc(101)+free pairs, then it exits
 *   fork            10 malloc(1001); fork: the child 20 malloc(2002)+free and exits; 10 free
 *   exec            30 malloc(3003), then exec of itself as `after`
 *   after           40 malloc(4004)+free
 *   vfork           5 malloc(5005); vfork: the child execs itself as `after`; 5 free
 *   signal N        a SIGALRM handler: malloc(6006)+free at every tick (100 us) while the main
 *                   thread makes free(NULL) calls, until the handler ran N times
 *   signals2 N      the same, and a SIGPROF handler (CPU-time ticks): malloc(6116)+free; the
 *                   two handlers nest (each may interrupt the other)
 *   dlopen LIB      dlopen(LIB) and its lib_calls(50): 50 malloc(7007)+free
 *   errno           errno survives malloc, free and a failing malloc sets ENOMEM; prints ERRNO ok
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

static void say(const char *text) {
    size_t n = strlen(text);
    if (write(1, text, n) != (ssize_t)n) _exit(99);
}

static void count(int type, size_t size, long n) {
    char line[100];
    snprintf(line, sizeof line, "COUNT %d %d %zu %ld\n", (int)getpid(), type, size, n);
    say(line);
}

static void pairs(size_t size, long n) {
    for (long i = 0; i < n; i++) {
        void *volatile p = malloc(size);
        free(p);
    }
}

static void *worker(void *arg) {
    (void)arg;
    pairs(101, 1000);
    return NULL;
}

static void threads(int waves) {
    for (int w = 0; w < waves; w++) {
        pthread_t th[4];
        for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, worker, NULL);
        for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    }
    count(1, 101, 4000L * waves);
    count(3, 101, 4000L * waves);
}

static void after(void) {
    pairs(4004, 40);
    count(1, 4004, 40);
    count(3, 4004, 40);
}

static void keep_then_free(size_t size, int n, int (*between)(void)) {
    void *kept[64];
    for (int i = 0; i < n; i++) kept[i] = malloc(size);
    count(1, size, n);
    int rc = between();
    for (int i = 0; i < n; i++) free(kept[i]);
    count(3, size, n);
    if (rc) _exit(rc);
}

static char self[4096];

static int fork_child(void) {
    pid_t pid = fork();
    if (pid == 0) {
        pairs(2002, 20);
        count(1, 2002, 20);
        count(3, 2002, 20);
        _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 3;
}

static int vfork_exec(void) {
    char *argv[] = {self, "after", NULL};
    pid_t pid = vfork();
    if (pid == 0) {
        execv(self, argv);
        _exit(127);
    }
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 3;
}

static volatile sig_atomic_t ticks;

static void on_alarm(int sig) {
    (void)sig;
    int saved = errno;
    void *volatile p = malloc(6006);
    free(p);
    ticks++;
    errno = saved;
}

static volatile sig_atomic_t prof_ticks;

static void on_prof(int sig) {
    (void)sig;
    int saved = errno;
    void *volatile p = malloc(6116);
    free(p);
    prof_ticks++;
    errno = saved;
}

static void signals(long n, int two) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval tv = {{0, 100}, {0, 100}};
    setitimer(ITIMER_REAL, &tv, NULL);
    if (two) {
        sa.sa_handler = on_prof;
        sigaction(SIGPROF, &sa, NULL);
        setitimer(ITIMER_PROF, &tv, NULL);
    }
    long nulls = 0;
    while (ticks < n) {
        free(NULL); /* glibc's free(NULL) returns at once: a handler may interrupt it anywhere */
        nulls++;
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    setitimer(ITIMER_PROF, &off, NULL);
    sigset_t alarm;
    sigemptyset(&alarm);
    sigaddset(&alarm, SIGALRM);
    sigaddset(&alarm, SIGPROF);
    sigprocmask(SIG_BLOCK, &alarm, NULL); /* a tick already pending stays so: the count is final */
    long ran = ticks, prof = prof_ticks;
    count(1, 6006, ran);
    count(3, 6006, ran);
    if (two) {
        count(1, 6116, prof);
        count(3, 6116, prof);
    }
    count(3, 0, nulls);
}

static void errno_kept(void) {
    errno = 1234;
    void *p = malloc(10);
    if (errno != 1234) _exit(4);
    free(p);
    if (errno != 1234) _exit(5);
    free(NULL);
    if (errno != 1234) _exit(6);
    void *huge = malloc((size_t)1 << 62);
    if (huge || errno != ENOMEM) _exit(7);
    say("ERRNO ok\n");
}

int main(int argc, char **argv) {
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 2;
    self[n] = 0;
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "threads")) {
        threads(argc > 2 ? atoi(argv[2]) : 4);
    } else if (!strcmp(mode, "fork")) {
        keep_then_free(1001, 10, fork_child);
    } else if (!strcmp(mode, "exec")) {
        for (int i = 0; i < 30; i++) (void)malloc(3003);
        count(1, 3003, 30);
        char *args[] = {self, "after", NULL};
        execv(self, args);
        return 127;
    } else if (!strcmp(mode, "after")) {
        after();
    } else if (!strcmp(mode, "vfork")) {
        keep_then_free(5005, 5, vfork_exec);
    } else if (!strcmp(mode, "signal")) {
        signals(argc > 2 ? atol(argv[2]) : 500, 0);
    } else if (!strcmp(mode, "signals2")) {
        signals(argc > 2 ? atol(argv[2]) : 500, 1);
    } else if (!strcmp(mode, "dlopen")) {
        void *lib = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
        if (!lib) return 2;
        void (*calls)(int) = (void (*)(int))dlsym(lib, "lib_calls");
        calls(50);
        count(1, 7007, 50);
        count(3, 7007, 50);
    } else if (!strcmp(mode, "errno")) {
        errno_kept();
    } else {
        say("usage: interpose_calls threads|fork|exec|vfork|signal|signals2|dlopen|errno [ARG]\n");
        return 2;
    }
    return 0;
}
