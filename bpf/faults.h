/* faults: page faults per process and per 64 KiB granule of its address space, from the
 * exceptions:page_fault_user/kernel tracepoints; shared with pymtrace/collect/collectors.py. */
#ifndef PYMTRACE_FAULTS_H
#define PYMTRACE_FAULTS_H

#include "common.h"

#define PF_GRANULE_SHIFT 16

/* Value of the per-CPU LRU hash `pf_totals` keyed by tgid (__u32): exact per-process counts
 * (unless the entry is evicted: more than PF_MAX_PROCS processes faulting). */
struct pf_totals {
    __u64 user;   /* faults raised in user mode */
    __u64 kernel; /* faults on user addresses raised in kernel mode (copy_to/from_user) */
    /* The process's name at the entry's creation and at exec, in the slot of the CPU that
     * wrote it (user space takes the latest comm_ns): an exited process keeps its name. */
    __u64 comm_ns;
    char comm[TASK_COMM_LEN];
};

/* Key of the LRU hash `pf_regions` (bounded: old granules are evicted, totals stay exact). */
struct pf_key {
    __u32 tgid;
    __u32 pad;
    __u64 granule; /* address >> PF_GRANULE_SHIFT */
};

struct pf_region {
    __u64 count;
    __u64 last_address; /* user space attributes the granule to the mapping holding this */
};

/* Record of the ring buffer `pf_new`: a (tgid, granule) key of pf_regions was created.
 * User space reads /proc/TGID/maps at once when the address is not in the maps it has, and
 * remembers the granule's region, so faults on a block unmapped before the next snapshot
 * (a large calloc'd block freed right after use) are still attributed to their region. */
struct pf_new_granule {
    __u32 tgid;
    __u32 pad;
    __u64 address;
};

#define PF_LOST_TOTALS_FULL 0 /* no pf_totals entry could be made (LRU: allocation failure) */
#define PF_LOST_RINGBUF     1 /* pf_new record dropped: ring buffer full (region from snapshot time) */
#define PF_LOST_N           2

#endif
