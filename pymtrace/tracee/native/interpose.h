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
 * record_event (bpf/record.h: the BPF ring buffer's very records, 72 bytes each), then with
 * stacks (`stack_offset` > 0, at that byte offset) the stack table below.
 *
 * Protocol: a producer reserves position P = head++ (atomic), waits while P - tail >= slots
 * (the ring is full: counted in `waits`), writes events[P % slots], then stores
 * seq[P % slots] = P + 1 (release). The consumer takes the positions from tail on whose
 * seq word says committed, copies them, then advances tail. Nothing is ever dropped.
 */
#ifndef PYMTRACE_INTERPOSE_H
#define PYMTRACE_INTERPOSE_H

#define RING_MAGIC       0x31474e49524d5950 /* "PYMRING1", stored last: the header is complete */
#define RING_VERSION     2
#define RING_HEADER_SIZE 4096
#define RING_SLOTS       131072 /* default slots (a power of two); PYMTRACE_RING_SLOTS overrides */
#define RING_MIN_SLOTS   1024
#define RING_MAX_SLOTS   16777216
#define RING_EVENT_SIZE  72 /* sizeof(struct record_event) */
#define RING_PATH_MAX    256
#define RING_DEFER       16 /* records a signal handler may leave while its thread is mid-write */

/* record --stacks in-process: each allocating call's stack, unwound in the process (libunwind's
 * unw_backtrace), interned there, and its id (1..STACK_IDS; 0: none) put in bits 8-31 of the
 * record's type word. The table, at the header's stack_offset: STACK_HASH_SLOTS u64 hash slots
 * ((tag << 32) | id, 0: empty), then STACK_IDS + 1 u32 entry offsets (by id: the entry's first
 * word + 1, 0: not written yet), then STACK_MODULES struct stack_module, then STACK_WORDS u64
 * words of entries, each a word (frames | STACK_F_CUT << 16) and its return addresses,
 * innermost first (each part page-aligned). A writer reserves an id (stack_next) and words
 * (stack_used), writes the entry, stores its offset (release), then publishes the hash slot:
 * an id any record carries has its entry written. Two threads interning the same new stack at
 * once may both write one: equal stacks can have two ids. Before a new stack is written, the
 * objects loaded since the last one are added to the modules (module_next reserves one,
 * `ready` says it is written): the process names where its return addresses are, so its
 * stacks are located after it has ended (a short-lived child's too). The file is sparse: only
 * the pages written take memory. */
#define STACK_MAX_FRAMES 128 /* return addresses kept per stack; deeper ones are cut (STACK_F_CUT) */
#define STACK_IDS        1048576
#define STACK_HASH_SLOTS 2097152
#define STACK_WORDS      16777216
#define STACK_MODULES    2048
#define STACK_F_CUT      1

/* One object the process had loaded when it wrote a stack (dl_iterate_phdr's view). */
struct stack_module {
    __u64 bias;  /* load bias: a return address minus this is its ELF virtual address */
    __u64 start; /* its PT_LOAD segments' lowest page and end, as /proc/PID/maps would show */
    __u64 end;
    __u64 ready;    /* 1 once written */
    char path[224]; /* as loaded (the executable: /proc/self/exe's target); cut if longer */
};

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
    __u64 stack_offset;            /* byte offset of the stack table; 0: no stacks */
    __u32 stack_frames;            /* frames kept per stack (at most STACK_MAX_FRAMES) */
    __u32 stack_error;             /* why stacks could not be taken (0: they are): STACK_E_* */
    __u64 pad0[24];
    /* offset 512, its own cache line: producers' reservations */
    __u64 head;
    __u64 pad1[7];
    /* offset 576: the consumer's */
    __u64 tail;
    __u64 detached;
    __u64 pad2[6];
    /* offset 640: counters producers add to rarely */
    __u64 waits;         /* calls that found the ring full and waited */
    __u64 wait_ns;       /* their total wait */
    __u64 deferred;      /* calls a signal handler made while its thread was writing: written after */
    __u64 stack_next;    /* stack ids handed out */
    __u64 stack_used;    /* entry words reserved */
    __u64 stacks_full;   /* allocations recorded without a stack: the table was full */
    __u64 stacks_nested; /* ... a signal handler's, while its thread was unwinding */
    __u64 module_next;   /* stack_module entries reserved */
};

/* stack_error */
#define STACK_E_NOLIB 1 /* libunwind (libunwind.so.8) could not be loaded */

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
