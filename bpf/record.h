/* pymtrace record: one dj/malloc binary-trace record per malloc-API call (docs/formats.md, section 1).
 * Shared with user space through pymtrace/bpf/structs.py: fixed-width fields only. */
#ifndef PYMTRACE_RECORD_H
#define PYMTRACE_RECORD_H

#include "common.h"
#include "pyframes.h"

#define CALL_UNUSED 0
#define CALL_MAGIC  255
#define MAGIC_PTR   0x1234
#define RECORD_SIZE 64

/* The exact 64-byte on-disk record of glibc's dj/malloc tracer (x86-64, little endian).
 * pad[0] = CLOCK_MONOTONIC ns at which the call took ownership (bpf_ktime_get_ns),
 * pad[1] = the caller's return address (the word at the stack pointer at entry). */
struct mtrace_record {
    __s32 thread;
    __u32 type;
    __u64 ptr1;
    __u64 ptr2;
    __u64 size;
    __u64 size2;
    __u64 size3;
    __u64 pad[2];
};

/* What travels through the ring buffer: the record plus the process (tgid) it belongs to,
 * so user space can write each followed process to its own file without decoding. */
struct record_event {
    struct mtrace_record rec;
    __u64 tgid;
};

/* record --stacks: one per allocating call's record, in the ring buffer `stacks`, written just
 * before the record itself (so a consumer that drained the records reserved before a moment and
 * then the stacks has every stack of those records). Keyed by the record's (thread, pad[0]): a
 * thread's records never share a timestamp. The registers at the call's return and the copied
 * stack (from regs[1] = sp upward, stack_len bytes) follow the caller's frame. */
#define STACK_NREGS 8
struct stack_event {
    __u64 tgid;
    __u32 tid;
    __u32 call; /* CALL_*: the function returned from (the leaf frame) */
    __u64 ts;   /* = the record's pad[0] */
    __u64 regs[STACK_NREGS];
    __u32 stack_len;
    __u32 pad;
};

#endif
