/* heap: sampled malloc-API calls of the target processes, each with a copy of the user stack
 * and the registers at function entry, plus the sampled blocks still live (pymtrace heap,
 * docs/heap.md; design: docs/design/heap-stacks.md).
 *
 * Attach points (pymtrace/collect/heap.py HeapCollector picks the sites, as top does):
 *   malloc, calloc, realloc, memalign (= aligned_alloc in glibc 2.36), aligned_alloc (2.41),
 *   posix_memalign, valloc, pvalloc    entry (hp_<call>_entry) + return (hp_return), the entry
 *                                      at +0 (the copied stack must hold the caller's return
 *                                      address, which a uretprobe replaces once +0 has run)
 *   free                               at its first emulated instruction (`push`, +9 on glibc
 *                                      2.36) and the early-exit paths before it
 *   sched:sched_process_exec/exit      (hp_exec, hp_exit) records for user space
 *   sched:sched_process_fork           (HP_FOLLOW) children of targets become targets
 *   pymtrace:heap_alloc, heap_free     the USDT sites of pymtrace's interposer (sampling mode,
 *                                      tracee/native/interpose.c: it draws the samples
 *                                      in-process): hp_usdt_alloc, hp_usdt_free, called by
 *                                      the site functions user space generates (HeapSource)
 * hp_targets says per process which of the two paths traces it (HP_VIA_*): the other's
 * programs ignore it.
 *
 * Sampling (design doc section 6): per thread, `left` bytes until the next sample, drawn
 * Exp(HP_SAMPLE_MEAN); a call of size >= HP_SAMPLE_MEAN is always sampled, a smaller one when
 * it uses up `left`, so P(sampled) = 1 - exp(-size / mean) for every block. HP_SAMPLE_MEAN 1:
 * every call (malloc(0) too). A sampled call's record (struct hp_event + the stack bytes) is
 * reserved in the ring at its largest size and the stack copied straight into it (HP_RESERVE 1,
 * one copy), or built in a per-CPU slot and written with ringbuf_output(length) (HP_RESERVE 0:
 * two copies, the ring holds only the bytes copied). Its block, once returned, goes into
 * hp_live until freed.
 *
 * Nested calls: realloc and the memalign family keep an hp_pending entry for the whole call,
 * so glibc's internal malloc/free calls (realloc(NULL, n) tail-jumps into malloc,
 * posix_memalign(<= 16) calls malloc) are not sampled again; a sampled malloc/calloc keeps one
 * only until its return. The call's own return is the one whose stack pointer is the entry's
 * + 8 (the return address popped): a nested call returns deeper, a tail-called one at the
 * same place (its return probe chained to the caller's: the first run finishes the call).
 * Counting nested returns instead would not do: a kernel that does not filter perf-event
 * return probes by process (6.1, 6.12; 6.18 does; uprobe_multi links do) runs hp_return once
 * per traced process attached to the function (`heap -p A -p B`) at each return, which would
 * end the call at its nested malloc's return (posix_memalign's block, written to *memptr
 * later, then lost).
 * hp_active counts entries, so an unsampled call's return probe and the entry of a call on a
 * thread outside any call need no hash lookup.
 *
 * Knobs (-D, set by HeapCollector): HP_SAMPLE_MEAN, HP_STACK_PAGES (the stack copy: the partial
 * page holding sp, then whole pages, HP_STACK_PAGES * 4096 bytes at most, stopping at the end
 * of the mapping; a main thread's copy ends HP_TOP_SLACK bytes above its stack top, hp_tops),
 * HP_RB_PAGES (ring buffer pages, a power of two), HP_MAX_CPUS (possible
 * CPUs: the scratch slots), HP_MAX_LIVE, HP_MAX_PENDING, HP_MAX_THREADS, HP_MAX_TARGETS,
 * HP_FOLLOW (follow fork children), HP_RESERVE (above), HP_LIVE (0: sampled blocks not put in
 * hp_live), HP_PY_FRAMES (Python frames per sample, bpf/pywalk.h: read for the processes user
 * space lists in hp_py; 0: none).
 */
#include <uapi/linux/ptrace.h>
#include "heap.h"

