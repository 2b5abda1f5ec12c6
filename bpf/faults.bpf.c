/* faults: page faults per process (LRU; exact while not evicted) and per address granule (LRU, for attributing
 * faults to mapped regions in user space). Tracepoints only.
 * Defines: PF_MAX_PROCS, PF_MAX_GRANULES, PF_FILTER=1 (count only tgids in pf_targets),
 * PF_REGIONS=0 (skip the per-granule map). */
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

/* LRU like pf_regions: a new process evicts the least recently used one when full. */
BPF_TABLE("lru_percpu_hash", u32, struct pf_totals, pf_totals, PF_MAX_PROCS);
BPF_TABLE("lru_hash", struct pf_key, struct pf_region, pf_regions, PF_MAX_GRANULES);
BPF_HASH(pf_targets, u32, u8, 1024);
BPF_PERCPU_ARRAY(pf_lost, u64, PF_LOST_N);

static __always_inline void count_fault(u64 address, int kernel)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (tgid == 0)
        return;
#if PF_FILTER
    if (!pf_targets.lookup(&tgid))
        return;
#endif
    struct pf_totals *t = pf_totals.lookup(&tgid);
    if (!t) {
        struct pf_totals init = {};
        init.comm_ns = bpf_ktime_get_ns();
        bpf_get_current_comm(init.comm, sizeof(init.comm));
        pf_totals.insert(&tgid, &init);
        t = pf_totals.lookup(&tgid);
        if (!t) {
            int idx = PF_LOST_TOTALS_FULL;
            u64 *v = pf_lost.lookup(&idx);
            if (v)
                (*v)++;
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
        if (pf_regions.insert(&key, &init) != 0) {   /* another CPU inserted it first */
            r = pf_regions.lookup(&key);
            if (r)
                __sync_fetch_and_add(&r->count, 1);
        }
    }
#endif
}

TRACEPOINT_PROBE(exceptions, page_fault_user)
{
    count_fault(args->address, 0);
    return 0;
}

TRACEPOINT_PROBE(exceptions, page_fault_kernel)
{
    /* Only faults on user addresses (top bit clear) count toward a process. */
    if ((s64)args->address < 0)
        return 0;
    count_fault(args->address, 1);
    return 0;
}

/* exec: the process has a new name (a forked child faults before it execs). */
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct pf_totals *t = pf_totals.lookup(&tgid);
    if (t) {
        t->comm_ns = bpf_ktime_get_ns();
        bpf_get_current_comm(t->comm, sizeof(t->comm));
    }
    return 0;
}
