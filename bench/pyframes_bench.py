#!/usr/bin/env python3
"""`pymtrace heap` on a Python program: against memray, and what reading Python frames costs.

    sudo /opt/pymtrace/venv/bin/python bench/pyframes_bench.py compare [--python PY] [--markdown]
    sudo /opt/pymtrace/venv/bin/python bench/pyframes_bench.py cost [--python PY] [--rounds 3] [--work 5]

compare: bench/pyalloc_workload.py run once under memray (`memray run`, PyPI's, installed into
  a private venv of PY on first use: --venv) and once under `pymtrace heap -- PY ...` with
  every call sampled (--sample-bytes 1: exact) and once at the default sampling (512 KiB).
  Both see the program's malloc-API calls (memray without --trace-python-allocators: pymalloc's
  objects neither); each allocation is counted at its innermost Python frame, by function
  (memray names it co_name, pymtrace the qualified name: compared by co_name) and file. The
  top 10 by memray's bytes, with pymtrace's bytes and their difference; a site of pymtrace's
  own top 10 missing from memray's is listed after them, then the interpreter's start-up
  (allocations before any Python frame, imports), which memray, starting after its own
  imports, does not see.

cost: the workload (WORK rounds, ~0.3 s each) in a fresh process per measurement, waiting for
  a line on stdin before its work, as: untraced; `heap -p` (uprobes) with Python frames
  (merged, the default); `heap -p --native`; `heap -- PY ...` (in-process), with and without
  (--native) Python frames. Reported: the program's own CPU time
  (time.process_time over the work), pymtrace's CPU from attached to written, samples; and
  the BPF programs' own time from the kernel's statistics (kernel.bpf_stats_enabled, on for
  the run; a tail-called program's time counts as its caller's): per sample, with Python
  frames minus without, is what reading them costs in BPF. Modes rotate per round.
"""

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from pymtrace.sinks import profile_pb2  # noqa: E402

WORKLOAD = HERE / "pyalloc_workload.py"
PYMTRACE = [sys.executable, "-m", "pymtrace"]
MALLOC_API = ("MALLOC", "CALLOC", "REALLOC", "POSIX_MEMALIGN", "ALIGNED_ALLOC", "MEMALIGN", "VALLOC", "PVALLOC")
DEFAULT_PYTHON = "/root/.pyenv/versions/3.12.1/bin/python3"
MODES = ("untraced", "heap", "heap --native", "heap -- CMD", "heap --native -- CMD")


def memray_python(python, venv):
    """A venv of PYTHON with memray from PyPI (made on first use)."""
    exe = pathlib.Path(venv) / "bin" / "python"
    if not exe.exists():
        subprocess.run([python, "-m", "venv", venv], check=True)
        subprocess.run([exe, "-m", "pip", "install", "-q", "memray"], check=True)
    return str(exe)


def short(function):
    """co_name of a qualified name ("K.method" -> "method", "f.<locals>.g" -> "g")."""
    return function.rsplit(".", 1)[-1]


def memray_sites(python, venv, tmp):
    """{(co_name, file basename): [bytes, calls]} of the workload under memray, malloc-API calls."""
    mpy = memray_python(python, venv)
    out = pathlib.Path(tmp) / "memray.bin"
    subprocess.run([mpy, "-m", "memray", "run", "-q", "-f", "-o", out, WORKLOAD], check=True)
    script = f"""
import json, memray
from memray import AllocatorType as A
keep = {{getattr(A, n) for n in {MALLOC_API!r}}}
sites = {{}}
for rec in memray.FileReader({str(out)!r}).get_allocation_records():
    if rec.allocator not in keep:
        continue
    stack = rec.stack_trace()
    if not stack or "/memray/" in stack[0][1]:
        continue
    function, file, _ = stack[0]
    key = function + "|" + file.rsplit("/", 1)[-1]
    site = sites.setdefault(key, [0, 0])
    site[0] += rec.size * rec.n_allocations
    site[1] += rec.n_allocations
print(json.dumps(sites))
"""
    sites = json.loads(subprocess.run([mpy, "-c", script], capture_output=True, text=True, check=True).stdout)
    return {tuple(k.split("|")): v for k, v in sites.items()}


def pprof_sites(path):
    """{(co_name, file basename): [bytes, calls]} of a heap pprof: each sample at its innermost
    Python frame (alloc_space, alloc_objects)."""
    profile = profile_pb2.Profile()
    profile.ParseFromString(gzip.decompress(pathlib.Path(path).read_bytes()))
    strings = profile.string_table
    python = {m.id for m in profile.mapping if strings[m.filename] == "[python]"}
    functions = {f.id: f for f in profile.function}
    where = {}
    for loc in profile.location:
        if loc.mapping_id in python and loc.line:
            f = functions[loc.line[0].function_id]
            where[loc.id] = (short(strings[f.name]), strings[f.filename].rsplit("/", 1)[-1])
    types = [strings[t.type] for t in profile.sample_type]
    space, objects = types.index("alloc_space"), types.index("alloc_objects")
    sites = {}
    for sample in profile.sample:
        key = next((where[loc] for loc in sample.location_id if loc in where), ("[no Python frame]", ""))
        site = sites.setdefault(key, [0, 0])
        site[0] += sample.value[space]
        site[1] += sample.value[objects]
    return sites


