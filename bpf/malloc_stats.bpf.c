/* malloc_stats: count every public malloc-API call once per process, with requested,
 * allocated and freed chunk bytes and a log2 histogram of requested sizes.
 *
 * Attach points (see pymtrace/collect/collectors.py MallocCollector, which picks the sites):
 *   malloc, calloc            entry + return
 *   realloc                   entry + return (outer call)
 *   memalign, aligned_alloc (one function in glibc 2.36, two in 2.41), posix_memalign,
 *   valloc, pvalloc           entry + return (outer)
 *   free                      at its first emulated instruction (`push %rbp`, +9 on glibc
 *                             2.36) -> non-NULL frees; plus the early-exit `ret` -> free(NULL)
 * glibc's realloc(NULL, n), realloc(p, 0) and the memalign family (alignment <= 16) reach
 * malloc/free internally: while an outer call runs on a thread (ms_outer entry), the
 * malloc/free probes skip, so each public call is counted once. realloc(NULL, n) tail-jumps
 * into malloc (glibc 2.36, 2.41): malloc's return probe is chained to realloc's and the
 * kernel runs it first, while the ms_outer entry still exists, so it skips too.
 *
 *   sched:sched_process_exec  (tracepoint, ms_exec) the process's new name into its entry
 * Several processes traced on one file (-p A -p B) attach each return probe once per process:
 * a kernel that does not filter return probes by process (6.1, 6.12; 6.18 does) then runs
 * every process's return program at each return (calls counted at the entry once, bytes at
 * the return N times). With MS_RET_ONCE=1 (set by MallocCollector for that case) each entry
 * of a non-idempotent return program marks its thread in ms_ret, and only the return that
 * finds and deletes the mark counts. ms_outer_return and ms_f_return need no mark: their state
 * is deleted by the first run, and ms_f_return tells the outermost call's own return (its
 * stack pointer above the entry's) from the returns of calls nested in it, which run N times
 * too (an aligned operator new's posix_memalign under jemalloc would otherwise end the new).
 * Defines: MS_MAX_PROCS (processes tracked: LRU), MS_GLIBC=0 / MS_FOREIGN=0 / MS_CXX=0 (leave
 * out the libc's / the other allocators' / C++ operator new/delete's programs), MS_F_SELECT=1
 * (of the ms_f_* entry programs only those whose MS_WANT_<program> is 1), MS_FBLOCKS=0 (other
 * allocators' blocks not kept: no allocated/freed/live bytes for them, under an overhead budget).
 */
#include <uapi/linux/ptrace.h>
#include "malloc_stats.h"

#ifndef MS_MAX_PROCS
#define MS_MAX_PROCS 8192
#endif
#ifndef MS_MAX_THREADS
#define MS_MAX_THREADS 16384
#endif
/* Which programs the module gets (all by default): MS_GLIBC the libc's (ms_<call>_*),
 * MS_FOREIGN the other allocators' (ms_f_<call>_<layout>), MS_CXX C++ operator new/delete's
 * (ms_f_new_*, ms_f_delete_*); ms_f_return with either of the last two. With MS_F_SELECT, of
 * the last two groups' entry programs only those whose MS_WANT_<program> is 1 (the argument
 * layouts the probed files use: pymtrace.target.allocators.programs). MallocCollector
 * compiles only what it will attach: ~0.02 CPU-s of compile a program. */
#ifndef MS_GLIBC
#define MS_GLIBC 1
#endif
#ifndef MS_FOREIGN
#define MS_FOREIGN 1
#endif
#ifndef MS_CXX
#define MS_CXX 1
#endif
#ifndef MS_F_SELECT
#define MS_F_SELECT 0
#endif
/* an identifier left undefined after expansion is 0 in #if: a program not asked for */
#define MS_WANT(program) (!MS_F_SELECT || MS_WANT_##program)
#ifndef MS_RET_ONCE
#define MS_RET_ONCE 0
#endif
#ifndef MS_MAX_BLOCKS
#define MS_MAX_BLOCKS 1048576
#endif
#ifndef MS_FBLOCKS
#define MS_FBLOCKS 1
#endif

