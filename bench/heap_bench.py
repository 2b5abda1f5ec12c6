#!/usr/bin/env python3
"""`pymtrace heap` side by side with top, bcc's memleak and heaptrack, as users run them.

    sudo /opt/pymtrace/venv/bin/python bench/heap_bench.py [--rounds 5] [--pairs 200000] [--iterations 100]

Two targets, each a fresh process per measurement that waits for a line on stdin before its
measured work (so a tool's start-up, seconds for the BPF ones, is never measured):

  storm   bench/storm.c: malloc(64)+free pairs (1000 warm-up pairs + N)
  perl    perl -e: a hash/string churn (PERL_CHURN below): per iteration a hash of 200 strings
          of 0-699 bytes is built, joined into one string and split again (~1000 malloc-API
          calls per iteration: Debian's perl uses the system malloc). Its calls are counted
          once, by a BPF counter on libc's entry points (pid-filtered), and every mode divides
          by that count. (Not python3: heaptrack 1.4 records only ~90 of the tens of thousands
          of malloc calls of Debian's python3.11, so the comparison would be void.)

Modes (every mode once per round, the order rotating from round to round):

  untraced    no tool
  top         `pymtrace top -p PID --batch` (its uprobes, page-fault and slab tracepoints)
  heap        `pymtrace heap -p PID -o FILE.folded` at the default sampling (512 KiB)
  heap-every  `pymtrace heap -p PID --sample-bytes 1 -o FILE.folded`: every call's stack
  memleak     `/usr/sbin/memleak-bpfcc -p PID -O LIBC 3600` (bcc's tool: every call, with
              its frame-pointer stacks via bpf_get_stackid)
  heaptrack   `heaptrack -o FILE CMD` (LD_PRELOAD, launched with the program; its
              heaptrack_interpret process is not counted, the target's own cost is)

A BPF tool is "ready" when bpftool shows its uprobes on the target's libc and their number has
not changed for a second. The cost is the target's CPU time (sum_exec_runtime of its threads
from /proc/PID/task/*/schedstat, kernel time of the probes included) over the measured work,
per malloc+free pair. The targets run on a private copy of libc (a file named libc.so.6 in a
temporary directory, through LD_LIBRARY_PATH): uprobes are attached per file, so tracers of
other users of the machine that probe the system libc cannot slow them down. System-wide
pymtrace instances (e.g. `exporter --per-call`) find every file named libc.so.6 and probe the
copy too: a measurement during which another process had uprobes on the copy is flagged
(with that process's command line) and left out of the statistics.

Also reported for `pymtrace heap`: its own CPU from ready until it went idle after the work
(the consumer: reading the ring, unwinding, the profile) per sample, its samples and drops,
its peak RSS (ru_maxrss at exit, the report written); and the fraction of samples whose stack
is complete root-to-leaf on tests/support/workloads/heap_chains.c built -O2
-fomit-frame-pointer with its shared library (`pymtrace heap -- heap_chains ...`), at both
sampling settings.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchutil import build_c  # noqa: E402

from pymtrace.bpf import load as bpfload  # noqa: E402
from pymtrace.tracee import libc  # noqa: E402

PY = sys.executable
MEMLEAK = "/usr/sbin/memleak-bpfcc"
HEAPTRACK = "/usr/bin/heaptrack"
MODES = ("untraced", "top", "heap", "heap-every", "memleak", "heaptrack")
WORKLOADS = ROOT / "tests" / "support" / "workloads"

PERL_CHURN = r"""
$| = 1;
print "ready $$\n";
while (my $n = <STDIN>) {
    for my $i (1 .. $n) {
        my %h;
        $h{"k$_"} = "x" x (($_ * 7 + $i) % 700) for 1 .. 200;
        my $s = join(",", map { "$_=$h{$_}" } sort keys %h);
        my @back = split /,/, $s;
        die unless @back == 200;
    }
    print "done\n";
}
"""

COUNTER = r"""
#include <uapi/linux/ptrace.h>
BPF_ARRAY(calls, u64, 2);
static int count(int i) {
    calls.atomic_increment(i);
    return 0;
}
int alloc_entry(struct pt_regs *ctx) { return count(0); }
int free_entry(struct pt_regs *ctx) { return count(1); }
"""
ALLOC_FUNCTIONS = ("malloc", "calloc", "realloc", "memalign", "aligned_alloc", "posix_memalign", "valloc", "pvalloc")


def cpu_ns(pid):
    """CPU time of PID's threads in ns (schedstat's sum_exec_runtime: user + kernel)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def probes_on(path):
    """{pid: number of uprobes} of the processes with uprobes on PATH (bpftool perf list)."""
    out = subprocess.run(["bpftool", "-j", "perf", "list"], capture_output=True, text=True, timeout=30).stdout
    found = {}
    for e in json.loads(out or "[]"):
        if e.get("pid") != os.getpid() and e.get("filename", "").endswith(path):  # also /proc/PID/root/PATH
            found[e["pid"]] = found.get(e["pid"], 0) + 1
    return found


