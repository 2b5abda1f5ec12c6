#!/usr/bin/env python3
"""Exit-latency benchmark: how long pymtrace takes to end after its work is done (not a test).

The time is in detaching uprobes: a uprobe perf event's close waits for an RCU grace period
inside perf's global event_mutex, one after the other (~85 ms each on 6.18), while a BPF
uprobe_multi link's close does not take that mutex (pymtrace/bpf/uprobes.py). A C++
process (libstdc++ mapped: operator new/delete probed too) runs throughout.

  top      top --batch -n 1 -i 0.5 (system-wide): first report after start, then from the
           report to the process's exit, and the total
  record   record -p CXX -o FILE: from SIGINT (after "pymtrace: recording") to exit
  heap     heap -p CXX -o FILE: from SIGINT (after "sampling") to exit

Rounds are interleaved (each command and version once per round, the versions' order
alternating); min and median per column. "refused" counts the kernel log's "ref_ctr_offset
mismatch" lines during the run: uprobes another process held (a BCC 0.26 tool: bcc issue
#5236) that pymtrace attached through BCC's perf events instead of a link, so slow to close.

Usage: sudo bench/exit_latency.py [--rounds 5] [--before /path/to/main/tree] [--markdown]
"""

import argparse
import os
import pathlib
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import benchutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMANDS = ("top", "record", "heap")
CXX = "#include <unistd.h>\nint main() { int *p = new int[4]; p[0] = 1; pause(); delete[] p; return 0; }\n"


class KernelLog:
    """New kernel-log records since creation, read from /dev/kmsg (dmesg's ring buffer may be
    full, so counting its lines before and after can miss new ones)."""

    def __init__(self):
        try:
            self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:
            self.fd = None

    def count(self, text):
        n = 0
        while self.fd is not None:
            try:
                record = os.read(self.fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten before we read them
                continue
            n += text in record
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        return n


def run_once(tree, name, target, tmp, timeout):
    """{'ready': s, 'exit': s, 'total': s, 'refused': n} or None on failure."""
    out = os.path.join(tmp, f"{name}-{time.monotonic_ns()}")
    if name == "top":
        argv, stream_name, until = ["top", "--batch", "-n", "1", "-i", "0.5"], "stdout", b""
    elif name == "record":
        argv, stream_name, until = ["record", "-p", str(target), "-o", out], "stderr", b"pymtrace: recording"
    else:
        argv, stream_name, until = ["heap", "-p", str(target), "-o", out], "stderr", b"sampling"
    log = KernelLog()
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pymtrace", *argv],
        cwd=tree,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(tree)),
    )
    stream = proc.stdout if stream_name == "stdout" else proc.stderr
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    seen, ready = b"", None
    deadline = start + timeout
    while ready is None and time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            break
        seen += chunk
        if (until and until in seen) or (not until and seen.strip()):
            ready = time.monotonic()
    if ready is None:
        proc.kill()
        proc.communicate()
        log.count(b"")
        print(f"  {name} from {tree}: not ready within {timeout:g} s", file=sys.stderr)
        return None
    if name != "top":
        proc.send_signal(signal.SIGINT)
        ready = time.monotonic()
    proc.communicate(timeout=120)
    end = time.monotonic()
    return {
        "ready": ready - start,
        "exit": end - ready,
        "total": end - start,
        "refused": log.count(b"ref_ctr_offset mismatch"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", metavar="DIR", help="another pymtrace checkout to compare with (e.g. main)")
    ap.add_argument("--commands", default=",".join(COMMANDS))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the exit-latency benchmark needs root (it runs pymtrace's BPF commands)")
    versions = benchutil.versions(ROOT, args.before)
    names = args.commands.split(",")
    with tempfile.TemporaryDirectory(prefix="pymtrace-exit-") as tmp:
        subprocess.run(["g++", "-O0", "-x", "c++", "-o", f"{tmp}/cxx", "-"], input=CXX.encode(), check=True)
        target = subprocess.Popen([f"{tmp}/cxx"])
        try:
            results = benchutil.run_interleaved(
                args.rounds,
                versions,
                names,
                lambda v, name: run_once(versions[v], name, target.pid, tmp, args.timeout),
                lambda res: (
                    f"ready {res['ready']:5.2f} s  exit {res['exit']:5.2f} s  total {res['total']:5.2f} s  "
                    f"refused {res['refused']}  load {os.getloadavg()[0]:.1f}"
                ),
            )
        finally:
            target.kill()
            target.wait()
    print_table(results, versions, names, args.markdown)


def print_table(results, versions, names, markdown):
    rows = []
    for name in names:
        for v in versions:
            res = results[(v, name)]

            def col(key, res=res):
                xs = [x[key] for x in res]
                return f"{min(xs):.2f} / {statistics.median(xs):.2f}" if xs else "-"

            refused = [x["refused"] for x in res] or [0]
            rows.append(
                {
                    "command": name,
                    "version": v,
                    "ready min / median (s)": col("ready"),
                    "exit min / median (s)": col("exit"),
                    "total min / median (s)": col("total"),
                    "refused": f"{min(refused)}-{max(refused)}",
                    "runs": len(res),
                }
            )
    benchutil.print_table(rows, markdown)


if __name__ == "__main__":
    main()
