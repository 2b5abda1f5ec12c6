/* The Python frames of the sampled thread, read from its interpreter's memory at sample time
 * (heap.bpf.c's hp_python; the layout: bpf/pyframes.h, written per process by user space).
 *
 * No maps here (BCC rewrites map operations in the program's own file only: heap.bpf.c looks
 * them up). The thread state: the one found last time for the thread (hp_pyts), checked on
 * every use (its recorded thread id must still be this thread's); else the interpreters'
 * thread lists are walked from _PyRuntime, at most HP_PY_THREADS states in all (interpreters
 * newest first: a thread with states in several interpreters is found in the newest one's).
 * Then the frames, innermost first, at most HP_PY_FRAMES (the rest: PY_STATUS_TRUNCATED): of
 * each, its fields (one read), its code object's name, file and first line (one read) and
 * those strings' identities (one read each). No frame is interpreted here (which frame starts
 * a C-level evaluation differs per version: user space does it).
 *
 * Written for the verifier, which follows every path of a bounded loop iteration by
 * iteration: a loop body branches only to leave the loop. A failed read is not tested (the
 * helper zero-fills its destination, so the fields read as 0 and the walk ends at a null
 * frame); a value chosen by a condition would give the verifier a known constant on one path
 * and an unknown one on the other, two states per iteration that never merge. */
#ifndef PYMTRACE_PYWALK_H
#define PYMTRACE_PYWALK_H

#include "pyframes.h"

#ifndef HP_PY_THREADS
#define HP_PY_THREADS 256
#endif

/* The u64 at ADDR (0 if it cannot be read). */
static __always_inline u64 py_ptr(u64 addr) {
    u64 v = 0;
    pm_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* The thread id thread state TS records: native_thread_id, or (3.10) the tid in the struct
 * pthread its thread_id points to. */
static __always_inline u32 py_tid(struct py_config *c, u64 ts) {
    u64 id = py_ptr(ts + c->ts_tid);
    if (c->tid_in_pthread == PY_NO_OFFSET) return (u32)id;
    u32 t = 0;
    pm_probe_read_user(&t, sizeof(t), (void *)(id + c->tid_in_pthread));
    return t;
}

/* Thread TID's state: KNOWN (the one found last time, 0: none) if it still is, else the one
 * the interpreters' lists hold (0: none). */
static __always_inline u64 py_tstate(struct py_config *c, u32 tid, u64 known) {
    if (known && py_tid(c, known) == tid) return known;
    u64 interp = py_ptr(c->runtime + c->interp_head);
    u64 ts = py_ptr(interp + c->interp_threads);
#pragma clang loop unroll(disable)
    for (int i = 0; i < HP_PY_THREADS; i++) {
        if (!ts) { /* this interpreter's list is done: the next one's */
            if (!interp) return 0;
            interp = py_ptr(interp + c->interp_next);
            ts = py_ptr(interp + c->interp_threads); /* 0 when there is no next one */
            continue;
        }
        if (py_tid(c, ts) == tid) return ts;
        ts = py_ptr(ts + c->ts_next);
    }
    return 0;
}

/* The identity of the str object at S (0: unreadable) through BUF (PY_FRAME_READ bytes):
 * hash ^ first 8 bytes of ASCII data ^ length. The hash may be computed after the sample
 * (-1 until then): user space accepts either (tracee.pyframes.str_tags). */
static __always_inline u64 py_tag(struct py_config *c, u64 s, u32 size, u8 *buf) {
    pm_probe_read_user(buf, size, (void *)s);
    return *(u64 *)(buf + (c->s_hash & (PY_FRAME_READ - 8))) ^
           *(u64 *)(buf + (c->s_data & (PY_FRAME_READ - 8))) ^
           *(u64 *)(buf + (c->s_length & (PY_FRAME_READ - 8)));
}

/* SIZE (from user space, 1 to PY_FRAME_READ) as the verifier wants a read's size: bounded,
 * by arithmetic (clamping by conditions would make one verifier state per case) */
static __always_inline u32 py_size(u32 size) {
    return ((size - 1) & (PY_FRAME_READ - 1)) + 1;
}

/* Fill HEAD and FRAMES (HP_PY_FRAMES slots) with the frames of thread state TS (0: the
 * thread has none). */
static __always_inline void py_walk(struct py_config *c, u64 ts, struct py_head *head,
                                    struct py_frame *frames) {
    head->count = 0;
    head->status = PY_STATUS_NO_THREAD;
    head->tstate = ts;
    if (!ts) return;
    u64 frame = py_ptr(ts + c->ts_frame);
    if (c->cframe_frame != PY_NO_OFFSET) frame = py_ptr(frame + c->cframe_frame); /* 0 from 0 */
    u32 fsize = py_size(c->f_read), csize = py_size(c->c_read), ssize = py_size(c->s_read);
    u32 prev = c->f_previous & (PY_FRAME_READ - 8), code = c->f_code & (PY_FRAME_READ - 8);
    u32 instr = c->f_instr & (PY_FRAME_READ - 8), flag = c->f_flag & (PY_FRAME_READ - 1);
    u32 name = c->c_name & (PY_FRAME_READ - 8), file = c->c_file & (PY_FRAME_READ - 8);
    u32 line = c->c_line & (PY_FRAME_READ - 4);
    u64 words[PY_FRAME_READ / 8]; /* zeroed word by word: a memset would be a call */
#pragma unroll
    for (int w = 0; w < PY_FRAME_READ / 8; w++) words[w] = 0;
    u8 *buf = (u8 *)words;
    long faults = 0;
    head->status = PY_STATUS_OK;
    /* the count is stored in the loop: after it, nothing depends on the iteration it left at,
     * so the verifier checks the rest of the program once, not once per iteration */
#pragma clang loop unroll(disable)
    for (int i = 0; i < HP_PY_FRAMES; i++) {
        if (!frame) break;
        faults |= pm_probe_read_user(buf, fsize, (void *)frame);
        u64 co = *(u64 *)(buf + code);
        frames[i].code = co;
        frames[i].instr = *(u64 *)(buf + instr);
        frames[i].flag = buf[flag]; /* meaningless where the version has no flag (3.10) */
        frame = *(u64 *)(buf + prev);
        /* what names the code object, kept with the frame: the object may be gone (a
         * module's body after its import) before user space reads it */
        pm_probe_read_user(buf, csize, (void *)(co + c->c_at));
        u64 name_at = *(u64 *)(buf + name), file_at = *(u64 *)(buf + file);
        frames[i].firstlineno = *(u32 *)(buf + line);
        frames[i].name = name_at;
        frames[i].file = file_at;
        frames[i].name_tag = py_tag(c, name_at, ssize, buf);
        frames[i].file_tag = py_tag(c, file_at, ssize, buf);
        head->count = i + 1;
    }
    if (frame) head->status = PY_STATUS_TRUNCATED; /* the loop ran out, not the frames */
    if (faults) head->status = PY_STATUS_FAULT;
}

#endif
