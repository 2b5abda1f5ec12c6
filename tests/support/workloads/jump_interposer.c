/* An LD_PRELOAD library whose malloc and free are each one `notrack jmp *next(%rip)` to the
 * next definition (dlsym RTLD_NEXT): an instruction x86 uprobes refuse (its DS prefix, as any
 * segment prefix), and one no probe can be moved past, being the function's jump itself. */
#define _GNU_SOURCE
#include <dlfcn.h>

__attribute__((visibility("hidden"))) void *next_malloc, *next_free;

__attribute__((constructor)) static void resolve(void) {
    next_malloc = dlsym(RTLD_NEXT, "malloc");
    next_free = dlsym(RTLD_NEXT, "free");
}

__asm__(".text\n"
        ".globl malloc\n"
        ".type malloc, @function\n"
        "malloc:\n"
        "\tnotrack jmp *next_malloc(%rip)\n"
        ".size malloc, .-malloc\n"
        ".globl free\n"
        ".type free, @function\n"
        "free:\n"
        "\tnotrack jmp *next_free(%rip)\n"
        ".size free, .-free\n");
