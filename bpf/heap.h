/* heap: sampled malloc-API calls with a copy of the user stack and the registers at entry, for
 * `pymtrace heap` (docs/heap.md). Shared with user space through pymtrace/bpf/structs.py:
 * fixed-width fields only. */
#ifndef PYMTRACE_HEAP_H
#define PYMTRACE_HEAP_H

#include "common.h"
#include "pyframes.h"

/* hp_event.type: what one ring record is */
#define HP_REC_SAMPLE 1 /* a sampled allocation: struct hp_event + stack_len bytes of stack */
#define HP_REC_EXEC   2 /* pid exec'd: user space re-captures the process image */
#define HP_REC_FORK   3 /* pid (the parent) forked `other` (a process or a thread: user space tells) */
#define HP_REC_EXIT   4 /* the process pid (its thread-group leader) exited */
/* HP_REC_FREE: the block of sample `id` was freed (or realloc'd away): a short record, the
 * first 40 bytes of a struct hp_event (type, pid, id set) */
#define HP_REC_FREE   5

#define HP_NREGS     8 /* ip, sp, bp, bx, r12, r13, r14, r15 (x86-64, at the probed instruction) */
#define HP_PAGE      4096
#define HP_MAX_PAGES 64 /* stack copy limit: 256 KiB */

/* The fixed part of every ring record; a sample's copied stack (from regs[1] = sp upward)
 * follows it directly. */
struct hp_event {
    __u32 type;
    __u32 pid; /* tgid */
    __u32 tid;
    __u32 call; /* CALL_* of common.h (aligned_alloc is counted as memalign, as everywhere) */
    __u64 size; /* bytes requested (calloc: n * m) */
    __u64 ts;   /* bpf_ktime_get_ns (CLOCK_MONOTONIC) */
    __u64 id;   /* sample id, unique in a run; exec/fork/exit: 0 */
    __u64 regs[HP_NREGS];
    __u32 stack_len; /* bytes of stack following this header */
    __u32 other;     /* HP_REC_FORK: the child's pid */
};

/* hp_targets' value: how a traced process's calls reach the program */
#define HP_VIA_UPROBES    1 /* uprobes on its allocator's functions */
#define HP_VIA_INTERPOSER 2 /* the USDT sites of pymtrace's interposer (tracee/native/interpose.c) */

/* Indexes of the per-CPU counter array hp_lost: everything the program could not do. */
#define HP_LOST_RINGBUF      0 /* sample record not written: ring buffer full */
#define HP_LOST_LIVE_FULL    1 /* sampled block not remembered: live map full (its free unseen) */
/* HP_LOST_PENDING_FULL: a call's entry->return state not stored: its sample lost (or an outer
 * call's nested calls may be sampled) */
#define HP_LOST_PENDING_FULL 2
#define HP_LOST_SAMPLER      3 /* no per-thread sampler state could be made: call not sampled */
#define HP_LOST_EVENT        4 /* exec/fork/exit record not written: ring buffer full */
#define HP_LOST_TARGETS_FULL 5 /* fork child not followed: target map full */
#define HP_LOST_SLOT_BUSY    6 /* sample dropped: its per-CPU slot was reused while it was preempted */
#define HP_LOST_N            7

/* hp_lg[j] = round(2^20 * log2(1 + j / 1024)), j = 0..1024, filled by user space before attaching */
#define HP_LG_BITS    10
#define HP_LG_ENTRIES 1025

#endif
