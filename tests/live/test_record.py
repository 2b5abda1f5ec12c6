"""`pymtrace record` with real BPF: exact records, order, glibc mtrace() parity, attach + SIGINT."""

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import time

import pytest
from support import machine
from support.cli import PYMTRACE, run_pymtrace, script_background, sigint_ignored
from support.paths import ROOT
from support.recording import check_own_calls, ground_truth, key, text_range
from support.top import alive
from support.uprobes import ProbeWatch

from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import mtrace_text as T

pytestmark = pytest.mark.bpf


def check_order(records):
    """Every free/realloc of a pointer comes after the allocation that returned it, and no
    pointer is handed out twice without a release in between (valid global order)."""
    live = {}
    for i, r in enumerate(records):
        if r.type == B.FREE:
            if r.ptr1:
                live.pop(r.ptr1, None)
        elif r.type == B.REALLOC:
            if r.ptr1 and r.ptr2 == 0 and r.size:
                continue  # failed realloc: the old block stays
            if r.ptr1:
                live.pop(r.ptr1, None)
            if r.ptr2:
                assert r.ptr2 not in live, f"record {i} {r}: {r.ptr2:#x} still live (allocated by {live[r.ptr2]})"
                live[r.ptr2] = r
        elif r.type != B.POSIX_MEMALIGN or r.ptr1 == 0:
            if r.ptr2:
                assert r.ptr2 not in live, f"record {i} {r}: {r.ptr2:#x} still live (allocated by {live[r.ptr2]})"
                live[r.ptr2] = r
    return live


def test_record_launch_exact_records(cbuild, tmp_path):
    prog = cbuild("record_calls", "-no-pie")
    out = tmp_path / "calls.trace"
    proc = run_pymtrace("record", "--json", "-o", out, "--", prog)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    truth = ground_truth(proc.stdout)
    assert len(truth) > 300  # 3 threads x 20 rounds x 5 calls + main's calls

    raw = out.read_bytes()
    assert len(raw) % 64 == 0 and len(raw) == summary["bytes_written"]
    assert B.detect_byteorder(raw[:64]) == "<"
    assert oct(os.stat(out).st_mode & 0o777) == "0o600"
    records = list(B.read_file(out))
    assert summary["lost"] == 0
    assert summary["entries"] == len(records) == len(raw) // 64 - 1
    counts = collections.Counter(r.type_name for r in records)
    assert summary["files"][0]["counts"] == {name: counts.get(name, 0) for name in summary["files"][0]["counts"]}

    # the program's own calls: exactly the ground truth, record for record, per thread in the
    # same order the thread made them
    by_thread = check_own_calls(records, prog, truth)
    assert len(by_thread) == 4
    lo, hi = text_range(prog)
    own = [r for r in records if lo <= r.caller < hi]
    # the special cases are really there, as docs/formats.md describes them
    kinds = {(t[1], t[2] == 0, t[3] == 0) for t in truth}
    assert (B.FREE, True, True) in kinds  # free(NULL)
    assert any(t[1] == B.REALLOC and t[2] == 0 and t[3] for t in truth)  # realloc(NULL, n)
    assert any(t[1] == B.REALLOC and t[2] and t[3] == 0 and t[4] == 0 for t in truth)  # realloc(p, 0)
    assert any(t[1] == B.POSIX_MEMALIGN and t[2] == 22 and t[3] == 0 for t in truth)  # EINVAL
    # timestamps and callers filled in the pad words
    assert all(r.ts_ns and r.caller for r in records)
    # valid global order over everything recorded (also libc's internal calls)
    check_order(records)
    # cross-thread frees: a block allocated by main freed by a worker and vice versa
    alloc_thread = {}
    crossed = 0
    for r in own:
        if r.type == B.FREE and r.ptr1 in alloc_thread and alloc_thread[r.ptr1] != r.thread:
            crossed += 1
        if r.ptr2:
            alloc_thread[r.ptr2] = r.thread
    assert crossed >= 6


