"""`pymtrace record`: every malloc-API call of a process into an mtrace-format file.

Data path: BPF uprobes/uretprobes on glibc's malloc functions write complete 64-byte
dj/malloc records into a BPF ring buffer (no wakeups). This module maps the ring buffer
itself (no per-event callback), and every poll copies all committed records out of it
with a few strided memoryview copies and one write(2): no per-event Python work.
"""

import argparse
import bisect
import ctypes
import functools
import json
import mmap
import os
import re
import select
import struct
import sys
import time

from pymtrace import stopping
from pymtrace.bpf import load as bpfload
from pymtrace.bpf import structs
from pymtrace.collect import base as collect
from pymtrace.target import libc, probesite

try:  # optional: one vectorised copy per batch instead of one strided copy per word
    import numpy as _np
except ImportError:  # pragma: no cover - the memoryview path does the same, ~2x slower
    _np = None
from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.trace.files import open_exclusive, open_unique
from pymtrace.trace.formats import mtrace_bin, mtrace_text

HELP = (
    "Record every malloc-API call of a process (malloc, calloc, realloc, free, memalign, "
    "aligned_alloc, posix_memalign, valloc, pvalloc) into an mtrace-format file."
)
EPILOG = """\
examples:
  pymtrace record -p 1234                    # all threads of 1234 until Ctrl-C or its exit
  pymtrace record -p 1234 --duration 10 -o app.trace
  pymtrace record -- ./myprog arg1 arg2      # traced from its first instruction on
  pymtrace record --format mtrace-text -o log -- ./myprog && mtrace ./myprog log
  pymtrace record --follow-forks -o t -- make -j2   # children go to t.PID
  pymtrace dump mtrace.out.1234

OVERHEAD: each traced call costs the process roughly 1-2.5 us (a uprobe trap, a
uretprobe for allocations, a ring-buffer record): a pure malloc storm runs ~300x slower
while recorded (4.8 ns -> ~1.4-1.6 us a call, docs/record.md), ordinary programs far
less. pymtrace itself needs ~0.1 us of CPU per event (mostly writing 64 bytes per event
to the file) and 64 bytes of disk per event; --format mtrace-text ~1 us per record
(text written as it is recorded). --follow-forks puts the probes on every process
that uses the same libc (filtered in BPF, after the trap): while it runs, every
malloc-API call of every such process on the machine pays the trap, recorded or not
(an unrelated malloc/free loop: 5.7 ns -> 0.8-1 us a call).

STOPPING: Ctrl-C, SIGINT (also sent by a script to a background job) or SIGTERM drains
what was recorded, writes it and detaches; more signals while stopping are ignored. A
failed write (disk full) stops the recording; the file keeps every complete record.

EXIT STATUS: 0 ok; 1 error (also a failed write); 3 events were lost (the ring buffer was
full), unless --allow-drops: make --buffer-size larger. See docs/record.md for details.
"""

EXIT_LOST = 3
_PAGE = mmap.PAGESIZE
_BUSY = 1 << 31
_DISCARD = 1 << 30

# (function, entry program) in call-type order; aligned_alloc shares memalign's code
_ALLOC_FUNCS = [
    ("malloc", "enter_malloc"),
    ("calloc", "enter_calloc"),
    ("realloc", "enter_realloc"),
    ("memalign", "enter_memalign"),
    ("aligned_alloc", "enter_memalign"),
    ("posix_memalign", "enter_posix_memalign"),
    ("valloc", "enter_valloc"),
    ("pvalloc", "enter_pvalloc"),
]
_DEBUG_LIB = "libc_malloc_debug.so.0"
_RECORD = struct.Struct("<" + mtrace_bin.RECORD_FORMAT)
_B_FREE = mtrace_bin.FREE
_B_PLUS = (mtrace_bin.MALLOC, mtrace_bin.CALLOC, mtrace_bin.MEMALIGN, mtrace_bin.VALLOC, mtrace_bin.PVALLOC)


