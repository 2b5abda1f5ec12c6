/* pymtrace record: every malloc-API call of the traced process(es) as one dj/malloc record.
 *
 * Entry probes stash the arguments per thread; a depth counter makes calls nested inside
 * another traced call (realloc(NULL,n)->malloc, realloc(p,0)->free, memalign(<=16)->malloc,
 * an interposer such as libc_malloc_debug calling libc) invisible. Allocations are emitted
 * at return (after they own their pointer), frees at entry (before the memory is released):
 * the ring buffer's global reservation order is then an order consistent with every thread.
 *
 * Compile-time switches (-D): RB_PAGES (ring buffer pages, power of two), TARGET_TGID,
 * FOLLOW (trace TARGET_TGID and its descendants through sched_process_fork), GLIBC_CHUNKS
 * (read glibc chunk headers for size2/size3), STASH_ENTRIES, STACKS (record --stacks: each
 * allocating call's registers and stack at its return into the ring buffer `stacks`; with
 * STACK_PAGES, STACK_RB_PAGES, MAX_CPUS; PY_FRAMES > 0: in a process user space lists in `py`,
 * each stack event also carries its thread's Python frames, up to this many, bpf/pywalk.h).
 * Without STACKS no stack code is compiled.
 * LIBC_PROBES=0 leaves out the libc's entry programs (enter_<call>: a process on another
 * allocator is probed by enter_f_* alone). OUTER_PROBES=0 leaves out the enter_outer_* programs (an interposer's entry probes), which
 * the recorder compiles only when it probes one. F_SELECT=1: of the enter_f_* and enter_cxx_new_*
 * programs (other allocators, C++ operator new/delete) only those whose WANT_<program> is 1 (the
 * recorder: those its probe plans attach; none for a glibc process without C++). CXX_SLOTS:
 * the carried operator news one recording can probe (enter_cxx_new_<slot>, at most 8). EXEC_ALLOCATORS
 * (`record -- CMD`, compiled without F_SELECT: it may exec onto any allocator): chunk
 * headers are read only while the map `foreign` says the program's allocator is glibc.
 */
#include <uapi/linux/ptrace.h>
#include "record.h"

#ifndef RB_PAGES
#define RB_PAGES 4096
#endif
#ifndef RESERVE_RETRIES
#define RESERVE_RETRIES 1
#endif
#ifndef STASH_ENTRIES
#define STASH_ENTRIES 65536
#endif
#ifndef TARGET_TGID
#define TARGET_TGID 0
#endif
#ifndef OUTER_PROBES
#define OUTER_PROBES 1
#endif
#ifndef LIBC_PROBES
#define LIBC_PROBES 1
#endif
#ifndef F_SELECT
#define F_SELECT 0
#endif
/* an identifier left undefined after expansion is 0 in #if: a program not asked for */
#define WANT(program) (!F_SELECT || WANT_##program)
#ifndef GLIBC_CHUNKS
#define GLIBC_CHUNKS 1
#endif
#ifndef PAGE_SIZE_BYTES
#define PAGE_SIZE_BYTES 4096
#endif

/* The operator new a thread entered last (a carried one: entry probe only, see cxx_new). Kept
 * until the thread enters another: a new_handler's retry makes the same allocation call again. */
struct cxx_new_call {
    u64 caller; /* its return address; 0: none yet */
    u64 sp;     /* its stack pointer at entry */
    u64 lo;     /* the function the allocation call is made from: [lo, lo + len) */
    u32 len;
    u32 type; /* recorded as (CALL_MALLOC, CALL_MEMALIGN) */
    u64 a0;   /* its arguments as `enter` keeps them for TYPE */
    u64 a1;
};

struct stash {
    u32 depth;
    u32 type;  /* the call recorded */
    u32 inner; /* the glibc function actually probed (differs under an interposer) */
    u32 pad;
    u64 a0;
    u64 a1;
    u64 a2;
    u64 old_size;
    u64 caller;
    struct cxx_new_call cxx;
};

