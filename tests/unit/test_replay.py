"""`pymtrace replay` and the native simulator on hand-built traces with known results, the
allocator/tunable/mallopt/trim configurations, failures per row, plots, the simulator's build
cache (tests/live/test_replay_bpf.py: what needs root or BPF)."""

import json
import os
import subprocess

import pytest
from support.cli import run_pymtrace
from support.paths import WORKLOADS
from support.replay import SIM_TIMEOUT, SINGLE, A, B, R, lib_for, only_result, replay_json, write_trace

from pymtrace.errors import PymtraceError
from pymtrace.trace.formats import mtrace_bin as mb
from pymtrace.trace.formats import wl


@pytest.mark.parametrize("sync", ["futex", "mutex"])
def test_counts_ideal_rss_and_null_results(tmp_path, sync):
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    doc = replay_json(trace, "--sync", sync)
    assert doc["converted"]["ideal_rss_bytes"] == 2020  # the converter's, in trace order
    r = only_result(doc)
    calls = r["calls"]
    got = {k: (v["count"], v["skipped"]) for k, v in calls.items()}
    assert got == {
        "malloc": (2, 1),
        "calloc": (1, 0),
        "realloc": (1, 0),
        "memalign": (1, 1),
        "valloc": (1, 0),
        "pvalloc": (1, 0),
        "free": (7, 0),
    }
    assert r["ideal_rss_peak_bytes"] == 2020 and r["ideal_rss_end_bytes"] == 0
    assert r["threads"] == 1 and r["sync"] == sync
    assert r["unit"] in ("cycles", "ns") and r["timer"] in ("rdtscp", "clock_gettime")
    for c in calls.values():
        if c["count"]:
            assert c["min"] <= c["p50"] <= c["p99"] <= c["max"] and c["total"] >= c["max"]
    assert r["rss_samples"] and r["max_rss_kb"] >= r["max_rss_start_kb"] > 0


def ping_pong(n, size=48):
    """A allocates one address, B frees it, A gets it back...: fully serialised handoffs."""
    recs = []
    for _i in range(n):
        recs += [R(A, mb.MALLOC, 0, 0x1000, size), R(B, mb.FREE, 0x1000)]
    return recs


@pytest.mark.parametrize("sync", ["futex", "mutex"])
def test_cross_thread_frees_in_order_without_deadlock(tmp_path, sync):
    n = 3000
    trace = write_trace(tmp_path / "pp.trace", ping_pong(n))
    wl_path = tmp_path / "pp.wl"
    run_pymtrace("workload", trace, "-o", wl_path, check=True)
    parsed = wl.read_file(wl_path)
    nsync_r = sum(1 for ops in parsed.threads for op, _, _ in ops if op == wl.SYNC_R)
    assert nsync_r == 2 * n  # B's start + one before every call but A's first
    r = only_result(replay_json(wl_path, "--sync", sync, "--timeout", "100"))
    assert r["calls"]["malloc"]["count"] == n and r["calls"]["free"]["count"] == n
    assert r["handoffs"] == nsync_r
    # in order: every free saw its block (a free before its malloc would free NULL and leave
    # the block live, so the ideal RSS would grow past one block)
    assert r["ideal_rss_peak_bytes"] == 48 and r["ideal_rss_end_bytes"] == 0
    assert r["slot_overwrites"] == 0


def test_text_report_upstream_style(tmp_path):
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    proc = run_pymtrace("replay", trace, "--text", timeout=SIM_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in (
        "usec wall time",
        "Kb Max RSS (",
        "Kb Max Ideal RSS",
        "sizeof ticks_t is 8",
        "Avg malloc time:",
        "Avg free time:",
        "Total call time:",
        "cross-thread handoffs",
    ):
        assert line in out, line
    assert "1 Kb Max Ideal RSS" in out  # 2020 bytes


def test_allocators_side_by_side_and_failures_in_rows(tmp_path, build_dir):
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    crash_so = build_dir / "replay_crash_alloc.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(crash_so), str(WORKLOADS / "replay_crash_alloc.c")], check=True
    )
    names = ["glibc"] + [n for n in ("jemalloc", "tcmalloc", "mimalloc") if lib_for(n)]
    args = []
    for n in names + ["/nonexistent/libfoo.so", str(crash_so)]:
        args += ["--allocator", n]
    doc = replay_json(trace, *args)
    rows = {c["configuration"]: c for c in doc["configurations"]}
    for n in names:
        assert rows[n]["error"] is None, rows[n]["error"]
        r = rows[n]["result"]
        assert r["calls"]["free"]["count"] == 7
        if n != "glibc":  # the simulator really mapped that allocator
            assert r["allocator_library"] == lib_for(n)
            assert lib_for(n) in {os.path.realpath(p) for p in r["libraries"]}
    assert "library not found" in rows["/nonexistent/libfoo.so"]["error"]
    assert rows[str(crash_so)]["error"].startswith("crashed: SIGSEGV")
    # the table: a row per configuration, the failures in theirs
    proc = run_pymtrace("replay", trace, *args, timeout=SIM_TIMEOUT)
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 + len(names) + 2
    assert any(line.startswith("/nonexistent/libfoo.so") and "library not found" in line for line in lines)
    assert any("crashed: SIGSEGV" in line for line in lines)


