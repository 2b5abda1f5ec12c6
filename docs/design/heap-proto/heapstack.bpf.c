/* Prototype for issue 13: sampled malloc calls with a copy of the user stack + registers.
 * -D switches: STACK_PAGES (pages copied at most, besides the partial first one),
 * RB_PAGES, SAMPLE_MEAN (0 = every call), COPY (0 = do not copy the stack: cost baseline). */
#include <uapi/linux/ptrace.h>

#ifndef STACK_PAGES
#define STACK_PAGES 4
#endif
#ifndef RB_PAGES
#define RB_PAGES 1024
#endif
#ifndef SAMPLE_MEAN
#define SAMPLE_MEAN 0
#endif
#ifndef COPY
#define COPY 1
#endif
#define PAGE 4096
#define STACK_MAX (STACK_PAGES * PAGE)

struct sample {
    u32 pid;
    u32 tid;
    u64 size;
    u64 ts;
    u64 id;
    u64 ip, sp, bp, bx, r12, r13, r14, r15;
    u32 stack_len;   /* bytes valid in stack[], starting at sp */
    u32 copy_ns;
    u8 stack[STACK_MAX];
};

BPF_RINGBUF_OUTPUT(events, RB_PAGES);
#ifndef VARLEN
#define VARLEN 0
#endif
#if VARLEN
/* Variable-length records: build the sample in a per-CPU slot, then bpf_ringbuf_output only the
 * bytes copied (the ring holds many more samples; costs one extra memcpy).  A plain array indexed
 * by CPU: per-CPU maps cap values at 32 KiB. */
BPF_ARRAY(scratch, struct sample, 256);
#endif
/* 0 calls seen, 1 sampled, 2 reserve failed, 3 copy ns total, 4 bytes copied, 5 live-map full */
BPF_PERCPU_ARRAY(stats, u64, 8);
BPF_ARRAY(next_id, u64, 1);
BPF_ARRAY(target, u32, 1);   /* the traced tgid, set by user space */
static __always_inline int traced(u32 pid) { u32 z = 0; u32 *t = target.lookup(&z); return t && *t == pid; }
/* log2 table: lg[j] = round(2^20 * log2(1 + j/1024)), j = 0..1024, filled by user space */
BPF_ARRAY(lg, u32, 1025);
BPF_TABLE("lru_hash", u32, s64, until_sample, 16384);  /* per thread: bytes left before the next sample */
BPF_HASH(pending, u32, u64, 16384);                    /* tid -> sample id between malloc entry and return */
BPF_HASH(live, u64, u64, 65536);                       /* sampled block address -> sample id */

static __always_inline void stat_add(u32 i, u64 v) {
    u64 *p = stats.lookup(&i);
    if (p) *p += v;
}

#if SAMPLE_MEAN > 0
/* Exp(mean) in bytes without floats: -ln(U) = ln2 * -log2(U), U = x / 2^32, x uniform 32-bit.
 * log2(x) = k + log2(1 + f): k from a bit search; log2(1 + f) from lg[] at f's top 10 bits,
 * linearly interpolated with the next 12 (without it, draws below ~mean/1000 are quantized and
 * tiny blocks get the wrong sampling probability). */
static __always_inline s64 draw_exp(void) {
    u32 x = bpf_get_prandom_u32() | 1;
    u32 k = 0, t = x;
    if (t >= (1u << 16)) { k += 16; t >>= 16; }
    if (t >= (1u << 8)) { k += 8; t >>= 8; }
    if (t >= (1u << 4)) { k += 4; t >>= 4; }
    if (t >= (1u << 2)) { k += 2; t >>= 2; }
    if (t >= (1u << 1)) { k += 1; }
    u32 m = (x << (31 - k)) & 0x7fffffff;          /* mantissa, 31 bits */
    u32 j = (m >> 21) & 1023, j1 = j + 1, rem = (m >> 9) & 4095;
    u32 *l0 = lg.lookup(&j), *l1 = lg.lookup(&j1);
    if (!l0 || !l1) return SAMPLE_MEAN;
    u64 lgf = *l0 + ((u64)(*l1 - *l0) * rem >> 12);
    u64 neg = (32ull << 20) - (((u64)k << 20) + lgf);   /* -log2(U), 12.20 fixed point */
    /* mean * ln2 (45426 / 2^16) * neg: < 2^32 * 2^25, fits */
    return (s64)(((u64)SAMPLE_MEAN * 45426ull >> 16) * neg >> 20) + 1;
}
#endif