BPF_RINGBUF_OUTPUT(events, RB_PAGES);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_PERCPU_ARRAY(retried, u64, 1); /* reservations that failed once */
/* set by user space once every probe is attached: records start together for all functions
 * (a call missed because its entry probe was not attached yet cannot leave holes later) */
BPF_ARRAY(enabled, u32, 1);
BPF_HASH(stash, u64, struct stash, STASH_ENTRIES);

#ifdef STACKS
#ifndef STACK_PAGES
#define STACK_PAGES 8
#endif
#ifndef STACK_RB_PAGES
#define STACK_RB_PAGES 4096
#endif
#ifndef MAX_CPUS
#define MAX_CPUS 256
#endif
#define SC_PAGES STACK_PAGES
#include "stackcopy.h"

#ifndef PY_FRAMES
#define PY_FRAMES 0
#endif
/* A Python process's stack event carries its thread's Python frames after the stack (at the
 * next 8-byte boundary): a py_head, then py_frame[count] (bpf/pyframes.h), only those filled. */
#if PY_FRAMES
#define HP_PY_FRAMES PY_FRAMES
#include "pywalk.h"
#define PY_BYTES (sizeof(struct py_head) + PY_FRAMES * sizeof(struct py_frame))
#else
#define PY_BYTES 0
#endif

struct stack_sample {
    struct stack_event h;
    u8 stack[STACK_PAGES * SC_PAGE + PY_BYTES];
};
/* A second ring buffer: stacks are variable-length (the bytes copied), records stay fixed-size
 * for the recorder's vectorised drain. */
BPF_RINGBUF_OUTPUT(stacks, STACK_RB_PAGES);
/* a plain array indexed by CPU: per-CPU map values are capped at 32 KiB */
BPF_ARRAY(stack_scratch, struct stack_sample, MAX_CPUS);
BPF_PERCPU_ARRAY(stack_lost, u64, 1); /* stacks not written (ring full, slot reused): id 0 */
#if PY_FRAMES
BPF_HASH(py, u32, struct py_config, 1024);    /* tgid -> its interpreter's layout */
BPF_TABLE("lru_hash", u32, u64, pyts, 65536); /* tid -> its thread state */
/* The frames are read by py_output, a program of its own tail-called by `leave` (as heap's
 * hp_py_output: the verifier checks its loops once, not once per path of `leave`), which then
 * writes the stack event and the record. pyjob: this CPU's record waiting for it. */
struct py_job {
    u64 ts; /* its stack event's (0: none waiting) */
    u64 ptr1;
    u64 ptr2;
    u64 size;
    u64 size2;
    u64 size3;
    u64 caller;
    u32 type;
    u32 pad;
};
BPF_PROG_ARRAY(progs, 1);
BPF_PERCPU_ARRAY(pyjob, struct py_job, 1);
#endif

static __always_inline void stack_lost_inc(void) {
    int zero = 0;
    u64 *n = stack_lost.lookup(&zero);
    if (n) *n += 1;
}

/* Write thread ID's stack event of TS from its slot S, EXTRA bytes after its stack (a Python
 * block: at the stack's 8-byte aligned end). */
static __always_inline void stack_output(struct stack_sample *s, u64 id, u64 ts, u32 extra) {
    u64 out = sizeof(struct stack_event) + (extra ? ((s->h.stack_len + 7) & ~7) + extra : s->h.stack_len);
    if (out > sizeof(struct stack_sample)) out = sizeof(struct stack_sample);
    /* another task used this CPU's slot while this one was preempted: a mix, dropped */
    if (s->h.ts != ts || s->h.tid != (u32)id || stacks.ringbuf_output(s, out, BPF_RB_NO_WAKEUP) != 0)
        stack_lost_inc();
}

/* The registers and stack at an allocating call's return (the caller's frame: ip is the return
 * address, the callee-saved registers are restored), keyed by (thread, ts), into this CPU's
 * slot; written at once, or (1) left there for py_output in a Python process. */
