/* operator new failing three times (no memory for 2^62 bytes), each bad_alloc caught by the
 * program (tests/live/test_cxx_calls.py): prints "caught 3". */
#include <cstdio>
#include <new>

int main() {
    int caught = 0;
    for (int i = 0; i < 3; i++) {
        try {
            void *volatile p = ::operator new((size_t)1 << 62);
            (void)p;
        } catch (const std::bad_alloc &) {
            caught++;
        }
    }
    printf("caught %d\n", caught);
    return 0;
}