/* LRU: when MS_MAX_PROCS processes are tracked, a new one evicts the least recently used
 * entry (user space notices the counters restart: pymtrace.collect.collectors, exporter.Aggregator)
 * instead of being dropped; entries of exited processes are deleted by user space. */
BPF_TABLE("lru_percpu_hash", u32, struct ms_stats, ms_stats, MS_MAX_PROCS);
BPF_PERCPU_ARRAY(ms_zero, struct ms_stats, 1); /* never written: the zero value */
BPF_TABLE("lru_hash", u64, struct ms_outer, ms_outer, MS_MAX_THREADS);
BPF_PERCPU_ARRAY(ms_lost, u64, MS_LOST_N);
/* Other allocators' live blocks allocated since attach -> requested size (their blocks have no
 * header to read a size from). Not preallocated: kernel memory grows with the blocks live
 * (~100 bytes each), not with MS_MAX_BLOCKS; full -> MS_LOST_BLOCKS_FULL. */
BPF_F_TABLE("hash", struct ms_fblock, u64, ms_fblocks, MS_MAX_BLOCKS, BPF_F_NO_PREALLOC);
/* Outer calls in progress on all threads: while 0 (nearly always), malloc and free need not
 * look their thread up in ms_outer. Only ever too high (an outer call whose return was never
 * seen), which costs a lookup, never a wrong count. */
BPF_ARRAY(ms_active, s64, 1);
#if MS_RET_ONCE
/* Returns expected by this thread (MS_RET_ONCE), one per return program kind MS_RET_*:
 * malloc and calloc do not nest on a thread, realloc(NULL, n)'s tail call into malloc marks
 * another kind than realloc's. */
struct ms_ret_key {
    u64 id; /* pid_tgid */
    u32 kind;
    u32 pad;
};
BPF_TABLE("lru_hash", struct ms_ret_key, u8, ms_ret, MS_MAX_THREADS);
#endif
#define MS_RET_MALLOC    0
#define MS_RET_CALLOC    1
#define MS_RET_OUTER_CXX 2 /* an aligned_alloc/memalign inside an aligned operator new */

/* At a probed entry: its return is to be counted once (MS_RET_ONCE). */
static __always_inline void expect_return(u32 kind) {
#if MS_RET_ONCE
    struct ms_ret_key k = {.id = bpf_get_current_pid_tgid(), .kind = kind};
    u8 one = 1;
    ms_ret.update(&k, &one);
#endif
}

/* At a return: 1 for the first run of the return programs (the mark deleted), 0 for the
 * runs of the other traced processes' attachments (and for a call entered before attach). */
static __always_inline int first_return(u32 kind) {
#if MS_RET_ONCE
    struct ms_ret_key k = {.id = bpf_get_current_pid_tgid(), .kind = kind};
    return ms_ret.delete(&k) == 0;
#else
    return 1;
#endif
}

static __always_inline void ms_lost_inc(int idx) {
    u64 *v = ms_lost.lookup(&idx);
    if (v) (*v)++;
}

static __always_inline void set_comm(struct ms_stats *s) {
    s->comm_ns = bpf_ktime_get_ns();
    bpf_get_current_comm(s->comm, sizeof(s->comm));
}

static __always_inline struct ms_stats *stats_for(u32 tgid) {
    struct ms_stats *s = ms_stats.lookup(&tgid);
    if (s) return s;
    int zero = 0;
    struct ms_stats *z = ms_zero.lookup(&zero);
    if (!z) return 0;
    int made = ms_stats.insert(&tgid, z) == 0;
    s = ms_stats.lookup(&tgid);
    if (!s)
        ms_lost_inc(MS_LOST_STATS_FULL);
    else if (made)
        set_comm(s);
    return s;
}