static __always_inline int emit_stack(struct pt_regs *ctx, u64 id, u32 call, u64 ts) {
    u32 cpu = bpf_get_smp_processor_id();
    struct stack_sample *s = stack_scratch.lookup(&cpu);
    if (!s) {
        stack_lost_inc();
        return 0;
    }
    s->h.tgid = id >> 32;
    s->h.tid = (u32)id;
    s->h.call = call;
    s->h.ts = ts;
    s->h.pad = 0;
    sc_regs(ctx, s->h.regs);
    s->h.stack_len = sc_copy_stack(s->stack, PT_REGS_SP(ctx), STACK_PAGES * SC_PAGE);
#if PY_FRAMES
    u32 tgid = id >> 32;
    if (py.lookup(&tgid)) return 1;
#endif
    stack_output(s, id, ts, 0);
    return 0;
}
#endif

/* An interposer in front of glibc (libc_malloc_debug): probed at entry only, to learn the
 * program's return address; glibc's probes then record the call with that caller. No
 * return probes there: a uretprobe rewrites the return address, and the interposer's own
 * __builtin_return_address (mtrace's caller column) would read the uprobe trampoline. */
struct outer_call {
    u64 caller;
    u64 sp;
    u32 type; /* the interposer's call; glibc may see another (calloc -> malloc) */
    u32 pad;
    u64 a0;
    u64 a1;
    u64 a2;
};
BPF_HASH(outer, u64, struct outer_call, STASH_ENTRIES);

#ifdef FOLLOW
BPF_HASH(traced, u32, u32, 65536);

TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!traced.lookup(&parent)) return 0;
    u32 child = args->child_pid;
    u32 one = 1;
    traced.update(&child, &one);
#if defined(STACKS) && PY_FRAMES
    struct py_config *c = py.lookup(&parent); /* a fork child runs its parent's interpreter */
    if (c) py.update(&child, c);
#endif
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id;
    u32 tgid = id >> 32;
    if (tid != tgid) /* a thread: its tid was only added because fork cannot tell */
        traced.delete(&tid);
    stash.delete(&id);
    return 0;
}

static __always_inline int wanted(u32 tgid) {
    return traced.lookup(&tgid) != 0;
}
#else
static __always_inline int wanted(u32 tgid) {
    return TARGET_TGID == 0 || tgid == TARGET_TGID;
}
#endif

#if defined(STACKS) && PY_FRAMES
/* Another program: user space describes its interpreter anew (Recorder._probe_program). */
TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    py.delete(&tgid);
    return 0;
}
#endif

#ifdef EXEC_ALLOCATORS
/* `record -- CMD`, which follows execs from one allocator to another: 1 (set by user space)
 * while the traced program's malloc is another allocator's, whose blocks have no glibc chunk
 * header */
BPF_ARRAY(foreign, u32, 1);
#endif

static __always_inline u64 chunk_size(u64 p) {
    u64 h = 0;
    if (!GLIBC_CHUNKS || p == 0) return 0;
#ifdef EXEC_ALLOCATORS
    int zero = 0;
    u32 *no_header = foreign.lookup(&zero);
    if (no_header && *no_header) return 0;
#endif
    pm_probe_read_user(&h, sizeof(h), (void *)(p - 8));
    return h & ~7ULL;
}

static __always_inline struct record_event *reserve(void) {
    int zero = 0;
    u32 *on = enabled.lookup(&zero);
    if (!on || !*on) return 0;
    struct record_event *e = events.ringbuf_reserve(sizeof(struct record_event));
    if (!e) {
        /* A full buffer (the consumer fell behind): one more try, counted, in case the
         * consumer just made room; then the event is counted as lost. */
        u64 *r = retried.lookup(&zero);
        if (r) *r += 1;
#pragma unroll
        for (int i = 0; i < RESERVE_RETRIES && !e; i++)
            e = events.ringbuf_reserve(sizeof(struct record_event));
    }
    if (!e) {
        u64 *n = lost.lookup(&zero);
        if (n) *n += 1;
    }
    return e;
}

