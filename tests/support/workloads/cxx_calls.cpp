/* C++ operator new/delete with exactly known counts per variant (tests/live/test_cxx_calls.py).
 *
 * Protocol (tests/support/top.py Workload): prints "ready PID", waits for a byte on stdin,
 * makes ROUNDS rounds of calls, prints one JSON line of its tally, waits for another byte,
 * exits. Each operator is called explicitly (::operator new(...)), so no new-expression is
 * elided or turned into another variant by the compiler; the pointers go through a volatile
 * sink. No other allocation happens between the two bytes: output is snprintf + write(2).
 */
#include <cstdio>
#include <cstdlib>
#include <new>
#include <unistd.h>

#define ROUNDS 100

static void *volatile sink;

static void keep(void *p) {
    sink = p;
}

int main() {
    char line[512];
    int n = snprintf(line, sizeof(line), "ready %d\n", (int)getpid());
    if (write(1, line, n) != n) return 1;
    char c;
    if (read(0, &c, 1) != 1) return 1;
    const std::align_val_t al = std::align_val_t(64);
    unsigned long news = 0, arrays = 0, nothrows = 0, aligned = 0;
    unsigned long deletes = 0, delete_arrays = 0, sized = 0, delete_aligned = 0;
    for (int i = 0; i < ROUNDS; i++) {
        size_t size = 16 + 8 * i;
        void *a = ::operator new(size); /* _Znwm */
        news++;
        keep(a);
        ::operator delete(a); /* _ZdlPv */
        deletes++;
        void *b = ::operator new[](size); /* _Znam */
        arrays++;
        keep(b);
        ::operator delete[](b); /* _ZdaPv */
        delete_arrays++;
        void *d = ::operator new(size, std::nothrow); /* _ZnwmRKSt9nothrow_t */
        nothrows++;
        keep(d);
        ::operator delete(d, size); /* _ZdlPvm */
        sized++;
        void *e = ::operator new[](size, std::nothrow); /* _ZnamRKSt9nothrow_t */
        nothrows++;
        keep(e);
        ::operator delete[](e, size); /* _ZdaPvm */
        sized++;
        void *f = ::operator new(size, al); /* _ZnwmSt11align_val_t */
        aligned++;
        keep(f);
        ::operator delete(f, al); /* _ZdlPvSt11align_val_t */
        delete_aligned++;
        void *g = ::operator new[](size, al); /* _ZnamSt11align_val_t */
        aligned++;
        keep(g);
        ::operator delete[](g, size, al); /* _ZdaPvmSt11align_val_t */
        delete_aligned++;
    }
    n = snprintf(line, sizeof(line),
                 "{\"calls\": {\"new\": %lu, \"new_array\": %lu, \"new_nothrow\": %lu, \"new_aligned\": %lu, "
                 "\"delete\": %lu, \"delete_array\": %lu, \"delete_sized\": %lu, \"delete_aligned\": %lu}, "
                 "\"requested_bytes\": %lu}\n",
                 news, arrays, nothrows, aligned, deletes, delete_arrays, sized, delete_aligned,
                 (unsigned long)ROUNDS * 6 * 16 + 6UL * 8 * (ROUNDS * (ROUNDS - 1) / 2));
    if (write(1, line, n) != n) return 1;
    if (read(0, &c, 1) != 1) return 1;
    return 0;
}