static __always_inline u32 bitlen(u64 v) {
    u32 n = 0;
    if (v >> 32) {
        v >>= 32;
        n += 32;
    }
    if (v >> 16) {
        v >>= 16;
        n += 16;
    }
    if (v >> 8) {
        v >>= 8;
        n += 8;
    }
    if (v >> 4) {
        v >>= 4;
        n += 4;
    }
    if (v >> 2) {
        v >>= 2;
        n += 2;
    }
    if (v >> 1) {
        v >>= 1;
        n += 1;
    }
    return n + (u32)v;
}

static __always_inline void count_call(struct ms_stats *s, u32 type, u64 size) {
    if (type < MS_NCALLS) s->calls[type]++;
    s->requested_bytes += size;
    u32 b = bitlen(size);
    if (b < MS_LOG2_BUCKETS) s->size_log2[b]++;
}

/* Chunk bytes of a block returned by / given to glibc: the size word before it, low 3
 * flag bits masked off. 0 if unreadable. */
static __always_inline u64 chunk_bytes(u64 ptr) {
    u64 hdr = 0;
    if (ptr < 8 || pm_probe_read_user(&hdr, sizeof(hdr), (void *)(ptr - 8)) != 0) return 0;
    return hdr & ~7ULL;
}

static __always_inline int inside_outer(void) {
    int zero = 0;
    s64 *active = ms_active.lookup(&zero);
    if (active && *active <= 0) return 0;
    u64 id = bpf_get_current_pid_tgid();
    return ms_outer.lookup(&id) != 0;
}

static __always_inline void add_active(s64 n) {
    int zero = 0;
    s64 *active = ms_active.lookup(&zero);
    if (active) __sync_fetch_and_add(active, n);
}

#if MS_GLIBC
/* ---- malloc, calloc ------------------------------------------------------------ */

int ms_malloc_entry(struct pt_regs *ctx) {
    expect_return(MS_RET_MALLOC); /* also inside an outer call: operator new's bytes */
    if (inside_outer()) return 0;
    struct ms_stats *s = stats_for(bpf_get_current_pid_tgid() >> 32);
    if (s) count_call(s, CALL_MALLOC, PT_REGS_PARM1(ctx));
    return 0;
}

static __always_inline int alloc_return(struct pt_regs *ctx) {
    u64 ret = PT_REGS_RC(ctx);
    struct ms_stats *s = stats_for(bpf_get_current_pid_tgid() >> 32);
    if (!s) return 0;
    if (ret)
        s->allocated_bytes += chunk_bytes(ret);
    else
        s->failed++;
    return 0;
}

/* The outer call this thread is in when it is a C++ operator new/delete (CALL_NEW..), else 0. */
static __always_inline struct ms_outer *inside_cxx(void) {
    int zero = 0;
    s64 *active = ms_active.lookup(&zero);
    if (active && *active <= 0) return 0;
    u64 id = bpf_get_current_pid_tgid();
    struct ms_outer *op = ms_outer.lookup(&id);
    return op && op->type >= CALL_NEW && op->depth ? op : 0;
}

int ms_malloc_return(struct pt_regs *ctx) {
    if (!first_return(MS_RET_MALLOC)) return 0;
    struct ms_outer *cxx = inside_cxx();
    if (cxx) { /* glibc's malloc inside operator new: the new's block and its bytes */
        u64 ret = PT_REGS_RC(ctx);
        struct ms_stats *s = stats_for(bpf_get_current_pid_tgid() >> 32);
        if (s && ret) s->allocated_bytes += chunk_bytes(ret);
        cxx->old_chunk = 1; /* its bytes are known */
        return 0;
    }
    if (inside_outer()) return 0;
    return alloc_return(ctx);
}

int ms_calloc_entry(struct pt_regs *ctx) {
    expect_return(MS_RET_CALLOC);
    struct ms_stats *s = stats_for(bpf_get_current_pid_tgid() >> 32);
    if (s) count_call(s, CALL_CALLOC, (u64)PT_REGS_PARM1(ctx) * (u64)PT_REGS_PARM2(ctx));
    return 0;
}

