/* Many threads racing on the interposer's ring (tests/live/test_interposer.py): WAVES waves of
 * THREADS threads; thread k of wave w (index j = w * THREADS + k) makes N calls malloc(SIZE)
 * + free with SIZE = (j << 20) + i + 1 for i = 0 .. N-1, so each thread's records can be
 * checked to be exactly its calls, in order, none lost or repeated.
 * usage: interpose_stress WAVES THREADS N; prints "STRESS threads N" at the end. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static long calls;

static void *worker(void *arg) {
    long j = (long)arg;
    for (long i = 0; i < calls; i++) {
        void *volatile p = malloc(((size_t)j << 20) + (size_t)i + 1);
        free(p);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    int waves = atoi(argv[1]), threads = atoi(argv[2]);
    calls = atol(argv[3]);
    pthread_t th[64];
    if (threads > 64 || calls >= (1L << 20)) return 2;
    for (int w = 0; w < waves; w++) {
        for (int k = 0; k < threads; k++)
            pthread_create(&th[k], NULL, worker, (void *)(long)(w * threads + k));
        for (int k = 0; k < threads; k++) pthread_join(th[k], NULL);
    }
    printf("STRESS %d %ld\n", waves * threads, calls);
    return 0;
}
