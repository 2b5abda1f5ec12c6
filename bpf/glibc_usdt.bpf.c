/* glibc malloc USDT probes: one program for the event stream and per-process aggregates.
 *
 * pymtrace/collect/usdt.py generates, before this file, one function per probe site
 * (site_N(struct pt_regs *ctx)) that decodes the site's arguments from the note's arg
 * spec -- registers from pt_regs, memory with pm_probe_read_user, RIP-relative libc
 * globals at ctx->ip + (symbol + offset - probe address) -- and calls glibc_hit().
 * Each site function is attached as a plain uprobe at the probe address (by library
 * path for every process, or per PID).
 *
 * Every hit is one struct glibc_event in the `events` ring buffer (reserve failures
 * are counted in `lost`: BCC does not report ring-buffer losses), and updates the
 * bounded aggregate maps read by GlibcCollector.snapshot() (pymtrace top view 4, the
 * exporter, pymtrace summary).
 *
 * With -DNO_STREAM=1 (pymtrace top, the exporter) probe hits only update the maps.
 * With -DWITH_FAULTS=1, user page faults, mmap/munmap and brk of the pids in
 * fault_pids are also emitted (pymtrace run/summary attribute faults to regions).
 */
#include <uapi/linux/ptrace.h>
#include "glibc_usdt.h"

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 256
#endif

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost, u64, 1);
/* [0] stats entry not created, [1] heaps map full, [2] threads entry not created,
 * [3] arenas map full (LRU maps evict when full: their counts are allocation failures) */
BPF_PERCPU_ARRAY(map_full, u64, 4);
BPF_ARRAY(zero_stats, struct glibc_pid_stats, 1); /* never written: the initial value */
/* Per-process and per-thread state: LRU, so churn of short-lived processes/threads stays
 * bounded even when an exit is missed (user space also deletes exited processes); a full
 * map evicts the least recently used entry instead of refusing new ones. */
BPF_TABLE("lru_hash", u32, struct glibc_pid_stats, stats, MAX_PIDS);
BPF_TABLE("lru_hash", struct pid_tid, struct glibc_thread, threads, MAX_THREADS);
BPF_HASH(arenas, struct pid_addr, struct glibc_arena, MAX_ARENAS);
BPF_HASH(heaps, struct pid_addr, u64, MAX_HEAPS);
BPF_HASH(mallopt_pending, u32, s32, MAX_THREADS); /* tid -> mallopt param in progress */
BPF_HASH(fault_pids, u32, u8, MAX_PIDS);

/* several threads of one process update its counters at once: atomic adds */
#define ADD(field, value) __sync_fetch_and_add(&(field), (value))

static __always_inline void count_full(int idx) {
    u64 *v = map_full.lookup(&idx);
    if (v) (*v)++;
}

static __always_inline void emit_fd(u32 probe, u32 site, u64 a0, u64 a1, u64 a2, u32 flags, u32 fd) {
    struct glibc_event *ev = events.ringbuf_reserve(sizeof(struct glibc_event));
    if (!ev) {
        int zero = 0;
        u64 *n = lost.lookup(&zero);
        if (n) (*n)++;
        return;
    }
    u64 id = bpf_get_current_pid_tgid();
    ev->ts = bpf_ktime_get_ns();
    ev->args[0] = a0;
    ev->args[1] = a1;
    ev->args[2] = a2;
    ev->pid = id >> 32;
    ev->tid = (u32)id;
    ev->probe = probe;
    ev->site = site;
    ev->flags = flags;
    ev->fd = fd;
    bpf_get_current_comm(&ev->comm, sizeof(ev->comm));
    events.ringbuf_submit(ev, BPF_RB_NO_WAKEUP);
}

static __always_inline void emit(u32 probe, u32 site, u64 a0, u64 a1, u64 a2, u32 flags) {
    emit_fd(probe, site, a0, a1, a2, flags, 0);
}

