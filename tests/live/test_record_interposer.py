"""`pymtrace record -- CMD` through pymtrace's interposer (the default for a launched command
that can preload it) against ground truth: the workloads' own CALL lines, the uprobe path on
the same program, and the path chosen (and said) per process."""

import collections
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import pytest
from support.cli import PYMTRACE, run_pymtrace
from support.interposer import build_counter, counter_counts, run_interposed
from support.paths import WORKLOADS
from support.recording import check_own_calls, ground_truth, key, text_range

from pymtrace.sources import interposer as I
from pymtrace.trace.formats import autodetect
from pymtrace.trace.formats import mtrace_bin as B

pytestmark = pytest.mark.bpf

# both paths see the same environment: the interposer's adds LD_PRELOAD and PYMTRACE_RING,
# and a program that copies its environment (sh) allocates once per variable
SAME_ENV = dict(os.environ, LD_PRELOAD="", PYMTRACE_RING="-")


def summary_of(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stderr.strip().splitlines()[-1])


def type_counts(path):
    return collections.Counter(r.type_name for r in autodetect.load_records(str(path))[1])


@pytest.mark.parametrize("fmt", ["mtrace-bin", "parquet", "mtrace-text"])
def test_interposer_records_every_call_exactly(cbuild, tmp_path, fmt):
    """record_calls' own calls (4 threads, free(NULL), realloc(NULL, n), realloc(p, 0), a
    failed posix_memalign, cross-thread frees) record for record, in each thread's order,
    with glibc's chunk sizes, in every format; the same counts per call type as uprobes."""
    prog = cbuild("record_calls", "-no-pie")
    out = tmp_path / f"in.{fmt}"
    proc = run_pymtrace("record", "--json", "--format", fmt, "-o", out, "--", prog, env=SAME_ENV)
    summary = summary_of(proc)
    assert summary["via"] == "interposer" and summary["lost"] == 0
    (p,) = summary["processes"]
    assert p["via"] == "interposer" and p["allocator"].endswith("libc.so.6") and p["torn"] == 0
    assert p["records"] == summary["entries"]
    truth = ground_truth(proc.stdout)
    assert len(truth) > 300
    if fmt == "mtrace-bin":
        records = list(B.read_file(out))
        by_thread = check_own_calls(records, prog, truth)
        assert all(r.ts_ns and r.caller for r in records)
        stamps = [r.ts_ns for r in records]
        assert stamps == sorted(stamps) or len(by_thread) > 1  # one thread's are in order (checked above)
    ref = tmp_path / f"up.{fmt}"
    summary2 = summary_of(
        run_pymtrace("record", "--json", "--via", "uprobes", "--format", fmt, "-o", ref, "--", prog, env=SAME_ENV)
    )
    assert summary2["via"] == "uprobes"
    assert type_counts(out) == type_counts(ref)


def test_interposer_full_ring_waits_and_loses_nothing(cbuild, tmp_path):
    """A ring of 1024 records against a storm of 200,000 calls: the program waits for the
    consumer (counted), nothing is lost, every call is there."""
    prog = cbuild("record_storm")
    pairs = 100_000
    out = tmp_path / "storm.trace"
    summary = summary_of(
        run_pymtrace("record", "--json", "--buffer-size", "64K", "--poll-interval", "50", "-o", out, "--", prog, pairs)
    )
    (p,) = summary["processes"]
    assert p["waits"] > 0 and p["wait_s"] > 0
    assert summary["lost"] == 0
    records = list(B.read_file(out))
    storm = collections.Counter(r.type for r in records if (r.type == B.MALLOC and r.size == 64) or r.type == B.FREE)
    assert storm[B.MALLOC] >= pairs and storm[B.FREE] >= pairs
    assert len(records) < 2 * pairs + 50