int ms_calloc_return(struct pt_regs *ctx) {
    if (!first_return(MS_RET_CALLOC)) return 0;
    return alloc_return(ctx);
}

/* ---- free ---------------------------------------------------------------------- */

/* Attached at free's first emulated instruction (`push %rbp`: the pointer is not NULL) and
 * at each early-exit branch target before it (free(NULL)'s `ret`); both see the argument
 * register unchanged. */
int ms_free_entry(struct pt_regs *ctx) {
    struct ms_outer *cxx = inside_cxx();
    if (cxx) { /* glibc's free inside operator delete: the bytes it releases */
        u64 ptr = PT_REGS_PARM1(ctx);
        struct ms_stats *s = stats_for(bpf_get_current_pid_tgid() >> 32);
        if (s && ptr) s->freed_bytes += chunk_bytes(ptr);
        cxx->old_chunk = 1;
        return 0;
    }
    if (inside_outer()) return 0;
    struct ms_stats *s = stats_for(bpf_get_current_pid_tgid() >> 32);
    if (!s) return 0;
    u64 ptr = PT_REGS_PARM1(ctx);
    s->calls[CALL_FREE]++;
    if (ptr)
        s->freed_bytes += chunk_bytes(ptr);
    else
        s->calls[MS_FREE_NULL]++;
    return 0;
}

/* ---- outer calls: realloc and the memalign family -------------------------------- */

static __always_inline int outer_entry(struct pt_regs *ctx, u32 type, u64 size, u64 arg_ptr) {
    struct ms_outer *cxx = inside_cxx();
    if (cxx) { /* an aligned operator new's aligned_alloc or posix_memalign: counted as the new */
        /* posix_memalign (libstdc++ 14's aligned new) writes its block to *memptr: kept for
         * the return (a new's own arg_ptr is unused) */
        if (type == CALL_POSIX_MEMALIGN && cxx->type < CALL_DELETE) cxx->arg_ptr = arg_ptr;
        expect_return(MS_RET_OUTER_CXX);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    struct ms_outer o = {};
    o.type = type;
    o.requested = size;
    o.arg_ptr = arg_ptr;
    if (type == CALL_REALLOC && arg_ptr) o.old_chunk = chunk_bytes(arg_ptr);
    int fresh = ms_outer.lookup(&id) == 0;
    if (ms_outer.update(&id, &o) != 0)
        ms_lost_inc(MS_LOST_OUTER_FULL);
    else if (fresh)
        add_active(1);
    struct ms_stats *s = stats_for(id >> 32);
    if (s) count_call(s, type, size);
    return 0;
}

int ms_realloc_entry(struct pt_regs *ctx) {
    return outer_entry(ctx, CALL_REALLOC, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx));
}

int ms_memalign_entry(struct pt_regs *ctx) /* memalign(align, size), aligned_alloc */
{
    return outer_entry(ctx, CALL_MEMALIGN, PT_REGS_PARM2(ctx), 0);
}

int ms_posix_memalign_entry(struct pt_regs *ctx) /* posix_memalign(&p, align, size) */
{
    return outer_entry(ctx, CALL_POSIX_MEMALIGN, PT_REGS_PARM3(ctx), PT_REGS_PARM1(ctx));
}

int ms_valloc_entry(struct pt_regs *ctx) {
    return outer_entry(ctx, CALL_VALLOC, PT_REGS_PARM1(ctx), 0);
}

int ms_pvalloc_entry(struct pt_regs *ctx) {
    return outer_entry(ctx, CALL_PVALLOC, PT_REGS_PARM1(ctx), 0);
}

