/* faults: page faults per process (LRU; exact while not evicted) and per address granule (LRU, for attributing
 * faults to mapped regions in user space). Tracepoints only.
 * Defines: PF_MAX_PROCS, PF_MAX_GRANULES, PF_FILTER=1 (count only tgids in pf_targets),
 * PF_REGIONS=0 (skip the per-granule map and the pf_new ring buffer), PF_RINGBUF_PAGES,
 * PF_WAKE_NS, PF_RB_FLAGS (fixed flags of bpf_ringbuf_output for pf_new, for measurements). */
#include "faults.h"

#ifndef PF_MAX_PROCS
#define PF_MAX_PROCS 16384
#endif
#ifndef PF_MAX_GRANULES
#define PF_MAX_GRANULES 65536
#endif
#ifndef PF_REGIONS
#define PF_REGIONS 1
#endif
#ifndef PF_RINGBUF_PAGES
#define PF_RINGBUF_PAGES 64 /* 256 KiB: ~10,000 new-granule records between two reads */
#endif
/* Wake-ups of the reader are rationed: a record wakes it (BPF_RB_FORCE_WAKEUP) only when
 * this CPU woke it no sooner than PF_WAKE_NS ago; other records go without (NO_WAKEUP) and
 * are read at the next wake-up or by the reader's periodic consume. The first new granule
 * of a burst is read within the scheduler's latency (its region must still be mapped when
 * user space reads /proc/PID/maps); a storm of new granules costs at most one wake-up per
 * PF_WAKE_NS per CPU instead of one per record (measured: bench/overhead.py, docs/top.md).
 * PF_RB_FLAGS, when defined, replaces this with fixed flags for every record. */
#ifndef PF_WAKE_NS
#define PF_WAKE_NS 1000000
#endif

/* LRU like pf_regions: a new process evicts the least recently used one when full. */
BPF_TABLE("lru_percpu_hash", u32, struct pf_totals, pf_totals, PF_MAX_PROCS);
BPF_HASH(pf_targets, u32, u8, 1024);
BPF_PERCPU_ARRAY(pf_lost, u64, PF_LOST_N);
#if PF_REGIONS
/* LRU maps are always preallocated: without regions, no PF_MAX_GRANULES entries to pay for. */
BPF_TABLE("lru_hash", struct pf_key, struct pf_region, pf_regions, PF_MAX_GRANULES);
BPF_RINGBUF_OUTPUT(pf_new, PF_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(pf_wake, u64, 1); /* when this CPU last woke the pf_new reader */
#endif

static __always_inline void pf_lost_inc(int idx) {
    u64 *v = pf_lost.lookup(&idx);
    if (v) (*v)++;
}

static __always_inline void count_fault(u64 address, int kernel) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (tgid == 0) return;
#if PF_FILTER
    if (!pf_targets.lookup(&tgid)) return;
#endif
    struct pf_totals *t = pf_totals.lookup(&tgid);
    if (!t) {
        struct pf_totals init = {};
        init.comm_ns = bpf_ktime_get_ns();
        bpf_get_current_comm(init.comm, sizeof(init.comm));
        pf_totals.insert(&tgid, &init);
        t = pf_totals.lookup(&tgid);
        if (!t) {
            pf_lost_inc(PF_LOST_TOTALS_FULL);
            return;
        }
    }
    if (kernel)
        t->kernel++;
    else
        t->user++;
#if PF_REGIONS
    struct pf_key key = {};
    key.tgid = tgid;
    key.granule = address >> PF_GRANULE_SHIFT;
    struct pf_region *r = pf_regions.lookup(&key);
    if (r) {
        __sync_fetch_and_add(&r->count, 1);
        r->last_address = address;
    } else {
        struct pf_region init = {1, address};
        if (pf_regions.insert(&key, &init) != 0) { /* another CPU inserted it first */
            r = pf_regions.lookup(&key);
            if (r) __sync_fetch_and_add(&r->count, 1);
        } else { /* a new granule: tell user space */
            struct pf_new_granule ev = {};
            ev.tgid = tgid;
            ev.address = address;
#ifdef PF_RB_FLAGS
            u64 flags = PF_RB_FLAGS;
#else
            u64 flags = BPF_RB_NO_WAKEUP;
            int zero = 0;
            u64 *last = pf_wake.lookup(&zero);
            u64 now = bpf_ktime_get_ns();
            if (last && now - *last >= PF_WAKE_NS) {
                *last = now;
                flags = BPF_RB_FORCE_WAKEUP;
            }
#endif
            if (pf_new.ringbuf_output(&ev, sizeof(ev), flags) != 0) pf_lost_inc(PF_LOST_RINGBUF);
        }
    }
#endif
}

TRACEPOINT_PROBE(exceptions, page_fault_user) {
    count_fault(args->address, 0);
    return 0;
}

TRACEPOINT_PROBE(exceptions, page_fault_kernel) {
    /* Only faults on user addresses (top bit clear) count toward a process. */
    if ((s64)args->address < 0) return 0;
    count_fault(args->address, 1);
    return 0;
}

/* exec: the process has a new name (a forked child faults before it execs). */
TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct pf_totals *t = pf_totals.lookup(&tgid);
    if (t) {
        t->comm_ns = bpf_ktime_get_ns();
        bpf_get_current_comm(t->comm, sizeof(t->comm));
    }
    return 0;
}
