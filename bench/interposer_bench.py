#!/usr/bin/env python3
"""Cost per call of pymtrace's LD_PRELOAD interposer on the single-thread storm (not a timed test).

    sudo /opt/pymtrace/venv/bin/python bench/interposer_bench.py [--pairs 2000000] [--rounds 5]
                                                                 [--markdown]

bench/storm.c `once N`: N malloc(64)+free pairs, timed by the storm itself (the program's own
work: tool start-up apart), ns per pair. Modes, every one once per round, the order rotating
from round to round (the machine is noisy: only ratios inside one run mean anything):

  untraced     no tool
  interposer   pymtrace/tracee/native/interpose.c preloaded, its ring drained by
               pymtrace.sources.interposer in this process and thrown away (/dev/null)
  interposer-file  the same, the records appended to a file (the bytes `record` would write)
  heaptrack    `heaptrack -o FILE CMD` (LD_PRELOAD too; every call with its stack)

--real: python3 (a json loop), sqlite3 (20,000 INSERTs in one transaction, 2 indexes, 2
queries), a C++ std::map<std::string, std::vector<int>> program and gcc -O2 -c (gcc, cc1,
as), each whole run's wall time (start-up included) untraced, under the interposer and under
heaptrack; min and median seconds, and the slowdown of the minima.

Reported per mode: min and median ns per pair, ns added per call against untraced (pair / 2,
from the minima and from the medians), and for the interposer the records drained, the
calls that waited for a full ring, and the consumer's CPU per record.
"""

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchutil import build_c, print_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pymtrace.sources import interposer as I  # noqa: E402

SRC = ROOT / "bench" / "storm.c"
MODES = ("untraced", "interposer", "interposer-file", "heaptrack")


def storm_ns(out):
    """(wall, CPU) ns per pair the storm measured itself (CPU: the process's own time, waits
    for a full ring spent asleep not in it)."""
    for line in out.splitlines():
        if line.startswith("pairs "):
            words = line.split()
            return float(words[3]), float(words[5])
    raise RuntimeError(f"no result from the storm: {out!r}")


def run_interposer(argv, sink_path, slots):
    """ARGV under the interposer; returns (its stdout, records, waits, consumer CPU s)."""
    rings = I.RingSet(I.RingOptions(slots=slots))
    cpu0 = time.process_time()
    records = waits = 0
    try:
        with open(sink_path, "wb") as sink:
            proc = subprocess.Popen(argv, env=rings.env(os.environ), stdout=subprocess.PIPE, text=True)
            while proc.poll() is None:
                batches = rings.drain()
                for b in batches:
                    sink.write(b.data)
                    records += b.count
                if not rings.busy(batches):
                    time.sleep(0.001)
            for b in rings.finish(timeout=10):
                sink.write(b.data)
                records += b.count
            out = proc.stdout.read()
            proc.stdout.close()
        waits = sum(s.waits for s in rings.stats())
    finally:
        rings.close()
    return out, records, waits, time.process_time() - cpu0


CXX_MAP = r"""
#include <map>
#include <string>
#include <vector>
int main() {
    std::map<std::string, std::vector<int>> m;
    for (int round = 0; round < ROUNDS; round++) {
        for (int i = 0; i < 30000; i++) m["key-" + std::to_string(i * 7919 % 100003)].push_back(i);
        for (int i = 0; i < 15000; i++) m.erase("key-" + std::to_string(i * 7919 % 100003));
    }
    return m.size() == 15000 ? 0 : 1;
}
"""


def real_commands(tmp, scale=1):
    """{name: argv} of the four real programs; SCALE times their work."""
    sql = os.path.join(tmp, "script.sql")
    with open(sql, "w") as f:
        f.write("CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);\nBEGIN;\n")
        f.writelines(
            f"INSERT INTO t(name, v) VALUES ('name-{i * 7919 % 20011}', {i * 0.5});\n" for i in range(20000 * scale)
        )
        f.write("COMMIT;\nCREATE INDEX i1 ON t(name);\nCREATE INDEX i2 ON t(v);\n")
        f.write("SELECT count(*) FROM t WHERE name LIKE 'name-1%';\nSELECT sum(v) FROM t GROUP BY name % 10;\n")
    cxx_src = os.path.join(tmp, "map.cpp")
    with open(cxx_src, "w") as f:
        f.write(CXX_MAP)
    cxx = os.path.join(tmp, "map")
    subprocess.run(["g++", "-O2", f"-DROUNDS={2 * scale}", "-o", cxx, cxx_src], check=True)
    c_src = ROOT / "tests" / "support" / "workloads" / "record_calls.c"
    if scale > 1:  # gcc's work grows with what it compiles: record_calls.c, and SCALE x 100 functions
        c_src = os.path.join(tmp, "many.c")
        with open(c_src, "w") as f:
            f.write(open(ROOT / "tests" / "support" / "workloads" / "record_calls.c").read())
            for i in range(100 * scale):
                f.write(
                    f"int gen_{i}(int *a, int n) {{ int s = 0; for (int k = 0; k < n; k++) "
                    f"s += a[k] * {i + 3} ^ (s >> {i % 7 + 1}); return s + {i}; }}\n"
                )
    return {
        "python3 json": [
            "/usr/bin/python3",
            "-c",
            f"import json; [json.dumps({{'a': list(range(50))}}) for _ in range({20000 * scale})]",
        ],
        "sqlite3 script": ["sqlite3", ":memory:", f".read {sql}"],
        "C++ map<string, vector<int>>": [cxx],
        "gcc -O2 -c": ["gcc", "-O2", "-c", str(c_src), "-o", os.path.join(tmp, "out.o")],
    }