static __always_inline int mallopt_param_index(s32 param) {
    switch (param) {
    case 1:
        return PARAM_MXFAST;
    case -1:
        return PARAM_TRIM_THRESHOLD;
    case -2:
        return PARAM_TOP_PAD;
    case -3:
        return PARAM_MMAP_THRESHOLD;
    case -4:
        return PARAM_MMAP_MAX;
    case -5:
        return PARAM_CHECK_ACTION;
    case -6:
        return PARAM_PERTURB;
    case -7:
        return PARAM_ARENA_TEST;
    case -8:
        return PARAM_ARENA_MAX;
    }
    return -1;
}

static __always_inline int probe_param_index(u32 probe) {
    switch (probe) {
    case PROBE_memory_mallopt_mxfast:
        return PARAM_MXFAST;
    case PROBE_memory_mallopt_trim_threshold:
        return PARAM_TRIM_THRESHOLD;
    case PROBE_memory_mallopt_top_pad:
        return PARAM_TOP_PAD;
    case PROBE_memory_mallopt_mmap_threshold:
        return PARAM_MMAP_THRESHOLD;
    case PROBE_memory_mallopt_mmap_max:
        return PARAM_MMAP_MAX;
    case PROBE_memory_mallopt_perturb:
        return PARAM_PERTURB;
    case PROBE_memory_mallopt_arena_test:
        return PARAM_ARENA_TEST;
    case PROBE_memory_mallopt_arena_max:
        return PARAM_ARENA_MAX;
    case PROBE_memory_mallopt_check_action:
        return PARAM_CHECK_ACTION;
    case PROBE_memory_tunable_tcache_max_bytes:
        return PARAM_TCACHE_MAX;
    case PROBE_memory_tunable_tcache_count:
        return PARAM_TCACHE_COUNT;
    case PROBE_memory_tunable_tcache_unsorted_limit:
        return PARAM_TCACHE_UNSORTED_LIMIT;
    }
    return -1;
}

static __always_inline void set_param(struct glibc_pid_stats *s, int idx, u64 value, u32 cause, u64 ts) {
    if (idx < 0 || idx >= NPARAMS) return;
    s->params[idx] = value;
    s->params_cause[idx] = cause;
    s->params_ts[idx] = ts;
    s->params_known |= 1ULL << idx;
}

static __always_inline struct glibc_thread *thread_of(u32 pid, u32 tid) {
    struct pid_tid key = {.pid = pid, .tid = tid};
    struct glibc_thread zero = {};
    struct glibc_thread *t = threads.lookup_or_try_init(&key, &zero);
    if (!t) count_full(2);
    return t;
}

static __always_inline struct glibc_arena *arena_of(u32 pid, u64 addr) {
    struct pid_addr key = {.addr = addr, .pid = pid, .pad = 0};
    struct glibc_arena zero = {};
    struct glibc_arena *a = arenas.lookup_or_try_init(&key, &zero);
    if (!a) count_full(3);
    return a;
}

static __always_inline void use_arena(u32 pid, u32 tid, u64 arena) {
    struct glibc_thread *t = thread_of(pid, tid);
    if (t) {
        if (t->arena != arena) t->arena_switches++;
        t->arena = arena;
    }
    struct glibc_arena *a = arena_of(pid, arena);
    if (a) ADD(a->attaches, 1);
}

static __always_inline u64 heap_size_swap(u32 pid, u64 heap, u64 size, int remove, int *known) {
    struct pid_addr key = {.addr = heap, .pid = pid, .pad = 0};
    u64 old = 0;
    u64 *cur = heaps.lookup(&key);
    *known = cur != 0;
    if (cur) old = *cur;
    if (remove) {
        heaps.delete(&key);
    } else if (cur) {
        *cur = size;
    } else if (heaps.update(&key, &size) != 0) {
        count_full(1);
    }
    return old;
}

