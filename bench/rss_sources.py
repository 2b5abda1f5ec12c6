#!/usr/bin/env python3
"""Cost per process of each source of a process's RSS, as top would read them every refresh.

    sudo /opt/pymtrace/venv/bin/python bench/rss_sources.py [--procs 1000] [--rounds 7]

Starts PROCS small processes (each holding a few MiB of touched anonymous memory, so the
page tables are not empty) and reads, for every one of them, in interleaved rounds:

  statm          /proc/PID/statm: resident and shared pages (anon = resident - shared)
  status         /proc/PID/status: RssAnon, RssFile, RssShmem (the same kernel counters,
                 in a ~1.4 KB text with everything else about the task)
  smaps_rollup   /proc/PID/smaps_rollup: walks every mapping and page table of the process
  taskstats      netlink taskstats through pyroute2 (TaskStats.get_pid_stat): hiwater_rss
                 (the peak) and coremem (an integral): it has no current RSS at all.
                 pyroute2 is not a pymtrace dependency (this measurement is why): without
                 it installed, this line is left out

CPU time of this process (time.process_time) per process read, min/median over rounds;
also smaps_rollup and status on one process with a 1 GiB touched heap (smaps_rollup's cost
grows with the pages mapped, the others do not).
"""

import argparse
import statistics
import subprocess
import sys
import time

HOG = "import mmap,sys,time\nm=mmap.mmap(-1,{n})\nfor i in range(0,{n},4096): m[i]=1\nprint('ok',flush=True)\ntime.sleep(600)\n"


def read_statm(pid):
    with open(f"/proc/{pid}/statm") as f:
        _size, resident, shared = f.read().split()[:3]
    return int(resident), int(resident) - int(shared)


def read_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0])
    return out


def read_smaps_rollup(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return f.read()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    procs = []
    try:
        # small C-free workers: sleep(1) maps libc and has a heap; a 1 GiB holder for the scaling line
        for _ in range(args.procs):
            procs.append(subprocess.Popen(["sleep", "600"]))
        big = subprocess.Popen([sys.executable, "-c", HOG.format(n=1 << 30)], stdout=subprocess.PIPE, text=True)
        procs.append(big)
        big.stdout.readline()
        pids = [p.pid for p in procs[:-1]]
        readers = {"statm": read_statm, "status": read_status, "smaps_rollup": read_smaps_rollup}
        ts = None
        try:
            from pyroute2 import TaskStats
        except ImportError:
            print("pyroute2 is not installed: no taskstats line", file=sys.stderr)
        else:
            ts = TaskStats()
            ts.bind()
            readers["taskstats"] = ts.get_pid_stat
        results = {n: [] for n in readers}
        big_results = {n: [] for n in ("status", "smaps_rollup")}
        names = list(readers)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.process_time()
                for pid in pids:
                    readers[name](pid)
                results[name].append((time.process_time() - t0) / len(pids) * 1e6)
            for name in big_results:
                t0 = time.process_time()
                for _ in range(20):
                    readers[name](big.pid)
                big_results[name].append((time.process_time() - t0) / 20 * 1e6)
        if ts is not None:
            ts.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    print(f"{args.procs} processes, {args.rounds} interleaved rounds, CPU us per process read\n")
    print("| source | us/process min | median | per refresh of 1,000 processes (median) |")
    print("|---|---|---|---|")
    for n, v in results.items():
        med = statistics.median(v)
        print(f"| {n} | {min(v):.1f} | {med:.1f} | {med * 1000 / 1e3:.1f} ms |")
    print("\none process with a 1 GiB touched mapping:")
    for n, v in big_results.items():
        print(f"| {n} | {min(v):.1f} | {statistics.median(v):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