#ifndef HP_SAMPLE_MEAN
#define HP_SAMPLE_MEAN 524288
#endif
#ifndef HP_STACK_PAGES
#define HP_STACK_PAGES 8
#endif
#ifndef HP_RB_PAGES
#define HP_RB_PAGES 4096
#endif
#ifndef HP_MAX_CPUS
#define HP_MAX_CPUS 256
#endif
#ifndef HP_MAX_LIVE
#define HP_MAX_LIVE 262144
#endif
#ifndef HP_MAX_PENDING
#define HP_MAX_PENDING 16384
#endif
#ifndef HP_MAX_THREADS
#define HP_MAX_THREADS 16384
#endif
#ifndef HP_MAX_TARGETS
#define HP_MAX_TARGETS 4096
#endif
#ifndef HP_FOLLOW
#define HP_FOLLOW 0
#endif
#ifndef HP_RESERVE
#define HP_RESERVE 0
#endif
#ifndef HP_LIVE
#define HP_LIVE 1 /* 0: sampled blocks are not remembered (no free probes: under an overhead budget) */
#endif
#ifndef HP_PY_FRAMES
#define HP_PY_FRAMES 0 /* > 0: each sample carries its thread's Python frames, up to this many */
#endif
#define HP_TOP_SLACK 64 /* bytes copied above the stack top: argc, the start of argv */

#if HP_STACK_PAGES < 1 || HP_STACK_PAGES > HP_MAX_PAGES
#error "HP_STACK_PAGES out of range"
#endif

#define SC_PAGES HP_STACK_PAGES
#include "stackcopy.h"

#if HP_PY_FRAMES
#if HP_RESERVE
#error "Python frames are read into the per-CPU slots: not with HP_RESERVE"
#endif
#include "pywalk.h"
BPF_HASH(hp_py, u32, struct py_config, HP_MAX_TARGETS);   /* tgid -> its interpreter's layout */
BPF_TABLE("lru_hash", u32, u64, hp_pyts, HP_MAX_THREADS); /* tid -> its thread state */
/* The frames are read by hp_py_output, a program of its own, tail-called once the sampling
 * program is done: the verifier checks its loops from one state, not once per path of the
 * sampling program (which multiplied them past its limit). hp_pyjob: this CPU's sample whose
 * record (in its hp_scratch slot) waits for them. */
BPF_PROG_ARRAY(hp_progs, 1);
BPF_PERCPU_ARRAY(hp_pyjob, u64, 1);

/* The Python frames of thread ID (pid_tgid) into HEAD and FRAMES, if its process is one user
 * space described in hp_py (else status PY_STATUS_NONE). */
static __always_inline void hp_python(struct py_head *head, struct py_frame *frames, u64 id) {
    u32 tgid = id >> 32, tid = (u32)id;
    struct py_config *c = hp_py.lookup(&tgid);
    if (!c) {
        head->count = 0;
        head->status = PY_STATUS_NONE;
        head->tstate = 0;
        return;
    }
    u64 *known = hp_pyts.lookup(&tid);
    u64 before = known ? *known : 0;
    u64 ts = py_tstate(c, tid, before);
    if (ts && ts != before) hp_pyts.update(&tid, &ts);
    py_walk(c, ts, head, frames);
}
#endif

/* A Python process's record carries its thread's Python frames after the stack (at the next
 * 8-byte boundary): a py_head, then py_frame[count] (bpf/pyframes.h), only those filled. */
#if HP_PY_FRAMES
#define HP_PY_BYTES (sizeof(struct py_head) + HP_PY_FRAMES * sizeof(struct py_frame))
#else
#define HP_PY_BYTES 0
#endif

struct hp_sample {
    struct hp_event h;
    u8 stack[HP_STACK_PAGES * HP_PAGE + HP_PY_BYTES];
};
#define HP_STACK_AT offsetof(struct hp_sample, stack)

/* A call between entry and return on one thread (key: pid_tgid). */
struct hp_pending {
    u64 sp; /* the stack pointer at its entry (+0: pointing at the return address) */
    u32 call;
    u32 pad;
    u64 sample_id; /* 0: not sampled (or its record was lost) */
    u64 arg_ptr;   /* realloc: the old block; posix_memalign: where the pointer is stored */
    u64 size;
};

/* A live block: per process (followed children share their parent's addresses). */
struct hp_block {
    u64 addr;
    u32 pid;
    u32 pad;
};

