/* interpose.h: the ring a preloaded process writes its malloc-API calls into, defined once.
 *
 * interpose.c (the LD_PRELOAD library) includes this file; pymtrace/sources/interposer.py
 * (the consumer) reads it with pymtrace.bpf.structs.parse, which understands only
 * `#define NAME NUMBER` and structs of fixed-width fields (so no expressions, no enums).
 *
 * One file per process image, RING_DIR/PID.STAMP (STAMP: CLOCK_MONOTONIC ns when it was made,
 * so the image an exec of the same process makes, or a reused pid's, sorts after), created by
 * the library with O_CREAT|O_EXCL|O_NOFOLLOW,
 * mode 0600, in the private directory pymtrace made (mkdtemp: 0700). Layout: the header
 * (RING_HEADER_SIZE bytes), then `slots` u64 sequence words, then `slots` struct
 * record_event (bpf/record.h: the BPF ring buffer's very records, 72 bytes each).
 *
 * Protocol: a producer reserves position P = head++ (atomic), waits while P - tail >= slots
 * (the ring is full: counted in `waits`), writes events[P % slots], then stores
 * seq[P % slots] = P + 1 (release). The consumer takes the positions from tail on whose
 * seq word says committed, copies them, then advances tail. Nothing is ever dropped.
 */
#ifndef PYMTRACE_INTERPOSE_H
#define PYMTRACE_INTERPOSE_H

#define RING_MAGIC       0x31474e49524d5950 /* "PYMRING1", stored last: the header is complete */
#define RING_VERSION     1
#define RING_HEADER_SIZE 4096
#define RING_SLOTS       131072 /* default slots (a power of two); PYMTRACE_RING_SLOTS overrides */
#define RING_MIN_SLOTS   1024
#define RING_MAX_SLOTS   16777216
#define RING_EVENT_SIZE  72 /* sizeof(struct record_event) */
#define RING_PATH_MAX    256
#define RING_DEFER       16 /* records a signal handler may leave while its thread is mid-write */

/* flags */
#define RING_F_GLIBC_CHUNKS 1 /* calls go to glibc: size2/size3 are chunk sizes */
#define RING_F_TSC          2 /* pad[0] holds the time stamp counter, not ns: the consumer converts */
#define RING_F_DETACHED     1 /* `detached`: stop recording (the consumer stopped or is gone) */

struct ring_header {
    __u64 magic;
    __u32 version;
    __u32 header_size;
    __u32 slots;
    __u32 event_size;
    __u32 pid;
    __u32 flags;
    __u32 owner; /* pid of the consumer: a producer waiting on a full ring stops if it is gone */
    __u32 reserved;
    __u64 created_ns;              /* CLOCK_MONOTONIC: the STAMP of its name */
    char allocator[RING_PATH_MAX]; /* the object the calls are forwarded to (its malloc) */
    __u64 pad0[26];
    /* offset 512, its own cache line: producers' reservations */
    __u64 head;
    __u64 pad1[7];
    /* offset 576: the consumer's */
    __u64 tail;
    __u64 detached;
    __u64 pad2[6];
    /* offset 640: counters producers add to rarely */
    __u64 waits;    /* calls that found the ring full and waited */
    __u64 wait_ns;  /* their total wait */
    __u64 deferred; /* calls a signal handler made while its thread was writing: written after */
    __u64 pad3[5];
};

/* heap's sampling mode: the credits its processes fire USDT probes against, so that heap's BPF
 * ring buffer never overflows (PYMTRACE_SAMPLE's PATH; one file for the command and every
 * process it follows, made by heap with O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, in its private
 * directory). Protocol: before firing a probe a sampler adds its cost (alloc_cost for
 * heap_alloc, free_cost for heap_free: the most ring bytes that probe's record can take) to
 * `used` (atomic); while `used` exceeds `granted` it waits (counted in `waits`); once the probe
 * has fired (its record written, or counted lost), it adds the same cost to `fired`. heap, once
 * it has read every record written before it read `fired` as F, stores granted = F + room (the
 * ring's size less a margin for exec/fork/exit records): probes fired up to F are out of the
 * ring, so the ring never holds more than `room` bytes of probes' records, those still being
 * written included. `detached`: heap stopped or is gone; nobody waits any more. */
#define CREDIT_MAGIC 0x31444552434d5950 /* "PYMCRED1", stored last */
#define CREDIT_SIZE  4096

struct sample_credits {
    __u64 magic;
    __u32 owner; /* pid of heap: a waiting sampler stops waiting if it is gone */
    __u32 reserved;
    __u64 alloc_cost;
    __u64 free_cost;
    __u64 pad0[4];
    /* offset 64, its own cache line: the samplers' */
    __u64 used;
    __u64 fired;
    __u64 pad1[6];
    /* offset 128: heap's */
    __u64 granted;
    __u64 detached;
    __u64 pad2[6];
    /* offset 192: counters samplers add to rarely */
    __u64 waits;   /* probes that found no credit and waited */
    __u64 wait_ns; /* their total wait */
    __u64 pad3[6];
};

#endif
