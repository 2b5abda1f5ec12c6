/* A known call chain that dumps its own registers and stack at its leaf (heap_selfstack.h),
 * for tests/unit/test_unwind.py. Built -O2 -fomit-frame-pointer (and once with -g).
 *
 *   heap_selfstack MODE DUMPFILE
 *   MODE exe:    main -> a -> b -> leaf                    (captures in leaf)
 *   MODE lib:    main -> a -> lib_b -> lib_leaf            (libheap_selfstack_lib.so)
 *   MODE inline: main -> a -> b_inl -> inl_leaf (inlined)  (captures in inl_leaf)
 *   MODE thread: thread_main -> a -> b -> leaf, in a second thread (its tid printed)
 *
 * Prints "ready" once DUMPFILE is written, then waits for a line on stdin and exits. Every
 * function is noipa (no inlining, no clones) and uses its callee's result (no tail calls). */
#include "heap_selfstack.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifdef WITH_LIB
int lib_b(const char *path, int n);
#endif

__attribute__((noipa)) int leaf(const char *path, int n) {
    selfstack_capture(path);
    return n * 2;
}

__attribute__((noipa)) int b(const char *path, int n) {
    return leaf(path, n + 1) + 1;
}

static inline __attribute__((always_inline)) int inl_leaf(const char *path, int n) {
    selfstack_capture(path);
    return n * 5;
}

__attribute__((noipa)) int b_inl(const char *path, int n) {
    return inl_leaf(path, n + 2) + 1;
}

__attribute__((noipa)) int a(const char *mode, const char *path, int n) {
    int r;
    if (strcmp(mode, "exe") == 0)
        r = b(path, n);
    else if (strcmp(mode, "inline") == 0)
        r = b_inl(path, n);
#ifdef WITH_LIB
    else if (strcmp(mode, "lib") == 0)
        r = lib_b(path, n);
#endif
    else
        abort();
    return r + 1;
}

static const char *thread_dump;
static long thread_tid;

__attribute__((noipa)) static void *thread_main(void *arg) {
    thread_tid = syscall(SYS_gettid);
    int r = a("exe", thread_dump, (int)(long)arg);
    return (void *)(long)(r + 1);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: heap_selfstack exe|lib|inline|thread DUMPFILE\n");
        return 2;
    }
    int r;
    if (strcmp(argv[1], "thread") == 0) {
        pthread_t thread;
        void *result;
        thread_dump = argv[2];
        if (pthread_create(&thread, NULL, thread_main, (void *)3L) != 0 || pthread_join(thread, &result) != 0)
            abort();
        r = (int)(long)result;
        printf("tid %ld\n", thread_tid);
    } else {
        r = a(argv[1], argv[2], argc);
    }
    printf("ready %d\n", r);
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 0;
    return r == 0;
}
