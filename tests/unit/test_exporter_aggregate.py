"""The exporter's aggregation (pymtrace.sinks.prometheus.Aggregator), without BPF or HTTP:
per-comm series summed over processes and monotonic through exit, exec, PID reuse and LRU
eviction; label-by-pid caps with "other"; comm/PID filters; label-by-cgroup."""

import os

from support.exporter import proc_entry

from pymtrace.sinks import prometheus
from pymtrace.tracee import proc


def test_series_keyed_by_comm_sum_processes_and_stay_monotonic_when_they_exit():
    t = [0.0]
    agg = prometheus.Aggregator(grace=60, alive=lambda pid: pid in alive)
    alive = {1, 2, 3}
    procs = {
        1: proc_entry(1, "web", malloc=10, requested=100, live=50),
        2: proc_entry(2, "web", malloc=5, requested=40, live=8),
        3: proc_entry(3, "db", malloc=7, requested=70, live=70),
    }
    agg.update(procs, now=t[0])
    s = agg.series()
    assert s["web"]["counters"][("calls", "malloc")] == 15
    assert s["web"]["counters"]["requested_bytes"] == 140
    assert s["web"]["gauges"]["live_bytes"] == 58
    assert s["db"]["counters"][("calls", "malloc")] == 7
    assert not any(lb.isdigit() for lb in s)  # never a PID label by default

    # pid 1 exits and leaves the source's map: its calls stay counted, its live bytes go
    alive.discard(1)
    del procs[1]
    procs[2] = proc_entry(2, "web", malloc=6, requested=50, live=8)
    agg.update(procs, now=1.0)
    s = agg.series()
    assert s["web"]["counters"][("calls", "malloc")] == 16
    assert s["web"]["counters"]["requested_bytes"] == 150
    assert s["web"]["gauges"]["live_bytes"] == 8

    # exec: pid 3 becomes "worker"; "db" keeps what it did, "worker" counts from there
    procs[3] = proc_entry(3, "worker", malloc=9, requested=90, live=70)
    agg.update(procs, now=2.0)
    s = agg.series()
    assert s["db"]["counters"][("calls", "malloc")] == 7
    assert s["worker"]["counters"][("calls", "malloc")] == 2

    # PID reuse: pid 2's counters restart from zero under the same comm -> no decrease
    procs[2] = proc_entry(2, "web", malloc=1, requested=10, live=10)
    agg.update(procs, now=3.0)
    assert agg.series()["web"]["counters"][("calls", "malloc")] == 17

    # everything of "web" gone: the series disappears after the grace period, not before
    alive.discard(2)
    del procs[2]
    agg.update(procs, now=4.0)
    assert "web" in agg.series()
    agg.update(procs, now=4.0 + 59)
    assert "web" in agg.series()
    agg.update(procs, now=4.0 + 61)
    assert "web" not in agg.series() and "db" not in agg.series()
    assert "worker" in agg.series()
    assert "web" not in agg.retired


def test_a_process_dropped_by_one_source_before_another_is_counted_once():
    alive = {1}
    agg = prometheus.Aggregator(alive=lambda pid: pid in alive)
    agg.update({1: {"pid": 1, "comm": "x", "calls": {"malloc": 3}, "faults_user": 5}}, now=0)
    alive.clear()
    # the fault source already forgot the exited process, the malloc source not yet
    agg.update({1: {"pid": 1, "comm": "x", "calls": {"malloc": 3}, "exited": True}}, now=1)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 3 and c["faults_user"] == 5
    agg.update({}, now=2)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 3 and c["faults_user"] == 5
    assert agg.pids == {}


def test_an_lru_evicted_entry_recreated_keeps_the_counters_monotonic():
    """The malloc map (LRU) evicted a live process's entry and re-created it at its next
    call: its malloc counters restart from 0, its fault counters (another map) do not.
    The series adds the restarted counters to what was counted before, and counts the
    faults once."""
    agg = prometheus.Aggregator(alive=lambda pid: True)
    agg.update(
        {1: {"pid": 1, "comm": "x", "calls": {"malloc": 100}, "requested_bytes": 1000, "faults_user": 50}}, now=0
    )
    # evicted from the malloc map: only the fault source reports it for a while
    agg.update({1: {"pid": 1, "comm": "x", "faults_user": 60}}, now=1)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 100 and c["faults_user"] == 60
    # re-created by its next calls: counted from 0 again, on top of the 100
    agg.update({1: {"pid": 1, "comm": "x", "calls": {"malloc": 4}, "requested_bytes": 40, "faults_user": 70}}, now=2)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 104 and c["requested_bytes"] == 1040 and c["faults_user"] == 70
    agg.update({1: {"pid": 1, "comm": "x", "calls": {"malloc": 9}, "requested_bytes": 90, "faults_user": 75}}, now=3)
    c = agg.series()["x"]["counters"]
    assert c[("calls", "malloc")] == 109 and c["requested_bytes"] == 1090 and c["faults_user"] == 75


