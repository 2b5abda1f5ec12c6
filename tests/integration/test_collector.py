"""`pymtrace collect` against the recorder's network sink (pymtrace.net.sender) without BPF:
a real collector process, synthetic records of known content, every fault the protocol must
survive (collector SIGKILLed and restarted, down longer than the memory spool), refusals
(token, version) and pre-authentication limits, TLS; the dataset read by DuckDB and Spark."""

import json
import os
import socket
import stat
import threading
import time

import duckdb
import numpy
import pyarrow.parquet as pq
import pytest
from support.collect import client_config, parts, token_file, type_counts

from pymtrace.net import protocol, sender
from pymtrace.trace.formats import mtrace_bin
from pymtrace.trace.formats import parquet as P


def records(n, start=0):
    """N records: types cycle malloc, calloc, free, realloc; ptr2 = offset (unique)."""
    recs = numpy.zeros(n, mtrace_bin.record_dtype("<"))
    offsets = numpy.arange(start, start + n, dtype=numpy.uint64)
    recs["type"] = (offsets % 4 + 1).astype(numpy.uint32)
    recs["ptr2"] = offsets
    recs["thread"] = 7
    recs["time_ns"] = offsets + 1
    return recs


def open_sender(port, pid=4242, memory=64 << 20, config=None, close_wait=20.0):
    meta = P.file_metadata(pid=pid, host="testhost", start_time="2026-11-24T10:00:00Z", page_size=4096)
    return sender.NetOutput(
        ("127.0.0.1", port), config or protocol.ClientConfig(), pid, meta, memory, quiet=True, close_wait=close_wait
    )


def send(out, n, batch=5000, pause=0.0):
    for start in range(0, n, batch):
        k = min(batch, n - start)
        out.write(records(k, start).tobytes(), k)
        if pause:
            time.sleep(pause)


def check_exactly_once(directory, n):
    rows = duckdb.sql(
        f"select count(*), count(distinct ptr2), min(ptr2), max(ptr2) "
        f"from read_parquet('{directory}/**/*.parquet', hive_partitioning=true)"
    ).fetchall()[0]
    assert rows == (n, n, 0, n - 1)


def test_exact_records_partitions_and_metadata(collector, tmp_path):
    c = collector()
    out = open_sender(c.port)
    send(out, 100_000)
    out.close()
    assert out.summary()["acknowledged"] == 100_000 and out.finished
    c.stop()
    files = parts(c.directory)
    assert files and all(f.startswith("host=") and "/date=2026-11-24/pid=4242/part-" in f for f in files)
    check_exactly_once(c.directory, 100_000)
    assert type_counts(c.directory) == {"malloc": 25_000, "calloc": 25_000, "free": 25_000, "realloc": 25_000}
    hive = duckdb.sql(
        f"select distinct date, pid from read_parquet('{c.directory}/**/*.parquet', hive_partitioning=true)"
    ).fetchall()
    assert [(str(d), p) for d, p in hive] == [("2026-11-24", 4242)]
    path = os.path.join(c.directory, files[0])
    meta = P.read_metadata(path)
    assert meta["pid"] == "4242" and meta["page_size"] == "4096" and meta["first_offset"] == "0"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # the parts read back as the same records (pymtrace's own reader)
    back = numpy.concatenate([numpy.concatenate(list(P.iter_arrays(os.path.join(c.directory, f)))) for f in files])
    assert back.tobytes() == records(100_000).tobytes()


def test_collector_killed_and_restarted_every_record_once(collector):
    c = collector()
    out = open_sender(c.port)
    n = 400_000
    t = threading.Thread(target=send, args=(out, n, 2000, 0.0005))
    t.start()
    for _ in range(3):
        time.sleep(0.4)
        c.kill()  # SIGKILL: whatever was not in a renamed part is lost there, and resent
        time.sleep(0.3)
        c.start()
    t.join()
    out.close()
    assert out.finished and out.summary()["connections"] >= 2
    c.stop()
    check_exactly_once(c.directory, n)
    assert not [f for _, _, fs in os.walk(c.directory) for f in fs if f.endswith(".inprogress")]
    assert len(parts(c.directory)) == 1  # at END the collector merged the stream's parts


def test_parts_of_a_stream_compacted_at_its_end(collector):
    """More records than a part holds (collector.PART_ROWS): two parts, one file after END."""
    from pymtrace.net.collector import PART_ROWS

    c = collector()
    out = open_sender(c.port)
    n = PART_ROWS // 50_000 * 50_000 + 50_000 + 1000  # the part closes at the DATA crossing PART_ROWS
    send(out, n, 50_000)
    out.close()
    c.stop()
    (part,) = parts(c.directory)
    meta = P.read_metadata(os.path.join(c.directory, part))
    assert meta["compacted_parts"] == "2" and meta["first_offset"] == "0" and meta["pid"] == "4242"
    check_exactly_once(c.directory, n)


