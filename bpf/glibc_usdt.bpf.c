/* glibc malloc USDT probes: one program for the event stream and per-process aggregates.
 *
 * pymtrace/usdt.py generates, before this file, one function per probe site
 * (site_N(struct pt_regs *ctx)) that decodes the site's arguments from the note's arg
 * spec -- registers from pt_regs, memory with bpf_probe_read_user, RIP-relative libc
 * globals at ctx->ip + (symbol + offset - probe address) -- and calls glibc_hit().
 * Each site function is attached as a plain uprobe at the probe address (by library
 * path for every process, or per PID).
 *
 * Every hit is one struct glibc_event in the `events` ring buffer (reserve failures
 * are counted in `lost`: BCC does not report ring-buffer losses), and updates the
 * bounded aggregate maps read by GlibcCollector.snapshot() (pymtrace top view 4, the
 * exporter, pymtrace summary).
 *
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
/* [0] stats map full, [1] heaps map full, [2] threads map full, [3] arenas map full */
BPF_PERCPU_ARRAY(map_full, u64, 4);
BPF_ARRAY(zero_stats, struct glibc_pid_stats, 1); /* never written: the initial value */
BPF_HASH(stats, u32, struct glibc_pid_stats, MAX_PIDS);
BPF_HASH(threads, struct pid_tid, struct glibc_thread, MAX_THREADS);
BPF_HASH(arenas, struct pid_addr, struct glibc_arena, MAX_ARENAS);
BPF_HASH(heaps, struct pid_addr, u64, MAX_HEAPS);
BPF_HASH(mallopt_pending, u32, s32, MAX_THREADS); /* tid -> mallopt param in progress */
BPF_HASH(fault_pids, u32, u8, MAX_PIDS);

static __always_inline void count_full(int idx)
{
	u64 *v = map_full.lookup(&idx);
	if (v)
		(*v)++;
}