def test_record_text_matches_glibc_mtrace(cbuild, tmp_path):
    prog = cbuild("record_calls")  # PIE: callers are module-relative, as glibc writes them
    glog = tmp_path / "glibc.log"
    plog = tmp_path / "pymtrace.log"
    env = dict(os.environ, LD_PRELOAD="libc_malloc_debug.so.0", MALLOC_TRACE=str(glog))
    proc = run_pymtrace("record", "-q", "--format", "mtrace-text", "-o", plog, "--", prog, "--mtrace", env=env)
    assert proc.returncode == 0, proc.stderr
    assert glog.exists(), "glibc's mtrace() wrote no log (libc_malloc_debug.so.0 missing?)"
    gev = [e for e in T.read_file(glog) if e.op != "="]
    pev = [e for e in T.read_file(plog) if e.op != "="]
    text = plog.read_text()
    assert text.startswith("= Start\n") and text.endswith("= End\n")

    pvalloc = {t[3] for t in ground_truth(proc.stdout) if t[1] == B.PVALLOC}

    def norm(e):
        # glibc 2.36's pvalloc logs a mis-rounded size (see docs/record.md); compare pointers only
        return (e.op, e.addr, None if e.addr in pvalloc else e.size)

    # every event of glibc's log is in pymtrace's, and pymtrace's extra events are glibc's
    # own internal calls, which bypass libc_malloc_debug (so its log never sees them)
    missing = collections.Counter(map(norm, gev)) - collections.Counter(map(norm, pev))
    assert not missing
    extra = collections.Counter(map(norm, pev)) - collections.Counter(map(norm, gev))
    prog_real = os.path.realpath(prog)
    for e in pev:
        if norm(e) in extra:
            assert not e.where.startswith(prog_real), f"program's own call missing from glibc's log: {e}"
    # program's own callers: same module-relative offsets as glibc writes
    gcallers = collections.Counter(
        re.sub(r"^.*:", "", e.where) for e in gev if e.where.startswith("./") or prog in e.where
    )
    pcallers = collections.Counter(re.sub(r"^.*:", "", e.where) for e in pev if e.where.startswith(prog_real))
    if sum(gcallers.values()) and "[0x7fff" not in " ".join(gcallers):
        assert pcallers == gcallers
    # one line per call, two per moving realloc, none for free(NULL) or a failed posix_memalign
    expected = sum(len(T.record_lines(B.Record(*t))) for t in ground_truth(proc.stdout))
    assert sum(pcallers.values()) == expected

    # glibc's mtrace script: the same leaks for both logs
    def leaks(log):
        r = subprocess.run(["mtrace", prog, str(log)], capture_output=True, text=True)
        assert r.returncode == 1, r.stdout + r.stderr  # leaks found
        rows = re.findall(r"^(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+at (.*)$", r.stdout, re.M)
        assert rows, r.stdout
        return rows

    g, p = leaks(glog), leaks(plog)
    assert [a for a, _, _ in g] == [a for a, _, _ in p]
    for (ga, gs, _), (_pa, ps, _where) in zip(g, p):
        if int(ga, 16) not in pvalloc:
            assert gs == ps
    # pymtrace's callers resolve to file:line through addr2line
    assert any("record_calls.c:" in where for _, _, where in p)
    assert T.leaks(pev).keys() == T.leaks(gev).keys()


# How long record may take to start recording: seconds on the host; BPF start-up (the
# compile, the attach) runs ~10x slower in an emulated VM, more on a loaded machine.
START_TIMEOUT = 300


