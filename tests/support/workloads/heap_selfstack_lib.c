/* The shared-library half of heap_selfstack.c's "lib" chain: a -> lib_b -> lib_leaf, built
 * -O2 -fomit-frame-pointer like the executable. */
#include "heap_selfstack.h"

__attribute__((noipa)) int lib_leaf(const char *path, int n) {
    selfstack_capture(path);
    return n * 3;
}

__attribute__((noipa)) int lib_b(const char *path, int n) {
    return lib_leaf(path, n + 1) + 1; /* "+ 1": no tail call, the frame stays */
}