def test_jemalloc_lacking_pvalloc_is_emulated_not_mixed(tmp_path):
    if not lib_for("jemalloc"):
        pytest.skip("jemalloc not installed")
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    r = only_result(replay_json(trace, "--allocator", "jemalloc"))
    assert "pvalloc" in r["emulated"].split()
    assert r["calls"]["pvalloc"]["count"] == 1


def test_repeat_trim_mallopt(tmp_path):
    recs = []
    for i in range(100):
        recs.append(R(A, mb.MALLOC, 0, 0x1000 + 16 * i, 32))
    trace = write_trace(tmp_path / "m.trace", recs)
    r = only_result(
        replay_json(
            trace,
            "--repeat",
            "3",
            "--trim-interval",
            "30",
            "--mallopt",
            "M_MMAP_THRESHOLD=65536",
            "--allocator",
            "glibc:M_TOP_PAD=0",
        )
    )
    assert r["runs"] == 3
    assert r["calls"]["malloc_trim"]["count"] == 3  # after calls 30, 60, 90
    assert [(m["name"], m["value"], m["result"]) for m in r["mallopt"]] == [
        ("M_MMAP_THRESHOLD", 65536, 1),
        ("M_TOP_PAD", 0, 1),
    ]


def test_tunable_and_mallopt_change_behaviour(tmp_path):
    """With mmap_threshold 4096, 400 live 5000-byte blocks each take an 8 KiB mapping."""
    recs = [R(A, mb.MALLOC, 0, 0x100000 + 0x2000 * i, 5000) for i in range(400)]
    trace = write_trace(tmp_path / "big.trace", recs)
    doc = replay_json(
        trace,
        "--allocator",
        "glibc",
        "--allocator",
        "glibc:glibc.malloc.mmap_threshold=4096",
        "--allocator",
        "glibc:M_MMAP_THRESHOLD=4096",
    )
    plain, tun, mal = (c["result"] for c in doc["configurations"])
    assert plain["anon_rss_peak_kb"] + 800 < tun["anon_rss_peak_kb"]
    assert plain["anon_rss_peak_kb"] + 800 < mal["anon_rss_peak_kb"]
    assert plain["ideal_rss_peak_bytes"] == tun["ideal_rss_peak_bytes"] == 400 * 5000


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_plot(tmp_path, ext):
    pytest.importorskip("matplotlib")
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    out = tmp_path / f"cmp.{ext}"
    proc = run_pymtrace(
        "replay", trace, "--allocator", "glibc", "--allocator", "/missing.so", "--plot", out, timeout=SIM_TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    if ext == "png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    else:
        assert b"<svg" in data and b"RSS over time" in data and b"cost per call type" in data


def test_plot_output_is_safe(tmp_path):
    """--plot: an existing file is refused before replaying (even a symlink, never followed);
    --force replaces the link itself; the image is 0600."""
    pytest.importorskip("matplotlib")
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "cmp.svg"
    out.symlink_to(victim)
    proc = run_pymtrace("replay", trace, "--plot", out, timeout=SIM_TIMEOUT)
    assert proc.returncode == 1 and proc.stdout == ""  # refused before any replay
    assert proc.stderr.strip() == f"pymtrace: error: {out} exists; choose another file or use --force"
    assert victim.read_text() == "precious"
    proc = run_pymtrace("replay", trace, "--plot", out, "--force", timeout=SIM_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == "precious" and not out.is_symlink() and b"<svg" in out.read_bytes()
    assert out.stat().st_mode & 0o777 == 0o600
    noext = tmp_path / "plainname"
    run_pymtrace("replay", trace, "--plot", noext, check=True, timeout=SIM_TIMEOUT)
    assert noext.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and noext.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.svg", "plainname", "single.trace", "victim"]


def test_corrupt_workload_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.wl"
    bad.write_bytes(wl.build(4, 4, [wl.encode_op(wl.SYNC_R, 2) + b"\x01"]))
    proc = run_pymtrace("replay", bad, timeout=SIM_TIMEOUT)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"pymtrace: error: {bad}: deadlock: thread 0 waits at byte 9 for sync id 2 "
        f"(never written); 1 of 1 threads can never finish"
    )


def test_no_compiler_is_a_clear_error(tmp_path):
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    env = dict(os.environ, CC="no-such-cc-for-pymtrace", PYMTRACE_CACHE_DIR=str(tmp_path / "cache"))
    proc = run_pymtrace("replay", trace, env=env, timeout=SIM_TIMEOUT)
    assert proc.returncode == 1
    assert "needs a C compiler" in proc.stderr and "Traceback" not in proc.stderr


def test_simulator_built_once_into_hash_keyed_cache(tmp_path):
    env = dict(os.environ, PYMTRACE_CACHE_DIR=str(tmp_path / "cache"))
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    run_pymtrace("replay", trace, env=env, check=True, timeout=SIM_TIMEOUT)
    built = list((tmp_path / "cache" / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("pymtrace-replay-")
    mtime = built[0].stat().st_mtime_ns
    run_pymtrace("replay", trace, env=env, check=True, timeout=SIM_TIMEOUT)
    assert built[0].stat().st_mtime_ns == mtime


def test_simulator_build_never_writes_through_a_planted_symlink(tmp_path, monkeypatch):
    """The build goes to a private directory and is renamed into place: a symlink at a
    guessable temporary name (EXE.tmpPID) is not followed."""
    from pymtrace.replay import runner as replay

    monkeypatch.setenv("PYMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    exe = replay.simulator_path()
    os.unlink(exe)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted = tmp_path / "cache" / "native" / f"{os.path.basename(exe)}.tmp{os.getpid()}"
    planted.symlink_to(victim)
    assert replay.simulator_path() == exe
    assert victim.read_text() == "precious" and planted.is_symlink()
    assert os.stat(exe).st_mode & 0o777 == 0o700
    assert sorted(os.listdir(os.path.dirname(exe))) == sorted([os.path.basename(exe), planted.name])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mallopt", "M_BOGUS=1"], "is not M_NAME=VALUE with M_NAME one of"),
        (["--mallopt", "M_TOP_PAD=x"], "'x' is not a number"),
        (["--tunable", "malloc.arena_max=1"], "is not glibc.NAMESPACE.NAME=VALUE"),
        (["--allocator", "glibc:foo=1"], "unknown setting 'foo=1'"),
        (["--allocator", "glibc:trim=abc"], "--allocator glibc:trim=abc: trim=N needs a number of calls, not 'abc'"),
        (["--allocator", "glibc:trim=" + "9" * 5000], "trim=N needs a number of calls"),
        (["--allocator", "nosuchmalloc"], None),
        (["--repeat", "0"], "--repeat must be at least 1"),
    ],
)
def test_bad_settings(tmp_path, args, message):
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    proc = run_pymtrace("replay", trace, *args, timeout=SIM_TIMEOUT)
    if message is None:  # an unknown allocator name fails its row only
        assert proc.returncode == 1 and "unknown allocator 'nosuchmalloc'" in proc.stdout
        return
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_hanging_allocator_is_caught(tmp_path, build_dir):
    from pymtrace.replay import runner as replay

    hang_so = build_dir / "replay_hang_alloc.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(hang_so), str(WORKLOADS / "replay_hang_alloc.c")], check=True
    )
    data = wl.build(
        4,
        3,
        [
            wl.encode_op(wl.MALLOC, 1, 64) + wl.encode_op(wl.SYNC_W, 1) + wl.encode_op(wl.MALLOC, 2, 12345) + b"\x01",
            wl.encode_op(wl.SYNC_R, 1) + wl.encode_op(wl.FREE, 1) + b"\x01",
        ],
    )
    path = tmp_path / "hang.wl"
    path.write_bytes(data)
    proc = subprocess.run(
        [replay.simulator_path(), "--stall-timeout", "1", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, LD_PRELOAD=str(hang_so)),
    )
    assert proc.returncode == 3
    assert "replay stalled: no thread made progress for" in proc.stderr
    doc = replay_json(path, "--allocator", str(hang_so), "--allocator", "glibc", "--timeout", "3")
    hung, ok = doc["configurations"]
    assert hung["error"] == "timed out after 3 s"
    assert ok["error"] is None and ok["result"]["calls"]["malloc"]["count"] == 2


def test_clock_gettime_fallback_is_said(tmp_path):
    trace = write_trace(tmp_path / "single.trace", SINGLE)
    r = only_result(replay_json(trace, "--timer", "clock"))
    assert r["timer"] == "clock_gettime" and r["unit"] == "ns"
    assert r["calls"]["malloc"]["count"] == 2 and r["calls"]["malloc"]["min"] > 0
    proc = run_pymtrace("replay", trace, "--timer", "clock", "--text", timeout=SIM_TIMEOUT)
    assert "ns (no RDTSCP: clock_gettime)" in proc.stdout
    assert "clock_gettime(CLOCK_MONOTONIC), no RDTSCP" in proc.stdout


def test_max_rss_excludes_the_workload_file(tmp_path):
    """Max RSS (VmHWM) leaves out the mapped .wl (which would otherwise dominate it: a 154 MB
    workload would show 158-163 MB for every allocator against a real peak of 21-30 MB). A
    48 MB workload of ops that allocate little shows a Max RSS far below its size."""
    chunk = b"\x00" * 4000 + wl.encode_op(wl.MALLOC, 1, 64) + wl.encode_op(wl.FREE, 1)
    stream = chunk * 12000 + b"\x01"
    path = tmp_path / "big.wl"
    path.write_bytes(wl.build(4, 1, [stream]))
    size_kb = path.stat().st_size // 1024
    assert size_kb > 45 << 10
    r = only_result(replay_json(path))
    assert r["calls"]["malloc"]["count"] == 12000
    assert r["max_rss_kb"] < size_kb / 4, (r["max_rss_kb"], size_kb)
    assert r["max_rss_reset"] is True
    proc = run_pymtrace("replay", path, timeout=SIM_TIMEOUT)
    assert "Max RSS KiB (no .wl)" in proc.stdout.splitlines()[0]


def test_timeout_covers_validation(tmp_path):
    """`replay --timeout` bounds the validation (`--check`) of the workload too."""
    stream = b"\x00" * (1 << 20) + b"\x01"
    path = tmp_path / "w.wl"
    path.write_bytes(wl.build(4, 1, [stream] * 64))
    proc = run_pymtrace("replay", path, "--timeout", "0.001", timeout=SIM_TIMEOUT)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"pymtrace: error: {path}: validating the workload took more than --timeout 0.001 s"
    ), proc.stderr