def wait_probes(tool, path, timeout=180):
    """Until TOOL (a Popen) has uprobes on PATH and their number held for a second."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if tool.poll() is not None:
            raise RuntimeError(f"{tool.args[0]} exited ({tool.returncode}) before attaching")
        n = probes_on(path).get(tool.pid, 0)
        if n and n == last:
            return
        last = n
        time.sleep(1)
    raise RuntimeError(f"{tool.args} did not attach within {timeout} s")


def wait_idle(pid, step=0.3):
    """Until PID used less than 2 % of a CPU over STEP seconds (a consumer caught up)."""
    before = cpu_ns(pid)
    while True:
        time.sleep(step)
        now = cpu_ns(pid)
        if now - before < step * 1e9 * 0.02:
            return now
        before = now


class Target:
    """A storm or perl target on the private libc; WORK lines make it do measured work."""

    def __init__(self, kind, argv, env, work, pairs):
        self.kind, self.argv, self.env, self.work, self.pairs = kind, argv, env, work, pairs

    def start(self, prefix=()):
        p = subprocess.Popen(
            [*prefix, *self.argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env
        )
        line = p.stdout.readline().split()
        for _ in range(20):  # heaptrack prints its own lines first
            if not line or line[0] == "ready":
                break
            line = p.stdout.readline().split()
        if not line or line[0] != "ready":
            p.kill()
            raise RuntimeError(f"{self.kind} did not start: {line}")
        return p, int(line[1])

    def run(self, proc, pid, mode):
        """Do the measured work once; CPU ns of PID for it."""
        t0 = cpu_ns(pid)
        proc.stdin.write(self.work[mode])
        proc.stdin.flush()
        if not proc.stdout.readline().strip():
            raise RuntimeError(f"{self.kind} failed under {mode}")
        return cpu_ns(pid) - t0


def private_libc(tmp):
    """A copy of the system libc as TMP/lib/libc.so.6; (its path, the env to run on it)."""
    d = tmp / "lib"
    d.mkdir()
    shutil.copy2(libc.system_libc(), d / "libc.so.6")
    return str(d / "libc.so.6"), dict(os.environ, LD_LIBRARY_PATH=str(d), PERL_HASH_SEED="0", PERL_PERTURB_KEYS="0")


def count_calls(target, path):
    """(allocation calls, frees) of one measured run of TARGET, counted in BPF."""
    proc, pid = target.start()
    import bcc

    b = bcc.BPF(text=COUNTER)
    for fn in ALLOC_FUNCTIONS:
        b.attach_uprobe(name=path, sym=fn, fn_name="alloc_entry", pid=pid)
    b.attach_uprobe(name=path, sym="free", fn_name="free_entry", pid=pid)
    try:
        target.run(proc, pid, "heap")
        allocs, frees = b["calls"][0].value, b["calls"][1].value
    finally:
        proc.stdin.close()
        proc.wait()
        b.cleanup()
    return allocs, frees


def measure(target, mode, path, tmp, serial):
    """One measurement: {cpu_ns, disturbed, and for heap modes: samples, drops, consumer_ns, maxrss_kb}."""
    out = {"disturbed": False}
    prefix = (HEAPTRACK, "-o", str(tmp / f"ht{serial}")) if mode == "heaptrack" else ()
    proc, pid = target.start(prefix)
    tool = None
    try:
        if mode in ("top", "heap", "heap-every", "memleak"):
            log = open(tmp / f"tool{serial}.log", "w+")
            if mode == "top":
                argv = [PY, "-m", "pymtrace", "top", "-p", str(pid), "--batch", "-i", "3600", "-n", "1"]
            elif mode == "memleak":
                argv = [MEMLEAK, "-p", str(pid), "-O", path, "3600"]
            else:
                argv = [PY, "-m", "pymtrace", "heap", "-p", str(pid), "-o", str(tmp / f"p{serial}.folded")]
                argv += ["--allow-drops"] + (["--sample-bytes", "1"] if mode == "heap-every" else [])
            tool = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            wait_probes(tool, path)
            ready_cpu = cpu_ns(tool.pid)
        others = set(probes_on(path)) - {tool.pid if tool else None}
        out["cpu_ns"] = target.run(proc, pid, mode)
        others |= set(probes_on(path)) - {tool.pid if tool else None}
        out["disturbed"] = sorted(others)
        for other in others:
            try:
                cmd = pathlib.Path(f"/proc/{other}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
            except OSError:
                cmd = b"(gone)"
            print(f"disturbed: {other} {cmd.decode(errors='replace')}", file=sys.stderr)
        if tool is not None:
            out["consumer_ns"] = wait_idle(tool.pid) - ready_cpu
            tool.send_signal(signal.SIGINT)
            _, status, usage = os.wait4(tool.pid, 0)
            tool.returncode = os.waitstatus_to_exitcode(status)
            out["maxrss_kb"] = usage.ru_maxrss
            log.seek(0)
            text = log.read()
            log.close()
            m = re.search(r"samples: (\d+), complete root-to-leaf: (\d+)", text)
            if m:
                out["samples"], out["complete"] = int(m[1]), int(m[2])
                out["drops"] = re.search(r"drops: (.*)", text)[1]
            elif mode.startswith("heap"):
                raise RuntimeError(f"heap printed no summary:\n{text}")
            tool = None
    finally:
        if tool is not None and tool.poll() is None:
            tool.kill()
            tool.wait()
        proc.stdin.close()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out


def completeness(tmp, sample_bytes, storm_n, storm_size):
    """(samples, complete) of `pymtrace heap` on heap_chains built without frame pointers."""
    no_fp = ["-O2", "-fomit-frame-pointer"]
    exe, lib = tmp / "heap_chains", tmp / "libheapchain.so"
    if not exe.exists():
        subprocess.run(["gcc", *no_fp, "-shared", "-fPIC", "-o", lib, WORKLOADS / "heap_chains_lib.c"], check=True)
        subprocess.run(
            ["gcc", *no_fp, "-pthread", "-o", exe, WORKLOADS / "heap_chains.c"]
            + ["-L", tmp, "-lheapchain", f"-Wl,-rpath,{tmp}"],
            check=True,
        )
    argv = [PY, "-m", "pymtrace", "heap", "--sample-bytes", str(sample_bytes), "--allow-drops"]
    argv += ["-o", str(tmp / f"chains{sample_bytes}.folded"), "--", str(exe), "0", str(storm_n), str(storm_size)]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
    m = re.search(r"samples: (\d+), complete root-to-leaf: (\d+)", r.stderr)
    if not m:
        raise RuntimeError(f"heap on heap_chains failed:\n{r.stderr}")
    return int(m[1]), int(m[2]), re.search(r"drops: (.*)", r.stderr)[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=200000, help="storm pairs per traced measurement")
    ap.add_argument("--fast-pairs", type=int, default=20000000, help="storm pairs untraced")
    ap.add_argument("--heaptrack-pairs", type=int, default=2000000, help="storm pairs under heaptrack")
    ap.add_argument("--iterations", type=int, default=100, help="perl churn iterations per measurement")
    ap.add_argument("--targets", default="storm,perl")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-completeness", action="store_true")
    ap.add_argument("--save", metavar="FILE", help="also write every measurement as JSON to FILE")
    ap.add_argument("--report", metavar="FILE", help="only print the tables of a run saved with --save")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            report(json.load(f))
        return 0
    bpfload.require_root("the heap benchmark")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pymtrace-heapbench-"))
    path, env = private_libc(tmp)
    storm_exe = build_c(tmp, "storm", HERE / "storm.c")
    modes = [m for m in MODES if m in args.modes.split(",")]
    storm_work = {m: f"{args.pairs} 64\n" for m in MODES}
    storm_work.update(untraced=f"{args.fast_pairs} 64\n", heaptrack=f"{args.heaptrack_pairs} 64\n")
    storm_pairs = {m: int(w.split()[0]) + 1000 for m, w in storm_work.items()}
    targets = {}
    if "storm" in args.targets:
        targets["storm"] = Target("storm", [storm_exe], env, storm_work, storm_pairs)
    if "perl" in args.targets:
        work = {m: f"{args.iterations}\n" for m in MODES}
        targets["perl"] = Target("perl", ["perl", "-e", PERL_CHURN], env, work, {})
    try:
        calls = {}
        for name, t in targets.items():
            if name != "perl":
                continue
            calls[name] = count_calls(t, path)
            print(f"{name}: {calls[name][0]} allocation calls, {calls[name][1]} frees (BPF count)", file=sys.stderr)
        if "perl" in targets:
            targets["perl"].pairs = {m: calls["perl"][0] for m in MODES}
        results = {(t, m): [] for t in targets for m in modes}
        serial = 0
        for r in range(args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for name, t in targets.items():
                for mode in order:
                    serial += 1
                    res = measure(t, mode, path, tmp, serial)
                    res["ns_per_pair"] = res["cpu_ns"] / t.pairs[mode]
                    results[name, mode].append(res)
                    print(
                        f"round {r + 1} {name} {mode}: {res['ns_per_pair']:.0f} ns/pair"
                        + (f" samples {res['samples']} drops {res['drops']}" if "samples" in res else "")
                        + (f" DISTURBED by {res['disturbed']}" if res["disturbed"] else ""),
                        file=sys.stderr,
                    )
        chains = {}
        if not args.no_completeness:
            chains["default"] = completeness(tmp, 524288, 1000000, 2000)
            chains["every"] = completeness(tmp, 1, 100000, 1000)
        load = os.getloadavg()
        env = (
            f"kernel {os.uname().release}, libc copy of {libc.system_libc()}, {os.cpu_count()} CPUs, "
            f"load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
        )
        raw = {f"{t} {m}": v for (t, m), v in results.items()}
        saved = {"args": vars(args), "calls": calls, "chains": chains, "results": raw, "env": env}
        if args.save:
            with open(args.save, "x") as f:
                json.dump(saved, f)
        report(saved)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(saved):
    """Print the tables of SAVED ({"args", "calls", "chains", "results": {"TARGET MODE": [...]}, "env"})."""
    args, calls, results = saved["args"], saved["calls"], saved["results"]
    targets = [t for t in ("storm", "perl") if any(k.startswith(t + " ") for k in results)]
    modes = [m for m in MODES if any(k.endswith(" " + m) for k in results)]
    print(f"\n{args['rounds']} interleaved rounds, {saved.get('env', '')}")
    for name in targets:
        what = (
            f"storm: malloc(64)+free pairs ({args['pairs']} per measurement; untraced "
            f"{args['fast_pairs']}, heaptrack {args['heaptrack_pairs']})"
            if name == "storm"
            else f"perl hash/string churn: {args['iterations']} iterations, {calls[name][0]} allocation calls and "
            f"{calls[name][1]} frees per measurement"
        )
        print(f"\n{what}\n")
        print("| mode | CPU ns/pair min | median | vs untraced | vs top | memleak / this | disturbed (left out) |")
        print("|---|---|---|---|---|---|---|")
        for mode in modes:
            v = [x["ns_per_pair"] for x in results[f"{name} {mode}"] if not x["disturbed"]]
            cols = [paired(results, name, mode, ref) for ref in ("untraced", "top")]
            cols.append(paired(results, name, "memleak", mode) if f"{name} memleak" in results else "")
            dist = sum(bool(x["disturbed"]) for x in results[f"{name} {mode}"])
            print(f"| {mode} | {min(v):.0f} | {statistics.median(v):.0f} | " + " | ".join(cols) + f" | {dist} |")
        for mode in ("heap", "heap-every"):
            runs = results.get(f"{name} {mode}")
            if not runs:
                continue
            samples = [x["samples"] for x in runs]
            per = [x["consumer_ns"] / max(x["samples"], 1) / 1000 for x in runs]
            consumer_ms = [x["consumer_ns"] / 1e6 for x in runs]
            rss = [x["maxrss_kb"] / 1024 for x in runs]
            complete = sum(x["complete"] for x in runs) / max(sum(samples), 1)
            print(
                f"\n{mode}: samples per run {min(samples)}-{max(samples)}, complete {complete:.2%}; "
                f"pymtrace CPU from attached to idle {min(consumer_ms):.0f} / {statistics.median(consumer_ms):.0f} ms, "
                f"per sample {min(per):.1f} / {statistics.median(per):.1f} us (min / median); "
                f"peak RSS {min(rss):.0f}-{max(rss):.0f} MiB; drops: " + "; ".join(x["drops"] for x in runs)
            )
    for setting, (samples, complete, drops) in saved["chains"].items():
        print(
            f"\nheap_chains (-O2 -fomit-frame-pointer), {setting} sampling: samples {samples}, "
            f"complete root-to-leaf {complete} ({complete / max(samples, 1):.2%}); drops: {drops}"
        )


def paired(results, target, mode, ref):
    """Median over rounds of MODE/REF measured in the same round, as "1.23x" ("" without REF);
    rounds where either measurement was disturbed are left out."""
    xs, ys = results.get(f"{target} {mode}"), results.get(f"{target} {ref}")
    if not xs or not ys:
        return ""
    ratios = [x["ns_per_pair"] / y["ns_per_pair"] for x, y in zip(xs, ys) if not (x["disturbed"] or y["disturbed"])]
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


if __name__ == "__main__":
    raise SystemExit(main())
