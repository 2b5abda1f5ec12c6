"""`pymtrace exporter` for real: BPF sources, a C workload with known calls, a real
Prometheus scraping every second, promtool on a live scrape, churn of 1,000 short-lived
processes, and glibc internals on the probe-carrying libc."""

import os
import signal
import subprocess
import time

import pytest
from support.cli import PYMTRACE
from support.prometheus import Prometheus, free_port, http_get, need_tool, parse_metrics, sample
from support.uprobes import ProbeWatch

pytestmark = pytest.mark.bpf

WORKLOAD_C = r"""
/* Exactly known malloc-API calls, then waits so Prometheus can scrape it alive.
 * argv[1]: comm to take. stdin lines drive it: "go" -> do the calls, "exit" -> exit.
 * Writes "ready\n" / "done\n" with write(2) (stdio would malloc its buffer). */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

static void say(const char *s) { if (write(1, s, strlen(s)) < 0) _exit(3); }
static void wait_for(const char *word)
{
    char buf[64]; size_t n = 0; char c;
    while (read(0, &c, 1) == 1) {
        if (c == '\n') { buf[n] = 0; if (!strcmp(buf, word)) return; n = 0; }
        else if (n < sizeof buf - 1) buf[n++] = c;
    }
    _exit(2);
}

int main(int argc, char **argv)
{
    prctl(PR_SET_NAME, argc > 1 ? argv[1] : "pmx-known");
    /* THP off: one fault per 4 KiB page, also where THP is "always" (stock Debian kernels:
     * 825 faults instead of >= 2048 in a Debian 12 VM, the 8 MiB block in 2 MiB pages) */
    prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
    say("ready\n");
    wait_for("go");
    static void *keep[1000];
    for (int i = 0; i < 1000; i++)           /* 1000 x malloc(100): bucket [64,127] */
        keep[i] = malloc(100);
    for (int i = 0; i < 500; i++)            /* 500 frees */
        free(keep[i]);
    void *c[200];
    for (int i = 0; i < 200; i++)            /* 200 x calloc(10, 300) = 3000 bytes: [2048,4095] */
        c[i] = calloc(10, 300);
    for (int i = 0; i < 200; i++)            /* 200 x realloc to 5000: [4096,8191] */
        c[i] = realloc(c[i], 5000);
    void *big = malloc(8 << 20);             /* 1 x 8 MiB, touched page by page */
    memset(big, 1, 8 << 20);
    void *m = memalign(64, 256);             /* 1 x memalign */
    void *p = 0;
    if (posix_memalign(&p, 4096, 1000))      /* 1 x posix_memalign */
        return 4;
    void *fail = malloc((size_t)1 << 62);    /* 1 x malloc that fails */
    if (fail)
        return 5;
    say("done\n");
    wait_for("exit");
    (void)m; (void)p; (void)big;
    return 0;
}
"""

CHURN_C = r"""
/* 1000 short-lived processes in waves: per wave, fork N children; each takes the name
 * churn<i>, does 3 mallocs and 3 frees, says so on a pipe, then blocks until the wave
 * ends. Once every child of the wave has made its calls (on an emulated CPU that can take
 * seconds after the forks), the parent says "wave" and waits for a line on stdin (the test
 * scrapes meanwhile), then ends the wave. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    int waves = atoi(argv[1]), per = atoi(argv[2]);
    prctl(PR_SET_NAME, "pmx-churner");   /* the parent is not one of the 1000 */
    for (int w = 0; w < waves; w++) {
        int fds[2], done[2];
        if (pipe(fds) || pipe(done)) return 1;
        for (int i = 0; i < per; i++) {
            pid_t pid = fork();
            if (pid == 0) {
                char name[16], c;
                close(fds[1]);
                close(done[0]);
                snprintf(name, sizeof name, "churn%d", w * per + i);
                prctl(PR_SET_NAME, name);
                void *a = malloc(10), *b = malloc(20), *d = malloc(30);
                free(a); free(b); free(d);
                if (write(done[1], "d", 1) != 1) _exit(4);
                while (read(fds[0], &c, 1) > 0) ;   /* until the parent closes the pipe */
                _exit(0);
            }
            if (pid < 0) return 1;
        }
        close(fds[0]);
        close(done[1]);
        for (int i = 0; i < per; i++) {   /* every child of the wave has made its calls */
            char c;
            if (read(done[0], &c, 1) != 1) return 5;
        }
        close(done[0]);
        if (write(1, "wave\n", 5) != 5) return 2;
        char line[8];
        if (!fgets(line, sizeof line, stdin)) return 3;
        close(fds[1]);
        while (wait(0) > 0) ;
    }
    return 0;
}
"""