def configure(parser):
    target = parser.add_mutually_exclusive_group()
    target.add_argument("-p", "--pid", type=int, help="record the running process PID (all its threads)")
    parser.add_argument(
        "-o", "--output", metavar="FILE", help="output file (default mtrace.out.PID, with .N appended if it exists)"
    )
    parser.add_argument("--force", action="store_true", help="replace FILE if it exists (never through a symlink)")
    parser.add_argument(
        "--format",
        choices=("mtrace-bin", "mtrace-text"),
        default="mtrace-bin",
        help="mtrace-bin: glibc dj/malloc 64-byte records (default); "
        "mtrace-text: glibc's MALLOC_TRACE log, readable by the mtrace script",
    )
    parser.add_argument(
        "--buffer-size",
        default="32M",
        metavar="BYTES",
        help="BPF ring buffer size (K/M/G suffixes; rounded up to a power of two; default 32M)",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=10.0,
        metavar="MS",
        help="how often the ring buffer is drained, in ms (default 10)",
    )
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    parser.add_argument("--allow-drops", action="store_true", help="exit 0 even if events were lost")
    parser.add_argument("--follow-forks", action="store_true", help="also record child processes, each into FILE.PID")
    parser.add_argument("--libc", metavar="PATH", help="the libc to probe (default: the one the process maps)")
    parser.add_argument("--json", action="store_true", help="print the closing summary as JSON on stderr")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...: launch and record CMD")


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[iI]?[bB]?\s*", str(text))
    if not m:
        raise PymtraceError(f"--buffer-size: cannot parse {text!r} (e.g. 64M)")
    n = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    pages = max(1, -(-n // _PAGE))
    pages = 1 << (pages - 1).bit_length()
    if pages * _PAGE > (1 << 31):
        raise PymtraceError("--buffer-size: at most 2G")
    return pages


# ---------------------------------------------------------------- output files


class WriteFailed(PymtraceError):
    """Writing a trace failed (disk full, quota, I/O error): recording stops, the file keeps
    every complete record written before the failure."""


class Output:
    """One process's trace, written as it is recorded: the MAGIC record then raw records
    (mtrace-bin), or "= Start" then glibc's text lines (mtrace-text). A failed write cuts
    the file back to its last complete record and raises WriteFailed."""

    def __init__(self, path, fd, fmt, tgid, fallback_maps=None):
        self.path = path
        self.fmt = fmt
        self.tgid = tgid
        self.fd = fd
        self.counts = [0] * 9
        self.entries = 0
        self.bytes_written = 0
        self.failed = None
        self.resolver = mtrace_text.CallerResolver() if fmt == "mtrace-text" else None
        self.fallback_maps = fallback_maps  # adds the maps BPF saw, for a process gone from /proc
        self.last_refresh = 0.0
        _, exc = self._put(b"= Start\n" if self.resolver is not None else mtrace_bin.magic_record(tgid), [])
        if exc is not None:
            os.close(fd)
            try:
                os.unlink(path)  # holds nothing
            except OSError:
                pass
            raise WriteFailed(f"cannot write {path}: {exc.strerror or exc}")

    def _put(self, blob, ends):
        """Append BLOB; ENDS: where each of its records ends in it. Returns how many of them
        are in the file: all, or, when the write fails, those written whole (WriteFailed)."""
        view = memoryview(blob)
        done = 0
        try:
            while done < len(view):
                done += os.write(self.fd, view[done:])
        except OSError as exc:
            kept = bisect.bisect_right(ends, done)
            keep = self.bytes_written + (ends[kept - 1] if kept else 0)
            if not ends:  # the file's header itself
                keep = 0
            try:
                os.ftruncate(self.fd, keep)
            except OSError:
                pass
            self.bytes_written = keep
            self.failed = exc
            return kept, exc
        self.bytes_written += done
        return len(ends), None

    def write(self, data, n):
        rs = mtrace_bin.RECORD_SIZE
        if self.resolver is None:
            blob, ends = data, range(rs, (n + 1) * rs, rs)
        else:
            blob, ends = self._text(data)
        kept, exc = self._put(blob, ends)
        types = bytes(data[4 : kept * rs : rs])  # ~0.014 us/event
        for t in range(1, 9):
            self.counts[t] += types.count(t)
        self.entries += kept
        if exc is not None:
            raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}")

    def _text(self, data):
        """glibc's text lines for the records in DATA, as one blob, and each record's end in it.
        The lines of mtrace_text.record_lines, inlined for the common calls (~1 us a record:
        this runs while recording)."""
        rows = list(_RECORD.iter_unpack(data))
        self._resolve_all({r[8] for r in rows})
        resolve = self.resolver
        parts, ends, pos = [], [], 0
        for row in rows:
            _, ty, p1, p2, size, _, _, _, caller = row
            ty &= 0xFF
            where = resolve(caller)
            at = f"@ {where} " if where else ""
            if ty == _B_FREE:
                text = f"{at}- {p1:#x}\n" if p1 else ""
            elif ty in _B_PLUS and p2 and size:
                text = f"{at}+ {p2:#x} {size:#x}\n"
            else:
                lines = mtrace_text.record_lines(mtrace_bin.Record(row[0], ty, *row[2:]), where)
                text = "".join(line + "\n" for line in lines)
            parts.append(text)
            pos += len(text)
            ends.append(pos)
        return "".join(parts).encode(), ends

    def _resolve_all(self, callers):
        """Read the maps again (or take BPF's) if a caller is in no module known yet (a
        library loaded since the last snapshot); at most every 0.2 s."""
        now = time.monotonic()
        if now - self.last_refresh < 0.2:
            return
        if any(a and self.resolver(a).startswith("[") for a in set(callers)):
            self.last_refresh = now
            if not self.snapshot_maps() and self.fallback_maps is not None:
                self.fallback_maps(self)

    def snapshot_maps(self):
        if self.resolver is not None:
            try:
                self.resolver.add_maps(libc.read_maps(self.tgid))
                return True
            except (PymtraceError, OSError):
                pass
        return False

    def close(self):
        if self.resolver is not None and self.failed is None:
            _, exc = self._put(b"= End\n", [6])
            if exc is not None:
                os.close(self.fd)
                raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}")
        os.close(self.fd)

    def summary(self):
        return {
            "file": self.path,
            "pid": self.tgid,
            "format": self.fmt,
            "entries": self.entries,
            "counts": {mtrace_bin.TYPE_NAMES[t]: self.counts[t] for t in range(1, 9)},
            "bytes_written": self.bytes_written,
        }