BPF_RINGBUF_OUTPUT(hp_events, HP_RB_PAGES);
#if !HP_RESERVE
/* a plain array indexed by CPU: per-CPU map values are capped at 32 KiB */
BPF_ARRAY(hp_scratch, struct hp_sample, HP_MAX_CPUS);
#endif
BPF_PERCPU_ARRAY(hp_lost, u64, HP_LOST_N);
BPF_ARRAY(hp_next_id, u64, 1);
BPF_ARRAY(hp_active, s64, 1);
BPF_ARRAY(hp_lg, u32, HP_LG_ENTRIES);
BPF_HASH(hp_targets, u32, u32, HP_MAX_TARGETS); /* tgid -> HP_VIA_* */
/* tgid -> its main thread's stack top (/proc/PID/stat startstack, set by user space): the
 * outermost frame (_start) lies just below it, the environment and auxv above it */
BPF_HASH(hp_tops, u32, u64, HP_MAX_TARGETS);
BPF_HASH(hp_pending, u64, struct hp_pending, HP_MAX_PENDING);
BPF_HASH(hp_live, struct hp_block, u64, HP_MAX_LIVE); /* block -> sample id */
/* LRU: an evicted thread draws afresh, which the memoryless draw allows */
BPF_TABLE("lru_hash", u32, s64, hp_sampler, HP_MAX_THREADS);

static __always_inline void hp_lost_inc(int idx) {
    u64 *v = hp_lost.lookup(&idx);
    if (v) (*v)++;
}

static __always_inline int hp_wanted(u32 tgid) {
    return hp_targets.lookup(&tgid) != 0;
}

/* How TGID is traced (HP_VIA_*), 0: it is not */
static __always_inline u32 hp_via(u32 tgid) {
    u32 *via = hp_targets.lookup(&tgid);
    return via ? *via : 0;
}

static __always_inline void hp_add_active(s64 n) {
    int zero = 0;
    s64 *active = hp_active.lookup(&zero);
    if (active) __sync_fetch_and_add(active, n);
}

/* This thread's call in progress, if any (no hash lookup while no thread has one). */
static __always_inline struct hp_pending *hp_current(u64 id) {
    int zero = 0;
    s64 *active = hp_active.lookup(&zero);
    if (active && *active <= 0) return 0;
    return hp_pending.lookup(&id);
}

#if HP_SAMPLE_MEAN > 1
/* Exp(mean) bytes without floats: -ln U = ln 2 * -log2 U, U = x / 2^32, x uniform and odd.
 * log2 x = k + log2(1 + f): k by a bit search, log2(1 + f) from hp_lg at f's top 10 bits,
 * linearly interpolated with the next 12 (without it draws are quantized to ~mean/1000 and
 * tiny blocks are sampled 2x too often). */
static __always_inline s64 hp_draw(void) {
    u32 x = bpf_get_prandom_u32() | 1;
    u32 k = 0, t = x;
    if (t >= (1u << 16)) {
        k += 16;
        t >>= 16;
    }
    if (t >= (1u << 8)) {
        k += 8;
        t >>= 8;
    }
    if (t >= (1u << 4)) {
        k += 4;
        t >>= 4;
    }
    if (t >= (1u << 2)) {
        k += 2;
        t >>= 2;
    }
    if (t >= (1u << 1)) k += 1;
    u32 m = (x << (31 - k)) & 0x7fffffff; /* the bits below the leading one, 31 wide */
    u32 j = (m >> 21) & 1023, j1 = j + 1, rem = (m >> 9) & 4095;
    u32 *l0 = hp_lg.lookup(&j), *l1 = hp_lg.lookup(&j1);
    if (!l0 || !l1) return HP_SAMPLE_MEAN;
    u64 lgf = *l0 + ((u64)(*l1 - *l0) * rem >> 12);
    u64 neg = (32ull << 20) - (((u64)k << 20) + lgf); /* -log2 U, 20 fraction bits */
    /* mean * ln 2 (45426 / 2^16) * neg / 2^20, i.e. a * neg >> 36 with a < 2^48, neg <= 2^25:
     * in two parts (a's high and low 16 bits), so small means keep their precision */
    u64 a = (u64)HP_SAMPLE_MEAN * 45426ull;
    return (s64)(((a >> 16) * neg >> 20) + ((a & 0xffff) * neg >> 36)) + 1;
}
#endif

