/* The Python frames of the sampled thread, read from its interpreter's memory at sample time
 * (heap.bpf.c's hp_emit; the layout: bpf/pyframes.h, written per process by user space).
 *
 * No maps here (BCC rewrites map operations in the program's own file only: heap.bpf.c's
 * hp_python looks them up). The thread state: the one found last time for the thread
 * (hp_pyts), checked on every use (its recorded thread id must still be this thread's);
 * else the interpreters' thread lists are walked from
 * _PyRuntime, at most HP_PY_THREADS states in all (interpreters newest first: a thread with
 * states in several interpreters is found in the newest one's). Then the frames, innermost
 * first, each read at once (f_read bytes) into a stack buffer: at most HP_PY_FRAMES, the
 * rest counted as truncated. Both loops are bounded for the verifier; no frame is
 * interpreted here (which frame starts a C-level evaluation differs per version: user space). */
#ifndef PYMTRACE_PYWALK_H
#define PYMTRACE_PYWALK_H

#include "pyframes.h"

#ifndef HP_PY_THREADS
#define HP_PY_THREADS 256
#endif

static __always_inline u64 py_ptr(u64 addr) {
    u64 v = 0;
    if (pm_probe_read_user(&v, sizeof(v), (void *)addr) != 0) return 0;
    return v;
}

/* Whether thread state TS belongs to thread TID. */
static __always_inline int py_is_thread(struct py_config *c, u64 ts, u32 tid) {
    u64 id = py_ptr(ts + c->ts_tid);
    if (c->tid_in_pthread == PY_NO_OFFSET) return id == tid;
    u32 t = 0;
    if (!id || pm_probe_read_user(&t, sizeof(t), (void *)(id + c->tid_in_pthread)) != 0) return 0;
    return t == tid;
}

/* Thread TID's state: KNOWN (the one found last time, 0: none) if it still is, else the one
 * the interpreters' lists hold (0: none). */
static __always_inline u64 py_tstate(struct py_config *c, u32 tid, u64 known) {
    if (known && py_is_thread(c, known, tid)) return known;
    u64 interp = py_ptr(c->runtime + c->interp_head);
    u64 ts = interp ? py_ptr(interp + c->interp_threads) : 0;
    for (int i = 0; i < HP_PY_THREADS; i++) {
        if (!ts) { /* this interpreter's list is done: the next one's */
            if (!interp) break;
            interp = py_ptr(interp + c->interp_next);
            if (!interp) break;
            ts = py_ptr(interp + c->interp_threads);
            continue;
        }
        if (py_is_thread(c, ts, tid)) return ts;
        ts = py_ptr(ts + c->ts_next);
    }
    return 0;
}

/* Fill HEAD and FRAMES (HP_PY_FRAMES slots) with the frames of thread state TS (0: the
 * thread has none). */
static __always_inline void py_walk(struct py_config *c, u64 ts, struct py_head *head,
                                    struct py_frame *frames) {
    head->count = 0;
    head->status = PY_STATUS_NO_THREAD;
    head->tstate = 0;
    if (!ts) return;
    head->tstate = ts;
    head->status = PY_STATUS_OK;
    u64 frame = py_ptr(ts + c->ts_frame);
    if (frame && c->cframe_frame != PY_NO_OFFSET) frame = py_ptr(frame + c->cframe_frame);
    u32 size = c->f_read;
    if (size > PY_FRAME_READ) size = PY_FRAME_READ;
    if (size < 8) size = 8;
    u32 prev = c->f_previous & (PY_FRAME_READ - 8), code = c->f_code & (PY_FRAME_READ - 8);
    u32 instr = c->f_instr & (PY_FRAME_READ - 8), flag = c->f_flag & (PY_FRAME_READ - 1);
    int has_flag = c->f_flag != PY_NO_OFFSET;
    u64 words[PY_FRAME_READ / 8]; /* zeroed word by word: a memset would be a call */
#pragma unroll
    for (int w = 0; w < PY_FRAME_READ / 8; w++) words[w] = 0;
    u8 *buf = (u8 *)words;
    int i = 0;
    for (; i < HP_PY_FRAMES; i++) {
        if (!frame) break;
        if (pm_probe_read_user(buf, size, (void *)frame) != 0) {
            head->status = PY_STATUS_FAULT;
            break;
        }
        frames[i].code = *(u64 *)(buf + code) | (has_flag ? (buf[flag] & 7) : 0);
        frames[i].instr = *(u64 *)(buf + instr);
        frame = *(u64 *)(buf + prev);
    }
    head->count = i;
    if (i == HP_PY_FRAMES && frame) head->status = PY_STATUS_TRUNCATED;
}

#endif
