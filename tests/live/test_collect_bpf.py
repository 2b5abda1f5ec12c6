"""`pymtrace record --to` into a real `pymtrace collect` on 127.0.0.1, with real BPF: exact
calls in the dataset, two recorders at once, the collector SIGKILLed and restarted during a
storm, the collector down for longer than the memory spool, TLS, a wrong token."""

import collections
import json
import os
import pathlib
import subprocess
import time

import duckdb
import pytest
from support.cli import PYMTRACE, run_pymtrace
from support.collect import CollectorProcess, client_config, token_file, type_counts
from support.recording import ground_truth, text_range

import pymtrace
from pymtrace.trace.formats import mtrace_bin as B
from pymtrace.trace.formats import parquet as P

pytestmark = pytest.mark.bpf


def summary_of(stderr):
    return json.loads(stderr.strip().splitlines()[-1])


def rows(directory, pid):
    return duckdb.sql(
        f"select thread, type, ptr1, ptr2, size, size2, size3, caller, time_ns from "
        f"read_parquet('{directory}/**/*.parquet', hive_partitioning=true) where pid = {pid}"
    ).fetchall()


def check_once(directory, summary):
    """The dataset holds exactly the records the recorder recorded, each once."""
    f = summary["files"][0]
    got = rows(directory, f["pid"])
    assert len(got) == f["entries"] == f["acknowledged"]
    assert len(set(got)) == len(got)  # time_ns and the pointers make every record distinct
    assert type_counts(directory, f"where pid = {f['pid']}") == {k: v for k, v in f["counts"].items() if v}


def test_record_to_collector_exact_calls_and_metadata(collector, cbuild):
    prog = cbuild("record_calls", "-no-pie")
    c = collector()
    proc = run_pymtrace("record", "--json", "--to", c.address, "--", prog)
    assert proc.returncode == 0, proc.stderr
    assert "over plain TCP (loopback only" not in proc.stderr  # --json: no progress lines
    summary = summary_of(proc.stderr)
    c.stop()
    check_once(c.directory, summary)
    pid = summary["files"][0]["pid"]
    lo, hi = text_range(prog)
    own = collections.Counter(
        (t, P.TYPE_NAMES.index(ty) + 1, p1, p2, s, s2, s3)
        for t, ty, p1, p2, s, s2, s3, caller, _ in rows(c.directory, pid)
        if lo <= caller < hi
    )
    assert own == collections.Counter(ground_truth(proc.stdout))
    part = next(pathlib.Path(c.directory).glob(f"host=*/date=*/pid={pid}/part-*.parquet"))
    meta = P.read_metadata(str(part))
    assert meta["pid"] == str(pid) and meta["libc_path"].startswith("/") and len(meta["libc_build_id"]) == 40
    assert meta["source_format"] == "record" and meta["start_time"][:10] in str(part)