/* Whether this call of SIZE bytes on thread TID is sampled. */
static __always_inline int hp_sampled(u32 tid, u64 size) {
#if HP_SAMPLE_MEAN <= 1
    return 1;
#else
    if (size >= HP_SAMPLE_MEAN) return 1;
    s64 *left = hp_sampler.lookup(&tid);
    if (!left) {
        s64 first = hp_draw();
        hp_sampler.update(&tid, &first);
        left = hp_sampler.lookup(&tid);
        if (!left) {
            hp_lost_inc(HP_LOST_SAMPLER);
            return 0;
        }
    }
    *left -= (s64)size;
    if (*left > 0) return 0;
    *left = hp_draw(); /* memoryless: a fresh draw after each sample */
    return 1;
#endif
}

/* The sample record's header and registers (its stack is copied after it). */
/* How many bytes of stack from SP the unwinder needs: up to the main thread's stack top (plus
 * HP_TOP_SLACK) when sp is below it within the limit; else the limit (threads, other stacks). */
static __always_inline u32 hp_want(u64 id, u64 sp) {
    u32 tgid = id >> 32, want = HP_STACK_PAGES * HP_PAGE;
    if (tgid != (u32)id) return want;
    u64 *top = hp_tops.lookup(&tgid);
    if (top && *top > sp && *top - sp < want - HP_TOP_SLACK) want = (u32)(*top - sp) + HP_TOP_SLACK;
    return want;
}

static __always_inline void hp_fill(struct hp_event *h, struct pt_regs *ctx, u64 id, u32 call, u64 size,
                                    u64 sample_id) {
    h->type = HP_REC_SAMPLE;
    h->pid = id >> 32;
    h->tid = (u32)id;
    h->call = call;
    h->size = size;
    h->ts = bpf_ktime_get_ns();
    h->id = sample_id;
    h->other = 0;
    sc_regs(ctx, h->regs);
}

#if !HP_RESERVE
/* Write the record of sample SAMPLE_ID of thread ID from its slot S, EXTRA bytes after its
 * stack (a Python block: at the stack's 8-byte aligned end); 0 if it was lost. */
static __always_inline int hp_output(struct hp_sample *s, u64 id, u64 sample_id, u32 extra) {
    /* Another task sampled on this CPU while this one was preempted mid-copy (the slot is
     * shared per CPU): the slot holds a mix; drop it, counted. */
    if (s->h.id != sample_id || s->h.tid != (u32)id) {
        hp_lost_inc(HP_LOST_SLOT_BUSY);
        return 0;
    }
    u64 out = HP_STACK_AT + (extra ? ((s->h.stack_len + 7) & ~7) + extra : s->h.stack_len);
    if (out > sizeof(struct hp_sample)) out = sizeof(struct hp_sample);
    if (hp_events.ringbuf_output(s, out, BPF_RB_NO_WAKEUP) != 0) {
        hp_lost_inc(HP_LOST_RINGBUF);
        return 0;
    }
    return 1;
}
#endif

/* Write the sample record (header, registers, stack copy); its id, or 0 if it was lost. In a
 * Python process (HP_PY_FRAMES) the record is written by hp_py_flush, at the caller's end. */
static __always_inline u64 hp_emit(struct pt_regs *ctx, u64 id, u32 call, u64 size) {
    int zero = 0;
    u64 *next = hp_next_id.lookup(&zero);
    if (!next) return 0;
#if HP_RESERVE
    /* The stack is copied once, straight into a ring record of the largest size (reserve needs
     * a constant size): ring space per sample is the maximum, the copy only what is mapped. */
    struct hp_sample *s = hp_events.ringbuf_reserve(sizeof(struct hp_sample));
    if (!s) {
        hp_lost_inc(HP_LOST_RINGBUF);
        return 0;
    }
    u64 sample_id = __sync_fetch_and_add(next, 1) + 1;
    hp_fill(&s->h, ctx, id, call, size, sample_id);
    s->h.stack_len = sc_copy_stack(s->stack, PT_REGS_SP(ctx), hp_want(id, PT_REGS_SP(ctx)));
    hp_events.ringbuf_submit(s, BPF_RB_NO_WAKEUP);
    return sample_id;
#else
    /* Copied twice: into a per-CPU slot, then ringbuf_output of the bytes copied (ring space per
     * sample is what was copied). */
    u32 cpu = bpf_get_smp_processor_id();
    struct hp_sample *s = hp_scratch.lookup(&cpu);
    if (!s) return 0;
    u64 sample_id = __sync_fetch_and_add(next, 1) + 1;
    hp_fill(&s->h, ctx, id, call, size, sample_id);
    s->h.stack_len = sc_copy_stack(s->stack, PT_REGS_SP(ctx), hp_want(id, PT_REGS_SP(ctx)));
#if HP_PY_FRAMES
    u32 tgid = id >> 32;
    if (hp_py.lookup(&tgid)) { /* a Python process: hp_py_flush has the record written */
        int zero = 0;
        u64 *job = hp_pyjob.lookup(&zero);
        if (job) {
            *job = sample_id;
            return sample_id;
        }
    }
#endif
    return hp_output(s, id, sample_id, 0) ? sample_id : 0;
#endif
}