static __always_inline void fill(struct record_event *e, u64 id, u32 type, u64 ptr1, u64 ptr2, u64 size,
                                 u64 size2, u64 size3, u64 caller, u64 ts) {
    e->rec.thread = (u32)id;
    e->rec.type = type;
    e->rec.ptr1 = ptr1;
    e->rec.ptr2 = ptr2;
    e->rec.size = size;
    e->rec.size2 = size2;
    e->rec.size3 = size3;
    e->rec.pad[0] = ts;
    e->rec.pad[1] = caller;
    e->tgid = id >> 32;
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

static __always_inline u64 caller_of(struct pt_regs *ctx) {
    u64 ra = 0;
    pm_probe_read_user(&ra, sizeof(ra), (void *)PT_REGS_SP(ctx));
    return ra;
}

/* The interposer's caller if this outermost glibc call was made by it (our stack is at
 * most 16 KiB below its entry); consumed once. */
static __always_inline int outer_call(u64 id, struct pt_regs *ctx, struct outer_call *out) {
    struct outer_call *o = outer.lookup(&id);
    if (!o || !o->caller) return 0;
    u64 sp = PT_REGS_SP(ctx);
    __builtin_memcpy(out, o, sizeof(*out));
    o->caller = 0;
    return sp < out->sp && out->sp - sp < 16384;
}

static __always_inline int outer_entry(struct pt_regs *ctx, u32 type, u64 a0, u64 a1, u64 a2) {
    u64 id = bpf_get_current_pid_tgid();
    if (!wanted(id >> 32)) return 0;
    struct stash *s = stash.lookup(&id);
    if (s && s->depth) return 0;
    struct outer_call o = {};
    o.caller = caller_of(ctx);
    o.sp = PT_REGS_SP(ctx);
    o.type = type;
    o.a0 = a0;
    o.a1 = a1;
    o.a2 = a2;
    outer.update(&id, &o);
    return 0;
}

#if OUTER_PROBES /* only for an interposer (libc_malloc_debug) among the probed files */
#define OUTER(name, TYPE, A0, A1, A2)                                                                        \
    int enter_outer_##name(struct pt_regs *ctx) {                                                            \
        return outer_entry(ctx, TYPE, A0, A1, A2);                                                           \
    }
OUTER(malloc, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 0)
OUTER(calloc, CALL_CALLOC, PT_REGS_PARM1(ctx) * PT_REGS_PARM2(ctx), 0, 0)
OUTER(realloc, CALL_REALLOC, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0)
OUTER(memalign, CALL_MEMALIGN, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0)
OUTER(posix_memalign, CALL_POSIX_MEMALIGN, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx))
OUTER(valloc, CALL_VALLOC, PT_REGS_PARM1(ctx), 0, 0)
OUTER(pvalloc, CALL_PVALLOC, PT_REGS_PARM1(ctx), 0, 0)
OUTER(free, CALL_FREE, PT_REGS_PARM1(ctx), 0, 0)
#endif

/* The call N (its fields before `cxx`) as thread ID's stash entry S: written in place where the
 * thread has one (a hash map update allocates a new element and frees the old one: ~100 ns),
 * its operator new state kept. */
static __always_inline void keep(struct stash *s, u64 id, struct stash *n) {
    if (s)
        __builtin_memcpy(s, n, __builtin_offsetof(struct stash, cxx));
    else
        stash.update(&id, n);
}

static __always_inline int enter(struct pt_regs *ctx, u32 type, u64 a0, u64 a1, u64 a2) {
    u64 id = bpf_get_current_pid_tgid();
    if (!wanted(id >> 32)) return 0;
    struct stash *s = stash.lookup(&id);
    if (s && s->depth) {
        s->depth++;
        return 0;
    }
    struct stash n = {};
    n.depth = 1;
    n.type = type;
    n.inner = type;
    n.a0 = a0;
    n.a1 = a1;
    n.a2 = a2;
    struct outer_call o;
    if (outer_call(id, ctx, &o)) { /* made by the interposer: record the program's call */
        n.caller = o.caller;
        n.type = o.type;
        n.a0 = o.a0;
        n.a1 = o.a1;
        n.a2 = o.a2;
    } /* else n.caller stays 0: the return address, taken at return */
    if (n.type == CALL_REALLOC) n.old_size = chunk_size(n.a0);
    keep(s, id, &n);
    return 0;
}