GLIBC_C = r"""
/* mallopt(M_MMAP_THRESHOLD) and threads (extra arenas/heaps); waits on stdin. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

static pthread_barrier_t bar;
static void *worker(void *arg) { void *p = malloc(1000); pthread_barrier_wait(&bar); pthread_barrier_wait(&bar); free(p); return arg; }
static void say(const char *s) { if (write(1, s, strlen(s)) < 0) _exit(3); }
static void wait_line(void) { char c; while (read(0, &c, 1) == 1 && c != '\n') ; }

int main(void)
{
    prctl(PR_SET_NAME, "pmx-glibc");
    say("ready\n");
    wait_line();
    mallopt(M_MMAP_THRESHOLD, 200000);
    pthread_t t[3];
    pthread_barrier_init(&bar, 0, 4);
    for (int i = 0; i < 3; i++) pthread_create(&t[i], 0, worker, 0);
    pthread_barrier_wait(&bar);   /* all three hold their arenas */
    say("done\n");
    wait_line();
    pthread_barrier_wait(&bar);
    for (int i = 0; i < 3; i++) pthread_join(t[i], 0);
    return 0;
}
"""


def compile_c(tmp_path, name, source):
    if not need_tool("gcc"):
        return None
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    subprocess.run(["gcc", "-O1", "-fno-builtin", "-pthread", "-o", str(out), str(src)], check=True)
    return str(out)