/* The sampled block B is gone: tell user space, which forgets its sample (the profile's memory
 * stays bounded by the sampled blocks live). A short record, no stack. Not counted when the ring
 * is full: it only bounds memory (the sample is then kept to the end, where hp_live decides). */
struct hp_free_rec { /* hp_event's first 40 bytes */
    u32 type;
    u32 pid;
    u32 tid;
    u32 call;
    u64 size;
    u64 ts;
    u64 id;
};

static __always_inline void hp_gone(struct hp_block *b) {
    u64 *sample_id = hp_live.lookup(b);
    if (!sample_id) return;
    struct hp_free_rec r = {};
    r.type = HP_REC_FREE;
    r.pid = b->pid;
    r.id = *sample_id;
    hp_live.delete(b);
    hp_events.ringbuf_output(&r, sizeof(r), BPF_RB_NO_WAKEUP);
}

/* The end of a program that sampled: a record waiting for its Python frames (hp_emit) is
 * handed to hp_py_output, which reads them and writes it (the tail call does not return);
 * written without them if that program cannot run. */
static __always_inline void hp_py_flush(struct pt_regs *ctx) {
#if HP_PY_FRAMES
    int zero = 0;
    u64 *job = hp_pyjob.lookup(&zero);
    if (!job || !*job) return;
    hp_progs.call(ctx, 0);
    u64 sample_id = *job;
    *job = 0;
    u32 cpu = bpf_get_smp_processor_id();
    struct hp_sample *s = hp_scratch.lookup(&cpu);
    if (s) hp_output(s, bpf_get_current_pid_tgid(), sample_id, 0);
#endif
}

#if HP_PY_FRAMES
/* Tail-called by hp_py_flush: this CPU's waiting record gets its thread's Python frames and
 * is written. */
int hp_py_output(struct pt_regs *ctx) {
    int zero = 0;
    u64 *job = hp_pyjob.lookup(&zero);
    if (!job || !*job) return 0;
    u64 sample_id = *job, id = bpf_get_current_pid_tgid();
    *job = 0;
    u32 cpu = bpf_get_smp_processor_id();
    struct hp_sample *s = hp_scratch.lookup(&cpu);
    if (!s) return 0;
    if (s->h.id != sample_id || s->h.tid != (u32)id) {
        hp_lost_inc(HP_LOST_SLOT_BUSY);
        return 0;
    }
    u64 at = s->h.stack_len;
    at = (at + 7) & ~7ull;
    if (at > HP_STACK_PAGES * HP_PAGE) return 0;
    asm volatile("" : "+r"(at)); /* the bounded register is the one used below */
    struct py_head *head = (struct py_head *)(s->stack + at);
    hp_python(head, (struct py_frame *)(s->stack + at + sizeof(struct py_head)), id);
    u32 count = head->count;
    if (count > HP_PY_FRAMES) count = HP_PY_FRAMES;
    hp_output(s, id, sample_id, sizeof(struct py_head) + count * sizeof(struct py_frame));
    return 0;
}
#endif

/* Entry of an allocating call. OUTER: it calls other malloc-API functions inside glibc, so it
 * keeps an hp_pending entry for its whole duration even when not sampled. */
static __always_inline void hp_entry_call(struct pt_regs *ctx, u32 call, u64 size, u64 arg_ptr, int outer) {
    u64 id = bpf_get_current_pid_tgid();
    if (hp_via(id >> 32) != HP_VIA_UPROBES) return;
    if (hp_current(id)) return; /* inside this thread's outer call: glibc's own call */
    int sampled = hp_sampled((u32)id, size);
    if (!sampled && !outer) return;
    struct hp_pending p = {};
    p.sp = PT_REGS_SP(ctx);
    p.call = call;
    p.arg_ptr = arg_ptr;
    p.size = size;
    if (sampled) p.sample_id = hp_emit(ctx, id, call, size);
    if (hp_pending.update(&id, &p) != 0) {
        hp_lost_inc(HP_LOST_PENDING_FULL);
        return;
    }
    hp_add_active(1);
}

