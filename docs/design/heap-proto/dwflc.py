"""ctypes binding to elfutils' libdwfl (libdw.so.1, Debian libdw1) for the issue-13 prototype:
unwind a copied user stack from DWARF CFI (.eh_frame/.debug_frame) and symbolize PCs.

One Proc per traced process: its modules come from its /proc/PID/maps (read by libdwfl itself,
either live or from a saved copy), so symbolization still works after the process exits.
"""
import ctypes as C
import ctypes.util
import os

_dw = C.CDLL(ctypes.util.find_library("dw") or "libdw.so.1")
_libc = C.CDLL(None)

Dwarf_Addr = C.c_uint64
Dwarf_Word = C.c_uint64

FIND_ELF = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_char_p, Dwarf_Addr,
                       C.POINTER(C.c_char_p), C.c_void_p)


class Callbacks(C.Structure):
    _fields_ = [("find_elf", C.c_void_p), ("find_debuginfo", C.c_void_p),
                ("section_address", C.c_void_p), ("debuginfo_path", C.c_void_p)]


NEXT_THREAD = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.POINTER(C.c_void_p))
GET_THREAD = C.CFUNCTYPE(C.c_bool, C.c_void_p, C.c_int, C.c_void_p, C.POINTER(C.c_void_p))
MEMORY_READ = C.CFUNCTYPE(C.c_bool, C.c_void_p, Dwarf_Addr, C.POINTER(Dwarf_Word), C.c_void_p)
SET_REGS = C.CFUNCTYPE(C.c_bool, C.c_void_p, C.c_void_p)
FRAME_CB = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p)


class ThreadCallbacks(C.Structure):
    _fields_ = [("next_thread", NEXT_THREAD), ("get_thread", GET_THREAD),
                ("memory_read", MEMORY_READ), ("set_initial_registers", SET_REGS),
                ("detach", C.c_void_p), ("thread_detach", C.c_void_p)]


class GElf_Sym(C.Structure):
    _fields_ = [("st_name", C.c_uint32), ("st_info", C.c_ubyte), ("st_other", C.c_ubyte),
                ("st_shndx", C.c_uint16), ("st_value", C.c_uint64), ("st_size", C.c_uint64)]