def test_interposer_follows_forks_and_execs_like_uprobes(cbuild, tmp_path):
    """sh forks two children (one in the background) and execs a third program in its own
    process: each program's calls in its process's file, and the same counts per call type
    over the files as through uprobes. (dash starts some children with vfork: what such a
    child allocates before its exec lands in the parent's heap, and the interposer records it
    as the parent's, where uprobes name the child: so the sums are compared, not each file.)"""
    prog = cbuild("record_storm")
    script = f"{prog} 500 1032; {prog} 700 2048 & wait; exec {prog} 300 3080"
    totals = {}
    for via in ("interposer", "uprobes"):
        out = tmp_path / via
        summary = summary_of(
            run_pymtrace(
                "record",
                "--json",
                "--via",
                via,
                "--follow-forks",
                "-o",
                out,
                "--",
                "/bin/sh",
                "-c",
                script,
                env=SAME_ENV,
            )
        )
        assert summary["lost"] == 0 and len(summary["files"]) == 3
        totals[via] = sum((type_counts(f["file"]) for f in summary["files"]), collections.Counter())
        storms = set()
        for f in summary["files"]:
            sizes = collections.Counter(r.size for r in B.read_file(f["file"]) if r.type == B.MALLOC)
            storms.add(("main" if f["file"] == str(out) else "child", sizes[1032], sizes[2048], sizes[3080]))
        # the exec'd program's calls are in sh's own file
        assert storms == {("child", 500, 0, 0), ("child", 0, 700, 0), ("main", 0, 0, 300)}
        if via == "interposer":
            main = summary["files"][0]["pid"]
            images = {(p["pid"], p["image"]) for p in summary["processes"]}
            assert (main, 0) in images and (main, 1) in images  # sh, then the program it exec'd
    assert totals["interposer"] == totals["uprobes"]


def test_exec_without_the_interposer_is_recorded_through_uprobes(cbuild, tmp_path):
    """`env -u LD_PRELOAD PROG`: env runs with the interposer, PROG without; PROG is held at
    its exec and recorded through uprobes from its first call, exactly, and the output says
    which path recorded which image and why."""
    prog = cbuild("record_calls", "-no-pie")
    out = tmp_path / "env.trace"
    proc = run_pymtrace("record", "--json", "-o", out, "--", "env", "-u", "LD_PRELOAD", prog)
    summary = summary_of(proc)
    vias = {p["via"]: p for p in summary["processes"]}
    assert set(vias) == {"interposer", "uprobes"}
    assert "LD_PRELOAD no longer names the interposer" in vias["uprobes"]["why"]
    assert summary["lost"] == 0
    truth = ground_truth(proc.stdout)
    lo, hi = text_range(prog)
    own = [r for r in B.read_file(out) if lo <= r.caller < hi]
    assert collections.Counter(map(key, own)) == collections.Counter(truth)
    text = run_pymtrace("record", "-o", tmp_path / "env2.trace", "--", "env", "-u", "LD_PRELOAD", prog).stderr
    assert "recorded through uprobes from its exec on" in text and "LD_PRELOAD no longer names the interposer" in text