def test_label_by_pid_is_capped_with_other_and_other_never_decreases():
    alive = set(range(1, 11))
    agg = prometheus.Aggregator(label_by="pid", max_series=3, grace=5, alive=lambda pid: pid in alive)
    procs = {p: proc_entry(p, "w", malloc=p * 10) for p in range(1, 11)}
    agg.update(procs, now=0)
    s = agg.series()
    assert set(s) == {"10", "9", "8", "other"}  # the three busiest get their own series
    assert s["other"]["counters"][("calls", "malloc")] == sum(p * 10 for p in range(1, 8))
    total = sum(v["counters"][("calls", "malloc")] for v in s.values())
    assert total == sum(p * 10 for p in range(1, 11))
    # pid 10 exits; after the grace period its place goes to a process from "other",
    # which continues from its current value while "other" keeps what it had
    alive.discard(10)
    del procs[10]
    prev_other = s["other"]["counters"][("calls", "malloc")]
    for p in procs:
        procs[p] = proc_entry(p, "w", malloc=p * 10 + 1)
    for now in (1, 3, 7, 8):
        agg.update(procs, now=now)
        s = agg.series()
        other = s["other"]["counters"][("calls", "malloc")]
        assert other >= prev_other
        prev_other = other
        assert len(s) <= 4
    assert "10" not in s and "7" in s


def test_a_label_expiring_as_new_processes_want_it_goes_on_without_restarting():
    """A wave of short-lived processes in "other" (or under one comm) exits; the next wave
    comes when the grace period has just passed. The label expires and is wanted again in
    the same update: it was never absent from a scrape, so it must not restart at 0 (a
    scraper sees 240 then 240 and cannot tell a reset; the churn test's 840 of 3,000 in the
    Debian VMs). A label absent from an update longer than the grace period does restart."""
    for max_series, label in ((1, "other"), (5, "job")):
        alive = set()  # changed in place below
        agg = prometheus.Aggregator(max_series=max_series, grace=3, alive=alive.__contains__)
        seen, base = [], 100
        for wave in range(3):
            pids = range(base + wave * 10, base + wave * 10 + 4)
            alive |= set(pids)
            procs = {p: proc_entry(p, "job", malloc=3) for p in pids}
            if label == "other":
                procs[1] = proc_entry(1, "big", malloc=1000)  # takes the one own series
                alive.add(1)
            agg.update(procs, now=wave * 5.0)
            seen.append(agg.series()[label]["counters"][("calls", "malloc")])
            alive -= set(pids)
            agg.update({p: dict(e, exited=True) for p, e in procs.items()}, now=wave * 5.0 + 0.5)
        assert seen == [12, 24, 36], (label, seen)
        assert agg.dropped_total == 0
        # gone for longer than the grace period, with no process wanting it: dropped
        agg.update({}, now=30.0)
        assert agg.series() == {} and agg.dropped_total == (2 if label == "other" else 1)  # "big" too


def test_comm_and_pid_filters():
    agg = prometheus.Aggregator(comm="^ngi", alive=lambda pid: True)
    agg.update({1: proc_entry(1, "nginx", malloc=1), 2: proc_entry(2, "bash", malloc=1)}, now=0)
    assert set(agg.series()) == {"nginx"}
    agg = prometheus.Aggregator(pids=[2], alive=lambda pid: True)
    agg.update({1: proc_entry(1, "nginx", malloc=1), 2: proc_entry(2, "bash", malloc=1)}, now=0)
    assert set(agg.series()) == {"bash"}


def test_label_by_cgroup():
    groups = {1: "/system.slice/nginx.service", 2: "/system.slice/nginx.service", 3: "/user.slice"}
    agg = prometheus.Aggregator(label_by="cgroup", alive=lambda pid: True, cgroup_of=groups.get)
    agg.update({p: proc_entry(p, "x", malloc=p) for p in groups}, now=0)
    s = agg.series()
    assert s["/system.slice/nginx.service"]["counters"][("calls", "malloc")] == 3
    assert s["/user.slice"]["counters"][("calls", "malloc")] == 3
    assert (proc.cgroup(os.getpid()) or "/").startswith("/")
