/* The registers and a copy of the user stack at a probe, for unwinding in user space from
 * DWARF CFI (pymtrace.target.unwind). Shared by heap.bpf.c (at a sampled call's entry) and
 * record.bpf.c (record --stacks, at an allocating call's return). Not shared with user space
 * (no structs): the includer defines SC_PAGES (how many pages at most are copied) first and
 * passes a destination of SC_PAGES * SC_PAGE bytes in a map value. */
#ifndef PYMTRACE_STACKCOPY_H
#define PYMTRACE_STACKCOPY_H

#ifndef SC_PAGES
#error "define SC_PAGES before including stackcopy.h"
#endif

#define SC_PAGE 4096

/* ip, sp, bp, bx, r12, r13, r14, r15 (x86-64): what unwinding from CFI needs (the callee-saved
 * registers a caller's CFI may name, and the frame pointer where one is kept). */
static __always_inline void sc_regs(struct pt_regs *ctx, u64 *regs) {
    regs[0] = PT_REGS_IP(ctx);
    regs[1] = PT_REGS_SP(ctx);
    regs[2] = ctx->bp;
    regs[3] = ctx->bx;
    regs[4] = ctx->r12;
    regs[5] = ctx->r13;
    regs[6] = ctx->r14;
    regs[7] = ctx->r15;
}

/* Copy the stack from SP upward into DST, at most WANT bytes (<= SC_PAGES * SC_PAGE): the
 * partial page holding sp, then whole pages, the last one cut at WANT. A page is mapped or not,
 * so the copy stops exactly at the end of the stack mapping. Each page is written at a constant
 * offset from `first` (bounded for the verifier); a running length would lose the bound.
 * Returns the bytes copied (0 if even sp's page could not be read). */
static __always_inline u32 sc_copy_stack(u8 *dst, u64 sp, u32 want) {
    u32 len = 0;
    u32 first = SC_PAGE - (u32)(sp & (SC_PAGE - 1));
    if (first > want) first = want;
    if (first > SC_PAGE) first = SC_PAGE;
    if (first == 0) return 0;
    first = ((first - 1) & (SC_PAGE - 1)) + 1; /* the same, in a form the verifier bounds */
    if (pm_probe_read_user(dst, first, (void *)sp) != 0) return 0;
    len = first;
#pragma unroll
    for (int i = 0; i < SC_PAGES - 1; i++) {
        u32 chunk = want - len;
        if (len >= want) break;
        if (chunk > SC_PAGE) chunk = SC_PAGE;
        chunk = ((chunk - 1) & (SC_PAGE - 1)) + 1; /* [1, SC_PAGE]: unchanged, but the verifier sees it */
        if (pm_probe_read_user(dst + first + i * SC_PAGE, chunk, (void *)(sp + first + i * SC_PAGE)) != 0)
            break;
        len += chunk;
    }
    return len;
}

#endif