int ms_outer_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct ms_outer *op = ms_outer.lookup(&id);
    if (!op) return 0; /* attached while the call was running */
    if (op->type >= CALL_NEW && op->depth) {
        /* glibc's aligned_alloc/memalign/posix_memalign inside an aligned operator new (its
         * entry was not counted): the block's bytes (posix_memalign: returns 0 and the block
         * in *memptr, kept in arg_ptr by its entry) */
        if (!first_return(MS_RET_OUTER_CXX)) return 0;
        u64 ret = PT_REGS_RC(ctx);
        u64 block = ret;
        if (op->arg_ptr) {
            block = 0;
            if ((u32)ret == 0) pm_probe_read_user(&block, sizeof(block), (void *)op->arg_ptr);
            op->arg_ptr = 0;
        }
        struct ms_stats *s = stats_for(id >> 32);
        if (s && block > 4096) s->allocated_bytes += chunk_bytes(block); /* not an error code */
        op->old_chunk = 1;
        return 0;
    }
    struct ms_outer o = *op;
    if (ms_outer.delete(&id) == 0) add_active(-1);
    struct ms_stats *s = stats_for(id >> 32);
    if (!s) return 0;
    u64 ret = PT_REGS_RC(ctx);
    u64 block = ret;
    if (o.type == CALL_POSIX_MEMALIGN) {
        block = 0;
        if ((u32)ret == 0 && o.arg_ptr) pm_probe_read_user(&block, sizeof(block), (void *)o.arg_ptr);
    }
    if (o.type == CALL_REALLOC && o.arg_ptr) {
        if (o.requested == 0) { /* realloc(p, 0) frees p and returns NULL */
            s->freed_bytes += o.old_chunk;
            return 0;
        }
        if (!ret) { /* failed: the old block stays */
            s->failed++;
            return 0;
        }
        s->freed_bytes += o.old_chunk;
    }
    if (block)
        s->allocated_bytes += chunk_bytes(block);
    else
        s->failed++;
    return 0;
}

#endif /* MS_GLIBC */

#if MS_FOREIGN || MS_CXX
/* ---- other allocators: jemalloc, tcmalloc, mimalloc, a malloc in the executable --------
 *
 * Attached by MallocCollector to the functions of pymtrace/target/allocators.py's tables,
 * one program per (call type, argument layout) of allocators.h. No chunk header is read
 * (their blocks have none): each block allocated since attach is kept in ms_fblocks with its
 * requested size, so allocated/freed/live bytes are requested bytes (foreign_calls says so
 * to user space). Every allocating call is an outer call with a return probe: whatever it
 * calls inside (another probed function, a forwarder's tail jump, an internal free) is not
 * counted again. A state whose frame is gone (its return never seen: stack pointer now above
 * it) is stale and replaced. */

static __always_inline struct ms_outer *foreign_outer(u64 id, u64 sp) {
    struct ms_outer *op = ms_outer.lookup(&id);
    if (op && op->depth && sp > op->sp) { /* its return was never seen: stale */
        if (ms_outer.delete(&id) == 0) add_active(-1);
        return 0;
    }
    return op;
}

/* A block of another allocator leaves: its requested size (if allocated since attach) is freed. */
static __always_inline void fblock_free(struct ms_stats *s, u32 tgid, u64 ptr) {
    if (!MS_FBLOCKS) return;
    struct ms_fblock k = {.ptr = ptr, .tgid = tgid};
    u64 *size = ms_fblocks.lookup(&k);
    if (!size) return;
    s->freed_bytes += *size;
    ms_fblocks.delete(&k);
}

static __always_inline void fblock_alloc(struct ms_stats *s, u32 tgid, u64 ptr, u64 size) {
    if (!MS_FBLOCKS) return;
    struct ms_fblock k = {.ptr = ptr, .tgid = tgid};
    if (ms_fblocks.update(&k, &size) != 0) {
        ms_lost_inc(MS_LOST_BLOCKS_FULL);
        return;
    }
    s->allocated_bytes += size;
}

/* An outermost call's state (depth 1) on this thread; 0 when it runs inside another probed
 * call of this thread (whose depth is raised instead: not counted again; its return is told
 * apart by the stack pointer, ms_f_return). */