@pytest.mark.parametrize(
    "installed", [["libmimalloc.so.2"], ["libmimalloc.so.3"], ["libmimalloc.so.3", "libmimalloc.so.2"]]
)
def test_mimalloc_2_or_3_is_mimalloc(tmp_path, monkeypatch, installed):
    """Debian 12 ships libmimalloc.so.2, Debian 13 libmimalloc.so.3: either is `mimalloc`
    (.so.2 first when both are there, as before)."""
    from pymtrace.replay import runner

    libs = {}
    for name in installed:
        (tmp_path / name).write_bytes(b"")
        libs[name] = str(tmp_path / name)
    monkeypatch.setattr(runner, "_ldconfig", lambda: libs)
    want = "libmimalloc.so.2" if "libmimalloc.so.2" in installed else "libmimalloc.so.3"
    assert runner.find_library("mimalloc") == os.path.realpath(libs[want])
    monkeypatch.setattr(runner, "_ldconfig", dict)
    with pytest.raises(
        PymtraceError, match=r"libmimalloc\.so\.2 / libmimalloc\.so\.3 / libmimalloc\.so not in ldconfig"
    ):
        runner.find_library("mimalloc")


def test_mimalloc_installed_here_is_found():
    """The machine's own mimalloc (either soname), as ldconfig lists it, is the one replayed."""
    from pymtrace.replay import runner

    here = [n for n in ("libmimalloc.so.2", "libmimalloc.so.3") if n in runner._ldconfig()]
    if not here:
        pytest.skip("neither libmimalloc.so.2 nor libmimalloc.so.3 is installed")
    assert lib_for("mimalloc") == os.path.realpath(runner._ldconfig()[here[0]])