def _fn(name, restype, *argtypes):
    f = getattr(_dw, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


dwfl_begin = _fn("dwfl_begin", C.c_void_p, C.POINTER(Callbacks))
dwfl_end = _fn("dwfl_end", None, C.c_void_p)
dwfl_errno = _fn("dwfl_errno", C.c_int)
dwfl_errmsg = _fn("dwfl_errmsg", C.c_char_p, C.c_int)
dwfl_report_begin = _fn("dwfl_report_begin", None, C.c_void_p)
dwfl_report_end = _fn("dwfl_report_end", C.c_int, C.c_void_p, C.c_void_p, C.c_void_p)
dwfl_linux_proc_maps_report = _fn("dwfl_linux_proc_maps_report", C.c_int, C.c_void_p, C.c_void_p)
dwfl_attach_state = _fn("dwfl_attach_state", C.c_bool, C.c_void_p, C.c_void_p, C.c_int,
                        C.POINTER(ThreadCallbacks), C.c_void_p)
dwfl_getthread_frames = _fn("dwfl_getthread_frames", C.c_int, C.c_void_p, C.c_int, FRAME_CB,
                            C.c_void_p)
dwfl_frame_pc = _fn("dwfl_frame_pc", C.c_bool, C.c_void_p, C.POINTER(Dwarf_Addr),
                    C.POINTER(C.c_bool))
dwfl_thread_state_registers = _fn("dwfl_thread_state_registers", C.c_bool, C.c_void_p, C.c_int,
                                  C.c_uint, C.POINTER(Dwarf_Word))
dwfl_thread_state_register_pc = _fn("dwfl_thread_state_register_pc", None, C.c_void_p, Dwarf_Word)
dwfl_addrmodule = _fn("dwfl_addrmodule", C.c_void_p, C.c_void_p, Dwarf_Addr)
dwfl_module_addrinfo = _fn("dwfl_module_addrinfo", C.c_char_p, C.c_void_p, Dwarf_Addr,
                           C.POINTER(C.c_uint64), C.POINTER(GElf_Sym), C.c_void_p, C.c_void_p,
                           C.c_void_p)
dwfl_module_info = _fn("dwfl_module_info", C.c_char_p, C.c_void_p, C.c_void_p,
                       C.POINTER(Dwarf_Addr), C.POINTER(Dwarf_Addr), C.c_void_p, C.c_void_p,
                       C.POINTER(C.c_char_p), C.POINTER(C.c_char_p))
dwfl_module_build_id = _fn("dwfl_module_build_id", C.c_int, C.c_void_p,
                           C.POINTER(C.POINTER(C.c_ubyte)), C.POINTER(C.c_uint64))
dwfl_module_getsrc = _fn("dwfl_module_getsrc", C.c_void_p, C.c_void_p, Dwarf_Addr)
dwfl_lineinfo = _fn("dwfl_lineinfo", C.c_char_p, C.c_void_p, C.POINTER(Dwarf_Addr),
                    C.POINTER(C.c_int), C.POINTER(C.c_int), C.c_void_p, C.c_void_p)

_fmemopen = _libc.fmemopen
_fmemopen.restype, _fmemopen.argtypes = C.c_void_p, [C.c_char_p, C.c_size_t, C.c_char_p]
_fclose = _libc.fclose
_fclose.argtypes = [C.c_void_p]


def _err():
    return dwfl_errmsg(-1).decode()


# x86-64 DWARF register numbers: 3 rbx, 6 rbp, 7 rsp, 12..15 r12..r15, 16 return address (pc)
NREGS = 17


def elf_maps(maps_text: bytes) -> bytes:
    """Keep the lines of files that have an executable mapping: libdwfl 0.188 reports every
    file-backed mapping as a module, and a non-ELF one (the locale archive, gconv cache) next to
    libc makes loading libc fail with "not a valid ELF file"."""
    lines = maps_text.splitlines(True)
    exe = set()
    for ln in lines:
        f = ln.split(None, 5)
        if len(f) == 6 and f[5].startswith(b"/") and b"x" in f[1]:
            exe.add(f[5].strip())
    return b"".join(ln for ln in lines
                    if len(ln.split(None, 5)) == 6 and ln.split(None, 5)[5].strip() in exe)


class Proc:
    """libdwfl session for one process, built from a maps text captured while it lived."""

    def __init__(self, pid, maps_text: bytes):
        self.pid = pid
        maps_text = self.maps_text = elf_maps(maps_text)
        self._cb = Callbacks(C.cast(_dw.dwfl_linux_proc_find_elf, C.c_void_p),
                             C.cast(_dw.dwfl_standard_find_debuginfo, C.c_void_p), None, None)
        self.dwfl = dwfl_begin(C.byref(self._cb))
        if not self.dwfl:
            raise OSError(_err())
        self.report(maps_text)
        # the sample being unwound: (stack bytes, sp, regs[17])
        self.cur = None
        self._tcb = ThreadCallbacks(NEXT_THREAD(self._next_thread), GET_THREAD(self._get_thread),
                                    MEMORY_READ(self._memory_read), SET_REGS(self._set_regs),
                                    None, None)
        self._frame_cb = FRAME_CB(self._frame)
        if not dwfl_attach_state(self.dwfl, None, pid, C.byref(self._tcb), None):
            raise OSError("dwfl_attach_state: " + _err())
        self._pcs = []
        self.sym_cache = {}

    def report(self, maps_text: bytes):
        """(Re)report the modules of a maps text (libdwfl parses it itself)."""
        buf = C.create_string_buffer(maps_text, len(maps_text))
        f = _fmemopen(buf, len(maps_text), b"r")
        dwfl_report_begin(self.dwfl)
        rc = dwfl_linux_proc_maps_report(self.dwfl, f)
        _fclose(f)
        dwfl_report_end(self.dwfl, None, None)
        if rc != 0:
            raise OSError(f"dwfl_linux_proc_maps_report: {rc} {_err()}")

    # --- thread callbacks: the "thread" is the copied stack of the current sample
    def _next_thread(self, dwfl, arg, thread_argp):
        if thread_argp[0]:
            return 0
        thread_argp[0] = 1
        return self.cur_tid

    def _get_thread(self, dwfl, tid, arg, thread_argp):
        return True

    def _memory_read(self, dwfl, addr, result, arg):
        stack, sp = self.cur[0], self.cur[1]
        off = addr - sp
        if 0 <= off <= len(stack) - 8:
            result[0] = int.from_bytes(stack[off:off + 8], "little")
            return True
        return False

    def _set_regs(self, thread, arg):
        regs = self.cur[2]
        arr = (Dwarf_Word * NREGS)(*regs)
        ok = dwfl_thread_state_registers(thread, 0, NREGS, arr)
        dwfl_thread_state_register_pc(thread, regs[16])
        return ok

    def _frame(self, frame, arg):
        pc = Dwarf_Addr()
        act = C.c_bool()
        if not dwfl_frame_pc(frame, C.byref(pc), C.byref(act)):
            return 1  # DWARF_CB_ABORT
        self._pcs.append(pc.value if act.value else pc.value - 1)
        return 0 if len(self._pcs) < 128 else 1

    def unwind(self, tid, stack: bytes, regs):
        """regs: dict with ip sp bp bx r12 r13 r14 r15. Returns (pcs leaf first, end reason)."""
        r = [0] * NREGS
        r[3], r[6], r[7] = regs["bx"], regs["bp"], regs["sp"]
        r[12], r[13], r[14], r[15] = regs["r12"], regs["r13"], regs["r14"], regs["r15"]
        r[16] = regs["ip"]
        self.cur = (stack, regs["sp"], r)
        self.cur_tid = tid
        self._pcs = []
        rc = dwfl_getthread_frames(self.dwfl, tid, self._frame_cb, None)
        return self._pcs, (_err() if rc == -1 else "end")

    def module_of(self, pc):
        mod = dwfl_addrmodule(self.dwfl, pc)
        if not mod:
            return None
        lo, hi = Dwarf_Addr(), Dwarf_Addr()
        main = C.c_char_p()
        name = dwfl_module_info(mod, None, C.byref(lo), C.byref(hi), None, None, C.byref(main), None)
        bits = C.POINTER(C.c_ubyte)()
        vaddr = C.c_uint64()
        n = dwfl_module_build_id(mod, C.byref(bits), C.byref(vaddr))
        bid = bytes(bits[:n]).hex() if n > 0 else ""
        return mod, name.decode(), lo.value, hi.value, bid

    def symbolize(self, pc):
        """-> (function name (mangled), offset, file, line, module name, build id)."""
        hit = self.sym_cache.get(pc)
        if hit:
            return hit
        m = self.module_of(pc)
        if not m:
            res = (None, 0, None, 0, None, "")
        else:
            mod, mname, lo, hi, bid = m
            off = C.c_uint64()
            sym = GElf_Sym()
            name = dwfl_module_addrinfo(mod, pc, C.byref(off), C.byref(sym), None, None, None)
            file, line = None, 0
            ln = dwfl_module_getsrc(mod, pc)
            if ln:
                lineno = C.c_int()
                f = dwfl_lineinfo(ln, None, C.byref(lineno), None, None, None)
                file, line = (f.decode() if f else None), lineno.value
            res = (name.decode() if name else None, off.value, file, line, os.path.basename(mname), bid)
        self.sym_cache[pc] = res
        return res