static __always_inline int hp_entry(struct pt_regs *ctx, u32 call, u64 size, u64 arg_ptr, int outer) {
    hp_entry_call(ctx, call, size, arg_ptr, outer);
    hp_py_flush(ctx);
    return 0;
}

int hp_malloc_entry(struct pt_regs *ctx) {
    return hp_entry(ctx, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 0);
}

int hp_calloc_entry(struct pt_regs *ctx) {
    return hp_entry(ctx, CALL_CALLOC, (u64)PT_REGS_PARM1(ctx) * (u64)PT_REGS_PARM2(ctx), 0, 0);
}

/* The interpreter's allocators (heap --python-allocators: PyObject_Malloc, PyMem_Malloc, ...
 * and their domain functions): outer calls, as a large block is pymalloc's malloc call, which
 * is then not sampled again. Their realloc and free have glibc's arguments: hp_realloc_entry,
 * hp_free_entry. */
int hp_py_malloc_entry(struct pt_regs *ctx) {
    return hp_entry(ctx, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 1);
}

int hp_py_calloc_entry(struct pt_regs *ctx) {
    return hp_entry(ctx, CALL_CALLOC, (u64)PT_REGS_PARM1(ctx) * (u64)PT_REGS_PARM2(ctx), 0, 1);
}

int hp_realloc_entry(struct pt_regs *ctx) {
    return hp_entry(ctx, CALL_REALLOC, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx), 1);
}

int hp_memalign_entry(struct pt_regs *ctx) /* memalign(align, size), aligned_alloc */
{
    return hp_entry(ctx, CALL_MEMALIGN, PT_REGS_PARM2(ctx), 0, 1);
}

int hp_posix_memalign_entry(struct pt_regs *ctx) /* posix_memalign(&p, align, size) */
{
    return hp_entry(ctx, CALL_POSIX_MEMALIGN, PT_REGS_PARM3(ctx), PT_REGS_PARM1(ctx), 1);
}

int hp_valloc_entry(struct pt_regs *ctx) {
    return hp_entry(ctx, CALL_VALLOC, PT_REGS_PARM1(ctx), 0, 1);
}

int hp_pvalloc_entry(struct pt_regs *ctx) {
    return hp_entry(ctx, CALL_PVALLOC, PT_REGS_PARM1(ctx), 0, 1);
}

/* Every allocating function's return: the call's own return (not a call nested in it) finishes
 * it; later runs at the same return (a tail-called function's probe, other processes'
 * attachments) find no entry. */
int hp_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct hp_pending *cur = hp_current(id);
    if (!cur) return 0;                           /* not sampled, or attached while the call was running */
    if (PT_REGS_SP(ctx) != cur->sp + 8) return 0; /* a call nested in it returns */
    struct hp_pending p = *cur;
    if (hp_pending.delete(&id) == 0) hp_add_active(-1);
    u64 rc = PT_REGS_RC(ctx), addr = rc;
    struct hp_block b = {};
    b.pid = id >> 32;
    if (p.call == CALL_POSIX_MEMALIGN) {
        addr = 0;
        if ((u32)rc == 0 && p.arg_ptr) pm_probe_read_user(&addr, sizeof(addr), (void *)p.arg_ptr);
    }
    /* realloc: the old block is gone when it succeeded, and after realloc(p, 0) */
    if (p.call == CALL_REALLOC && p.arg_ptr && (rc || p.size == 0)) {
        b.addr = p.arg_ptr;
        hp_gone(&b);
    }
    if (HP_LIVE && p.sample_id && addr) {
        b.addr = addr;
        if (hp_live.update(&b, &p.sample_id) != 0) hp_lost_inc(HP_LOST_LIVE_FULL);
    }
    return 0;
}

/* free, at its first emulated instruction (and the early exits before it): the pointer
 * argument is unchanged there. An address that was never sampled is not in hp_live: nothing. */
int hp_free_entry(struct pt_regs *ctx) {
    u64 ptr = PT_REGS_PARM1(ctx);
    if (!ptr) return 0;
    struct hp_block b = {};
    b.addr = ptr;
    b.pid = bpf_get_current_pid_tgid() >> 32;
    hp_gone(&b);
    return 0;
}