def test_a_trace_from_another_allocator_is_replayed_against_it_by_default(tmp_path):
    """A trace naming its allocator (record -p on a jemalloc process: the MAGIC record's size3)
    is replayed against glibc and that allocator without --allocator; dump says it too."""
    if not lib_for("jemalloc"):
        pytest.skip("jemalloc not installed")
    trace = tmp_path / "je.trace"
    trace.write_bytes(mb.magic_record(SINGLE[0].thread, allocator="jemalloc") + b"".join(mb.pack(r) for r in SINGLE))
    proc = run_pymtrace("replay", trace, "--json", timeout=SIM_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [c["configuration"] for c in doc["configurations"]] == ["glibc", "jemalloc"]
    assert "recorded from jemalloc" in proc.stderr and "--allocator" in proc.stderr
    stats = json.loads(run_pymtrace("dump", "--stats", "--json", trace, check=True).stdout)["stats"]
    assert stats["allocator"] == "jemalloc"
    assert "recorded from jemalloc" in run_pymtrace("dump", "--stats", trace, check=True).stdout
    # an explicit --allocator is what runs; a trace naming none (glibc) stays glibc only
    assert [c["configuration"] for c in replay_json(trace, "--allocator", "glibc")["configurations"]] == ["glibc"]
    plain = write_trace(tmp_path / "plain.trace", SINGLE)
    assert [c["configuration"] for c in replay_json(plain)["configurations"]] == ["glibc"]
