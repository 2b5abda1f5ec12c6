#!/usr/bin/env python3
"""Benchmark of `pymtrace record --to` into `pymtrace collect` on loopback (not a timed test).

A single-thread malloc storm recorded three ways, rounds interleaved (the machine is noisy):
  - file:    record -o FILE (mtrace-bin), the reference
  - net:     record --to 127.0.0.1:PORT, the collector writing Parquet parts
  - stalled: record --to a collector stopped with SIGSTOP for the whole storm (then SIGCONT):
             the spool's size (memory + disk) holding the backlog
Columns: events/s of the traced storm (its full traced rate, all recorded?), lost events, the
recorder's CPU per event (drain loop; net: + the sender thread), the collector's CPU per
million events (utime+stime of its process from /proc over the round), spool peak.
Usage: sudo bench/collect_bench.py [--pairs N] [--rounds R] [--markdown]
       bench/collect_bench.py --compaction [--markdown]   (no root: the collector's part
       compaction alone, streams of many small and of a few large parts, CPU time)
"""

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchutil import build_c, cpu_seconds, print_table

SRC = pathlib.Path(__file__).resolve().parent / "storm.c"
PYMTRACE = [sys.executable, "-m", "pymtrace"]


def start_collector(directory):
    proc = subprocess.Popen(
        PYMTRACE + ["collect", "--listen", "127.0.0.1:0", "--dir", str(directory)], stderr=subprocess.PIPE, text=True
    )
    while True:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError("collect did not start")
        if "listening on " in line:
            return proc, line.split("listening on ")[1].split(",")[0]


def record(exe, pairs, target, while_storming=None):
    """record --json TARGET -- storm; WHILE_STORMING(): called once the storm is over and
    record still runs (the stalled round resumes its collector there)."""
    cmd = PYMTRACE + ["record", "--json", *target, "--", exe, "once", str(pairs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if while_storming is not None:
        seen = False
        while proc.poll() is None:
            kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            if seen and not kids:
                break
            seen = seen or bool(kids)
            time.sleep(0.05)
        while_storming()
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(err)
    ns = next(float(line.split()[3]) for line in out.splitlines() if line.startswith("pairs "))
    return json.loads(err.strip().splitlines()[-1]), ns


def round_of(kind, exe, pairs, tmp):
    row = {"mode": kind}
    work = pathlib.Path(tempfile.mkdtemp(dir=tmp))
    collector_cpu = None
    if kind == "file":
        summary, ns = record(exe, pairs, ["-o", str(work / "t.bin")])
    else:
        coll, address = start_collector(work / "ds")
        c0 = cpu_seconds(coll.pid)
        resume = None
        if kind == "stalled":
            coll.send_signal(signal.SIGSTOP)

            def resume():
                coll.send_signal(signal.SIGCONT)

        summary, ns = record(exe, pairs, ["--to", address], resume)
        collector_cpu = cpu_seconds(coll.pid) - c0  # END is acknowledged once the last part is written
        coll.send_signal(signal.SIGTERM)
        coll.wait()
    f = summary["files"][0]
    events = summary["entries"]
    row["events_per_s"] = round(2e9 / ns)
    row["events"] = events
    row["lost"] = summary["lost"]
    row["recorder_us_per_event"] = round(1e6 * (summary["consumer_cpu_s"] + f.get("sender_cpu_s", 0)) / events, 3)
    row["collector_cpu_s_per_M"] = round(collector_cpu * 1e6 / events, 2) if collector_cpu is not None else ""
    row["spool_peak_MiB"] = (
        round((f.get("spool_max_memory_bytes", 0) + f.get("spool_max_disk_bytes", 0)) / 2**20, 1)
        if kind != "file"
        else ""
    )
    shutil.rmtree(work, ignore_errors=True)
    return row


def compaction_rows(tmp):
    """A closed stream written part by part by the collector's Stream, then compacted."""
    import numpy

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from pymtrace.net.collector import Stream, compact
    from pymtrace.trace.formats import mtrace_bin
    from pymtrace.trace.formats import parquet as P

    rows = []
    for n_parts, per_part in ((720, 1000), (20, 50_000)):
        root = pathlib.Path(tempfile.mkdtemp(dir=tmp))
        meta = P.file_metadata(pid=1, host="bench", start_time="2026-11-24T10:00:00Z")
        stream = Stream(str(root), {"stream": "ef" * 16, "pid": 1, "host": "bench", "metadata": meta})
        for k in range(n_parts):
            recs = numpy.zeros(per_part, mtrace_bin.record_dtype("<"))
            recs["type"], recs["thread"] = mtrace_bin.MALLOC, 7
            recs["ptr2"] = numpy.arange(k * per_part, (k + 1) * per_part, dtype=numpy.uint64) * 16
            recs["time_ns"] = recs["ptr2"] + 1
            stream.add(k * per_part, recs.tobytes())
            stream.flush()
        stream.end()
        c0, w0 = time.process_time(), time.monotonic()
        done = compact(str(root))
        cpu, wall = time.process_time() - c0, time.monotonic() - w0
        rows.append(
            {
                "parts": n_parts,
                "records": done["rows"],
                "cpu_s": round(cpu, 2),
                "wall_s": round(wall, 2),
                "parts_per_cpu_s": round(n_parts / cpu),
                "M_records_per_cpu_s": round(done["rows"] / cpu / 1e6, 2),
            }
        )
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--compaction", action="store_true", help="only the part compaction (no root)")
    args = ap.parse_args()
    if args.compaction:
        with tempfile.TemporaryDirectory() as tmp:
            print_table(compaction_rows(tmp), args.markdown)
        return
    if os.geteuid() != 0:
        sys.exit("run as root (BPF)")
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_c(tmp, "record_storm", SRC, flags=["-O2", "-fno-builtin", "-fno-omit-frame-pointer"])
        rows = {k: [] for k in ("file", "net", "stalled")}
        for _ in range(args.rounds):
            for kind in rows:
                rows[kind].append(round_of(kind, exe, args.pairs, tmp))
        table = []
        for kind, rs in rows.items():
            med = {"mode": kind, "rounds": len(rs)}
            for key in rs[0]:
                if key == "mode":
                    continue
                vals = [r[key] for r in rs if r[key] != ""]
                if key == "lost":
                    med["lost_max"] = max(vals)
                elif key == "events":
                    med["events"] = rs[0][key]
                else:
                    med[key] = statistics.median(vals) if vals else ""
            table.append(med)
        print_table(table, args.markdown)


if __name__ == "__main__":
    main()