int on_malloc(struct pt_regs *ctx) {
    u64 pt = bpf_get_current_pid_tgid();
    u32 pid = pt >> 32, tid = (u32)pt;
    if (!traced(pid)) return 0;
    u64 size = PT_REGS_PARM1(ctx);
    stat_add(0, 1);
#if SAMPLE_MEAN > 0
    if (size < SAMPLE_MEAN) {
        s64 *left = until_sample.lookup(&tid);
        if (!left) {
            s64 init = draw_exp();
            until_sample.update(&tid, &init);
            left = until_sample.lookup(&tid);
            if (!left) return 0;
        }
        *left -= (s64)size;
        if (*left > 0) return 0;
        *left = draw_exp();   /* memoryless: a fresh draw after each sample */
    }
#endif
    u64 t0 = bpf_ktime_get_ns();
#if VARLEN
    u32 cpu = bpf_get_smp_processor_id();
    struct sample *s = scratch.lookup(&cpu);
    if (!s) return 0;
#else
    struct sample *s = events.ringbuf_reserve(sizeof(struct sample));
    if (!s) { stat_add(2, 1); return 0; }
#endif
    u32 zero = 0;
    u64 *idp = next_id.lookup(&zero);
    u64 id = idp ? __sync_fetch_and_add(idp, 1) : 0;
    s->pid = pid; s->tid = tid; s->size = size; s->ts = t0; s->id = id;
    s->ip = ctx->ip; s->sp = ctx->sp; s->bp = ctx->bp; s->bx = ctx->bx;
    s->r12 = ctx->r12; s->r13 = ctx->r13; s->r14 = ctx->r14; s->r15 = ctx->r15;
    u32 len = 0;
#if COPY
    /* The partial page holding sp, then whole pages: a page is mapped or not, so the copy
     * stops exactly at the end of the stack mapping, never losing its last bytes. */
    u64 sp = ctx->sp;
    u32 first = PAGE - (u32)(sp & (PAGE - 1));   /* 1..4096 */
    if (first > PAGE) first = PAGE;               /* for the verifier */
    if (bpf_probe_read_user(s->stack, first, (void *)sp) == 0) {
        len = first;
#pragma unroll
        for (int i = 0; i < STACK_PAGES - 1; i++) {
            /* first is in [1, PAGE]: the verifier sees the bound of each constant-i offset */
            if (bpf_probe_read_user(s->stack + first + i * PAGE, PAGE, (void *)(sp + first + i * PAGE)) != 0)
                break;
            len = first + (i + 1) * PAGE;
        }
    }
#endif
    s->stack_len = len;
    u64 t1 = bpf_ktime_get_ns();
    s->copy_ns = (u32)(t1 - t0);
    stat_add(1, 1); stat_add(3, t1 - t0); stat_add(4, len);
#if VARLEN
    u64 out = offsetof(struct sample, stack) + len;
    if (out > sizeof(struct sample)) out = sizeof(struct sample);
    if (events.ringbuf_output(s, out, BPF_RB_NO_WAKEUP) != 0) { stat_add(2, 1); return 0; }
#else
    events.ringbuf_submit(s, BPF_RB_NO_WAKEUP);
#endif
    pending.update(&tid, &id);
    return 0;
}

int on_malloc_ret(struct pt_regs *ctx) {
    u64 pt = bpf_get_current_pid_tgid();
    if (!traced(pt >> 32)) return 0;
    u32 tid = (u32)pt;
    u64 *id = pending.lookup(&tid);
    if (!id) return 0;
    u64 ptr = PT_REGS_RC(ctx), v = *id;
    pending.delete(&tid);
    if (ptr && live.insert(&ptr, &v) != 0) stat_add(5, 1);
    return 0;
}

int on_free(struct pt_regs *ctx) {
    if (!traced(bpf_get_current_pid_tgid() >> 32)) return 0;
    u64 ptr = PT_REGS_PARM1(ctx);
    if (ptr) live.delete(&ptr);
    return 0;
}