def heap_sites(python, tmp, *args):
    out = pathlib.Path(tmp) / f"heap{len(args)}.pb.gz"
    cmd = [*PYMTRACE, "heap", "-q", "--ring-bytes", "1G", "-o", out, "--force", *args, "--", python, WORKLOAD]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pymtrace heap failed:\n{proc.stderr}")
    return pprof_sites(out)


def startup(key):
    """A site of the interpreter's start-up: no Python frame yet, or an import."""
    return key[0] == "[no Python frame]" or key[1].startswith("<frozen importlib")


def compare(args):
    with tempfile.TemporaryDirectory() as tmp:
        memray = memray_sites(args.python, args.venv, tmp)
        exact = heap_sites(args.python, tmp, "--sample-bytes", "1")
        sampled = heap_sites(args.python, tmp)
    top = sorted(memray, key=lambda k: -memray[k][0])[:10]
    # the interpreter's start-up (before any Python frame, imports): memray starts tracing
    # after it has imported its own modules (most of the program's too); ranked apart
    ours = sorted((k for k in exact if not startup(k)), key=lambda k: -exact[k][0])[:10]
    version = subprocess.run([args.python, "-V"], capture_output=True, text=True).stdout.strip()
    print(f"{version}; bench/pyalloc_workload.py; bytes by the allocation's innermost Python frame")
    head = ("site", "memray bytes", "calls", "heap exact", "calls", "diff", "heap 512K", "diff")
    rows = []
    for key in top + [k for k in ours if k not in top] + sorted(k for k in exact if startup(k)):
        m, e, s = memray.get(key, [0, 0]), exact.get(key, [0, 0]), sampled.get(key, [0, 0])
        diff = (e[0] - m[0]) / m[0] * 100 if m[0] else float("inf")
        sdiff = (s[0] - m[0]) / m[0] * 100 if m[0] else float("inf")
        rows.append((f"{key[0]} ({key[1]})", m[0], m[1], e[0], e[1], f"{diff:+.1f}%", s[0], f"{sdiff:+.1f}%"))
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in r) + " |")
    else:
        for r in [head, *rows]:
            print("  ".join(f"{v:>14,}" if isinstance(v, int) else f"{v:>14}" for v in r))
    print(f"top 10 sets equal: {set(top) == set(ours)}")