def _run_until_named(cmd, storm):
    """`record --json --follow-forks CMD...`, whose child waits on stdin (record_storm stdin)
    until record has named it on stderr, then runs STORM ("PAIRS SIZE") and ends: (stdout,
    stderr, summary). A child that ends before record could read its /proc entry would not be
    named (docs/record.md)."""
    proc = subprocess.Popen(
        [*PYMTRACE, "record", "--json", "--follow-forks", *cmd],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    tree = []

    def never_named():  # the child would wait forever, holding the pipes: end both
        ps = subprocess.run(["ps", "-eHo", "pid,ppid,user,stat,wchan:20,args"], capture_output=True, text=True)
        tree.append(ps.stdout)  # what record and its children were doing, for the failure message
        proc.kill()
        proc.stdin.close()

    never = threading.Timer(300, never_named)
    never.start()
    try:
        for line in proc.stderr:
            lines.append(line)
            if "is not recorded from here on" in line:
                break
        assert not proc.stdin.closed, "record never named it:\n" + "".join(lines) + "".join(tree)
        proc.stdin.write(storm + "\n")
        proc.stdin.close()
        err = proc.stderr.read()  # (the program's stdout is two short lines: no pipe fills)
        out = proc.stdout.read()
        proc.wait()
    finally:
        never.cancel()
    err = "".join(lines) + err
    assert proc.returncode == 0, err
    return out, err, json.loads(err.strip().splitlines()[-1])


def test_followed_child_without_the_interposer_is_named(cbuild, tmp_path):
    """A followed child that execs a program without LD_PRELOAD cannot be recorded from the
    start any more: named, with why, in the lines and the JSON summary."""
    prog = cbuild("record_storm")
    out = tmp_path / "kid.trace"
    script = f"env -u LD_PRELOAD {prog} stdin; {prog} 200 2048"
    _, err, summary = _run_until_named(["-o", out, "--", "/bin/sh", "-c", script], "3000 1032")
    gone = [p for p in summary["processes"] if p["via"] is None]
    assert len(gone) == 1, err
    (gone,) = gone
    assert "LD_PRELOAD no longer names the interposer" in gone["why"] and prog in gone["why"]
    assert f"process {gone['pid']} " in err
    sizes = collections.Counter()
    for f in summary["files"]:
        sizes.update(r.size for r in B.read_file(f["file"]) if r.type == B.MALLOC)
    assert sizes[2048] == 200 and sizes[1032] == 0


def test_what_cannot_be_preloaded_goes_through_uprobes_and_says_why(cbuild, tmp_path):
    """A program defining malloc itself: recorded through uprobes, the reason on stderr;
    --via interposer refuses it with the same reason in one line; a static binary too."""
    own = cbuild("top_calls_own")
    proc = run_pymtrace("record", "-o", tmp_path / "own.trace", "--", own, input="xxxx")
    assert proc.returncode == 0, proc.stderr
    assert f"pymtrace: recording through uprobes: {own}: defines malloc itself" in proc.stderr
    proc = run_pymtrace("record", "--json", "-o", tmp_path / "own2.trace", "--", own, input="xxxx")
    summary = summary_of(proc)
    assert summary["via"] == "uprobes" and "defines malloc itself" in summary["why"]
    refused = run_pymtrace("record", "--via", "interposer", "-o", tmp_path / "x.trace", "--", own)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        f"pymtrace: error: --via interposer: {own}: defines malloc itself, its definition wins over a preloaded one"
    ]
    static = cbuild("record_storm", "-static")
    refused = run_pymtrace("record", "--via", "interposer", "-o", tmp_path / "s.trace", "--", static, "10")
    assert refused.returncode == 1 and "a static binary" in refused.stderr
    assert "Traceback" not in refused.stderr
    # --stacks is taken in-process too: a static binary still goes through uprobes, saying why
    stacks = run_pymtrace("record", "--stacks", "-o", tmp_path / "st.trace", "--", static, "10")
    assert stacks.returncode == 1 and f"recording through uprobes: {static}: a static binary" in stacks.stderr
    assert "Traceback" not in stacks.stderr