# ---------------------------------------------------------------- ring buffer


class RingReader:
    """Consumer of a BPF ring buffer of fixed-size samples, reading its mmap'ed pages directly.

    Kernel layout: page 0 = consumer position (we write it), page 1 = producer position,
    then the data pages mapped twice in a row, so a sample that wraps is contiguous.
    Each sample has an 8-byte header (len | BUSY | DISCARD, page offset).
    """

    def __init__(self, map_fd, size, sample_size):
        self.size = size
        self.mask = size - 1
        self.sample = sample_size
        self.stride = (8 + sample_size + 7) & ~7
        if self.stride % 8 or (sample_size % 8):
            raise ValueError("samples must be a multiple of 8 bytes")
        self.cons_map = mmap.mmap(map_fd, _PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self.prod_map = mmap.mmap(map_fd, _PAGE + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=_PAGE)
        # positions are read and written as whole aligned 8-byte words (memoryview 'Q' items
        # are copied with one 8-byte memcpy): struct's "<Q" goes byte by byte, and the kernel
        # reading a half-written consumer position sees the ring full and drops records
        self.cons_pos = memoryview(self.cons_map).cast("Q")
        self.prod_pos = memoryview(self.prod_map)[:8].cast("Q")
        self.data = memoryview(self.prod_map)[_PAGE:]
        self.words = self.data.cast("Q")
        self.max_batch = size // self.stride
        self.discarded = 0
        self.max_backlog = 0  # most bytes ever waiting in the ring: how close we came to losing

    def _pos(self):
        return self.cons_pos[0], self.prod_pos[0]

    def producer(self):
        """The producer position: everything reserved before now lies below it."""
        return self.prod_pos[0]

    def read(self, max_records=None, limit=None):
        """(bytes of the committed samples' payloads, count); advances the consumer position.
        LIMIT: a producer position read earlier; samples reserved after it are left alone."""
        cons, prod = self._pos()
        if prod - cons > self.max_backlog:
            self.max_backlog = prod - cons
        if limit is not None:
            prod = min(prod, limit)
        avail = (prod - cons) // self.stride
        if avail <= 0:
            return None, 0
        n = min(avail, self.max_batch, max_records or avail)
        off = cons & self.mask
        # stop at the first sample still being written (BUSY) or discarded
        tops = bytes(self.data[off + 3 : off + n * self.stride : self.stride])
        bad = len(tops) - len(tops.lstrip(b"\0"))
        if bad < n:
            if tops[bad] & 0x80:  # BUSY: not committed yet, read up to it
                n = bad
            elif tops[bad] & 0x40:  # DISCARD: skip it (pymtrace never discards; be safe)
                if bad == 0:
                    self.discarded += 1
                    self._advance(cons + self.stride)
                    return self.read(max_records, limit)
                n = bad
            else:
                raise PymtraceError(f"ring buffer header corrupt at {cons:#x}")
            if n == 0:
                return None, 0
        out = self._extract(off, n)
        self._advance(cons + n * self.stride)
        return out, n

    def _extract(self, off, n):
        """The N samples at data offset OFF, headers dropped: (first RECORD_SIZE bytes of each,
        concatenated; the u64 after them in each sample as a list, or None if the sample is
        only a record). One vectorised copy with numpy, strided word copies without it."""
        rs = mtrace_bin.RECORD_SIZE
        extra = self.sample > rs
        if _np is not None:
            rows = _np.frombuffer(self.prod_map, dtype=_np.uint8, count=n * self.stride, offset=_PAGE + off).reshape(
                n, self.stride
            )
            recs = rows[:, 8 : 8 + rs].tobytes()
            tg = rows[:, 8 + rs : 16 + rs].copy().view("<u8").ravel() if extra else None
            return recs, tg
        qstride = self.stride // 8
        qoff = off // 8 + 1  # skip the 8-byte header
        wpr = rs // 8
        recs = bytearray(n * rs)
        oq = memoryview(recs).cast("Q")
        src = self.words[qoff : qoff + n * qstride]
        for k in range(wpr):
            oq[k::wpr] = src[k::qstride]
        tg = src[wpr::qstride].tolist() if extra else None
        return recs, tg

    def _advance(self, pos):
        self.cons_pos[0] = pos

    def close(self):
        self.cons_pos.release()
        self.prod_pos.release()
        self.words.release()
        self.data.release()
        self.prod_map.close()
        self.cons_map.close()


# ---------------------------------------------------------------- probes


def probe_libraries(libc_path, want_debug=True):
    """[(path, outermost)] to probe: glibc, plus glibc's libc_malloc_debug interposer when it
    is installed next to it and WANT_DEBUG (the process maps or will preload it)."""
    libs = [(libc_path, False)]
    debug = os.path.join(os.path.dirname(libc_path), _DEBUG_LIB)
    if want_debug and os.path.exists(debug) and os.path.realpath(debug) != os.path.realpath(libc_path):
        libs.append((debug, True))
    return libs


def uses_debug_lib(pid=None, launched=None):
    """Whether to probe libc_malloc_debug. A launched command: always, since it may exec
    other programs (`env LD_PRELOAD=... prog`, `sh -c`, make) and the loader of the one that
    preloads the debug library maps it and runs the program at once, before pymtrace could
    see it (the probes cost a process that does not map the library nothing). A running
    process: only if it maps it, as each probed function adds BCC detach time at exit."""
    if launched is not None:
        return True
    try:
        return any("libc_malloc_debug" in m.path for m in libc.read_maps(pid))
    except PymtraceError:
        return False


_SHUTDOWN_MSG = b"tcache_thread_shutdown(): unaligned tcache chunk detected\0"


@functools.lru_cache(maxsize=16)
def tcache_shutdown_returns(path):
    """Return addresses (ELF vaddrs) of glibc's calls to free inside tcache_thread_shutdown.

    Found without symbols: the function is the code that loads the address of its own
    error message (`lea reg, [rip+msg]`); its direct `call free` instructions lie within
    a few dozen bytes of that. Empty if this libc has no such code (then nothing is skipped).
    """
    try:
        free = libc.symbol(path, "free").address
        with open(path, "rb") as f:
            from elftools.elf.elffile import ELFFile

            elf = ELFFile(f)
            segs = [
                (s["p_vaddr"], s["p_offset"], s["p_filesz"], s["p_flags"])
                for s in elf.iter_segments()
                if s["p_type"] == "PT_LOAD"
            ]
            f.seek(0)
            blob = f.read()
    except Exception:
        return ()
    pos = blob.find(_SHUTDOWN_MSG)
    if pos < 0:
        return ()

    def vaddr(off):
        for va, fo, sz, _ in segs:
            if fo <= off < fo + sz:
                return va + off - fo
        return None

    msg = vaddr(pos)
    found = []
    for va, fo, sz, flags in segs:
        if not flags & 1:  # PF_X
            continue
        text = blob[fo : fo + sz]
        for m in re.finditer(rb"[\x48\x4c]\x8d[\x05\x0d\x15\x1d\x25\x2d\x35\x3d]", text, re.S):
            i = m.start()
            disp = struct.unpack_from("<i", text, i + 3)[0]
            if va + i + 7 + disp != msg:
                continue
            for j in range(max(0, i - 0x80), min(len(text) - 5, i + 0x40)):
                if text[j] == 0xE8 and va + j + 5 + struct.unpack_from("<i", text, j + 1)[0] == free:
                    found.append(va + j + 5)
    return tuple(sorted(set(found)))[:2] if len(set(found)) <= 2 else ()


def entry_site(path, function):
    """ELF address of FUNCTION's entry probe in PATH (where pymtrace.target.probesite puts it)."""
    return libc.symbol(path, function).address + probesite.sites(path, function).offset


def attach(bpf, libs, pid, note_bases=False):
    """Attach every probe. glibc: entry + return probes (free: entry only), return probes
    first so that a thread inside a function during attach cannot leave a stale depth.
    An interposer (libc_malloc_debug): entry probes only (see record.bpf.c).
    Returns [(lib, function, offsets)]."""
    plan = []
    for index, (path, outer) in enumerate(libs):
        seen = set()
        for func, entry in _ALLOC_FUNCS + [("free", "enter_free")]:
            if note_bases and func == "malloc":
                entry = f"enter_malloc_{index}"
            elif outer:
                entry = "enter_outer_" + ("memalign" if func == "aligned_alloc" else func)
            try:
                sym = libc.symbol(path, func)
            except PymtraceError:
                continue
            if sym.address in seen:
                continue
            seen.add(sym.address)
            sites = probesite.sites(path, func)
            offsets = (sites.offset,) + tuple(sites.side_paths)
            plan.append((path, func, sym.address, entry, offsets, func != "free" and not outer))
    if not any(p == libs[0][0] for p, *_ in plan):
        raise PymtraceError(f"{libs[0][0]}: no malloc/free symbols to probe (not a libc?)")
    for path, _func, addr, _entry, _offsets, has_ret in plan:
        if has_ret:
            bpf.attach_uretprobe(name=path, addr=addr, fn_name="leave", pid=pid)
    for path, _func, addr, entry, offsets, _has_ret in plan:
        for off in offsets:
            bpf.attach_uprobe(name=path, addr=addr + off, fn_name=entry, pid=pid)
    return [(p, f, o) for p, f, _, _, o, _ in plan]


# ---------------------------------------------------------------- the command


class Recorder:
    def __init__(self, args):
        self.args = args
        self.pages = parse_size(args.buffer_size)
        self.outputs = {}
        self.bpf = None
        self.reader = None
        self.launched = None
        self.follow = args.follow_forks
        self.start = None
        self.alive = set()
        self.procevents = None
        self.consumer_cpu = 0.0  # CPU time spent draining the ring buffer and writing
        self.polls = 0
        self.last_poll = None
        self.max_gap = 0.0
        self.allocators = libc.AllocatorCache()  # -- CMD: whose malloc it calls (_warn_allocator)
        self.allocator_checked, self.allocator_warned = 0.0, []

    # -- files
    def output_for(self, tgid):
        out = self.outputs.get(tgid)
        if out is not None:
            return out
        if tgid == self.target:
            if self.args.output:
                path, fd = self.args.output, open_exclusive(self.args.output, self.args.force)
            else:
                path, fd = open_unique(f"mtrace.out.{tgid}")
        else:
            base = f"{self.outputs[self.target].path}.{tgid}"
            try:
                path, fd = open_unique(base)
            except PymtraceError as exc:  # a full disk: stop like a failed write
                raise WriteFailed(str(exc)) from None
        out = Output(path, fd, self.args.format, tgid, fallback_maps=self._note_bases)
        self.outputs[tgid] = out
        out.snapshot_maps()
        if not self.args.quiet and not self.args.json:
            print(f"pymtrace: writing to {path}", file=sys.stderr)
        return out

    def run(self):
        args = self.args
        if args.cmd and args.cmd[0] == "--":
            args.cmd = args.cmd[1:]
        if args.pid is None and not args.cmd:
            raise PymtraceError("give -p PID or -- CMD ARGS...")
        if args.pid is not None and args.cmd:
            raise PymtraceError("give either -p PID or -- CMD, not both")
        bpfload.require_root("pymtrace record")
        if args.cmd:
            from pymtrace.target.launch import Launched

            self.launched = Launched(args.cmd)
            self.target = self.launched.pid
            libc_path = args.libc or self.launched.libc_path()
        else:
            self.target = _tgid(args.pid)  # a thread id means its whole process
            if self.target == os.getpid():
                raise PymtraceError(
                    f"process {self.target} is this pymtrace: recording it would record its own recording without end"
                )
            libc_path = args.libc or libc.process_libc(self.target)
            found = None if args.libc else libc.allocator(self.target)
            if found is not None and not found.traced and libc_path is not None:
                raise PymtraceError(libc.untraced_message(self.target, found) + ": nothing to record")
        try:
            if libc_path is None:
                raise PymtraceError(
                    "the process does not use a shared libc (static binary?): nothing to probe; use --libc PATH"
                )
            self.output_for(self.target)
            try:
                self._load(libc_path)
            except BaseException:
                self._discard_outputs()  # nothing was recorded: leave no empty trace behind
                raise
            return self._loop()
        finally:
            self._cleanup()

    def _discard_outputs(self):
        for out in self.outputs.values():
            for fd in (out.fd, getattr(out, "final_fd", None)):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            try:
                os.unlink(out.path)
            except OSError:
                pass
        self.outputs.clear()

    def _load(self, libc_path):
        if not os.path.isfile(libc_path):
            raise PymtraceError(f"{libc_path}: no such file")
        defines = {"RB_PAGES": self.pages, "PAGE_SIZE_BYTES": _PAGE, "TARGET_TGID": self.target}
        if self.follow:
            defines["FOLLOW"] = 1
        want_debug = self.follow or uses_debug_lib(
            pid=None if self.launched is not None else self.target, launched=self.launched
        )
        self.libs = probe_libraries(libc_path, want_debug)
        if self.args.format == "mtrace-text":
            defines["NOTE_BASES"] = 1
            for index, (path, _) in enumerate(self.libs):
                defines[f"MALLOC_SITE_{index}"] = f"{entry_site(path, 'malloc'):#x}ULL"
        skips = tcache_shutdown_returns(libc_path)
        if len(skips) == 2:
            site = entry_site(libc_path, "free")
            defines["FREE_SKIP1"] = f"{skips[0] - site:#x}ULL"
            defines["FREE_SKIP2"] = f"{skips[1] - site:#x}ULL"
        self.bpf = bpfload.load("record", defines=defines, what="pymtrace record")
        if self.follow:
            self.bpf["traced"][ctypes.c_uint32(self.target)] = ctypes.c_uint32(1)
            self._start_procevents()
        pid = -1 if self.follow else self.target
        try:
            self.sites = attach(self.bpf, self.libs, pid, note_bases=self.args.format == "mtrace-text")
        except Exception as exc:
            if isinstance(exc, PymtraceError):
                raise
            if not _exists(self.target):
                raise ProcessGone(self.target) from None
            raise PymtraceError(f"cannot attach uprobes to {libc_path}: {exc}") from None
        self.bpf["enabled"][ctypes.c_int(0)] = ctypes.c_uint32(1)
        sample = ctypes.sizeof(structs.header("record").structs["record_event"])
        self.reader = RingReader(self.bpf["events"].map_fd, self.pages * _PAGE, sample)
        self.sample = sample

    def _start_procevents(self):
        self.alive = {self.target}
        try:
            from pymtrace.target.procevents import ProcEvents

            self.procevents = ProcEvents(kinds=("fork", "exit")).start()
        except Exception:
            self.procevents = None  # fall back to scanning /proc for children

    def _drain(self, final=False):
        total = 0
        now = time.monotonic()
        if self.last_poll is not None:
            self.max_gap = max(self.max_gap, now - self.last_poll)
        self.last_poll = now
        t0 = time.thread_time()
        # Only what was reserved when this drain began (the final drain: when stopping
        # began): a process whose calls our own draining causes (pymtrace's own writes
        # reaching a traced reader...) can never keep a drain, or the stop, going.
        limit = self.reader.producer()
        patience = time.monotonic() + 0.1
        # a stop signal waits until this drain is done: a batch taken from the ring is
        # always written whole, and the counts match the file
        try:
            with stopping.stop_deferred():
                # Take what is there and go back to sleep: chasing the producer in a loop
                # would read tiny batches, and the per-batch cost would dominate. Read again
                # at once only while batches are large (the buffer was filling up).
                while True:
                    data, n = self.reader.read(limit=limit)
                    if not n:
                        if final and self.reader.cons_pos[0] < limit and time.monotonic() < patience:
                            time.sleep(0.001)  # a record reserved before the stop, being written
                            continue
                        return total
                    total += n
                    self._dispatch(data, n)
                    if n < self.reader.max_batch // 8 and not final:
                        return total
        finally:
            self.consumer_cpu += time.thread_time() - t0
            self.polls += 1

    def _dispatch(self, data, n):
        recs, tg = data
        rs = mtrace_bin.RECORD_SIZE
        if tg is None:
            self.output_for(self.target).write(recs, n)
            return
        first = int(tg[0])
        if (_np is not None and bool((tg == first).all())) or (_np is None and tg.count(first) == n):
            self.output_for(first).write(recs, n)
            return
        # several processes in this batch (--follow-forks): split into runs
        tgids = tg.tolist() if _np is not None else tg
        i = 0
        while i < n:
            j = i
            t = tgids[i]
            while j < n and tgids[j] == t:
                j += 1
            self.output_for(t).write(recs[i * rs : j * rs], j - i)
            i = j

    def _lost(self):
        return int(self.bpf["lost"].sum(ctypes.c_int(0)).value)

    def _retried(self):
        try:
            return int(self.bpf["retried"].sum(ctypes.c_int(0)).value)
        except Exception:
            return 0

    def _target_alive(self, pidfd):
        if self.launched is not None:
            if self.launched.proc.poll() is not None:
                return False
        else:
            r, _, _ = select.select([pidfd], [], [], 0)
            if r:
                return False
        return True

    def _children_alive(self):
        if not self.follow:
            return False
        if self.procevents is not None:
            for ev in self.procevents.drain():
                if ev.kind == "fork" and ev.pid == ev.tgid and ev.parent_tgid in self.alive:
                    self.alive.add(ev.tgid)
                elif ev.kind == "exit" and ev.pid == ev.tgid:
                    self.alive.discard(ev.tgid)
        self.alive |= set(self.outputs)
        self.alive = {p for p in self.alive if p != self.target and _exists(p)}
        return bool(self.alive)

    def _loop(self):
        args = self.args
        interval = max(args.poll_interval, 0.5) / 1000.0
        pidfd = os.pidfd_open(self.target)
        self.start = time.monotonic()
        deadline = self.start + args.duration if args.duration else None
        if self.launched is not None:
            self.launched.resume()
        if not args.quiet and not args.json:
            what = " ".join(args.cmd) if args.cmd else f"process {self.target}"
            print(f"pymtrace: recording {what}" + ("" if args.duration else "; Ctrl-C to stop"), file=sys.stderr)
        interrupted = False
        last_maps = 0.0
        self.failure = None
        try:
            while True:
                self._drain()
                now = time.monotonic()
                if args.format == "mtrace-text" and now - last_maps > 0.2:
                    for out in self.outputs.values():
                        out.snapshot_maps()
                    last_maps = now
                if self.launched is not None and not args.libc:
                    self._warn_allocator()
                if deadline is not None and now >= deadline:
                    break
                if not self._target_alive(pidfd) and not self._children_alive():
                    break
                timeout = interval if deadline is None else max(0.0, min(interval, deadline - now))
                time.sleep(timeout)
        except KeyboardInterrupt:
            interrupted = True
        except WriteFailed as exc:  # disk full: what was written whole stays, recording stops
            self.failure = exc
        finally:
            os.close(pidfd)
            stopping.begin_stopping()  # from here on SIGINT/SIGTERM cannot cut the stop short
        # a last drain: everything committed before we stop (later SIGINT/SIGTERM are
        # ignored while stopping, see pymtrace.cli)
        if self.failure is None:
            try:
                self._drain(final=True)
            except WriteFailed as exc:
                self.failure = exc
        self.duration = time.monotonic() - self.start
        self.interrupted = interrupted
        return self._finish()

    def _warn_allocator(self):
        """-- CMD: once the command's libraries are loaded (after each exec), warn once if its
        malloc is not glibc's (jemalloc, tcmalloc, ...): those calls are not recorded."""
        now = time.monotonic()
        if now - self.allocator_checked < 0.02:
            return
        self.allocator_checked = now
        found = self.allocators.get(self.target)
        if found is not None and not found.traced and found not in self.allocator_warned:
            self.allocator_warned.append(found)
            print(f"pymtrace: warning: {libc.untraced_message(self.target, found)}", file=sys.stderr)

    def _finish(self):
        args = self.args
        lost = self._lost()
        if self.reader is not None:
            lost += self.reader.discarded
        for out in self.outputs.values():
            try:
                out.close()
            except WriteFailed as exc:
                self.failure = self.failure or exc
        summary = {
            "files": [o.summary() for o in self.outputs.values()],
            "entries": sum(o.entries for o in self.outputs.values()),
            "lost": lost,
            "duration_s": round(self.duration, 3),
            "bytes_written": sum(o.bytes_written for o in self.outputs.values()),
            "buffer_size": self.pages * _PAGE,
            "consumer_cpu_s": round(self.consumer_cpu, 6),
            "polls": self.polls,
            "max_poll_gap_s": round(self.max_gap, 4),
            "reserve_retries": self._retried(),
            "max_backlog_bytes": self.reader.max_backlog if self.reader is not None else 0,
        }
        if self.failure is not None:
            summary["error"] = str(self.failure)
        if self.launched is not None:
            rc = self.launched.proc.poll()
            summary["command_exit_status"] = rc
        if args.json:
            print(json.dumps(summary), file=sys.stderr)
        else:
            for o in summary["files"]:
                print(f"pymtrace: {o['entries']} entries recorded in {o['file']}", file=sys.stderr)
                counts = ", ".join(f"{k} {v}" for k, v in o["counts"].items() if v)
                print(f"pymtrace:   {counts or 'no calls'}; {o['bytes_written']} bytes written", file=sys.stderr)
            print(f"pymtrace: {lost} events lost, {summary['duration_s']:.3f} s", file=sys.stderr)
            if lost:
                print(
                    "pymtrace: events were lost: the ring buffer was full; use a larger --buffer-size"
                    + ("" if args.allow_drops else " (or --allow-drops)"),
                    file=sys.stderr,
                )
        if self.failure is not None:
            raise WriteFailed(
                f"{self.failure}; recording stopped, {summary['entries']} complete "
                f"entries kept" + (f" in {len(self.outputs)} files" if len(self.outputs) > 1 else "")
            )
        if lost and not args.allow_drops:
            return EXIT_LOST
        return 0

    def _note_bases(self, out):
        """Library load addresses seen by BPF, for a process that exited before /proc was read."""
        try:
            items = list(self.bpf["bases"].items())
        except Exception:
            return
        for key, base in items:
            tgid, index = key.value >> 32, key.value & 0xFFFFFFFF
            if tgid != out.tgid or index >= len(self.libs):
                continue
            path = self.libs[index][0]
            end = base.value + _image_size(path)
            out.resolver.add_maps([libc.Mapping(base.value, end, "r-xp", 0, 0, path)], prefer=False)

    def _cleanup(self):
        if self.procevents is not None:
            self.procevents.stop()
        if self.launched is not None and not self.launched.resumed:
            self.launched.kill()  # failed before it could run traced: do not let it run
        # a launched command still running after Ctrl-C/--duration keeps running, untraced
        if self.reader is not None:
            try:
                self.reader.close()
            except Exception:
                pass
        collect.detach_parallel(self.bpf)


def _image_size(path):
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        ends = [s["p_vaddr"] + s["p_memsz"] for s in ELFFile(f).iter_segments() if s["p_type"] == "PT_LOAD"]
    return max(ends) if ends else 0


def _tgid(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    raise ProcessGone(pid)


def _exists(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def run(args):
    return Recorder(args).run()