def _record_running(pid, out, records, step):
    """`pymtrace record -p PID -o OUT --json` in the background, once OUT holds more than
    RECORDS records (checked every STEP seconds). Records in OUT mean record is in its
    recording loop: a signal sent before that interrupts the start-up (exit 130), which is
    not what the callers test."""
    rec = subprocess.Popen(
        PYMTRACE + ["record", "-p", str(pid), "-o", str(out), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + START_TIMEOUT
    while not (out.exists() and out.stat().st_size > 64 * records):
        assert rec.poll() is None, rec.stderr.read()
        assert time.monotonic() < deadline, f"no {records} records within {START_TIMEOUT} s"
        time.sleep(step)
    return rec


def test_record_attach_running_sigint(cbuild, tmp_path):
    prog = cbuild("record_loop")
    target = subprocess.Popen([prog], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        out = tmp_path / "attach.trace"
        rec = _record_running(target.pid, out, 2000, 0.2)
        rec.send_signal(signal.SIGINT)
        _, err = rec.communicate(timeout=60)
        assert rec.returncode == 0, err
        assert target.poll() is None  # the target keeps running, untraced
    finally:
        target.kill()
        target.wait()
    summary = json.loads(err.strip().splitlines()[-1])
    raw = out.read_bytes()
    assert len(raw) % 64 == 0
    records = list(B.read_file(out))
    assert summary["lost"] == 0, summary
    assert summary["entries"] == len(records) >= 2000
    assert summary["bytes_written"] == len(raw)
    assert {r.thread for r in records} >= {target.pid}
    assert len({r.thread for r in records}) == 2
    assert set(r.type_name for r in records) >= {"malloc", "free", "realloc"}
    check_order(records)
    # timestamps: all set, spanning no more than the recording (order is the file's order;
    # a producer preempted between reservation and timestamp can be late, so no strict check)
    ts = [r.ts_ns for r in records]
    assert all(ts) and (max(ts) - min(ts)) / 1e9 <= summary["duration_s"] + 1


def test_record_default_name_and_no_symlink(cbuild, tmp_path):
    prog = cbuild("record_storm")
    # -o onto a symlink is refused and the symlink's target is untouched
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(victim)
    proc = run_pymtrace("record", "-o", link, "--", prog, "10")
    assert proc.returncode != 0 and "exists" in proc.stderr
    assert victim.read_text() == "keep"
    # default name mtrace.out.PID in the working directory, .1 when taken
    proc = run_pymtrace("record", "--json", "--", prog, "1000", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    name = summary["files"][0]["file"]
    assert re.fullmatch(r"mtrace\.out\.\d+", name)
    pid = int(name.rsplit(".", 1)[1])
    records = list(B.read_file(tmp_path / name))
    assert sum(1 for r in records if r.type == B.MALLOC and r.size == 64) >= 1000
    assert {r.thread for r in records} == {pid}


def test_record_follow_forks(cbuild, tmp_path):
    prog = cbuild("record_storm")
    out = tmp_path / "f.trace"
    script = f"{prog} 500 32; {prog} 700 48 & wait"
    proc = run_pymtrace("record", "--follow-forks", "--json", "-o", out, "--", "/bin/sh", "-c", script)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    files = {f["file"]: f for f in summary["files"]}
    assert str(out) in files
    children = [f for f in files.values() if f["file"] != str(out)]
    sizes = set()
    for f in children:
        assert f["file"] == f"{out}.{f['pid']}"
        records = list(B.read_file(f["file"]))
        assert {r.thread for r in records} == {f["pid"]}
        c = collections.Counter(r.size for r in records if r.type == B.MALLOC)
        sizes |= {s for s, n in c.items() if n >= 500}
    assert {32, 48} <= sizes
    assert summary["lost"] == 0


def test_record_counts_every_lost_event(cbuild, tmp_path):
    """A BPF ring buffer far too small: records go missing, every one of them is counted, and
    record exits 3 (or 0 with --allow-drops). (The interposer's ring makes the program wait
    instead: test_record_interposer.py.)"""
    prog = cbuild("record_storm")
    pairs = 100_000
    for extra, code in (([], 3), (["--allow-drops"], 0)):
        out = tmp_path / f"small{code}.trace"
        proc = run_pymtrace(
            "record",
            "--json",
            "--via",
            "uprobes",
            "--buffer-size",
            "4K",
            "--poll-interval",
            "50",
            *extra,
            "-o",
            out,
            "--",
            prog,
            pairs,
        )
        assert proc.returncode == code, proc.stderr
        summary = json.loads(proc.stderr.strip().splitlines()[-1])
        records = list(B.read_file(out))
        assert summary["entries"] == len(records)
        assert summary["lost"] > 0
        storm = sum(1 for r in records if (r.type == B.MALLOC and r.size == 64) or r.type == B.FREE)
        # the storm's 2 x pairs calls plus a few of libc's own: recorded + lost accounts for all
        assert 2 * pairs <= len(records) + summary["lost"] <= 2 * pairs + 50
        assert storm <= 2 * pairs


def test_record_missing_process():
    proc = run_pymtrace("record", "-p", "999999999")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "pymtrace: error: process 999999999 does not exist (or exited)"


def test_record_attach_stops_at_duration_and_at_exit(cbuild, tmp_path):
    prog = cbuild("record_loop")
    target = subprocess.Popen([prog], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        # --duration: record stops by itself, the target keeps running
        out1 = tmp_path / "d.trace"
        p = run_pymtrace("record", "-p", target.pid, "--duration", "1", "--json", "-o", out1)
        assert p.returncode == 0, p.stderr
        assert target.poll() is None
        s1 = json.loads(p.stderr.strip().splitlines()[-1])
        assert 1.0 <= s1["duration_s"] < 3 and s1["entries"] == len(list(B.read_file(out1))) > 0
        # the process exits: record notices, drains and ends on its own
        out2 = tmp_path / "e.trace"
        rec = _record_running(target.pid, out2, 500, 0.1)
        target.kill()
        target.wait()
        _, err = rec.communicate(timeout=60)
        assert rec.returncode == 0, err
        s2 = json.loads(err.strip().splitlines()[-1])
        records = list(B.read_file(out2))
        assert s2["entries"] == len(records) >= 500 and s2["lost"] == 0
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()


@contextlib.contextmanager
def _loop_target(cbuild):
    """record_loop running (it allocates in two threads until killed)."""
    target = subprocess.Popen([cbuild("record_loop")], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        yield target
    finally:
        target.kill()
        target.wait()


def _wait_records(out, records, proc_alive, timeout=START_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (out.exists() and out.stat().st_size > 64 * records):
        assert proc_alive(), "pymtrace ended before recording"
        time.sleep(0.2)
    assert out.stat().st_size > 64 * records


def test_record_stops_on_sigint_sent_by_a_script(cbuild, tmp_path):
    """`pymtrace record -p P -o t & ... kill -INT $!` from a script: a non-interactive shell
    starts the job with SIGINT ignored; record still stops on it like Ctrl-C, with the trace
    complete and the probes gone."""
    check = subprocess.Popen(["bash", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    try:
        spid = int(check.stdout.readline())
        deadline = time.monotonic() + 5  # the job sets its signals up just after the fork
        while not sigint_ignored(spid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sigint_ignored(spid), "this shell does not ignore SIGINT in background jobs"
        os.kill(spid, signal.SIGKILL)
    finally:
        check.kill()
        check.wait()
    with _loop_target(cbuild) as target:
        out = tmp_path / "bg.trace"
        with script_background("record", "-p", target.pid, "-o", out, "--json") as (shell, pid):
            _wait_records(out, 2000, lambda: shell.poll() is None)
            watch = ProbeWatch(pid)
            watch.wait_attached(3)
            os.kill(pid, signal.SIGINT)
            stdout, err = shell.communicate(timeout=60)
        assert stdout.strip() == "rc=0", err
        assert not alive(pid)
        watch.assert_gone()
        assert target.poll() is None  # the target keeps running, untraced
    assert "Traceback" not in err
    summary = json.loads(err.strip().splitlines()[-1])
    records = list(B.read_file(out))
    assert summary["lost"] == 0
    assert summary["entries"] == len(records) >= 2000
    assert summary["bytes_written"] == out.stat().st_size
    check_order(records)


def test_record_second_stop_signal_while_stopping_is_ignored(cbuild, tmp_path):
    """SIGTERM, then more SIGTERMs and SIGINTs while record drains and detaches: it finishes
    its clean stop (no traceback from BCC's exit handlers), exit 0, trace complete."""
    with _loop_target(cbuild) as target:
        out = tmp_path / "t.trace"
        rec = _record_running(target.pid, out, 2000, 0.2)
        watch = ProbeWatch(rec.pid)
        watch.wait_attached(3)
        rec.send_signal(signal.SIGTERM)
        for i in range(40):  # over ~2 s: the drain, the summary, the detach
            time.sleep(0.05)
            if rec.poll() is not None:
                break
            rec.send_signal(signal.SIGTERM if i % 2 else signal.SIGINT)
        _, err = rec.communicate(timeout=60)
    assert "Traceback" not in err and "Exception" not in err, err
    assert rec.returncode == 0, err
    summary = json.loads(err.strip().splitlines()[-1])
    assert summary["entries"] == len(list(B.read_file(out))) >= 2000
    watch.assert_gone()


def test_record_refuses_its_own_pid():
    # `exec` keeps the shell's PID: pymtrace is asked to record itself
    proc = subprocess.run(
        ["bash", "-c", 'exec "$0" -m pymtrace record -p $$ --duration 2', PYMTRACE[0]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"pymtrace: error: process \d+ is this pymtrace: .*", lines[0]), proc.stderr


def test_record_duration_bounds_the_stop_on_a_busy_allocator(cbuild, tmp_path):
    """--duration on a process that allocates as fast as it can (text format, the slowest
    consumer): record stops recording (the drain done, the log closed, the summary printed)
    within the duration plus a small bound, and the log holds exactly the records counted.
    Then it detaches: the kernel removes each uprobe after an RCU grace period (~1.5 s in
    all on the development machine, overlapped; about 2 s in an emulated VM), whatever the
    target does, so that part has a bound of its own."""
    prog = cbuild("record_storm")
    target = subprocess.Popen([prog, "1000000000"], stdout=subprocess.DEVNULL)
    try:
        out = tmp_path / "busy.log"
        rec = subprocess.Popen(
            PYMTRACE
            + [
                "record",
                "-p",
                str(target.pid),
                "--duration",
                "2",
                "--allow-drops",
                "--format",
                "mtrace-text",
                "-o",
                str(out),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        lines = []
        for line in rec.stderr:  # BPF start-up can take long on a busy machine: time from here
            lines.append(line)
            if line.startswith("pymtrace: recording"):
                break
        started = time.monotonic()
        recording = lines[-1] if lines else ""
        for line in rec.stderr:  # the summary's first line: recording is over
            lines.append(line)
            if " entries recorded in " in line:
                break
        took = time.monotonic() - started
        _, rest = rec.communicate(timeout=120)
        detached = time.monotonic() - started - took
    finally:
        target.kill()
        target.wait()
    rest = "".join(lines[-1:]) + rest
    assert rec.returncode == 0, "".join(lines) + rest
    # the drain after the stop (bounded by what was committed) runs at the machine's speed
    bound = 2 + 3 * machine.slowness()
    assert took < bound, f"record took {took:.1f} s to stop recording after a 2 s --duration (bound {bound:.1f} s)"
    assert detached < 20, f"record took {detached:.1f} s to detach"
    assert recording.startswith("pymtrace: recording process")
    entries = int(re.search(r"^pymtrace: (\d+) entries recorded in ", rest, re.M).group(1))
    events = [e for e in T.read_file(out) if e.op != "="]
    assert entries > 1000
    assert len(events) == entries  # one line per malloc/free(non-NULL) of the storm
    assert out.read_text().endswith("= End\n")


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.fail(f"cannot mount a small tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("fmt", ["mtrace-bin", "mtrace-text"])
def test_record_disk_full_keeps_every_complete_record(cbuild, small_tmpfs, fmt):
    """The disk fills up during record: it stops, the file keeps every record written whole
    (text too), one error line says how many, exit 1."""
    prog = cbuild("record_storm")
    out = small_tmpfs / "full.trace"
    proc = run_pymtrace("record", "--json", "--format", fmt, "-o", out, "--", prog, 100000)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    m = re.fullmatch(
        r"pymtrace: error: cannot write (\S+): No space left on device; recording stopped, "
        r"(\d+) complete entries kept",
        lines[-1],
    )
    assert m and m.group(1) == str(out), proc.stderr
    kept = int(m.group(2))
    summary = json.loads(lines[-2])
    assert summary["entries"] == kept > 1000
    size = out.stat().st_size
    assert summary["bytes_written"] == size > 200 * 1024
    if fmt == "mtrace-bin":
        assert size % 64 == 0
        records = list(B.read_file(out))
        assert len(records) == kept
    else:
        text = out.read_text()
        assert text.startswith("= Start\n") and text.endswith("\n")
        events = [e for e in T.read_file(out) if e.op != "="]
        assert len(events) == kept  # malloc and free(non-NULL): one line each
        records = events
    # the storm's calls, in order, up to where the disk was full
    assert sum(1 for r in records if getattr(r, "size", 0) == 64) >= kept // 2 - 10


def test_record_force_onto_a_file_it_cannot_replace(cbuild):
    """--force -o onto a file that cannot be removed (/proc/version): one line, exit 1."""
    with _loop_target(cbuild) as target:
        proc = run_pymtrace("record", "--force", "-o", "/proc/version", "-p", target.pid)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["pymtrace: error: cannot create /proc/version: Operation not permitted"]
    assert os.path.exists("/proc/version")


def test_record_interposer_preloaded_after_an_exec(cbuild, tmp_path):
    """`record -- env LD_PRELOAD=libc_malloc_debug.so.0 PROG`: the debug library is loaded
    only by the program env execs; the program's calls still carry the program's own call
    sites (not the debug library's), as when LD_PRELOAD is set for the command directly."""
    import glob

    if not glob.glob("/usr/lib/*/libc_malloc_debug.so.0") + glob.glob("/lib*/libc_malloc_debug.so.0"):
        pytest.fail("glibc's libc_malloc_debug.so.0 is not installed")
    prog = cbuild("record_calls", "-no-pie")
    lo, hi = text_range(prog)
    out = tmp_path / "exec.trace"
    proc = run_pymtrace("record", "--json", "-o", out, "--", "env", "LD_PRELOAD=libc_malloc_debug.so.0", prog)
    assert proc.returncode == 0, proc.stderr
    truth = ground_truth(proc.stdout)
    assert len(truth) > 300
    records = list(B.read_file(out))
    # the program's own calls, record for record (by pointer alone, a block the program freed
    # and libc then handed to its own calloc, e.g. a new thread's, would count as the program's;
    # calls without a pointer, free(NULL), look the same from anyone: left out)
    expected = {t for t in truth if t[2] or t[3]}
    calls = [r for r in records if key(r) in expected]
    assert len(calls) >= len(expected) - 10  # (a failed posix_memalign never reaches glibc)
    wrong = [r for r in calls if not lo <= r.caller < hi]
    assert not wrong, f"{len(wrong)} of {len(calls)} calls attributed outside {prog}, e.g. {wrong[0]}"
    # the call sites are the program's: exactly the ones a direct LD_PRELOAD records
    direct = tmp_path / "direct.trace"
    env = dict(os.environ, LD_PRELOAD="libc_malloc_debug.so.0")
    proc2 = run_pymtrace("record", "-q", "-o", direct, "--", prog, env=env)
    assert proc2.returncode == 0, proc2.stderr
    sites = collections.Counter(r.caller for r in records if lo <= r.caller < hi)
    sites2 = collections.Counter(r.caller for r in B.read_file(direct) if lo <= r.caller < hi)
    assert sites == sites2
