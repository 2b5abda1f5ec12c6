/* Capture of the calling function's own registers and stack, for tests/unit/test_unwind.py.
 *
 * selfstack_capture(path) is always inlined into its caller (the "leaf" of a known chain): it
 * records ip (a label inside the caller), sp, rbp, rbx, r12-r15 exactly as they are at that
 * label, then copies the stack from sp up to the top of the mapping holding it and writes
 * path: 8 registers (little-endian u64: ip sp bp bx r12 r13 r14 r15), the length (u64), the
 * bytes. What the BPF heap sampler records at a malloc, without BPF or root. */
#ifndef HEAP_SELFSTACK_H
#define HEAP_SELFSTACK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The end of the mapping holding ADDR, from /proc/self/maps. */
static inline uintptr_t selfstack_mapping_end(uintptr_t addr) {
    FILE *maps = fopen("/proc/self/maps", "r");
    unsigned long start, end;
    char line[512];
    uintptr_t found = 0;
    if (!maps) abort();
    while (!found && fgets(line, sizeof line, maps))
        if (sscanf(line, "%lx-%lx", &start, &end) == 2 && start <= addr && addr < end) found = end;
    fclose(maps);
    if (!found) abort();
    return found;
}

static inline __attribute__((always_inline)) void selfstack_capture(const char *path) {
    uint64_t regs[8];
    /* one asm: the registers are stored to memory (never moved through a register the
     * unwinder needs), then the label whose address is the ip */
    __asm__ volatile("leaq 0f(%%rip), %%rax\n\t"
                     "movq %%rax, 0(%0)\n\t"
                     "movq %%rsp, 8(%0)\n\t"
                     "movq %%rbp, 16(%0)\n\t"
                     "movq %%rbx, 24(%0)\n\t"
                     "movq %%r12, 32(%0)\n\t"
                     "movq %%r13, 40(%0)\n\t"
                     "movq %%r14, 48(%0)\n\t"
                     "movq %%r15, 56(%0)\n"
                     "0:\n\t"
                     :
                     : "r"(regs)
                     : "rax", "memory");
    uint64_t len = selfstack_mapping_end(regs[1]) - regs[1];
    FILE *out = fopen(path, "wbx");
    if (!out || fwrite(regs, sizeof regs, 1, out) != 1 || fwrite(&len, sizeof len, 1, out) != 1 ||
        fwrite((const void *)(uintptr_t)regs[1], 1, len, out) != len || fclose(out) != 0)
        abort();
}

#endif