/* ---- the interposer's USDT sites ------------------------------------------------------
 * The interposer drew the sample in-process and fires heap_alloc after the allocator
 * returned: the registers and the stack copy are the site's (inside the interposer, whose
 * frames user space drops), the block is known. TRACKED 0: the interposer's set of sampled
 * blocks was full, so their free will not be told: not remembered, counted as live_full. */
static __always_inline void hp_usdt_sample(struct pt_regs *ctx, u64 call, u64 ptr, u64 size, u64 tracked) {
    u64 id = bpf_get_current_pid_tgid();
    if (hp_via(id >> 32) != HP_VIA_INTERPOSER) return;
    u64 sample_id = hp_emit(ctx, id, (u32)call, size);
    if (!sample_id || !ptr) return;
    if (!tracked) {
        hp_lost_inc(HP_LOST_LIVE_FULL);
        return;
    }
    struct hp_block b = {};
    b.addr = ptr;
    b.pid = id >> 32;
    if (hp_live.update(&b, &sample_id) != 0) hp_lost_inc(HP_LOST_LIVE_FULL);
}

static __always_inline int hp_usdt_alloc(struct pt_regs *ctx, u64 call, u64 ptr, u64 size, u64 tracked) {
    hp_usdt_sample(ctx, call, ptr, size, tracked);
    hp_py_flush(ctx);
    return 0;
}

/* heap_free: a sampled block is about to be freed (or realloc'd away) */
static __always_inline int hp_usdt_free(struct pt_regs *ctx, u64 ptr) {
    struct hp_block b = {};
    b.addr = ptr;
    b.pid = bpf_get_current_pid_tgid() >> 32;
    hp_gone(&b);
    return 0;
}

/* ---- the target processes: exec, exit (and fork when following) -------------------- */

static __always_inline void hp_event(u32 type, u64 id, u32 other, u64 value) {
    struct hp_event e = {};
    e.type = type;
    e.pid = id >> 32;
    e.tid = (u32)id;
    e.ts = bpf_ktime_get_ns();
    e.id = value;
    e.other = other;
    if (hp_events.ringbuf_output(&e, sizeof(e), 0) != 0) hp_lost_inc(HP_LOST_EVENT);
}

/* Attached by user space to sched:sched_process_exec. The record's id is the last sample id
 * given so far: user space drops the live blocks of the old image sampled up to it. */
int hp_exec(void *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!hp_wanted(tgid)) return 0;
    hp_tops.delete(&tgid); /* a new stack: copies are whole until user space sets the new top */
#if HP_PY_FRAMES
    hp_py.delete(&tgid); /* another program: user space describes its interpreter anew */
#endif
    int zero = 0;
    u64 *next = hp_next_id.lookup(&zero);
    hp_event(HP_REC_EXEC, id, 0, next ? *next : 0);
    return 0;
}

/* Attached by user space to sched:sched_process_exit (once per thread). */
int hp_exit(void *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id, tgid = id >> 32;
    if (!hp_wanted(tgid)) return 0;
    hp_sampler.delete(&tid);
#if HP_PY_FRAMES
    hp_pyts.delete(&tid);
#endif
    if (hp_pending.delete(&id) == 0) hp_add_active(-1);
    if (tid != tgid) {
#if HP_FOLLOW
        hp_targets.delete(&tid); /* a thread, added at its clone since fork cannot tell */
#endif
        return 0;
    }
    hp_tops.delete(&tgid);
#if HP_PY_FRAMES
    hp_py.delete(&tgid);
#endif
    hp_event(HP_REC_EXIT, id, 0, 0);
    return 0;
}

#if HP_FOLLOW
TRACEPOINT_PROBE(sched, sched_process_fork) {
    u64 id = bpf_get_current_pid_tgid();
    u32 child = args->child_pid, via = hp_via(id >> 32); /* the child is traced as its parent */
    if (!via) return 0;
    if (hp_targets.update(&child, &via) != 0) {
        hp_lost_inc(HP_LOST_TARGETS_FULL);
        return 0;
    }
#if HP_PY_FRAMES
    u32 parent = id >> 32;
    struct py_config *py = hp_py.lookup(&parent); /* a fork child runs its parent's interpreter */
    if (py) hp_py.update(&child, py);
#endif
    hp_event(HP_REC_FORK, id, child, 0);
    return 0;
}
#endif