/* Called by every generated site_N function. */
static __always_inline int glibc_hit(struct pt_regs *ctx, u32 probe, u32 site, u64 a0, u64 a1, u64 a2,
                                     u32 flags) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = (u32)id;
    u64 ts = bpf_ktime_get_ns();
    u32 cause = CAUSE_NONE;
    int idx = -1, known = 0;
    u64 old, cur;

    int zero = 0;
    struct glibc_pid_stats *init = zero_stats.lookup(&zero);
    if (!init) return 0;
    struct glibc_pid_stats *s = stats.lookup_or_try_init(&pid, init);
    if (!s) {
        count_full(0);
#ifndef NO_STREAM
        emit(probe, site, a0, a1, a2, flags);
#endif
        return 0;
    }
    ADD(s->events, 1);
    s->last_site = site;

    switch (probe) {
    case PROBE_memory_sbrk_more:
        if (a0 == 0) {
            ADD(s->sbrk_failed, 1);
        } else {
            ADD(s->sbrk_more_count, 1);
            ADD(s->sbrk_more_bytes, a1);
        }
        break;
    case PROBE_memory_sbrk_less:
        ADD(s->sbrk_less_count, 1);
        ADD(s->sbrk_less_bytes, a1);
        break;
    case PROBE_memory_heap_new:
        ADD(s->heaps_new, 1);
        heap_size_swap(pid, a0, a1, 0, &known);
        ADD(s->heap_bytes, a1);
        cur = s->heap_bytes; /* the maximum is approximate when threads race */
        if (cur > s->heap_bytes_max) s->heap_bytes_max = cur;
        break;
    case PROBE_memory_heap_more:
    case PROBE_memory_heap_less:
        if (probe == PROBE_memory_heap_more)
            ADD(s->heap_more, 1);
        else
            ADD(s->heap_less, 1);
        old = heap_size_swap(pid, a0, a1, 0, &known);
        ADD(s->heap_bytes, a1 - old);
        cur = s->heap_bytes;
        if (cur > s->heap_bytes_max) s->heap_bytes_max = cur;
        break;
    case PROBE_memory_heap_free:
        ADD(s->heaps_freed, 1);
        old = heap_size_swap(pid, a0, a1, 1, &known);
        if (!known) old = a1;
        ADD(s->heap_bytes, -old);
        break;
    case PROBE_memory_arena_new: {
        ADD(s->arenas_new, 1);
        struct glibc_arena *a = arena_of(pid, a0);
        if (a) {
            a->created_ts = ts;
            a->creator_tid = tid;
        }
        use_arena(pid, tid, a0);
        break;
    }
    case PROBE_memory_arena_reuse_free_list:
        ADD(s->arena_reuse_free_list, 1);
        use_arena(pid, tid, a0);
        break;
    case PROBE_memory_arena_reuse:
        ADD(s->arena_reuse, 1);
        use_arena(pid, tid, a0);
        break;
    case PROBE_memory_arena_reuse_wait: {
        ADD(s->arena_reuse_wait, 1);
        struct glibc_thread *t = thread_of(pid, tid);
        if (t) ADD(t->waits, 1);
        struct glibc_arena *a = arena_of(pid, a1);
        if (a) ADD(a->waits, 1);
        break;
    }
    case PROBE_memory_arena_retry:
        ADD(s->arena_retry, 1);
        break;
    case PROBE_memory_malloc_retry:
        ADD(s->malloc_retry, 1);
        break;
    case PROBE_memory_realloc_retry:
        ADD(s->realloc_retry, 1);
        break;
    case PROBE_memory_memalign_retry:
        ADD(s->memalign_retry, 1);
        break;
    case PROBE_memory_calloc_retry:
        ADD(s->calloc_retry, 1);
        break;
    case PROBE_memory_tcache_double_free:
        ADD(s->tcache_double_free, 1);
        break;
    case PROBE_memory_mallopt: {
        s32 param = (s32)a0;
        ADD(s->mallopt_calls, 1);
        mallopt_pending.update(&tid, &param);
        break;
    }
    case PROBE_memory_mallopt_free_dyn_thresholds:
        ADD(s->dyn_threshold_changes, 1);
        cause = CAUSE_DYNAMIC;
        set_param(s, PARAM_MMAP_THRESHOLD, a0, cause, ts);
        set_param(s, PARAM_TRIM_THRESHOLD, a1, cause, ts);
        break;
    default:
        idx = probe_param_index(probe);
        if (idx >= 0) {
            cause = CAUSE_TUNABLE;
            s32 *pending = mallopt_pending.lookup(&tid);
            if (pending) {
                if (mallopt_param_index(*pending) == idx) cause = CAUSE_MALLOPT;
                mallopt_pending.delete(&tid);
            }
            set_param(s, idx, a0, cause, ts);
        }
        break;
    }