static __always_inline int enter_outermost(struct pt_regs *ctx, u64 id, u32 type, u64 size, u64 arg_ptr,
                                           u32 nofail) {
    u64 sp = PT_REGS_SP(ctx);
    struct ms_outer *op = foreign_outer(id, sp);
    if (op) {
        if (op->depth) op->depth++;
        return 0;
    }
    struct ms_outer o = {};
    o.type = type;
    o.requested = size;
    o.arg_ptr = arg_ptr;
    o.sp = sp;
    o.depth = 1;
    o.old_chunk = nofail; /* foreign calls keep no chunk bytes: the slot says "never fails" */
    if (ms_outer.update(&id, &o) != 0)
        ms_lost_inc(MS_LOST_OUTER_FULL);
    else
        add_active(1);
    return 1;
}

static __always_inline int foreign_entry(struct pt_regs *ctx, u32 type, u64 size, u64 arg_ptr, u32 nofail) {
    u64 id = bpf_get_current_pid_tgid();
    if (!enter_outermost(ctx, id, type, size, arg_ptr, nofail)) return 0;
    struct ms_stats *s = stats_for(id >> 32);
    if (!s) return 0;
    s->foreign_calls++;
    if (type == CALL_FREE) {
        s->calls[CALL_FREE]++;
        if (!arg_ptr)
            s->calls[MS_FREE_NULL]++;
        else
            fblock_free(s, id >> 32, arg_ptr);
    } else
        count_call(s, type, size);
    return 0;
}

#if MS_CXX
/* C++ operator new/delete (CALL_NEW..): counted at entry (foreign_entry without
 * foreign_calls). On glibc the malloc/free they make inside adds the block's bytes and sets
 * old_chunk; an outermost new that saw none (another allocator's, whose blocks have no
 * chunk header) keeps its block's requested size in ms_fblocks, as the ms_f_* functions do. */
static __always_inline int cxx_entry(struct pt_regs *ctx, u32 type, u64 size, u64 arg_ptr) {
    u64 id = bpf_get_current_pid_tgid();
    /* new[] -> new, sized delete -> delete, or inside another probed call: not counted */
    if (!enter_outermost(ctx, id, type, size, arg_ptr, 0)) return 0;
    struct ms_stats *s = stats_for(id >> 32);
    if (!s) return 0;
    if (type >= CALL_DELETE) {
        s->calls[type]++;
        /* another allocator's block (kept in ms_fblocks), before it is released; a glibc
         * block is not there (its chunk bytes are counted by the free inside) */
        if (arg_ptr) fblock_free(s, id >> 32, arg_ptr);
    } else
        count_call(s, type, size);
    return 0;
}

static __always_inline int cxx_return(struct pt_regs *ctx, u64 id, struct ms_outer *o) {
    u64 ret = PT_REGS_RC(ctx);
    int is_new = o->type < CALL_DELETE;
    struct ms_stats *s = stats_for(id >> 32);
    if (!s) return 0;
    if (is_new && !ret) s->failed++;                    /* a nothrow new that returned NULL */
    if (!o->old_chunk && (is_new ? ret : o->arg_ptr)) { /* no glibc call inside: another allocator */
        s->foreign_calls++;
        if (is_new) fblock_alloc(s, id >> 32, ret, o->requested);
    }
    return 0;
}

#endif /* MS_CXX */

int ms_f_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct ms_outer *op = ms_outer.lookup(&id);
    if (!op || !op->depth) return 0; /* attached while the call was running */
    /* A call nested in it returns (its frame lies below the outermost entry's stack pointer);
     * the outermost call's own return, and a tail-called function's chained to it, pop the
     * return address above it. Not by counting returns: a kernel that runs every traced
     * process's return program (see the top) would count each nested return N times. */
    if (PT_REGS_SP(ctx) <= op->sp) return 0;
    struct ms_outer o = *op;
    if (ms_outer.delete(&id) == 0) add_active(-1);
