/* Structs and constants shared by bpf/glibc_usdt.bpf.c and pymtrace/collect/glibc.py
 * (and usdt.py, which decodes the probes' arguments).
 *
 * glibc's malloc USDT probes (provider libc, memory_*): every hit becomes one
 * glibc_event in the ring buffer, and per-process aggregates are kept in BPF maps.
 * Probe ids of the probes glibc is known to carry are fixed here; a probe name
 * this table does not know gets an id >= PROBE_FIRST_UNKNOWN (events only, no
 * aggregate). Pseudo-probes (faults, mmap, brk) carry ids >= 200.
 */
#ifndef PYMTRACE_GLIBC_USDT_H
#define PYMTRACE_GLIBC_USDT_H

#include "common.h"

#define PROBE_memory_sbrk_more                     1
#define PROBE_memory_sbrk_less                     2
#define PROBE_memory_heap_new                      3
#define PROBE_memory_heap_more                     4
#define PROBE_memory_heap_less                     5
#define PROBE_memory_heap_free                     6
#define PROBE_memory_arena_new                     7
#define PROBE_memory_arena_reuse_free_list         8
#define PROBE_memory_arena_reuse_wait              9
#define PROBE_memory_arena_reuse                   10
#define PROBE_memory_arena_retry                   11
#define PROBE_memory_malloc_retry                  12
#define PROBE_memory_realloc_retry                 13
#define PROBE_memory_memalign_retry                14
#define PROBE_memory_calloc_retry                  15
#define PROBE_memory_mallopt                       16
#define PROBE_memory_mallopt_mxfast                17
#define PROBE_memory_mallopt_trim_threshold        18
#define PROBE_memory_mallopt_top_pad               19
#define PROBE_memory_mallopt_mmap_threshold        20
#define PROBE_memory_mallopt_mmap_max              21
#define PROBE_memory_mallopt_perturb               22
#define PROBE_memory_mallopt_arena_test            23
#define PROBE_memory_mallopt_arena_max             24
#define PROBE_memory_mallopt_free_dyn_thresholds   25
#define PROBE_memory_mallopt_check_action          26
#define PROBE_memory_tunable_tcache_max_bytes      27
#define PROBE_memory_tunable_tcache_count          28
#define PROBE_memory_tunable_tcache_unsorted_limit 29
#define PROBE_memory_tcache_double_free            30
#define PROBE_FIRST_UNKNOWN                        64

/* pseudo-probes from tracepoints, only for pids in the fault_pids map */
#define PROBE_FAULT  200 /* exceptions:page_fault_user: address, ip, error_code */
#define PROBE_MMAP   201 /* syscalls mmap: addr, len, prot << 32 | flags; EV_FILE if fd-backed, fd in .fd */
#define PROBE_MUNMAP 202 /* syscalls munmap: addr, len */
#define PROBE_BRK    203 /* syscalls brk: returned break */
#define PROBE_OPEN   204 /* syscalls openat: fd in args[0]; a glibc_path_event */

/* malloc parameters whose current value is tracked (index into params[]) */
#define PARAM_MXFAST                0
#define PARAM_TRIM_THRESHOLD        1
#define PARAM_TOP_PAD               2
#define PARAM_MMAP_THRESHOLD        3
#define PARAM_MMAP_MAX              4
#define PARAM_PERTURB               5
#define PARAM_ARENA_TEST            6
#define PARAM_ARENA_MAX             7
#define PARAM_TCACHE_MAX            8
#define PARAM_TCACHE_COUNT          9
#define PARAM_TCACHE_UNSORTED_LIMIT 10
#define PARAM_CHECK_ACTION          11
#define NPARAMS                     12

/* why a parameter changed */
#define CAUSE_NONE    0
#define CAUSE_MALLOPT 1
#define CAUSE_TUNABLE 2
#define CAUSE_DYNAMIC 3

/* glibc_event.flags: bits 0-2 = argument N could not be read (EV_ARG_UNREADABLE << N);
 * bits 8-15 = cause (CAUSE_*) */
#define EV_ARG_UNREADABLE 1
#define EV_FILE           16
#define EV_CAUSE_SHIFT    8
#define EV_CAUSE_MASK     0xff

/* arguments decoded per probe hit (glibc_event.args; the generated site_N functions) */
#define MAX_ARGS 3

#define MAX_PIDS    8192
#define MAX_HEAPS   16384
#define MAX_THREADS 32768
#define MAX_ARENAS  16384

struct glibc_event {
    __u64 ts;
    __u64 args[MAX_ARGS];
    __u32 pid;
    __u32 tid;
    __u32 probe;
    __u32 site;
    __u32 flags;
    __u32 fd; /* PROBE_MMAP with EV_FILE: the mapped file's descriptor; else 0 */
    char comm[TASK_COMM_LEN];
};

#define PATH_LEN 256

/* PROBE_OPEN: names the files that PROBE_MMAP events map (by fd, in ev.fd) */
struct glibc_path_event {
    struct glibc_event ev;
    char path[PATH_LEN];
};

/* per-process aggregate, key: pid (tgid) */
struct glibc_pid_stats {
    __u64 events;
    __u32 last_site; /* the libc of a process seen system-wide: that of its last site */
    __u32 pad;
    __u64 sbrk_more_count;
    __u64 sbrk_more_bytes;
    __u64 sbrk_failed;
    __u64 sbrk_less_count;
    __u64 sbrk_less_bytes;
    __u64 arenas_new;
    __u64 arena_reuse;
    __u64 arena_reuse_free_list;
    __u64 arena_reuse_wait;
    __u64 heaps_new;
    __u64 heaps_freed;
    __u64 heap_bytes;
    __u64 heap_bytes_max;
    __u64 heap_more;
    __u64 heap_less;
    __u64 malloc_retry;
    __u64 realloc_retry;
    __u64 calloc_retry;
    __u64 memalign_retry;
    __u64 arena_retry;
    __u64 tcache_double_free;
    __u64 mallopt_calls;
    __u64 dyn_threshold_changes;
    __u64 params_known;
    __s64 params[NPARAMS];
    __u32 params_cause[NPARAMS];
    __u64 params_ts[NPARAMS];
};

struct pid_tid {
    __u32 pid;
    __u32 tid;
};

struct pid_addr {
    __u64 addr;
    __u32 pid;
    __u32 pad;
};

/* per (pid, tid): the thread's arena lock waits and the arena it uses now */
struct glibc_thread {
    __u64 waits;
    __u64 arena;
    __u64 arena_switches;
};

/* per (pid, arena) */
struct glibc_arena {
    __u64 created_ts;
    __u64 creator_tid;
    __u64 attaches;
    __u64 waits;
};

#endif
