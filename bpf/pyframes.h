/* A sampled thread's CPython frames, read at sample time by heap.bpf.c (bpf/pywalk.h): the
 * interpreter's frames live on the heap, not on the copied C stack. Shared with user space
 * (pymtrace/bpf/structs.py): the per-process configuration it writes (offsets of the
 * interpreter's own layout: pymtrace/tracee/pyruntime.py) and the block a sample carries
 * (names: pymtrace/tracee/pyframes.py). */
#ifndef PYMTRACE_PYFRAMES_H
#define PYMTRACE_PYFRAMES_H

#define PY_NO_OFFSET  0xffffffff /* a field this version does not have */
#define PY_FRAME_READ 128        /* bytes of each frame read at once: its fields lie below */

/* py_head.status */
#define PY_STATUS_NONE      0 /* not a Python process (no configuration) */
#define PY_STATUS_OK        1 /* every frame of the thread is in the block */
#define PY_STATUS_NO_THREAD 2 /* no thread state of this thread found (it never ran Python) */
#define PY_STATUS_TRUNCATED 3 /* the frame limit was reached: the outermost frames are missing */
#define PY_STATUS_FAULT     4 /* a frame could not be read: the frames up to it are in the block */

/* hp_py's value: where a process's interpreter keeps its threads and frames */
struct py_config {
    __u64 runtime;        /* the address of _PyRuntime */
    __u32 interp_head;    /* _PyRuntimeState.interpreters.head */
    __u32 interp_next;    /* PyInterpreterState.next */
    __u32 interp_threads; /* PyInterpreterState.threads.head (3.10: tstate_head) */
    __u32 ts_next;        /* PyThreadState.next */
    __u32 ts_tid;         /* .native_thread_id; 3.10: .thread_id, a pthread_t */
    __u32 tid_in_pthread; /* 3.10: the tid's offset in glibc's struct pthread; else PY_NO_OFFSET */
    __u32 ts_frame;       /* .current_frame (3.11, 3.12: .cframe; 3.10: .frame) */
    __u32 cframe_frame;   /* 3.11, 3.12: _PyCFrame.current_frame; else PY_NO_OFFSET */
    __u32 f_previous;     /* frame fields, each below PY_FRAME_READ - 8: the caller's frame */
    __u32 f_code;         /* the code object (3.13: f_executable) */
    __u32 f_instr;        /* prev_instr / instr_ptr (3.10: the int f_lasti) */
    __u32 f_flag;         /* 3.11: is_entry; 3.12+: owner (a byte); 3.10: PY_NO_OFFSET */
    __u32 f_read;         /* bytes of a frame to read: past every field above, <= PY_FRAME_READ */
    __u32 c_at;           /* where the code object's fields read with each frame start */
    __u32 c_read;         /* how many bytes of it to read (<= PY_FRAME_READ), and where in them: */
    __u32 c_name;         /* co_qualname (3.10: co_name) */
    __u32 c_file;         /* co_filename */
    __u32 c_line;         /* co_firstlineno (an int) */
    __u32 s_read;         /* bytes of a str read for its tag (<= PY_FRAME_READ), where in them: */
    __u32 s_length;       /* its length */
    __u32 s_hash;         /* its hash (-1: not computed yet) */
    __u32 s_data;         /* an ASCII string's first characters */
    __u32 pad;
};

/* A sample's Python block: this head, then py_frame[HP_PY_FRAMES], innermost first, `count`
 * of them filled. */
struct py_head {
    __u32 count;
    __u32 status; /* PY_STATUS_* */
    __u64 tstate; /* the thread state the frames were read from (0: none) */
};

struct py_frame {
    __u64 code;     /* the code object's address */
    __u64 instr;    /* the raw 8 bytes at f_instr */
    __u64 name;     /* its co_qualname's address (3.10: co_name), 0: unread */
    __u64 file;     /* its co_filename's address */
    __u64 name_tag; /* each str's identity, should the code object be gone before user space */
    __u64 file_tag; /* reads it: its hash if computed, else its first 8 bytes ^ its length */
    __u32 firstlineno;
    __u32 flag; /* the byte at f_flag */
};

#endif