# -- cost ------------------------------------------------------------------------------------
def bpf_programs():
    """{name: (run_cnt, run_time_ns)} of the loaded BPF programs, summed per name (bpftool)."""
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True).stdout
    progs = collections.defaultdict(lambda: [0, 0])
    for p in json.loads(out or "[]"):
        if p.get("name", "").startswith("hp_"):
            progs[p["name"]][0] += p.get("run_cnt", 0)
            progs[p["name"]][1] += p.get("run_time_ns", 0)
    return progs


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(python, mode, work, tmp):
    """One run: {program_cpu, heap_cpu, samples, progs}."""
    result = {"mode": mode}
    if mode.endswith("-- CMD"):
        return measure_launched(python, mode, work, tmp, result)
    target = subprocess.Popen([python, WORKLOAD, str(work), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    target.stdout.readline()
    tracer = None
    try:
        if mode != "untraced":
            extra = ["--native"] if mode == "heap --native" else []
            out = pathlib.Path(tmp) / "cost.folded"
            tracer = subprocess.Popen(
                [*PYMTRACE, "heap", "-p", str(target.pid), *extra, "-o", out, "--force"],
                stderr=subprocess.PIPE,
                text=True,
            )
            line = tracer.stderr.readline()
            assert "sampling PID" in line, line + tracer.stderr.read()
            heap_cpu0, progs0 = cpu_s(tracer.pid), bpf_programs()
        target.stdin.write(b"go\n")
        target.stdin.flush()
        result["program_cpu"] = float(target.stdout.readline().split()[1])
        if tracer is not None:
            time.sleep(1.0)  # the last samples taken in
            progs1 = bpf_programs()
            result["heap_cpu"] = cpu_s(tracer.pid) - heap_cpu0
            result["progs"] = {k: (v[0] - progs0[k][0], v[1] - progs0[k][1]) for k, v in progs1.items()}
            tracer.send_signal(2)
            err = tracer.communicate(timeout=120)[1]
            found = re.search(r"heap: samples: (\d+)", err)
            result["samples"] = int(found.group(1)) if found else 0
            result["report"] = [s for s in err.splitlines() if "python:" in s]
    finally:
        target.stdin.close()
        target.wait()
    return result


def measure_launched(python, mode, work, tmp, result):
    """`heap -- PY workload` (in-process): the workload's stdin and stdout are pymtrace's."""
    extra = ["--native"] if "--native" in mode else []
    out = pathlib.Path(tmp) / "cost.folded"
    cmd = [*PYMTRACE, "heap", "-q", *extra, "-o", out, "--force", "--", python, WORKLOAD, str(work), "wait"]
    tracer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert tracer.stdout.readline().strip() == "ready"
        heap_cpu0, progs0 = cpu_s(tracer.pid), bpf_programs()
        tracer.stdin.write("go\n")
        tracer.stdin.flush()
        result["program_cpu"] = float(tracer.stdout.readline().split()[1])
        time.sleep(1.0)
        progs1 = bpf_programs()
        result["heap_cpu"] = cpu_s(tracer.pid) - heap_cpu0
        result["progs"] = {k: (v[0] - progs0[k][0], v[1] - progs0[k][1]) for k, v in progs1.items()}
    finally:
        tracer.stdin.close()
        err = tracer.stderr.read()
        tracer.wait(timeout=300)
    result["samples"] = None  # the samples after "go" are not told apart from start-up's
    result["report"] = [s for s in err.splitlines() if "python:" in s]
    return result


def cost(args):
    with open("/proc/sys/kernel/bpf_stats_enabled") as f:
        before = f.read().strip()
    with open("/proc/sys/kernel/bpf_stats_enabled", "w") as f:
        f.write("1")
    modes = [m for m in MODES if args.modes is None or m in args.modes.split(",")]
    results = collections.defaultdict(list)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    results[mode].append(measure(args.python, mode, args.work, tmp))
    finally:
        with open("/proc/sys/kernel/bpf_stats_enabled", "w") as f:
            f.write(before)
    version = subprocess.run([args.python, "-V"], capture_output=True, text=True).stdout.strip()
    print(f"{version}; {args.work} rounds of bench/pyalloc_workload.py; median of {args.rounds}")
    base = statistics.median(r["program_cpu"] for r in results[modes[0]])
    per_sample = {}
    for mode in modes:
        runs = results[mode]
        cpu = statistics.median(r["program_cpu"] for r in runs)
        line = f"{mode:15} program CPU {cpu:.3f} s ({cpu / base:.3f}x)"
        if mode.endswith("-- CMD"):
            heap = statistics.median(r["heap_cpu"] for r in runs)
            bpf_ns = statistics.median(sum(v[1] for v in r["progs"].values()) for r in runs)
            calls = statistics.median(sum(v[0] for v in r["progs"].values()) for r in runs)
            line += f", pymtrace CPU {heap:.3f} s, BPF {bpf_ns / 1e9:.3f} s in {calls:.0f} runs"
        elif mode != "untraced":
            samples = statistics.median(r["samples"] for r in runs)
            heap = statistics.median(r["heap_cpu"] for r in runs)
            line += f", samples {samples:.0f}, pymtrace CPU {heap:.3f} s ({heap / max(samples, 1) * 1e6:.0f} us/sample)"
            # a tail-called program's time is its caller's (the kernel counts entry programs)
            bpf_ns = statistics.median(sum(v[1] for v in r["progs"].values()) for r in runs)
            calls = statistics.median(sum(v[0] for v in r["progs"].values()) for r in runs)
            per_sample[mode] = bpf_ns / max(samples, 1)
            line += f", BPF {bpf_ns / 1e9:.3f} s in {calls:.0f} runs"
        print(line)
    if per_sample.get("heap") is not None and per_sample.get("heap --native") is not None:
        print(
            "reading Python frames, per sample (BPF time per sample, merged - native): "
            f"{(per_sample['heap'] - per_sample['heap --native']) / 1000:.1f} us"
        )
    for mode in modes[1:2]:
        for r in results[mode][-1:]:
            for report in r.get("report", []):
                print(f"    {report}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("compare", "cost"))
    parser.add_argument("--python", default=DEFAULT_PYTHON if os.path.exists(DEFAULT_PYTHON) else "/usr/bin/python3")
    parser.add_argument("--venv", default="/var/tmp/pymtrace-bench-memray", help="memray's venv (compare)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=int, default=5, help="workload rounds per measurement (cost)")
    parser.add_argument("--modes", help="cost: these modes only, comma-separated (default: all)")
    args = parser.parse_args()
    compare(args) if args.what == "compare" else cost(args)


if __name__ == "__main__":
    main()