def real_programs(args):
    modes = [m for m in ("untraced", "interposer", "heaptrack") if m != "heaptrack" or shutil.which("heaptrack")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        I.library()
        for name, argv in real_commands(tmp).items():
            secs = {m: [] for m in modes}
            records = []
            for r in range(args.rounds):
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    t0 = time.perf_counter()
                    if mode == "untraced":
                        subprocess.run(argv, capture_output=True, check=True, cwd=tmp)
                    elif mode == "heaptrack":
                        subprocess.run(
                            ["heaptrack", "-o", os.path.join(tmp, "ht"), *argv], capture_output=True, cwd=tmp
                        )
                        for f in os.listdir(tmp):
                            if f.startswith("ht."):
                                os.unlink(os.path.join(tmp, f))
                    else:
                        _, n, _, _ = run_interposer(argv, os.devnull, args.slots)
                        records.append(n)
                    secs[mode].append(time.perf_counter() - t0)
            base = min(secs["untraced"])
            row = {"program": name, "records": f"{min(records)}-{max(records)}"}
            for mode in modes:
                row[f"{mode} s (min/median)"] = f"{min(secs[mode]):.3f} / {statistics.median(secs[mode]):.3f}"
                if mode != "untraced":
                    row[f"{mode} slowdown"] = f"{min(secs[mode]) / base:.2f}x"
            rows.append(row)
    print(f"real programs, whole runs (start-up included), {args.rounds} interleaved rounds")
    print_table(rows, args.markdown)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slots", type=int, default=I.RingOptions().slots, help="records per ring")
    ap.add_argument("--real", action="store_true", help="real programs instead of the storm (wall time)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    if args.real:
        return real_programs(args)
    modes = [m for m in MODES if m != "heaptrack" or shutil.which("heaptrack")]
    ns = {m: [] for m in modes}
    cpu_ns = {m: [] for m in modes}
    extra = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_c(tmp, "storm", SRC, flags=["-O2", "-fno-builtin", "-fno-omit-frame-pointer"])
        argv = [exe, "once", str(args.pairs)]
        I.library()  # built before the first round
        for r in range(args.rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                if mode == "untraced":
                    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
                elif mode == "heaptrack":
                    base = os.path.join(tmp, f"ht{r}")
                    out = subprocess.run(["heaptrack", "-o", base, *argv], capture_output=True, text=True, cwd=tmp)
                    out = out.stdout
                    for name in os.listdir(tmp):
                        if name.startswith(f"ht{r}"):
                            os.unlink(os.path.join(tmp, name))
                else:
                    sink = os.path.join(tmp, "records") if mode == "interposer-file" else os.devnull
                    out, records, waits, cpu = run_interposer(argv, sink, args.slots)
                    extra[mode].append((records, waits, cpu))
                    if sink != os.devnull:
                        os.unlink(sink)
                wall, cpu = storm_ns(out)
                ns[mode].append(wall)
                cpu_ns[mode].append(cpu)
    base_min, base_med = min(ns["untraced"]), statistics.median(ns["untraced"])
    cpu_min = min(cpu_ns["untraced"])
    rows = []
    for mode in modes:
        lo, med = min(ns[mode]), statistics.median(ns[mode])
        row = {
            "mode": mode,
            "ns/pair min": f"{lo:.1f}",
            "ns/pair median": f"{med:.1f}",
            "added ns/call (min, median)": ""
            if mode == "untraced"
            else f"{(lo - base_min) / 2:.1f}, {(med - base_med) / 2:.1f}",
            "CPU ns/pair min (added/call)": f"{min(cpu_ns[mode]):.1f}"
            + ("" if mode == "untraced" else f" ({(min(cpu_ns[mode]) - cpu_min) / 2:.1f})"),
            "records": "",
            "waits": "",
            "consumer ns/record": "",
        }
        if extra[mode]:
            records = [e[0] for e in extra[mode]]
            row["records"] = f"{min(records)}-{max(records)}"
            row["waits"] = str(sum(e[1] for e in extra[mode]))
            row["consumer ns/record"] = f"{statistics.median(e[2] / e[0] * 1e9 for e in extra[mode]):.1f}"
        rows.append(row)
    print(f"storm once {args.pairs}: malloc(64)+free pairs, {args.rounds} interleaved rounds, {args.slots} slots")
    print_table(rows, args.markdown)


if __name__ == "__main__":
    main()
