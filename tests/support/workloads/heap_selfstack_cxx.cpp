// The C++ chain of tests/unit/test_unwind.py: names to demangle, and a `new` on the way.
//   heap_selfstack_cxx DUMPFILE: main -> shapes::build(int) -> shapes::Pool<shapes::Node>::make(long)
// captures its stack after allocating with new, prints "ready", waits for a line on stdin.
#include "heap_selfstack.h"

namespace shapes {
struct Node {
    long value;
    Node *next;
};

template <typename T> struct Pool {
    T *head = nullptr;
    __attribute__((noipa)) long make(long n, const char *path);
};

template <typename T> long Pool<T>::make(long n, const char *path) {
    T *node = new T{n, head};
    head = node;
    selfstack_capture(path);
    return node->value + 1;
}

__attribute__((noipa)) long build(int n, const char *path) {
    Pool<Node> pool;
    long r = pool.make(n, path) + 1;
    delete pool.head;
    return r;
}
} // namespace shapes

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    long r = shapes::build(argc, argv[1]);
    printf("ready %ld\n", r);
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 0;
    return r == 0;
}
