/* The interposer's rings read by their consumer (pymtrace/sources/interposer.py), in C: a
 * drain copies some million records a second per ring, where a Python loop or a numpy
 * expression per step would cost the program waits for a full ring. A separate library from
 * the interposer: the consumer loads it with ctypes, and loading the interposer itself would
 * run its constructor in pymtrace. Layout and protocol: interpose.h. */
#include <stdint.h>
#include <string.h>
#include <time.h>

#define EVENT_WORDS  9 /* struct record_event: the 64-byte record, then the process id */
#define RECORD_WORDS 8
#define TIME_WORD    6 /* rec.pad[0] */

/* The time stamp counter and CLOCK_MONOTONIC read together (the counter's at the middle). */
void pymtrace_clock_pair(uint64_t *tsc, uint64_t *ns) {
    struct timespec t;
    uint64_t before = __builtin_ia32_rdtsc();
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint64_t after = __builtin_ia32_rdtsc();
    *tsc = before + (after - before) / 2;
    *ns = (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Copy the records at positions TAIL .. TAIL+N-1 of a ring (SEQ: its sequence words, EVENTS:
 * its record_events, SLOTS a power of two) into OUT as 64-byte records (the process id
 * dropped), in order, up to the first slot not committed yet. FINAL (the writers are gone): a
 * slot reserved but never written is skipped, counted in *TORN. TYPES[t] counts the records of
 * each call type t (0-8). Returns the positions consumed (the caller moves the ring's tail by
 * as many); *WRITTEN: the records in OUT. */
uint64_t pymtrace_ring_take(const uint64_t *seq, const uint64_t *events, uint64_t slots, uint64_t tail,
                            uint64_t n, int final, uint64_t *out, uint64_t *written, uint64_t *torn,
                            uint64_t *types) {
    uint64_t mask = slots - 1, done = 0, w = 0;
    for (; done < n; done++) {
        uint64_t pos = tail + done, i = pos & mask;
        if (__atomic_load_n(&seq[i], __ATOMIC_ACQUIRE) != pos + 1) {
            if (!final) break;
            (*torn)++;
            continue;
        }
        uint64_t *o = out + w * RECORD_WORDS;
        memcpy(o, events + i * EVENT_WORDS, RECORD_WORDS * 8);
        uint32_t type = (uint32_t)(o[0] >> 32);
        types[(type & 0xff) < 9 ? (type & 0xff) : 0]++; /* bits 8-31: a stack id */
        w++;
    }
    *written = w;
    return done;
}

/* The time words of N records at OUT (counter values) as CLOCK_MONOTONIC ns: linear between
 * the pairs (PTSC[i], PNS[i]), NP >= 2 of them in increasing order, read after the records
 * were copied (so nearly every value lies before the last pair); beyond the pairs at the rate
 * of the nearest segment. The map is the same for a value whichever drain maps it, so a
 * thread's times keep their order. */
void pymtrace_map_times(uint64_t *out, uint64_t n, const int64_t *ptsc, const int64_t *pns, int np) {
    int last = np - 2; /* the segment most values fall in */
    for (uint64_t k = 0; k < n; k++) {
        int64_t t = (int64_t)out[k * RECORD_WORDS + TIME_WORD];
        int s = last;
        if (t < ptsc[last]) { /* an older value: the segment holding it */
            int lo = 0, hi = last;
            while (lo < hi) {
                int mid = (lo + hi + 1) / 2;
                if (ptsc[mid] <= t)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            s = lo;
        }
        int64_t dt = ptsc[s + 1] - ptsc[s];
        double rate = dt > 0 ? (double)(pns[s + 1] - pns[s]) / (double)dt : 1.0;
        double v = (double)(t - ptsc[s]) * rate;
        out[k * RECORD_WORDS + TIME_WORD] = (uint64_t)(pns[s] + (int64_t)(v < 0 ? v - 0.5 : v + 0.5));
    }
}