#if MS_CXX
    if (o.type >= CALL_NEW) return cxx_return(ctx, id, &o);
#endif
    if (o.type == CALL_FREE || o.old_chunk) return 0; /* nothing can fail; xallocx: in place */
    struct ms_stats *s = stats_for(id >> 32);
    if (!s) return 0;
    u64 ret = PT_REGS_RC(ctx);
    u64 block = ret;
    if (o.type == CALL_POSIX_MEMALIGN) {
        block = 0;
        if ((u32)ret == 0 && o.arg_ptr) pm_probe_read_user(&block, sizeof(block), (void *)o.arg_ptr);
    }
    if (o.type == CALL_REALLOC && o.arg_ptr) {
        if (o.requested == 0) { /* realloc(p, 0) frees p; a block it returns (mimalloc) is new */
            fblock_free(s, id >> 32, o.arg_ptr);
            if (ret) fblock_alloc(s, id >> 32, ret, 0);
            return 0;
        }
        if (!ret) { /* failed: the old block stays */
            s->failed++;
            return 0;
        }
        fblock_free(s, id >> 32, o.arg_ptr);
    }
    int failed = o.type == CALL_POSIX_MEMALIGN ? (u32)ret != 0 : ret == 0;
    if (failed)
        s->failed++;
    else if (block)
        fblock_alloc(s, id >> 32, block, o.requested);
    return 0;
}

/* A free-type function that calls no other probed function (AL_LEAF): entry only, skipped inside
 * an allocating call (realloc(p, 0), an internal free). */
static __always_inline int foreign_free_leaf(struct pt_regs *ctx, u64 ptr) {
    u64 id = bpf_get_current_pid_tgid();
    int zero = 0;
    s64 *active = ms_active.lookup(&zero);
    if (!active || *active > 0) {
        if (foreign_outer(id, PT_REGS_SP(ctx))) return 0;
    }
    struct ms_stats *s = stats_for(id >> 32);
    if (!s) return 0;
    s->foreign_calls++;
    s->calls[CALL_FREE]++;
    if (!ptr)
        s->calls[MS_FREE_NULL]++;
    else
        fblock_free(s, id >> 32, ptr);
    return 0;
}

/* The entry programs ms_f_<call>_<layout> (allocators.py's ApiFunction.program), of the argument
 * layouts in allocators.h: the other allocators' with MS_FOREIGN, C++ operator new/delete's with
 * MS_CXX (MS_F_SELECT applies to both: tcmalloc's and mimalloc's delete is their free). */
#define AL_WANT(name)     (MS_FOREIGN && MS_WANT(ms_f_##name))
#define AL_CXX_WANT(name) (MS_CXX && MS_WANT(ms_f_##name))
#define AL_ENTRY(name, type, size, ptr, align, flags)                                                        \
    int ms_f_##name(struct pt_regs *ctx) {                                                                   \
        if ((flags)&AL_LEAF) return foreign_free_leaf(ctx, ptr);                                             \
        return foreign_entry(ctx, type, size, ptr, (flags)&AL_NOFAIL);                                       \
    }
#define AL_CXX_ENTRY(name, type, as_type, size, ptr, align)                                                  \
    int ms_f_##name(struct pt_regs *ctx) {                                                                   \
        return cxx_entry(ctx, type, size, ptr);                                                              \
    }
#include "allocators.h"
#endif /* MS_FOREIGN || MS_CXX */

/* ---- exec: the process has a new name ------------------------------------------ */

/* Attached by user space to sched:sched_process_exec. Not TRACEPOINT_PROBE: its function
 * and argument struct are named after the tracepoint, and bpf/faults.bpf.c, compiled in the
 * same module by pymtrace top, has its own exec probe. The record is not read. */
int ms_exec(void *ctx) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct ms_stats *s = ms_stats.lookup(&tgid);
    if (s) set_comm(s);
    return 0;
}