#if LIBC_PROBES
int enter_malloc(struct pt_regs *ctx) {
    return enter(ctx, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 0);
}

#ifdef NOTE_BASES
/* --format mtrace-text: the load address of each probed library in each process, taken
 * from the probe address (the process may be gone before /proc/PID/maps is read). */
BPF_HASH(bases, u64, u64, 4096);

static __always_inline void note_base(struct pt_regs *ctx, u64 lib, u64 site) {
    u64 key = (bpf_get_current_pid_tgid() & ~0xffffffffULL) | lib;
    if (!bases.lookup(&key) && wanted(key >> 32)) {
        u64 base = PT_REGS_IP(ctx) - site;
        bases.update(&key, &base);
    }
}
#ifdef MALLOC_SITE_0 /* glibc */
int enter_malloc_0(struct pt_regs *ctx) {
    note_base(ctx, 0, MALLOC_SITE_0);
    return enter(ctx, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 0);
}
#endif
#ifdef MALLOC_SITE_1 /* the interposer */
int enter_malloc_1(struct pt_regs *ctx) {
    note_base(ctx, 1, MALLOC_SITE_1);
    return outer_entry(ctx, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 0);
}
#endif
#endif
int enter_calloc(struct pt_regs *ctx) {
    return enter(ctx, CALL_CALLOC, PT_REGS_PARM1(ctx) * PT_REGS_PARM2(ctx), 0, 0);
}
int enter_realloc(struct pt_regs *ctx) {
    return enter(ctx, CALL_REALLOC, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0);
}
int enter_memalign(struct pt_regs *ctx) {
    return enter(ctx, CALL_MEMALIGN, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0);
}
int enter_posix_memalign(struct pt_regs *ctx) {
    return enter(ctx, CALL_POSIX_MEMALIGN, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx));
}
int enter_valloc(struct pt_regs *ctx) {
    return enter(ctx, CALL_VALLOC, PT_REGS_PARM1(ctx), 0, 0);
}
int enter_pvalloc(struct pt_regs *ctx) {
    return enter(ctx, CALL_PVALLOC, PT_REGS_PARM1(ctx), 0, 0);
}

/* free in the innermost allocator (glibc): no return probe, recorded at entry unless nested.
 * FREE_SKIP1/2: (return address - probe address) of glibc's own calls to free in
 * tcache_thread_shutdown, which hands blocks the program already freed (sitting in the
 * thread cache) back to the arena at thread exit: not API calls, and they would read as
 * double frees. */
int enter_free(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if (!wanted(id >> 32)) return 0;
    struct stash *s = stash.lookup(&id);
    if (s && s->depth) return 0;
    u64 p = PT_REGS_PARM1(ctx);
    u64 caller = caller_of(ctx); /* free has no return probe: [sp] is the return address */
#ifdef FREE_SKIP1
    u64 delta = caller - PT_REGS_IP(ctx);
    if (delta == FREE_SKIP1 || delta == FREE_SKIP2) return 0;
#endif
    struct outer_call o;
    if (outer_call(id, ctx, &o)) caller = o.caller;
    struct record_event *e = reserve();
    if (e) fill(e, id, CALL_FREE, p, 0, 0, chunk_size(p), 0, caller, bpf_ktime_get_ns());
    return 0;
}
#endif /* LIBC_PROBES */

