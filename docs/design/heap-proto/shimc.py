"""ctypes front of libshim.so (shim.c): the unwinding loop in C, symbolization via dwflc."""
import ctypes as C
import os

import dwflc

_lib = C.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libshim.so"))
_lib.shim_open.restype = C.c_void_p
_lib.shim_open.argtypes = [C.c_int, C.c_char_p, C.c_size_t]
_lib.shim_dwfl.restype = C.c_void_p
_lib.shim_dwfl.argtypes = [C.c_void_p]
_lib.shim_report.argtypes = [C.c_void_p, C.c_char_p, C.c_size_t]
_lib.shim_unwind.argtypes = [C.c_void_p, C.c_int, C.c_void_p, C.c_size_t,
                             C.POINTER(C.c_uint64), C.POINTER(C.c_uint64), C.c_int,
                             C.POINTER(C.c_int)]
_lib.shim_errmsg.restype = C.c_char_p
_lib.shim_add_file.argtypes = [C.c_char_p, C.c_int]


def capture_files(pid, maps_text):
    """Open every mapped ELF file through /proc/PID/map_files while the process lives and hand
    the fds to the helper: later lookups use the very inode that was mapped."""
    seen = set()
    for ln in dwflc.elf_maps(maps_text).splitlines():
        f = ln.split(None, 5)
        path = f[5].strip()
        if path in seen:
            continue
        seen.add(path)
        try:
            fd = os.open(f"/proc/{pid}/map_files/{f[0].decode()}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        _lib.shim_add_file(path, fd)
MAXF = 128


class Proc(dwflc.Proc):
    def __init__(self, pid, maps_text):   # noqa: super().__init__ not called: shim owns the Dwfl
        self.pid = pid
        maps_text = self.maps_text = dwflc.elf_maps(maps_text)
        self.h = _lib.shim_open(pid, maps_text, len(maps_text))
        if not self.h:
            raise OSError("shim_open: " + _lib.shim_errmsg().decode())
        self.dwfl = _lib.shim_dwfl(self.h)
        self.sym_cache = {}
        self._out = (C.c_uint64 * MAXF)()
        self._regs = (C.c_uint64 * 8)()
        self._err = C.c_int()

    def unwind(self, tid, stack, regs, length=None):
        """stack: bytes, or an address (int) of `length` bytes (zero-copy from the ring)."""
        if length is None:
            length = len(stack)
        r = self._regs
        r[0], r[1], r[2], r[3] = regs["ip"], regs["sp"], regs["bp"], regs["bx"]
        r[4], r[5], r[6], r[7] = regs["r12"], regs["r13"], regs["r14"], regs["r15"]
        n = _lib.shim_unwind(self.h, tid, stack, length, r, self._out, MAXF, C.byref(self._err))
        return list(self._out[:n]), (_lib.shim_errmsg().decode() if self._err.value else "end")


_lib.shim_inlines.argtypes = [C.c_void_p, C.c_uint64, C.POINTER(C.c_char_p), C.POINTER(C.c_char_p),
                              C.POINTER(C.c_int), C.c_int]


def inlines(dwfl, pc, max_=16):
    """[(name, file, line)] innermost first (inlined callees, then the function itself)."""
    names, files, lines = (C.c_char_p * max_)(), (C.c_char_p * max_)(), (C.c_int * max_)()
    n = _lib.shim_inlines(dwfl, pc, names, files, lines, max_)
    return [((names[i] or b"?").decode(), (files[i] or b"").decode(), lines[i]) for i in range(n)]
