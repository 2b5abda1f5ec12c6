/* Definitions shared by every pymtrace BPF program and parsed by pymtrace/bpf/structs.py.
 * Headers shared with user space use only fixed-width types so that the Python side
 * can mirror them without a C compiler. */
#ifndef PYMTRACE_COMMON_H
#define PYMTRACE_COMMON_H

#define TASK_COMM_LEN 16

/* malloc-API call types, numbered as in the dj/malloc binary trace (docs/formats.md). */
#define CALL_MALLOC         1
#define CALL_CALLOC         2
#define CALL_FREE           3
#define CALL_REALLOC        4
#define CALL_MEMALIGN       5
#define CALL_VALLOC         6
#define CALL_PVALLOC        7
#define CALL_POSIX_MEMALIGN 8

#endif