/* ---- other allocators (jemalloc, tcmalloc, mimalloc, a malloc in the executable) -------
 * Attached by the recorder to the functions of pymtrace/target/allocators.py's probe plan:
 * entry program enter_f_<call>_<layout> for its ms_f_<call>_<layout> (the argument layouts of
 * allocators.h), `leave` at every return probe. Compiled with GLIBC_CHUNKS=0: their blocks have
 * no glibc chunk header, so size2/size3 stay 0 (alignments and the page size are kept).
 * Every allocating function is an outer call: what it calls inside is not recorded again. */

/* A free-type function: recorded at entry unless nested in another recorded call. NEST: it
 * calls another probed function and has a return probe, so its depth is kept like an
 * allocating call's (`leave` records nothing for CALL_FREE). */
static __always_inline int enter_foreign_free(struct pt_regs *ctx, u64 p, int nest) {
    u64 id = bpf_get_current_pid_tgid();
    if (!wanted(id >> 32)) return 0;
    struct stash *s = stash.lookup(&id);
    if (s && s->depth) {
        if (nest) s->depth++;
        return 0;
    }
    struct record_event *e = reserve();
    if (e) fill(e, id, CALL_FREE, p, 0, 0, chunk_size(p), 0, caller_of(ctx), bpf_ktime_get_ns());
    if (nest) {
        struct stash n = {};
        n.depth = 1;
        n.type = CALL_FREE;
        n.inner = CALL_FREE;
        keep(s, id, &n);
    }
    return 0;
}

/* An entry of allocators.h, with the arguments `enter` keeps for TYPE (as `leave` reads them):
 * realloc (ptr, size, NOFAIL: in place), memalign (alignment, size), posix_memalign (memptr,
 * alignment, size), the others (size); a free as enter_foreign_free. */
static __always_inline int enter_foreign(struct pt_regs *ctx, u32 type, u64 size, u64 ptr, u64 align,
                                         u32 nofail, int nest) {
    switch (type) {
    case CALL_FREE:
        return enter_foreign_free(ctx, ptr, nest);
    case CALL_REALLOC: /* xallocx (AL_NOFAIL): recorded as realloc(p) -> p */
        return enter(ctx, type, ptr, size, nofail);
    case CALL_MEMALIGN:
        return enter(ctx, type, align, size, 0);
    case CALL_POSIX_MEMALIGN:
        return enter(ctx, type, ptr, align, size);
    default:
        return enter(ctx, type, size, 0, 0);
    }
}

/* C++ operator new/delete (allocators.CXX, entry + `leave`) are recorded as dj/malloc's calls
 * (docs/formats.md): every new as malloc (size), an aligned new as memalign (alignment, size),
 * every delete as free. The malloc/free they make inside is nested: not recorded again. */
#define AL_WANT(name)     WANT(enter_f_##name)
#define AL_CXX_WANT(name) WANT(enter_f_##name)
#define AL_ENTRY(name, type, size, ptr, align, flags)                                                        \
    int enter_f_##name(struct pt_regs *ctx) {                                                                \
        return enter_foreign(ctx, type, size, ptr, align, (flags)&AL_NOFAIL, !((flags)&AL_LEAF));            \
    }
#define AL_CXX_ENTRY(name, type, as_type, size, ptr, align) AL_ENTRY(name, as_type, size, ptr, align, 0)
#include "allocators.h"

/* ---- C++ operator new carried by its allocation call (pymtrace/tracee/cxxplan.py) --------
 * An operator new whose every call makes one call of a probed allocating function first thing
 * (libstdc++'s new -> malloc) has an entry probe only: enter_cxx_new_<slot> keeps its caller
 * and arguments per thread, and the allocating call made from inside that function (its return
 * address in [lo, lo + len), its stack below the new's) is recorded as the new, at its own
 * return probe: three traps a new instead of four, and no return probe that would hide the
 * new's frame from an exception unwinding through it. A new called by another one (nothrow ->
 * new) only moves the range. cxx_fns[slot], set by user space before the probe is attached:
 * the probe's offset in its function, what the function has pushed on the stack there (the
 * probe may sit on the call itself), the function's size, the call type recorded. */
