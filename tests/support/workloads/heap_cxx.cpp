// C++ allocations with known counts for `pymtrace heap`'s tests (tests/live/test_heap.py),
// built -O2 -fomit-frame-pointer: operator new/new[] reach malloc, and the stack must show
// the C++ caller (demangled) above operator new, which an entry-time frame-pointer walk loses.
//
//   main -> shapes::build(int) -> new shapes::Node: NODES x 48 bytes, KEEP of them leaked
//   main -> shapes::buffers(int) -> new char[ARRAY_SIZE]: ARRAYS x, one leaked
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

namespace shapes {
struct Node {
    long v[6];  // 48 bytes
};
static Node *volatile keep[16];
static char *volatile keep_array;
static volatile int after;

NOINLINE void build(int n) {
    for (int i = 0; i < n; i++) {
        Node *node = new Node();
        if (i < 5)
            keep[i] = node;  // leaked
        else
            delete node;
    }
    after++;
}

NOINLINE void buffers(int n) {
    for (int i = 0; i < n; i++) {
        char *b = new char[1000];
        if (i == 0)
            keep_array = b;  // leaked
        else
            delete[] b;
    }
    after++;
}
}  // namespace shapes

int main() {
    shapes::build(30);
    shapes::buffers(4);
    if (write(1, "done\n", 5) != 5) return 3;
    return 0;
}