def test_collector_down_longer_than_the_memory_spool(collector):
    c = collector()
    port = c.port
    c.stop()
    out = open_sender(port, memory=256 << 10)
    send(out, 50_000)  # 3.2 MB, the memory spool holds 256 KiB: the rest goes to disk
    spool = out.spool
    assert spool.max_disk_bytes > 0 and spool.memory_bytes <= 256 << 10
    assert stat.S_IMODE(os.stat(spool.disk_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(spool.disk_dir).st_mode) == 0o700
    c.start()  # same port
    out.close()
    assert out.finished
    c.stop()
    check_exactly_once(c.directory, 50_000)
    assert not os.path.exists(spool.disk_dir)  # the spool is removed once delivered


def test_wrong_token_refused_on_both_sides_and_recorder_keeps_spooling(collector, tmp_path, capsys, monkeypatch):
    c = collector("--token-file", token_file(tmp_path, "correct-horse-battery-staple"))
    bad = client_config(tmp_path / "bad.yml", "wrong-token-0123456789")
    out = open_sender(c.port, config=protocol.load_client_config(str(bad)), close_wait=0.5)
    send(out, 1000)
    time.sleep(0.5)
    monkeypatch.chdir(tmp_path)  # the undelivered records are kept here
    with pytest.raises(Exception, match="1000 entries never acknowledged.*kept in mtrace.out.4242"):
        out.close()
    err = capsys.readouterr().err
    assert err.count("credential rejected") == 1, err  # one line, not one per retry
    with open(tmp_path / "mtrace.out.4242", "rb") as f:
        kept = [r for r in mtrace_bin.iter_records(f) if r.type != mtrace_bin.MAGIC_TYPE]
    assert [r.ptr2 for r in kept] == list(range(1000))
    good = tmp_path / "good.yml"
    good.write_text("authorization:\n  credentials_file: token\n")
    ok = open_sender(c.port, config=protocol.load_client_config(str(good)))
    send(ok, 1000)
    ok.close()
    c.stop()
    assert "rejected credential" in c.stderr
    check_exactly_once(c.directory, 1000)


def test_version_mismatch_one_line_each_side(collector):
    c = collector()
    with socket.create_connection(("127.0.0.1", c.port)) as s:
        s.sendall(protocol.hello_frame({"stream": "0" * 32}, version=99))
        kind, payload = protocol.recv_frame(s)
    assert kind == protocol.REFUSED
    doc = json.loads(payload)
    assert doc["code"] == "version" and "version mismatch" in doc["message"]
    c.stop()
    assert "protocol version 99 (this collector: 1)" in c.stderr


def test_connection_cap_and_garbage_before_authentication(collector):
    c = collector("--max-connections", "2")
    idle = [socket.create_connection(("127.0.0.1", c.port)) for _ in range(2)]
    time.sleep(0.3)
    with socket.create_connection(("127.0.0.1", c.port)) as third:
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""  # the oldest connection still before its HELLO made room
        third.sendall(protocol.HEADER.pack(protocol.HELLO, 1 << 30))  # a 1 GiB HELLO: refused unread
        kind, payload = protocol.recv_frame(third)
        assert kind == protocol.REFUSED and json.loads(payload)["code"] == "bad"
    for s in idle:
        s.close()


def test_tls_and_basic_auth(collector, tls_files, tmp_path):
    c = collector("--web-config", tls_files / "web.yml")
    cfg = tmp_path / "client.yml"
    cfg.write_text(
        f"tls_config:\n  ca_file: {tls_files / 'cert.pem'}\nbasic_auth:\n  username: prom\n  password: s3cret\n"
    )
    out = open_sender(c.port, config=protocol.load_client_config(str(cfg)))
    send(out, 20_000)
    out.close()
    assert out.finished
    c.stop()
    assert "plain TCP" not in c.stderr
    check_exactly_once(c.directory, 20_000)


def test_plain_tcp_only_on_loopback(tmp_path):
    from support.cli import run_pymtrace

    proc = run_pymtrace("collect", "--listen", "0.0.0.0:0", "--dir", tmp_path)
    assert proc.returncode == 1 and "plain TCP is allowed only on loopback" in proc.stderr
    proc = run_pymtrace("record", "--to", "192.0.2.1:7300", "-p", "1")
    assert proc.returncode == 1 and "plain TCP is allowed only to loopback" in proc.stderr


def test_two_streams_at_once(collector):
    c = collector()
    outs = [open_sender(c.port, pid=pid) for pid in (101, 102)]
    threads = [threading.Thread(target=send, args=(o, 30_000)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in outs:
        o.close()
    c.stop()
    got = duckdb.sql(
        f"select pid, count(*), count(distinct ptr2) from read_parquet('{c.directory}/**/*.parquet', "
        "hive_partitioning=true) group by pid order by pid"
    ).fetchall()
    assert got == [(101, 30_000, 30_000), (102, 30_000, 30_000)]
    assert pq.ParquetDataset(c.directory).read().num_rows == 60_000  # pyarrow's dataset reader too


def test_follow_forks_outputs_wait_their_send_timeouts_at_once(tmp_path, monkeypatch):
    """record --follow-forks has one NetOutput per process: with the collector away, their ends
    wait one --send-timeout in all (close_outputs begins them together), not one each."""
    from pymtrace.errors import WriteFailed
    from pymtrace.recorder.outputs import close_outputs

    monkeypatch.chdir(tmp_path)  # what is never acknowledged is kept in ./mtrace.out.PID
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = [open_sender(port, pid=5000 + i, close_wait=2.0) for i in range(4)]
    for out in outs:
        send(out, 100)
    t0 = time.monotonic()
    failure = close_outputs(outs)
    took = time.monotonic() - t0
    assert isinstance(failure, WriteFailed) and "never acknowledged" in str(failure)
    assert 2.0 <= took < 4.0, took  # one after another: >= 8 s
    for i in range(4):  # each process's records kept locally, whole
        assert os.path.getsize(tmp_path / f"mtrace.out.{5000 + i}") == 64 * 101


def closed_stream(root, n_parts, rows):
    """A closed stream of N_PARTS parts of ROWS records each, written by the collector's Stream."""
    from pymtrace.net.collector import Stream

    meta = P.file_metadata(pid=77, host="h", start_time="2026-11-24T10:00:00Z")
    stream = Stream(str(root), {"stream": "cd" * 16, "pid": 77, "host": "h", "metadata": meta})
    for k in range(n_parts):
        stream.add(k * rows, records(rows, k * rows).tobytes())
        stream.flush()
    stream.end()
    return stream.dir


def test_compaction_killed_at_any_point_leaves_every_record_once(tmp_path):
    """`collect --compact DIR` SIGKILLed while it writes the merged file, and right after its
    commit (the rename) while it removes the merged parts; run again: one part, every record
    once. Then the state a kill after the commit leaves, made exactly: a merged part beside a
    part it holds."""
    import shutil
    import signal
    import subprocess

    from support.cli import PYMTRACE

    from pymtrace.net.collector import stream_parts

    n_parts, rows = 150, 2000
    n = n_parts * rows
    root = tmp_path / "ds"
    directory = closed_stream(root, n_parts, rows)
    shutil.copytree(root, tmp_path / "before")
    first = os.path.join(directory, f"part-{'cd' * 16}-{0:012d}.parquet")
    inode = os.stat(first).st_ino
    landed = []
    for wait_for in ("temporary file", "commit"):
        proc = subprocess.Popen(PYMTRACE + ["collect", "--compact", str(root)], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            names = os.listdir(directory)
            if wait_for == "temporary file" and any(f.endswith(".inprogress") for f in names):
                break
            if wait_for == "commit" and os.stat(first).st_ino != inode:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            landed.append(wait_for)
        if wait_for == "temporary file":  # before the commit: the parts as they were
            check_exactly_once(root, n)
    assert "temporary file" in landed  # the kill hit a compaction in progress
    done = subprocess.run(PYMTRACE + ["collect", "--compact", str(root)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(parts(root)) == 1 and not [f for f in os.listdir(directory) if f.endswith(".inprogress")]
    check_exactly_once(root, n)
    again = subprocess.run(PYMTRACE + ["collect", "--compact", str(root)], capture_output=True, text=True)
    assert "compacted 0 streams" in again.stderr  # idempotent
    check_exactly_once(root, n)
    back = numpy.concatenate(list(P.iter_arrays(os.path.join(root, parts(root)[0]))))
    assert back.tobytes() == records(n).tobytes()
    # a kill between the commit and the removals: the merged part and some parts it holds
    for k in (1, 75, 149):
        name = f"part-{'cd' * 16}-{k * rows:012d}.parquet"
        shutil.copy(os.path.join(str(tmp_path / "before"), os.path.relpath(directory, root), name), directory)
    assert duckdb.sql(f"select count(*) from read_parquet('{root}/**/*.parquet')").fetchall()[0][0] == n + 3 * rows
    assert [(f, r) for f, r, _ in stream_parts(directory, "cd" * 16)] == [(0, n)]  # what recovery does
    check_exactly_once(root, n)
    print("kills landed:", landed)
