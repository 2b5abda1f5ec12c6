// C++ + threads for the issue-13 prototype: new through a namespaced class, in 2 threads.
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <unistd.h>
#include <vector>
namespace shapes {
struct Node { long v[12]; };
template <typename T> struct Pool {
    std::vector<T *> keep;
    __attribute__((noinline)) T *make(long i) { T *n = new T(); n->v[0] = i; keep.push_back(n); return n; }
};
__attribute__((noinline)) void worker(int id, long n) {
    Pool<Node> pool;
    for (long i = 0; i < n; i++) pool.make(i + id);
    for (Node *p : pool.keep) delete p;
}
}  // namespace shapes
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000;
    usleep((argc > 2 ? atol(argv[2]) : 300) * 1000);
    std::thread t1(shapes::worker, 1, n), t2(shapes::worker, 2, n);
    t1.join(); t2.join();
    std::printf("cxx done %ld\n", n);
}
