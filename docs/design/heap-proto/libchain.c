#include <stdlib.h>
#include <string.h>
__attribute__((noinline)) void *lib_inner(size_t n) { void *p = malloc(n); if (p) memset(p, 2, 8); return p; }
__attribute__((noinline)) void *lib_outer(size_t n) { void *p = lib_inner(n); if (p) ((char *)p)[9] = 3; return p; }
