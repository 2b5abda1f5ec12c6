/* Prints the offsets tracee/pyruntime.py's tables hold, as the interpreter's own headers lay
 * them out (tests/unit/test_pyframes.py builds it against each interpreter's include
 * directory: -I INCLUDE -I INCLUDE/internal). One "name value" line each. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#else
#include "frameobject.h"
#endif
#define P(name, v) printf("%s %zu\n", name, (size_t)(v))
int main(void) {
    P("version", PY_VERSION_HEX);
    P("runtime.interpreters_head", offsetof(_PyRuntimeState, interpreters.head));
    P("interp.next", offsetof(PyInterpreterState, next));
#if PY_VERSION_HEX >= 0x030B0000
    P("interp.threads_head", offsetof(PyInterpreterState, threads.head));
#else
    P("interp.threads_head", offsetof(PyInterpreterState, tstate_head));
#endif
    P("thread.next", offsetof(PyThreadState, next));
    P("thread.interp", offsetof(PyThreadState, interp));
    P("thread.thread_id", offsetof(PyThreadState, thread_id));
#if PY_VERSION_HEX >= 0x030B0000
    P("thread.native_thread_id", offsetof(PyThreadState, native_thread_id));
#endif
#if PY_VERSION_HEX >= 0x030D0000
    P("thread.current_frame", offsetof(PyThreadState, current_frame));
#elif PY_VERSION_HEX >= 0x030B0000
    P("thread.cframe", offsetof(PyThreadState, cframe));
    P("cframe.current_frame", offsetof(_PyCFrame, current_frame));
#else
    P("thread.frame", offsetof(PyThreadState, frame));
#endif
#if PY_VERSION_HEX >= 0x030B0000
    P("frame.previous", offsetof(_PyInterpreterFrame, previous));
#if PY_VERSION_HEX >= 0x030D0000
    P("frame.code", offsetof(_PyInterpreterFrame, f_executable));
    P("frame.instr", offsetof(_PyInterpreterFrame, instr_ptr));
#else
    P("frame.code", offsetof(_PyInterpreterFrame, f_code));
    P("frame.instr", offsetof(_PyInterpreterFrame, prev_instr));
#endif
#if PY_VERSION_HEX >= 0x030C0000
    P("frame.flag", offsetof(_PyInterpreterFrame, owner));
#else
    P("frame.flag", offsetof(_PyInterpreterFrame, is_entry));
#endif
    P("code.qualname", offsetof(PyCodeObject, co_qualname));
    P("code.code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
#else
    P("frame.previous", offsetof(PyFrameObject, f_back));
    P("frame.code", offsetof(PyFrameObject, f_code));
    P("frame.instr", offsetof(PyFrameObject, f_lasti));
#endif
    P("code.filename", offsetof(PyCodeObject, co_filename));
    P("code.name", offsetof(PyCodeObject, co_name));
    P("code.linetable", offsetof(PyCodeObject, co_linetable));
    P("code.firstlineno", offsetof(PyCodeObject, co_firstlineno));
    P("unicode.state", offsetof(PyASCIIObject, state));
    P("unicode.length", offsetof(PyASCIIObject, length));
    P("unicode.hash", offsetof(PyASCIIObject, hash));
    P("unicode.ascii_size", sizeof(PyASCIIObject));
    P("unicode.compact_size", sizeof(PyCompactUnicodeObject));
    P("bytes.ob_size", offsetof(PyBytesObject, ob_base.ob_size));
    P("bytes.ob_sval", offsetof(PyBytesObject, ob_sval));
    return 0;
}