#ifndef CXX_SLOTS
#define CXX_SLOTS 8
#endif
struct cxx_fn {
    u32 site;
    u32 depth;
    u32 size;
    u32 type;
};
BPF_ARRAY(cxx_fns, struct cxx_fn, CXX_SLOTS);

static __always_inline int cxx_new(struct pt_regs *ctx, int slot) {
    u64 id = bpf_get_current_pid_tgid();
    if (!wanted(id >> 32)) return 0;
    struct cxx_fn *f = cxx_fns.lookup(&slot);
    if (!f || !f->size) return 0;
    struct stash zero = {};
    struct stash *s = stash.lookup_or_try_init(&id, &zero);
    if (!s || s->depth) return 0;        /* inside another recorded call: hidden like its other calls */
    u64 sp = PT_REGS_SP(ctx) + f->depth; /* at its entry: its return address */
    u64 ra = 0;
    pm_probe_read_user(&ra, sizeof(ra), (void *)sp);
    u64 lo = PT_REGS_IP(ctx) - f->site;
    struct cxx_new_call *c = &s->cxx;
    if (c->caller && ra - c->lo < c->len && sp < c->sp) { /* called by the new entered last */
        c->lo = lo;
        c->len = f->size;
        return 0;
    }
    c->caller = ra;
    c->sp = sp;
    c->lo = lo;
    c->len = f->size;
    c->type = f->type;
    if (f->type == CALL_MEMALIGN) { /* (size, alignment) kept as memalign's (alignment, size) */
        c->a0 = PT_REGS_PARM2(ctx);
        c->a1 = PT_REGS_PARM1(ctx);
    } else {
        c->a0 = PT_REGS_PARM1(ctx);
        c->a1 = 0;
    }
    return 0;
}

#define CXX_NEW(slot)                                                                                        \
    int enter_cxx_new_##slot(struct pt_regs *ctx) {                                                          \
        return cxx_new(ctx, slot);                                                                           \
    }
#if WANT(enter_cxx_new_0)
CXX_NEW(0)
#endif
#if WANT(enter_cxx_new_1)
CXX_NEW(1)
#endif
#if WANT(enter_cxx_new_2)
CXX_NEW(2)
#endif
#if WANT(enter_cxx_new_3)
CXX_NEW(3)
#endif
#if WANT(enter_cxx_new_4)
CXX_NEW(4)
#endif
#if WANT(enter_cxx_new_5)
CXX_NEW(5)
#endif
#if WANT(enter_cxx_new_6)
CXX_NEW(6)
#endif
#if WANT(enter_cxx_new_7)
CXX_NEW(7)
#endif

