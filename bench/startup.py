#!/usr/bin/env python3
"""Start-up benchmark: time from launching a pymtrace command to its first output (not a test).

Commands (each run as `python -m pymtrace ...` in a fresh process, as a user would):
  top          top --batch -n 1 -i 0.5            until the first report is on stdout
  top-always   top --always-on --batch -n 1 -i 0.5
  top-p        top -p PID --batch -n 1 -i 0.5       (what is compiled does not depend on the
                                                    other processes of the machine)
  record       record -p PID -o FILE               until "pymtrace: recording" (then SIGINT)
  exporter     exporter --listen 127.0.0.1:PORT    until the first /metrics scrape is answered
  top-stacks   top --stacks -p PID --batch -n 1 -i 0.5   (not run by default: --commands)
Rounds are interleaved (every command and version once per round, the order of the versions
alternating), and each measurement notes the 1-minute load average: on this 2-core machine
start-up is mostly CPU-bound, so wall time grows with the load (about CPU x load / cores once
the load exceeds the cores). CPU is the child's user+sys time over its whole run (for record
and the exporter: until they exit after SIGINT), which the load does not inflate much;
"compile CPU" is the CPU time of its BCC compile(s) alone (PYMTRACE_DEBUG_BPF's line; only
versions that print it). System-wide top also compiles the other allocators' programs when
some process maps jemalloc, tcmalloc, mimalloc or its own malloc: the files mapped at the
start are printed (the machine's state decides what is compiled, not only the code).

--before DIR runs the same commands from another checkout (e.g. the main branch) for a
before/after table. Usage: sudo bench/startup.py [--rounds 5] [--before /path/to/old/tree]
                                                 [--commands top,record] [--markdown]
"""

import argparse
import itertools
import os
import pathlib
import re
import resource
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import benchutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMANDS = ("top", "top-p", "top-always", "record", "exporter")
SERIAL = itertools.count()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def argv_for(name, target, tmp):
    if name == "top":
        return ["top", "--batch", "-n", "1", "-i", "0.5"], "stdout"
    if name == "top-p":
        return ["top", "-p", str(target), "--batch", "-n", "1", "-i", "0.5"], "stdout"
    if name == "top-stacks":
        return ["top", "--stacks", "-p", str(target), "--batch", "-n", "1", "-i", "0.5"], "stdout"
    if name == "top-always":
        return ["top", "--always-on", "--batch", "-n", "1", "-i", "0.5"], "stdout"
    if name == "record":
        out = os.path.join(tmp, f"startup-{next(SERIAL)}.mtrace")  # tmp: a private directory
        return ["record", "-p", str(target), "-o", out], "pymtrace: recording"
    if name == "exporter":
        return ["exporter", "--listen", f"127.0.0.1:{free_port()}"], "scrape"
    raise SystemExit(f"unknown command {name} (known: {', '.join(COMMANDS)}, top-stacks)")


def scrape(port, deadline):
    """Seconds until GET /metrics is answered with metrics (the exporter binds before it attaches)."""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/metrics", timeout=max(1.0, deadline - time.monotonic())
            ) as r:
                if r.status == 200 and b"pymtrace_" in r.read():
                    return True
        except OSError:
            time.sleep(0.02)
    return False


def run_once(tree, name, target, tmp, timeout):
    """(seconds to first output, child CPU seconds, load average at start) or None on failure."""
    argv, until = argv_for(name, target, tmp)
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pymtrace", *argv],
        cwd=tree,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(tree), PYMTRACE_DEBUG_BPF="1"),
    )
    deadline = start + timeout
    elapsed = None
    seen = b""
    try:
        if until == "scrape":
            port = int(argv[-1].rsplit(":", 1)[1])
            if scrape(port, deadline):
                elapsed = time.monotonic() - start
        else:
            stream = proc.stdout if until == "stdout" else proc.stderr
            sel = selectors.DefaultSelector()
            sel.register(stream, selectors.EVENT_READ)
            while elapsed is None and time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
                chunk = os.read(stream.fileno(), 65536)
                if not chunk:
                    break
                seen += chunk
                if (until == "stdout" and seen.strip()) or until.encode() in seen:
                    elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if elapsed is None:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
        print(f"  {name} from {tree}: no output within {timeout:g} s {tail}", file=sys.stderr)
        return None
    stderr = (seen if until != "stdout" else b"") + (err or b"")  # record's first lines were read above
    compile_cpu = [float(x) for x in re.findall(rb"compiled BPF .* \(CPU ([0-9.]+) s\)", stderr)]
    return elapsed, cpu, load, sum(compile_cpu) if compile_cpu else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", metavar="DIR", help="another pymtrace checkout to compare with (e.g. main)")
    ap.add_argument("--commands", default=",".join(COMMANDS), help="comma-separated subset of " + ", ".join(COMMANDS))
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for a first output")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the start-up benchmark needs root (it runs pymtrace's BPF commands)")
    versions = benchutil.versions(ROOT, args.before)
    names = args.commands.split(",")
    target = subprocess.Popen(["sleep", "100000"])  # record -p's target: any process with a libc
    sys.path.insert(0, str(ROOT))
    from pymtrace.tracee import libc

    others = libc.distinct_allocators()
    print(f"other allocators mapped at the start: {sorted(others) or 'none'}", file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="pymtrace-startup-") as tmp:
            results = benchutil.run_interleaved(
                args.rounds,
                versions,
                names,
                lambda v, name: run_once(versions[v], name, target.pid, tmp, args.timeout),
                lambda res: (
                    f"{res[0]:6.2f} s  cpu {res[1]:5.2f} s  "
                    f"compile cpu {res[3] if res[3] is not None else float('nan'):5.2f} s  load {res[2]:.1f}"
                ),
            )
    finally:
        target.kill()
        target.wait()
    print_table(results, versions, names, args.markdown)


def print_table(results, versions, names, markdown):
    head = [
        "command",
        "version",
        "first output min (s)",
        "median (s)",
        "CPU min / median (s)",
        "compile CPU min / median (s)",
        "load (1-min avg)",
        "runs",
    ]
    rows = []
    for name in names:
        for v in versions:
            res = results[(v, name)]
            if not res:
                rows.append([name, v, "-", "-", "-", "-", "-", "0"])
                continue
            wall = [x[0] for x in res]
            loads = [x[2] for x in res]
            cpus = [x[1] for x in res]
            compiles = [x[3] for x in res if x[3] is not None]
            rows.append(
                [
                    name,
                    v,
                    f"{min(wall):.2f}",
                    f"{statistics.median(wall):.2f}",
                    f"{min(cpus):.2f} / {statistics.median(cpus):.2f}",
                    f"{min(compiles):.2f} / {statistics.median(compiles):.2f}" if compiles else "-",
                    f"{min(loads):.1f}-{max(loads):.1f}",
                    str(len(res)),
                ]
            )
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        for row in [head] + rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