#ifndef NO_STREAM
    emit(probe, site, a0, a1, a2, flags | (cause << EV_CAUSE_SHIFT));
#endif
    return 0;
}

#ifdef WITH_FAULTS
struct mmap_call {
    u64 len;
    u64 prot_flags;
    u64 fd;
};
BPF_HASH(mmap_calls, u32, struct mmap_call, MAX_THREADS);

static __always_inline int fault_traced(void) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    return fault_pids.lookup(&pid) != 0;
}

TRACEPOINT_PROBE(exceptions, page_fault_user) {
    if (!fault_traced()) return 0;
    emit(PROBE_FAULT, 0, args->address, args->ip, args->error_code, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap) {
    if (!fault_traced()) return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct mmap_call c = {
        .len = args->len, .prot_flags = (args->prot << 32) | (u32)args->flags, .fd = args->fd};
    mmap_calls.update(&tid, &c);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct mmap_call *c = mmap_calls.lookup(&tid);
    if (!c) return 0;
    struct mmap_call call = *c;
    mmap_calls.delete(&tid);
    if (args->ret < 0 && args->ret > -4096) return 0;
    u32 flags = 0;
    /* MAP_ANONYMOUS = 0x20 */
    if (!(call.prot_flags & 0x20) && (s32)call.fd >= 0) flags |= EV_FILE;
    emit_fd(PROBE_MMAP, 0, (u64)args->ret, call.len, call.prot_flags, flags, (u32)call.fd);
    return 0;
}

BPF_HASH(open_calls, u32, u64, MAX_THREADS); /* tid -> filename pointer */

TRACEPOINT_PROBE(syscalls, sys_enter_openat) {
    if (!fault_traced()) return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 name = (u64)args->filename;
    open_calls.update(&tid, &name);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *name = open_calls.lookup(&tid);
    if (!name) return 0;
    u64 ptr = *name;
    open_calls.delete(&tid);
    if (args->ret < 0) return 0;
    struct glibc_path_event *pe = events.ringbuf_reserve(sizeof(struct glibc_path_event));
    if (!pe) {
        int zero = 0;
        u64 *n = lost.lookup(&zero);
        if (n) (*n)++;
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    pe->ev.ts = bpf_ktime_get_ns();
    pe->ev.args[0] = args->ret;
    pe->ev.args[1] = 0;
    pe->ev.args[2] = 0;
    pe->ev.pid = id >> 32;
    pe->ev.tid = (u32)id;
    pe->ev.probe = PROBE_OPEN;
    pe->ev.site = 0;
    pe->ev.flags = 0;
    pe->ev.fd = 0;
    bpf_get_current_comm(&pe->ev.comm, sizeof(pe->ev.comm));
    if (pm_probe_read_user_str(pe->path, sizeof(pe->path), (void *)ptr) < 0) pe->path[0] = 0;
    events.ringbuf_submit(pe, BPF_RB_NO_WAKEUP);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_munmap) {
    if (!fault_traced()) return 0;
    emit(PROBE_MUNMAP, 0, args->addr, args->len, 0, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_brk) {
    if (!fault_traced()) return 0;
    emit(PROBE_BRK, 0, (u64)args->ret, 0, 0, 0);
    return 0;
}
#endif