int leave(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if (!wanted(id >> 32)) return 0;
    struct stash *s = stash.lookup(&id);
    if (!s || !s->depth) return 0; /* entry not seen (attached mid-call) */
    if (--s->depth) return 0;      /* nested call */
    u32 type = s->type;
    u64 a0 = s->a0, a1 = s->a1, a2 = s->a2;
    /* at a return probe the instruction pointer is the caller's return address (the entry
     * probe may sit after the return address was redirected to the uretprobe trampoline) */
    u64 caller = s->caller ? s->caller : PT_REGS_IP(ctx);
    struct cxx_new_call *c = &s->cxx;
    if (c->caller && caller - c->lo < c->len && PT_REGS_SP(ctx) <= c->sp) { /* a carried new's call */
        caller = c->caller;
        type = c->type;
        a0 = c->a0;
        a1 = c->a1;
        a2 = 0;
    }
    u64 rc = PT_REGS_RC(ctx);
    u64 ptr1 = 0, ptr2 = rc, size = 0, size2 = 0;
    switch (type) {
    case CALL_MALLOC:
    case CALL_CALLOC:
    case CALL_PVALLOC:
        size = a0;
        break;
    case CALL_VALLOC:
        size = a0;
        size2 = PAGE_SIZE_BYTES;
        break;
    case CALL_REALLOC:
        ptr1 = a0;
        size = a1;
        size2 = s->old_size;
        if (a2) ptr2 = a0; /* xallocx: in place, returns a size */
        break;
    case CALL_MEMALIGN:
        size = a1;
        size2 = a0;
        break;
    case CALL_POSIX_MEMALIGN:
        if (s->inner != CALL_POSIX_MEMALIGN) { /* interposer -> glibc memalign: rc not visible */
            ptr1 = rc ? 0 : 12 /* ENOMEM */;
            ptr2 = rc;
        } else {
            ptr1 = (u32)rc;
            ptr2 = 0;
            if ((u32)rc == 0 && a0) pm_probe_read_user(&ptr2, sizeof(ptr2), (void *)a0);
        }
        size = a2;
        size2 = a1;
        break;
    default:
        return 0;
    }
    u64 ts = bpf_ktime_get_ns();
    u64 size3 = chunk_size(ptr2);
#ifdef STACKS
    /* before the record is reserved: a record's stack is always committed before it */
    int zero = 0;
    u32 *on = enabled.lookup(&zero);
    if (on && *on && emit_stack(ctx, id, type, ts)) {
#if PY_FRAMES
        struct py_job *job = pyjob.lookup(&zero);
        if (job) {
            job->ts = ts;
            job->ptr1 = ptr1;
            job->ptr2 = ptr2;
            job->size = size;
            job->size2 = size2;
            job->size3 = size3;
            job->caller = caller;
            job->type = type;
            progs.call(ctx, 0); /* does not return when it runs */
            job->ts = 0;
        }
        u32 cpu = bpf_get_smp_processor_id(); /* written without Python frames */
        struct stack_sample *s = stack_scratch.lookup(&cpu);
        if (s) stack_output(s, id, ts, 0);
#endif
    }
#endif
    struct record_event *e = reserve();
    if (e) fill(e, id, type, ptr1, ptr2, size, size2, size3, caller, ts);
    return 0;
}

#if defined(STACKS) && PY_FRAMES
/* Tail-called by `leave` in a Python process: the waiting stack event gets its thread's Python
 * frames and is written, then the record (as `leave` would have). */
int py_output(struct pt_regs *ctx) {
    int zero = 0;
    struct py_job *job = pyjob.lookup(&zero);
    if (!job || !job->ts) return 0;
    struct py_job j = *job; /* the slot is this CPU's: another task's call may take it */
    u64 ts = j.ts, id = bpf_get_current_pid_tgid();
    job->ts = 0;
    u32 cpu = bpf_get_smp_processor_id();
    struct stack_sample *s = stack_scratch.lookup(&cpu);
    if (s && s->h.ts == ts && s->h.tid == (u32)id) {
        u64 at = s->h.stack_len;
        at = (at + 7) & ~7ull;
        if (at <= STACK_PAGES * SC_PAGE) {
            asm volatile("" : "+r"(at)); /* the bounded register is the one used below */
            struct py_head *head = (struct py_head *)(s->stack + at);
            u32 tgid = id >> 32, tid = (u32)id;
            struct py_config *c = py.lookup(&tgid);
            if (c) {
                u64 *known = pyts.lookup(&tid);
                u64 before = known ? *known : 0;
                u64 tstate = py_tstate(c, tid, before);
                if (tstate && tstate != before) pyts.update(&tid, &tstate);
                py_walk(c, tstate, head, (struct py_frame *)(s->stack + at + sizeof(struct py_head)));
            } else {
                head->count = 0;
                head->status = PY_STATUS_NONE;
                head->tstate = 0;
            }
            u32 count = head->count;
            if (count > PY_FRAMES) count = PY_FRAMES;
            stack_output(s, id, ts, sizeof(struct py_head) + count * sizeof(struct py_frame));
        } else {
            stack_output(s, id, ts, 0);
        }
    } else {
        stack_lost_inc();
    }
    struct record_event *e = reserve();
    if (e) fill(e, id, j.type, j.ptr1, j.ptr2, j.size, j.size2, j.size3, j.caller, ts);
    return 0;
}
#endif