def test_recorder_killed_the_program_runs_on_and_its_rings_are_swept(cbuild, tmp_path):
    """pymtrace SIGKILLed mid-recording (no clean-up at all): the program it launched runs
    on, unblocked, with a ring it cannot fill for ever (its consumer is gone); the next
    recording removes the ring directory left behind."""
    prog = cbuild("record_loop")
    shm = "/dev/shm"
    before = set(os.listdir(shm))
    rec = subprocess.Popen(
        [*PYMTRACE, "record", "-q", "--buffer-size", "64K", "-o", tmp_path / "k.trace", "--", prog],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert rec.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        (left,) = [n for n in set(os.listdir(shm)) - before if n.startswith("pymtrace-rings-")]
        assert os.listdir(os.path.join(shm, left))  # its ring
        kids = [int(p) for p in open(f"/proc/{rec.pid}/task/{rec.pid}/children").read().split()]
        (child,) = kids
        rec.kill()
        rec.wait()

        # the program keeps allocating: its CPU time grows, it is not stuck waiting
        def cpu():
            with open(f"/proc/{child}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12]), fields[0]

        t0, state0 = cpu()
        time.sleep(1.0)
        t1, state1 = cpu()
        assert t1 > t0 and state1 in "RS"
        proc = run_pymtrace("record", "-q", "-o", tmp_path / "next.trace", "--", "/bin/true")
        assert proc.returncode == 0, proc.stderr
        assert not os.path.exists(os.path.join(shm, left))
    finally:
        rec.kill()
        for pid in kids if "kids" in locals() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize(
    "switch",
    [
        ["runuser", "-u", "nobody", "--"],  # (forks, where PAM opens a session: a followed child)
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"],  # the command itself
    ],
)
def test_child_switching_user_loads_the_library_and_is_named(cbuild, tmp_path, switch):
    """A followed child, or the command itself, that becomes another user still loads the
    interposer (root builds it readable by all: no loader error reaches the program's
    stderr), but its ring could not be pymtrace's: named, with why."""
    if shutil.which(switch[0]) is None:
        pytest.fail(f"{switch[0]} (util-linux) is not installed")
    shared = tempfile.mkdtemp()  # a directory the other user can reach (tmp_path's parents are 0700)
    try:
        os.chmod(shared, 0o755)
        prog = os.path.join(shared, "storm")
        shutil.copy(cbuild("record_storm"), prog)
        cmd = ["-o", tmp_path / "u.trace", "--", *switch, prog, "stdin"]
        out, err, summary = _run_until_named(cmd, "3000 1032")
    finally:
        shutil.rmtree(shared)
    assert out.startswith("ready ") and len(out.splitlines()) == 2  # it ran, as the other user
    assert "cannot be preloaded" not in err and "ld.so" not in err
    gone = [p for p in summary["processes"] if p["via"] is None]
    assert len(gone) == 1, err
    (gone,) = gone
    assert "runs as user 65534" in gone["why"]
    lib = I.library()
    st = os.stat(lib)
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o755 and lib.startswith("/var/cache/pymtrace/")


@pytest.mark.parametrize("stop", ["duration", "SIGINT", "SIGTERM"])
def test_stopping_keeps_every_record_and_the_program_runs_on(cbuild, tmp_path, stop):
    """--duration, Ctrl-C and SIGTERM: the file holds exactly what the summary counts, the
    program goes on running, never blocked on its ring (its CPU time keeps growing)."""
    prog = cbuild("record_loop")
    out = tmp_path / "s.trace"
    extra = ["--duration", "1"] if stop == "duration" else []
    log = tmp_path / "stderr"
    with open(log, "w") as err_file:  # (not a pipe: the program, running on, holds it too)
        rec = subprocess.Popen(
            [*PYMTRACE, "record", "--json", "--buffer-size", "64K", *extra, "-o", out, "--", prog],
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
        )
    child = None
    try:
        assert rec.stdout.readline().strip() == "ready"
        (child,) = [int(p) for p in open(f"/proc/{rec.pid}/task/{rec.pid}/children").read().split()]
        if stop != "duration":
            time.sleep(1.0)
            rec.send_signal(getattr(signal, stop))
        rec.wait(timeout=60)
        err = log.read_text()
        assert rec.returncode == 0, err
        summary = json.loads(err.strip().splitlines()[-1])
        records = list(B.read_file(out))
        assert summary["entries"] == len(records) > 1000 and summary["lost"] == 0
        assert {r.type_name for r in records} >= {"malloc", "realloc", "free"}

        def cpu():
            with open(f"/proc/{child}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])

        t0 = cpu()
        time.sleep(0.5)
        assert cpu() > t0  # running on, untraced
    finally:
        rec.kill()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


CXX_MAP = r"""
#include <map>
#include <string>
#include <vector>
int main() {
    std::map<std::string, std::vector<int>> m;
    for (int i = 0; i < 10000; i++) m["key-" + std::to_string(i * 7919 % 100003)].push_back(i);
    for (int i = 0; i < 5000; i++) m.erase("key-" + std::to_string(i * 7919 % 100003));
    return m.size() == 5000 ? 0 : 1;
}
"""


def _real_program(name, tmp_path):
    """(argv, follow forks) of one of the real programs the paths are compared on."""
    if name == "sqlite3":
        if shutil.which("sqlite3") is None:
            pytest.fail("sqlite3 is not installed")
        sql = tmp_path / "script.sql"
        rows = "".join(f"INSERT INTO t(name, v) VALUES ('n-{i * 7919 % 20011}', {i});\n" for i in range(5000))
        sql.write_text(f"CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);\nBEGIN;\n{rows}COMMIT;\n"
                       "CREATE INDEX i1 ON t(name);\nSELECT count(*) FROM t WHERE name LIKE 'n-1%';\n")  # fmt: skip
        return ["sqlite3", ":memory:", f".read {sql}"], False
    if name == "python3":
        return [
            "/usr/bin/python3",
            "-c",
            "import json; [json.dumps({'a': list(range(50))}) for _ in range(5000)]",
        ], False
    if name == "c++ map":
        src = tmp_path / "map.cpp"
        src.write_text(CXX_MAP)
        subprocess.run(["g++", "-O2", "-o", tmp_path / "map", src], check=True)
        return [str(tmp_path / "map")], False
    src = tmp_path / "rc.c"
    shutil.copy(WORKLOADS / "record_calls.c", src)
    return ["gcc", "-O2", "-c", str(src), "-o", str(tmp_path / "rc.o")], True


@pytest.mark.parametrize("name", ["sqlite3", "python3", "c++ map", "gcc"])
def test_both_paths_and_a_counter_agree_on_real_programs(build_dir, tmp_path, name):
    """Per call type and process, over whole runs: `record` through the interposer and `record
    --via uprobes` of the same program in the same environment; and the tests' own LD_PRELOAD
    counter in front of the interposer, against what the interposer recorded in that run."""
    argv, follow = _real_program(name, tmp_path)
    # the same addresses in every run: gcc's and Python's hash tables of pointers grow (and
    # allocate) at other moments when the addresses differ
    argv = ["setarch", "-R", *argv]
    counted = tmp_path / "counted"
    counted.mkdir()
    base = dict(os.environ, PYTHONHASHSEED="0", COUNTER_DIR=str(counted))  # one environment for all
    runs = {}
    # the uprobe path's run maps the interposer too, forwarding only (no ring named): the same
    # address space, where gcc's tables of pointers grow at the same moments
    quiet = dict(base, LD_PRELOAD=I.library(), PYMTRACE_RING="-")
    for via, env in (("interposer", base), ("uprobes", quiet)):
        out = tmp_path / via
        flags = ["--follow-forks"] if follow else []
        summary = summary_of(
            run_pymtrace("record", "--json", "--via", via, *flags, "-o", out, "--", *argv, env=env, cwd=tmp_path)
        )
        assert summary["lost"] == 0
        runs[via] = sorted(
            tuple(sorted((k, v) for k, v in type_counts(f["file"]).items() if v)) for f in summary["files"]
        )
    assert len(runs["interposer"]) == len(runs["uprobes"]) == (3 if follow else 1)  # gcc, cc1, as
    if name != "gcc":
        assert runs["interposer"] == runs["uprobes"]
    else:  # cc1 hashes addresses of memory it mmaps, which the interposer's ring mapping moves:
        # a table of pointers may grow (an xcalloc) once more or less; nothing else differs
        for a, b in zip(runs["interposer"], runs["uprobes"]):
            assert [k for k, _ in a] == [k for k, _ in b]
            assert all(abs(x - y) <= max(2, x // 2000) for (_, x), (_, y) in zip(a, b)), (a, b)
    # the counter in front of the interposer, in a run of their own (a library more, its TLS
    # too: the loader's and a thread's allocations are not quite those of the runs above)
    run = run_interposed(argv, env=base, preload_first=build_counter(build_dir))
    assert run.proc.returncode == 0, run.proc.stderr
    assert counter_counts(counted) == {pid: run.counts(pid) for pid in run.records}