static __always_inline void emit(u32 probe, u32 site, u64 a0, u64 a1, u64 a2, u32 flags)
{
	struct glibc_event *ev = events.ringbuf_reserve(sizeof(struct glibc_event));
	if (!ev) {
		int zero = 0;
		u64 *n = lost.lookup(&zero);
		if (n)
			(*n)++;
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
	ev->pad = 0;
	bpf_get_current_comm(&ev->comm, sizeof(ev->comm));
	events.ringbuf_submit(ev, BPF_RB_NO_WAKEUP);
}

static __always_inline int mallopt_param_index(s32 param)
{
	switch (param) {
	case 1: return PARAM_MXFAST;
	case -1: return PARAM_TRIM_THRESHOLD;
	case -2: return PARAM_TOP_PAD;
	case -3: return PARAM_MMAP_THRESHOLD;
	case -4: return PARAM_MMAP_MAX;
	case -5: return PARAM_CHECK_ACTION;
	case -6: return PARAM_PERTURB;
	case -7: return PARAM_ARENA_TEST;
	case -8: return PARAM_ARENA_MAX;
	}
	return -1;
}

static __always_inline int probe_param_index(u32 probe)
{
	switch (probe) {
	case PROBE_memory_mallopt_mxfast: return PARAM_MXFAST;
	case PROBE_memory_mallopt_trim_threshold: return PARAM_TRIM_THRESHOLD;
	case PROBE_memory_mallopt_top_pad: return PARAM_TOP_PAD;
	case PROBE_memory_mallopt_mmap_threshold: return PARAM_MMAP_THRESHOLD;
	case PROBE_memory_mallopt_mmap_max: return PARAM_MMAP_MAX;
	case PROBE_memory_mallopt_perturb: return PARAM_PERTURB;
	case PROBE_memory_mallopt_arena_test: return PARAM_ARENA_TEST;
	case PROBE_memory_mallopt_arena_max: return PARAM_ARENA_MAX;
	case PROBE_memory_mallopt_check_action: return PARAM_CHECK_ACTION;
	case PROBE_memory_tunable_tcache_max_bytes: return PARAM_TCACHE_MAX;
	case PROBE_memory_tunable_tcache_count: return PARAM_TCACHE_COUNT;
	case PROBE_memory_tunable_tcache_unsorted_limit: return PARAM_TCACHE_UNSORTED_LIMIT;
	}
	return -1;
}

static __always_inline void set_param(struct glibc_pid_stats *s, int idx, u64 value, u32 cause, u64 ts)
{
	if (idx < 0 || idx >= NPARAMS)
		return;
	s->params[idx] = value;
	s->params_cause[idx] = cause;
	s->params_ts[idx] = ts;
	s->params_known |= 1ULL << idx;
}

static __always_inline struct glibc_thread *thread_of(u32 pid, u32 tid)
{
	struct pid_tid key = {.pid = pid, .tid = tid};
	struct glibc_thread zero = {};
	struct glibc_thread *t = threads.lookup_or_try_init(&key, &zero);
	if (!t)
		count_full(2);
	return t;
}

static __always_inline struct glibc_arena *arena_of(u32 pid, u64 addr)
{
	struct pid_addr key = {.addr = addr, .pid = pid, .pad = 0};
	struct glibc_arena zero = {};
	struct glibc_arena *a = arenas.lookup_or_try_init(&key, &zero);
	if (!a)
		count_full(3);
	return a;
}

static __always_inline void use_arena(u32 pid, u32 tid, u64 arena)
{
	struct glibc_thread *t = thread_of(pid, tid);
	if (t) {
		if (t->arena != arena)
			t->arena_switches++;
		t->arena = arena;
	}
	struct glibc_arena *a = arena_of(pid, arena);
	if (a)
		a->attaches++;
}

static __always_inline u64 heap_size_swap(u32 pid, u64 heap, u64 size, int remove, int *known)
{
	struct pid_addr key = {.addr = heap, .pid = pid, .pad = 0};
	u64 old = 0;
	u64 *cur = heaps.lookup(&key);
	*known = cur != 0;
	if (cur)
		old = *cur;
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
static __always_inline int glibc_hit(struct pt_regs *ctx, u32 probe, u32 site, u64 a0, u64 a1, u64 a2, u32 flags)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 pid = id >> 32, tid = (u32)id;
	u64 ts = bpf_ktime_get_ns();
	u32 cause = CAUSE_NONE;
	int idx = -1, known = 0;
	u64 old;

	int zero = 0;
	struct glibc_pid_stats *init = zero_stats.lookup(&zero);
	if (!init)
		return 0;
	struct glibc_pid_stats *s = stats.lookup_or_try_init(&pid, init);
	if (!s) {
		count_full(0);
		emit(probe, site, a0, a1, a2, flags);
		return 0;
	}
	s->events++;

	switch (probe) {
	case PROBE_memory_sbrk_more:
		if (a0 == 0) {
			s->sbrk_failed++;
		} else {
			s->sbrk_more_count++;
			s->sbrk_more_bytes += a1;
		}
		break;
	case PROBE_memory_sbrk_less:
		s->sbrk_less_count++;
		s->sbrk_less_bytes += a1;
		break;
	case PROBE_memory_heap_new:
		s->heaps_new++;
		heap_size_swap(pid, a0, a1, 0, &known);
		s->heap_bytes += a1;
		if (s->heap_bytes > s->heap_bytes_max)
			s->heap_bytes_max = s->heap_bytes;
		break;
	case PROBE_memory_heap_more:
	case PROBE_memory_heap_less:
		if (probe == PROBE_memory_heap_more)
			s->heap_more++;
		else
			s->heap_less++;
		old = heap_size_swap(pid, a0, a1, 0, &known);
		s->heap_bytes = s->heap_bytes - old + a1;
		if (s->heap_bytes > s->heap_bytes_max)
			s->heap_bytes_max = s->heap_bytes;
		break;
	case PROBE_memory_heap_free:
		s->heaps_freed++;
		old = heap_size_swap(pid, a0, a1, 1, &known);
		if (!known)
			old = a1;
		s->heap_bytes = s->heap_bytes > old ? s->heap_bytes - old : 0;
		break;
	case PROBE_memory_arena_new: {
		s->arenas_new++;
		struct glibc_arena *a = arena_of(pid, a0);
		if (a) {
			a->created_ts = ts;
			a->creator_tid = tid;
		}
		use_arena(pid, tid, a0);
		break;
	}
	case PROBE_memory_arena_reuse_free_list:
		s->arena_reuse_free_list++;
		use_arena(pid, tid, a0);
		break;
	case PROBE_memory_arena_reuse:
		s->arena_reuse++;
		use_arena(pid, tid, a0);
		break;
	case PROBE_memory_arena_reuse_wait: {
		s->arena_reuse_wait++;
		struct glibc_thread *t = thread_of(pid, tid);
		if (t)
			t->waits++;
		struct glibc_arena *a = arena_of(pid, a1);
		if (a)
			a->waits++;
		break;
	}
	case PROBE_memory_arena_retry:
		s->arena_retry++;
		break;
	case PROBE_memory_malloc_retry:
		s->malloc_retry++;
		break;
	case PROBE_memory_realloc_retry:
		s->realloc_retry++;
		break;
	case PROBE_memory_memalign_retry:
		s->memalign_retry++;
		break;
	case PROBE_memory_calloc_retry:
		s->calloc_retry++;
		break;
	case PROBE_memory_tcache_double_free:
		s->tcache_double_free++;
		break;
	case PROBE_memory_mallopt: {
		s32 param = (s32)a0;
		s->mallopt_calls++;
		mallopt_pending.update(&tid, &param);
		break;
	}
	case PROBE_memory_mallopt_free_dyn_thresholds:
		s->dyn_threshold_changes++;
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
				if (mallopt_param_index(*pending) == idx)
					cause = CAUSE_MALLOPT;
				mallopt_pending.delete(&tid);
			}
			set_param(s, idx, a0, cause, ts);
		}
		break;
	}
	emit(probe, site, a0, a1, a2, flags | (cause << EV_CAUSE_SHIFT));
	return 0;
}

