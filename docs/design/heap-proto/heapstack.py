"""Issue-13 prototype driver: BCC uprobe on libc malloc copies the user stack + registers of
sampled calls into a ring buffer; user space unwinds them with libdwfl (DWARF CFI) and
symbolizes them; writes folded stacks and a pprof profile.

usage: heapstack.py [--pages N] [--mean BYTES] [--nocopy] [--unwinder ctypes|shim]
                    [--out PREFIX] -- CMD ARGS  (CMD must sleep ~3 s before allocating)
"""
import argparse
import ctypes as C
import math
import os
import struct
import subprocess
import sys
import time

from bcc import BPF

HERE = os.path.dirname(os.path.abspath(__file__))
HDR = struct.Struct("<IIQQQ8QII")   # pid tid size ts id ip sp bp bx r12 r13 r14 r15 len copy_ns
REG_NAMES = ("ip", "sp", "bp", "bx", "r12", "r13", "r14", "r15")


def libc_of(pid):
    for line in open(f"/proc/{pid}/maps"):
        parts = line.split()
        if len(parts) >= 6 and os.path.basename(parts[5]).startswith("libc.so"):
            return parts[5]
    raise SystemExit("no libc mapped")


def lg_table():
    return [round((1 << 20) * math.log2(1 + j / 1024)) for j in range(1025)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=4)
    ap.add_argument("--mean", type=int, default=0)
    ap.add_argument("--nocopy", action="store_true")
    ap.add_argument("--delete-exe", action="store_true")
    ap.add_argument("--varlen", action="store_true", help="per-CPU slot + ringbuf_output(len)")
    ap.add_argument("--unwinder", default="shim", choices=("ctypes", "shim", "none"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--pid", type=int, default=0, help="attach to a running process instead")
    ap.add_argument("--duration", type=float, default=0)
    ap.add_argument("--save", default=None, help="pickle raw samples + maps here")
    ap.add_argument("cmd", nargs="*")
    a = ap.parse_args()

    t0 = time.time()
    src = open(os.path.join(HERE, "heapstack.bpf.c")).read()
    b = BPF(text=src, cflags=[f"-DSTACK_PAGES={a.pages}",
                              f"-DSAMPLE_MEAN={a.mean}", f"-DCOPY={0 if a.nocopy else 1}",
                              "-DRB_PAGES=4096", "-Wno-unused-function",
                              f"-DVARLEN={1 if a.varlen else 0}"])
    print(f"compiled in {time.time() - t0:.2f}s", file=sys.stderr)
    lg = b["lg"]
    for j, v in enumerate(lg_table()):
        lg[C.c_int(j)] = C.c_uint(v)
    child = None
    if a.pid:
        pid = a.pid
    else:
        child = subprocess.Popen(a.cmd)
        pid = child.pid
        time.sleep(0.2)   # let the dynamic loader map libc
    b["target"][C.c_int(0)] = C.c_uint(pid)
    maps_text = open(f"/proc/{pid}/maps", "rb").read()   # captured while it lives
    exe = os.readlink(f"/proc/{pid}/exe")
    if a.unwinder == "shim":
        import shimc
        shimc.capture_files(pid, maps_text)
    if a.delete_exe:   # test: the binary disappears while the process runs
        os.unlink(exe)
    libc = libc_of(pid)
    t0 = time.time()
    b.attach_uprobe(name=libc, sym="malloc", fn_name="on_malloc", pid=pid)
    b.attach_uretprobe(name=libc, sym="malloc", fn_name="on_malloc_ret", pid=pid)
    b.attach_uprobe(name=libc, sym="free", fn_name="on_free", pid=pid)
    print(f"attached in {time.time() - t0:.2f}s", file=sys.stderr)

    if a.unwinder == "ctypes":
        import dwflc
        proc = dwflc.Proc(pid, maps_text)
        unwind = proc.unwind
    elif a.unwinder == "shim":
        import shimc
        proc = shimc.Proc(pid, maps_text)
        unwind = proc.unwind
    else:
        proc = unwind = None

    copy_list = []
    raw = [] if a.save else None
    samples = []          # (id, tid, size, ts, stack_key, complete)
    stacks = {}           # tuple(pcs) -> stack index: keyed by content
    timing = {"n": 0, "cb_s": 0.0, "unwind_s": 0.0, "copied": 0, "copy_ns": 0, "frames": 0}

    def on_event(ctx, data, size):
        c0 = time.process_time()
        try:
            handle(data)
        finally:
            timing["cb_s"] += time.process_time() - c0

    def handle(data):
        hdr = C.string_at(data, HDR.size)
        f = HDR.unpack(hdr)
        pid_, tid, sz, ts, sid = f[0:5]
        regs = dict(zip(REG_NAMES, f[5:13]))
        slen, copy_ns = f[13], f[14]
        timing["n"] += 1
        timing["copied"] += slen
        timing["copy_ns"] += copy_ns
        copy_list.append(copy_ns)
        if unwind is None and raw is None:
            return
        if raw is None and a.unwinder == "shim":   # zero-copy: the helper reads the ring record
            u0 = time.process_time()
            pcs, why = proc.unwind(tid, data + HDR.size, regs, slen)
            timing["unwind_s"] += time.process_time() - u0
            timing["frames"] += len(pcs)
            idx = stacks.setdefault(tuple(pcs), len(stacks))
            samples.append((sid, tid, sz, ts, idx, why))
            return
        stack = C.string_at(data + HDR.size, slen)
        if raw is not None and len(raw) < 2000:
            raw.append((tid, stack, regs, sz))
        if unwind is None:
            return
        u0 = time.process_time()   # CPU time: the shared machine's load inflates wall time
        pcs, why = unwind(tid, stack, regs)
        timing["unwind_s"] += time.process_time() - u0
        timing["frames"] += len(pcs)
        key = tuple(pcs)
        idx = stacks.setdefault(key, len(stacks))
        samples.append((sid, tid, sz, ts, idx, why))

    b["events"].open_ring_buffer(on_event)
    t_start = time.time()
    while True:
        b.ring_buffer_consume()
        if child is not None and child.poll() is not None:
            break
        if a.duration and time.time() - t_start > a.duration:
            break
        time.sleep(0.01)
    b.ring_buffer_consume()
    st = [sum(v) for v in zip(*[list(r) for r in b["stats"].values()])] if False else None
    stats = b["stats"]
    tot = [0] * 8
    for i in range(8):
        tot[i] = sum(stats[C.c_int(i)])
    live_ids = {v.value for v in b["live"].values()}
    b.cleanup()
    if a.save:
        import pickle
        with open(a.save, "wb") as f:
            pickle.dump(dict(pid=pid, maps=maps_text, raw=raw), f)
    print(f"calls={tot[0]} sampled={tot[1]} reserve_fail={tot[2]} live_full={tot[5]} "
          f"received={timing['n']}", file=sys.stderr)
    if tot[1]:
        print(f"BPF copy: {tot[3] / tot[1] / 1000:.2f} us/sample, {tot[4] / tot[1]:.0f} bytes/sample",
              file=sys.stderr)
    if copy_list:
        copy_list.sort()
        q = lambda f: copy_list[min(len(copy_list) - 1, int(f * len(copy_list)))] / 1000
        print(f"BPF copy+reserve us: p10 {q(.1):.2f} median {q(.5):.2f} p90 {q(.9):.2f}",
              file=sys.stderr)
    if timing["n"] and unwind is not None:
        print(f"unwind: {timing['unwind_s'] / timing['n'] * 1e6:.1f} us/sample, "
              f"{timing['frames'] / timing['n']:.1f} frames/sample, {len(stacks)} distinct stacks; "
              f"whole callback {timing['cb_s'] / timing['n'] * 1e6:.1f} us/event",
              file=sys.stderr)
    if unwind is None:
        return
    # symbolize at the end (the process may have exited: the Dwfl built from the captured
    # maps keeps the ELF files open)
    import symbolize
    s0 = time.perf_counter()
    prof = symbolize.build(proc, samples, stacks, live_ids, a.mean)
    print(f"symbolize+aggregate: {(time.perf_counter() - s0) * 1e3:.1f} ms "
          f"for {len(stacks)} stacks", file=sys.stderr)
    est = [sum(v[i] for v in prof["values"].values()) for i in range(4)]
    print(f"estimates: alloc_objects {est[0]:.0f} alloc_space {est[1]:.0f} inuse_objects "
          f"{est[2]:.0f} inuse_space {est[3]:.0f}; complete {prof['complete']}/{prof['total']}",
          file=sys.stderr)
    if a.out:
        symbolize.write_folded(prof, a.out + ".folded")
        symbolize.write_text(prof, a.out + ".txt")
        import pprof_out
        pprof_out.write(prof, a.out + ".pb.gz", main=exe)
        import html_out
        html_out.write(prof, a.out + ".html")
        html_out.write(prof, a.out + ".alloc.html", title="pymtrace heap: allocated bytes", value=1)
        print(f"wrote {a.out}.folded/.txt/.pb.gz/.html", file=sys.stderr)


if __name__ == "__main__":
    main()