def test_two_recorders_at_once(collector, cbuild):
    prog = cbuild("record_calls", "-no-pie")
    c = collector()
    procs = [
        subprocess.Popen(
            PYMTRACE + ["record", "--json", "--to", c.address, "--", prog],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    c.stop()
    summaries = [summary_of(err) for _, err in outs]
    assert len({s["files"][0]["pid"] for s in summaries}) == 2
    for s in summaries:
        check_once(c.directory, s)


class _Storm:
    """`record --json --to ADDRESS -- record_storm stdin`: the recorded program runs one storm of
    malloc(64)+free pairs each time `run` is called, so the test knows which calls were made
    before and after it breaks the collector, however fast the recording path is."""

    def __init__(self, cbuild, address, *extra):
        self.proc = subprocess.Popen(
            PYMTRACE + ["record", "--json", "--to", address, *extra, "--", cbuild("record_storm"), "stdin"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().startswith("ready "), self.proc.stderr.read()

    def run(self, pairs):
        """PAIRS pairs (and 1,000 warm-up pairs), returning when the program has made them."""
        self.proc.stdin.write(f"{pairs} 64\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip(), self.proc.stderr.read()

    def finish(self):
        self.proc.stdin.close()
        err = self.proc.stderr.read()
        self.proc.wait(timeout=180)
        assert self.proc.returncode == 0, err
        return summary_of(err), err


def test_collector_sigkilled_and_restarted_during_a_storm(collector, cbuild):
    c = collector()
    pairs = 500_000
    rec = _Storm(cbuild, c.address)
    rec.run(pairs)
    c.wait_connected()  # the recorder's stream is open (slow start-up under load is waited for)
    time.sleep(0.5)  # part of the first storm delivered
    c.kill()
    time.sleep(0.5)
    c.start()  # same port
    rec.run(pairs)  # this storm can only go through a second connection
    summary, err = rec.finish()
    c.stop()
    assert summary["lost"] == 0 and summary["files"][0]["connections"] >= 2, err
    check_once(c.directory, summary)
    storm = type_counts(c.directory, "where (type = 'malloc' and size = 64) or type = 'free'")
    assert storm["malloc"] >= 2 * pairs and storm["free"] >= 2 * pairs  # every call of both (libc adds a few)


def test_collector_down_longer_than_the_memory_spool(collector, cbuild):
    c = collector()
    c.stop()
    rec = _Storm(cbuild, c.address, "--spool-memory", "1M")
    rec.run(300_000)  # 38 MB of records; the memory spool holds 1 MiB
    time.sleep(2)  # the recorder drains the last of them into its spool
    c.start()
    summary, err = rec.finish()
    c.stop()
    f = summary["files"][0]
    assert f["spool_max_disk_bytes"] > 30 << 20 and f["spool_max_memory_bytes"] <= 1 << 20, f
    assert err.count("unreachable") == 1 and err.count("delivering again") == 1, err
    check_once(c.directory, summary)


def test_tls_and_basic_auth(collector, cbuild, tls_files, tmp_path):
    prog = cbuild("record_calls", "-no-pie")
    c = collector("--web-config", tls_files / "web.yml")
    cfg = tmp_path / "client.yml"
    cfg.write_text(
        f"tls_config:\n  ca_file: {tls_files / 'cert.pem'}\nbasic_auth:\n  username: prom\n  password: s3cret\n"
    )
    proc = run_pymtrace("record", "--to", c.address, "--web-config", cfg, "--", prog)
    assert proc.returncode == 0, proc.stderr
    assert "plain TCP" not in proc.stderr
    c.stop()
    assert "plain TCP" not in c.stderr
    n = len(ground_truth(proc.stdout))
    assert sum(type_counts(c.directory).values()) >= n


def test_wrong_token_refused_the_recording_kept_locally(collector, cbuild, tmp_path):
    prog = cbuild("record_calls", "-no-pie")
    c = collector("--token-file", token_file(tmp_path, "the-right-token-0123456789"))
    cfg = client_config(tmp_path / "client.yml", "a-wrong-token-0123456789")
    # run from TMP_PATH (the undelivered records are kept in the current directory), this pymtrace
    here = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(pymtrace.__file__))}
    proc = run_pymtrace(
        "record", "--to", c.address, "--web-config", cfg, "--send-timeout", "1", "--", prog, cwd=tmp_path, env=here
    )
    assert proc.returncode == 1
    assert proc.stderr.count("refused: credential rejected; spooling, retrying") == 1, proc.stderr
    assert "never acknowledged by the collector" in proc.stderr.splitlines()[-1]
    kept = next(tmp_path.glob("mtrace.out.*"))
    with open(kept, "rb") as f:
        records = [r for r in B.iter_records(f) if r.type != B.MAGIC_TYPE]
    assert len(records) >= len(ground_truth(proc.stdout))
    c.stop()
    assert c.stderr.count("rejected credential") >= 1
    assert not list((tmp_path / "ds").glob("host=*"))


def test_collector_disk_full_one_line_each_side_then_delivered(tmp_path, capsys):
    """A full dataset disk (a small tmpfs, root only): one line on each side, the recorder keeps
    spooling, and once there is space every record lands once. The recorder's sender is fed
    records directly (no BPF needed for this part)."""
    import numpy

    from pymtrace.net import protocol, sender

    ds = tmp_path / "ds"
    ds.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(ds)], check=True)
    c = None
    try:
        c = CollectorProcess(ds)
        n = 100_000
        recs = numpy.zeros(n, B.record_dtype("<"))
        recs["type"] = 1
        recs["ptr2"] = numpy.random.default_rng(1).integers(0, 1 << 60, n, dtype=numpy.uint64)  # incompressible
        recs["time_ns"] = numpy.arange(n)
        meta = P.file_metadata(pid=77, host="h", start_time="2026-11-24T00:00:00Z")
        out = sender.NetOutput(("127.0.0.1", c.port), protocol.ClientConfig(), 77, meta)
        out.write(recs.tobytes(), n)
        time.sleep(9)  # a part is due after 5 s; then a few retries
        assert out.spool.acked == 0
        subprocess.run(["mount", "-o", "remount,size=64m", str(ds)], check=True)
        out.close()
        assert out.finished
        c.stop()
        err = capsys.readouterr().err
        assert err.count("refused: disk full") == 1 and err.count("delivering again") == 1, err
        assert c.stderr.count("disk full: cannot write") == 1, c.stderr
        got = duckdb.sql(f"select count(*), count(distinct time_ns) from read_parquet('{ds}/**/*.parquet')").fetchall()
        assert got == [(n, n)]
    finally:
        if c is not None:
            c.close()
        subprocess.run(["umount", str(ds)], check=False)