class Exporter:
    """`pymtrace exporter` as a subprocess (the real CLI), ready when it says so."""

    def __init__(self, *args, port=None):
        self.port = port or free_port()
        self.proc = subprocess.Popen(
            PYMTRACE + ["exporter", "--listen", f"127.0.0.1:{self.port}", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.watch = ProbeWatch(self.proc.pid)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 120
        said = []
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            said.append(line)
            if "serving" in line:
                return
            if not line and self.proc.poll() is not None:
                break
        rc = self.stop()  # negative: killed by that signal
        raise AssertionError(
            f"exporter did not start (exit status {rc}): {''.join(said)}"
            f"{self.proc.stderr.read() if self.proc.stderr else ''}"
        )

    def scrape(self):
        status, _, body = http_get(self.url + "/metrics", timeout=30)
        assert status == 200
        return body.decode()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        return rc


class Workload:
    def __init__(self, argv):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.proc.stdout.readline().strip() == "ready"

    def send(self, word, expect=None):
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()
        if expect:
            assert self.proc.stdout.readline().strip() == expect

    def close(self):
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _uprobes_of(ex):
    """[(file, offset)] of the uprobes the running exporter EX holds (perf-event uprobes and
    tracefs uprobe_events), recorded in ex.watch for its check after exit."""
    return [(p["file"], p["offset"]) for p in ex.watch.sample()]


def test_real_prometheus_stores_the_exact_calls_of_a_workload(tmp_path):
    binary = compile_c(tmp_path, "pmx_known", WORKLOAD_C)
    promtool = need_tool("promtool")
    ex = Exporter("--per-call", "--comm", "^pmx-known$")
    prom = None
    w = None
    try:
        ex.watch.wait_attached(3)  # --per-call: the malloc-path uprobes, held while it runs
        prom = Prometheus(
            tmp_path, [{"job_name": "pymtrace", "static_configs": [{"targets": [f"127.0.0.1:{ex.port}"]}]}]
        )
        w = Workload([binary, "pmx-known"])
        w.send("go", expect="done")
        sel = 'comm="pmx-known"'

        def settled():
            got = prom.query(f'pymtrace_malloc_calls_total{{{sel}}}')
            calls = {dict(k)["call"]: v for k, v in got.items()}
            return calls if calls.get("posix_memalign") == 1 and calls.get("malloc") == 1002 else None

        calls = prom.wait_for(settled, timeout=60, what="the workload's calls in Prometheus")
        assert calls["malloc"] == 1000 + 1 + 1  # 1000 small, the 8 MiB block, the failed one
        assert calls["free"] == 500
        assert calls["calloc"] == 200
        assert calls["realloc"] == 200
        assert calls["memalign"] == 1
        assert calls["posix_memalign"] == 1
        assert calls.get("valloc", 0) == 0 and calls.get("pvalloc", 0) == 0

        def one(expr):
            got = prom.query(expr)
            assert len(got) == 1, (expr, got)
            return next(iter(got.values()))

        requested = 1000 * 100 + 200 * 3000 + 200 * 5000 + (8 << 20) + 256 + 1000 + (1 << 62)
        assert one(f"pymtrace_malloc_requested_bytes_total{{{sel}}}") == pytest.approx(requested, rel=1e-9)
        assert one(f"pymtrace_malloc_failures_total{{{sel}}}") == 1
        # live: 500 blocks of 100 still held, 200 reallocs of 5000, 8 MiB, memalign, posix_memalign,
        # in chunk bytes (usable size + header): at least the requested bytes of what is held
        live = one(f"pymtrace_malloc_live_bytes{{{sel}}}")
        held = 500 * 100 + 200 * 5000 + (8 << 20) + 256 + 1000
        assert held <= live <= held + 1000 * 64 + (1 << 16), live
        # size histogram: exact bucket counts (le = 2**i - 1)
        buckets = {
            float(dict(k)["le"]): v for k, v in prom.query(f"pymtrace_malloc_size_bytes_bucket{{{sel}}}").items()
        }
        assert buckets[63] == 0
        assert buckets[127] == 1000  # malloc(100)
        assert buckets[255] == 1000
        assert buckets[511] == 1001  # memalign(64, 256)
        assert buckets[1023] == 1002  # posix_memalign(.., 4096, 1000)
        assert buckets[2047] == 1002
        assert buckets[4095] == 1202  # calloc(10, 300)
        assert buckets[8191] == 1402  # realloc(.., 5000)
        assert buckets[16777215] == 1403  # malloc(8 MiB)
        assert buckets[float("inf")] in (1403, 1404), buckets  # the failed malloc(2**62), if counted by size
        assert one(f"pymtrace_malloc_size_bytes_count{{{sel}}}") == buckets[float("inf")]
        # page faults: touching 8 MiB page by page is at least 2048 user faults (4 KiB pages)
        faults = {dict(k)["mode"]: v for k, v in prom.query(f"pymtrace_page_faults_total{{{sel}}}").items()}
        assert faults["user"] >= 2048, faults
        # exporter self-metrics arrived too
        assert prom.query("pymtrace_exporter_bpf_program_runs_total > 0")
        assert prom.query("pymtrace_exporter_bpf_program_run_seconds_total > 0")  # kernel BPF stats are on
        assert prom.query('pymtrace_exporter_bpf_map_max_entries{map="ms_stats"}')
        assert all(v == 1 for v in prom.query("pymtrace_exporter_collector_up").values())
        # the filter really filters: no other comm
        assert {dict(k)["comm"] for k in prom.query("pymtrace_malloc_calls_total")} == {"pmx-known"}

        # promtool accepts a live scrape
        text = ex.scrape()
        r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True)
        assert r.returncode == 0, (r.stdout + r.stderr).decode()
    finally:
        if w:
            w.close()
        if prom:
            prom.stop()
        assert ex.stop() == 0
        ex.watch.assert_gone()


def test_churn_of_1000_processes_keeps_series_and_maps_bounded(tmp_path):
    """1,000 processes (10 waves of 100, each alive for a scrape, then gone): every malloc is
    counted exactly once across the series, there are never more than --max-series label
    values plus "other", the per-process BPF map shrinks back, and after the grace period
    the series of the gone processes disappear."""
    binary = compile_c(tmp_path, "churn", CHURN_C)
    ex = Exporter("--per-call", "--max-series", "20", "--grace", "3", "--comm", r"^churn\d+$")
    # label -> [finished segments, current value], as a Prometheus client sees a counter: a
    # series absent from a scrape ended; one that went down was reset
    totals = {}

    def observe():
        m = parse_metrics(ex.scrape())
        present = set()
        for (n, lb), v in m.items():
            if n == "pymtrace_malloc_calls_total" and dict(lb)["call"] == "malloc":
                present.add(dict(lb)["comm"])
                seg = totals.setdefault(dict(lb)["comm"], [0, 0])
                if v < seg[1]:
                    seg[0] += seg[1]
                seg[1] = v
        for label, seg in totals.items():
            if label not in present:
                seg[0], seg[1] = seg[0] + seg[1], 0
        return m

    try:
        before = observe()
        base_entries = sample(before, "pymtrace_exporter_bpf_map_entries", map="ms_stats")
        cap = sample(before, "pymtrace_exporter_bpf_map_max_entries", map="ms_stats")
        assert base_entries is not None and cap == 8192
        proc = subprocess.Popen([binary, "10", "100"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        max_labels = max_entries = 0
        for _wave in range(10):
            assert proc.stdout.readline().strip() == "wave"
            for _ in range(2):
                m = observe()
                labels = {dict(lb)["comm"] for (n, lb) in m if n == "pymtrace_malloc_calls_total"}
                max_labels = max(max_labels, len(labels))
                max_entries = max(max_entries, sample(m, "pymtrace_exporter_bpf_map_entries", map="ms_stats"))
            proc.stdin.write("next\n")
            proc.stdin.flush()
        assert proc.wait(60) == 0
        time.sleep(1.0)
        for _ in range(2):
            m = observe()
        assert max_labels <= 20 + 1, max_labels  # --max-series plus "other"
        assert max_entries <= cap
        # every malloc of the 1000 children counted exactly once, across all series
        odd = {k: v for k, v in totals.items() if v != [0, 3]}
        assert sum(a + b for a, b in totals.values()) == 3 * 1000, odd
        assert sample(m, "pymtrace_exporter_events_lost_total", cause="malloc_stats_full") == 0
        # the exited children's map entries are gone again, and the exporter forgot them
        entries = sample(m, "pymtrace_exporter_bpf_map_entries", map="ms_stats")
        assert entries <= base_entries + 100, (base_entries, max_entries, entries)
        assert sample(m, "pymtrace_exporter_processes") <= 5
        # after the grace period, the gone processes' series disappear
        time.sleep(4.0)
        observe()
        m = observe()
        labels = {dict(lb)["comm"] for (n, lb) in m if n == "pymtrace_malloc_calls_total"}
        assert labels == set(), labels
        assert sample(m, "pymtrace_exporter_series_labels") == 0
        assert sample(m, "pymtrace_exporter_series_dropped_total") >= 20
    finally:
        assert ex.stop() == 0


def test_label_by_pid_is_capped(tmp_path):
    binary = compile_c(tmp_path, "pmx_known", WORKLOAD_C)
    workloads = [Workload([binary, "pmx-pid"]) for _ in range(4)]
    ex = Exporter("--per-call", "--label-by", "pid", "--max-series", "2", "--comm", "^pmx-pid$")
    try:
        for w in workloads:
            w.send("go", expect="done")
        time.sleep(0.5)
        ex.scrape()
        m = parse_metrics(ex.scrape())
        got = {
            dict(lb)["pid"]: v
            for (n, lb), v in m.items()
            if n == "pymtrace_malloc_calls_total" and dict(lb)["call"] == "malloc"
        }
        assert len(got) == 3 and "other" in got, got
        assert sum(got.values()) == 4 * 1002
        pids = {str(w.proc.pid) for w in workloads}
        assert set(got) - {"other"} <= pids
    finally:
        for w in workloads:
            w.close()
        assert ex.stop() == 0


def test_always_on_has_faults_and_slab_but_no_malloc_series(tmp_path):
    binary = compile_c(tmp_path, "pmx_known", WORKLOAD_C)
    ex = Exporter("--always-on", "--comm", "^pmx-ao$")
    w = None
    try:
        w = Workload([binary, "pmx-ao"])
        w.send("go", expect="done")
        time.sleep(0.5)
        ex.scrape()
        m = parse_metrics(ex.scrape())
        assert sample(m, "pymtrace_page_faults_total", comm="pmx-ao", mode="user") >= 2048
        assert not [k for k in m if k[0].startswith("pymtrace_malloc_calls")]
        assert not [k for k in m if k[0] == "pymtrace_exporter_duty_cycle"]
        assert [k for k in m if k[0] == "pymtrace_slab_allocations_total"]
        info = [dict(lb) for (n, lb) in m if n == "pymtrace_exporter_build_info"]
        assert info and info[0]["mode"] == "always-on"
        assert not any("ms_stats" == dict(lb).get("map") for (n, lb) in m)
    finally:
        if w:
            w.close()
        assert ex.stop() == 0


def _malloc_path(libc_path):
    """{function: (first, end) file offsets} of the malloc-API entry points in LIBC_PATH."""
    from pymtrace.tracee import libc

    out = {}
    for name in ("malloc", "free", "calloc", "realloc"):
        sym = libc.symbol(libc_path, name)
        start = libc.file_offset(libc_path, sym.address)[0]
        out[name] = (start, start + max(sym.size, 1))
    return out


def _on_malloc_path(probes, libc_path, ranges):
    """The functions of RANGES that PROBES ([(file, offset)]) put a uprobe on."""
    hit = set()
    for path, off in probes:
        try:
            same = os.path.samefile(path, libc_path)
        except (OSError, TypeError):
            same = False
        if same:
            hit |= {name for name, (a, b) in ranges.items() if a <= off < b}
    return hit


def test_always_on_attaches_no_uprobe_on_the_malloc_path_and_per_call_does(tmp_path):
    """--always-on must not trap a malloc call; --per-call traps every one (the default,
    a budget, attaches them in windows: test_default_mode_estimates_malloc_rates_under_its_budget)."""
    from pymtrace.tracee import libc

    binary = compile_c(tmp_path, "pmx_known", WORKLOAD_C)
    w = Workload([binary, "pmx-mode"])
    try:
        libc_path = libc.process_libc(w.proc.pid)
        ranges = _malloc_path(libc_path)
        probe_free_libc = not libc.malloc_probes(libc_path)  # no USDT probes to attach either
        for args, mode in ((["--always-on"], "always-on"), (["--per-call"], "per-call")):
            ex = Exporter(*args, "-p", str(w.proc.pid))
            try:
                ours = _uprobes_of(ex)  # while it runs
                hit = _on_malloc_path(ours, libc_path, ranges)
                if mode == "per-call":
                    assert hit == set(ranges), (hit, ours)
                else:
                    assert hit == set(), (args, ours)
                    if probe_free_libc:
                        assert ours == [], (args, ours)
                m = parse_metrics(ex.scrape())
                info = [dict(lb) for (n, lb) in m if n == "pymtrace_exporter_build_info"]
                assert info and info[0]["mode"] == mode, info
            finally:
                assert ex.stop() == 0
            ex.watch.assert_gone()
    finally:
        w.close()


def test_default_mode_estimates_malloc_rates_under_its_budget(cbuild, tmp_path):
    """By default the exporter attaches the malloc uprobes of every process in windows under
    a 1 % budget: a workload making 500 mallocs a second (~5 us of work each, sleeping
    most of the time, under a VM's emulation too: it keeps its rate traced or not) gets estimated series within 25 % of
    the calls it counted itself, not saturated, the error and duty-cycle gauges, and a
    measured cost under the budget; no exact-count series. The host is kept busy by a shell
    loop the exporter does not trace (the budget is a share of the host's busy CPU time: on
    an idle emulated VM a window's attach and detach take minutes to earn)."""
    from support.top import Workload as PacedWorkload
    from support.top import private_libc

    calls = {"call": "malloc", "comm": "top_budget"}
    busy = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    w = PacedWorkload([cbuild("top_budget"), "steps", "15000", "500:600"], env=private_libc(tmp_path))
    ex = Exporter("--comm", "^top_budget$", "--window", "0.5")
    try:
        w.go()
        deadline = time.monotonic() + 300

        def scrape_after_windows(n):
            while True:
                m = parse_metrics(ex.scrape())
                windows = sample(m, "pymtrace_exporter_sampling_windows_total") or 0
                if windows >= n and sample(m, "pymtrace_malloc_calls_estimated_total", **calls):
                    return time.monotonic(), m
                said = {k[0]: v for k, v in m.items() if not k[1] and k[0].startswith("pymtrace_exporter_")}
                assert time.monotonic() < deadline, f"not {n} windows under the budget within 300 s: {said}"
                time.sleep(0.5)

        t0, m0 = scrape_after_windows(2)
        # over 5 s: the estimate grows at the pace the windows found, between windows too
        # (where windows are dear, perf-event uprobes under a VM's emulation, none may come)
        time.sleep(5)
        t1, m1 = scrape_after_windows(2)
        w.go()  # ends its steps: its own count over them
        exact = w.result(timeout=60)["steps"][0]
        exact_rate = exact["calls"] / (exact["end"] - exact["start"])
        estimated = [sample(m, "pymtrace_malloc_calls_estimated_total", **calls) for m in (m0, m1)]
        rate = (estimated[1] - estimated[0]) / (t1 - t0)
        assert abs(rate - exact_rate) <= 0.25 * exact_rate, (rate, exact_rate)
        assert 0 < sample(m1, "pymtrace_malloc_estimate_error_ratio", comm="top_budget") < 1
        assert sample(m1, "pymtrace_malloc_estimate_saturated_processes", comm="top_budget") == 0
        assert sample(m1, "pymtrace_exporter_overhead_budget_ratio") == 0.01
        assert 0 < sample(m1, "pymtrace_exporter_duty_cycle") < 1
        assert sample(m1, "pymtrace_exporter_overhead_ratio") <= 0.02  # a window's misprediction on a busy host
        assert not [k for k in m1 if k[0] == "pymtrace_malloc_calls_total"]
        info = [dict(lb) for (n, lb) in m1 if n == "pymtrace_exporter_build_info"]
        assert info and info[0]["mode"] == "budget"
    finally:
        busy.kill()
        busy.wait()
        w.kill()
        assert ex.stop() == 0
    ex.watch.assert_gone()


def test_glibc_internals_from_usdt_probes(tmp_path, sdt_libc):
    prefix, _libc_path = sdt_libc
    binary = compile_c(tmp_path, "pmx_glibc", GLIBC_C)
    w = Workload(prefix + [binary])  # started first: its libc is mapped when probes attach
    ex = Exporter("--always-on", "--comm", "^pmx-glibc$")
    try:
        w.send("go", expect="done")
        deadline = time.time() + 20
        while True:
            m = parse_metrics(ex.scrape())
            if sample(m, "pymtrace_glibc_mmap_threshold_bytes", comm="pmx-glibc") == 200000 or time.time() > deadline:
                break
            time.sleep(0.5)
        assert sample(m, "pymtrace_glibc_mmap_threshold_bytes", comm="pmx-glibc") == 200000
        assert sample(m, "pymtrace_glibc_arenas", comm="pmx-glibc") >= 2
        assert sample(m, "pymtrace_glibc_heaps", comm="pmx-glibc") >= 1
        assert sample(m, "pymtrace_glibc_heap_bytes", comm="pmx-glibc") > 0
        assert sample(m, "pymtrace_glibc_arena_lock_waits_total", comm="pmx-glibc") is not None
    finally:
        w.send("x")
        w.close()
        assert ex.stop() == 0