#ifdef WITH_FAULTS
struct mmap_call {
	u64 len;
	u64 prot_flags;
	u64 fd;
};
BPF_HASH(mmap_calls, u32, struct mmap_call, MAX_THREADS);

static __always_inline int fault_traced(void)
{
	u32 pid = bpf_get_current_pid_tgid() >> 32;
	return fault_pids.lookup(&pid) != 0;
}

TRACEPOINT_PROBE(exceptions, page_fault_user)
{
	if (!fault_traced())
		return 0;
	emit(PROBE_FAULT, 0, args->address, args->ip, args->error_code, 0);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
	if (!fault_traced())
		return 0;
	u32 tid = (u32)bpf_get_current_pid_tgid();
	struct mmap_call c = {.len = args->len, .prot_flags = (args->prot << 32) | (u32)args->flags, .fd = args->fd};
	mmap_calls.update(&tid, &c);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap)
{
	u32 tid = (u32)bpf_get_current_pid_tgid();
	struct mmap_call *c = mmap_calls.lookup(&tid);
	if (!c)
		return 0;
	struct mmap_call call = *c;
	mmap_calls.delete(&tid);
	if (args->ret < 0 && args->ret > -4096)
		return 0;
	u32 flags = 0;
	/* MAP_ANONYMOUS = 0x20 */
	if (!(call.prot_flags & 0x20) && (s32)call.fd >= 0)
		flags |= EV_FILE;
	emit(PROBE_MMAP, 0, (u64)args->ret, call.len, call.prot_flags, flags);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_munmap)
{
	if (!fault_traced())
		return 0;
	emit(PROBE_MUNMAP, 0, args->addr, args->len, 0, 0);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_brk)
{
	if (!fault_traced())
		return 0;
	emit(PROBE_BRK, 0, (u64)args->ret, 0, 0, 0);
	return 0;
}
#endif
