/* operator new that throws (tests/live/test_interposer.py): 3 new[] of 2^62 bytes, each
 * std::bad_alloc caught, then 10 new(100)+delete; prints "caught N". */
#include <cstdio>
#include <new>

static void *volatile sink;
static volatile size_t huge = (size_t)1 << 62;

int main() {
    int caught = 0;
    for (int i = 0; i < 3; i++) {
        try {
            sink = ::operator new[](huge);
        } catch (std::bad_alloc &) {
            caught++;
        }
    }
    for (int i = 0; i < 10; i++) {
        sink = ::operator new(100);
        ::operator delete(sink);
    }
    printf("caught %d\n", caught);
    return 0;
}
