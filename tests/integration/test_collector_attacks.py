"""`pymtrace collect` attacked by a hostile client or user: slow unauthenticated connections
against real `record --to` streams, symlinks planted in the dataset by another user, memory
per stream, malformed HELLOs and partition values, a full disk. A real collector process on
127.0.0.1 each time; raw protocol frames where the attack needs them."""

import json
import os
import select
import socket
import ssl
import stat
import subprocess
import threading
import time
import uuid

import numpy
import pytest
from support.cli import PYMTRACE, run_pymtrace
from support.collect import collectors, parts
from support.needs import missing_or_fail
from support.slowloris import SlowClients

import pymtrace
from pymtrace.net import protocol
from pymtrace.trace.formats import mtrace_bin
from pymtrace.trace.formats import parquet as P

TOKEN = "attack-test-token-0123456789"
NOBODY = 65534


@pytest.fixture
def collector(tmp_path):
    with collectors(tmp_path / "ds") as make:
        yield make


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def needs_root():
    if os.geteuid() != 0:
        missing_or_fail("not root (another user, a tmpfs mount)")


def records(n, start=0):
    recs = numpy.zeros(n, mtrace_bin.record_dtype("<"))
    recs["type"] = mtrace_bin.MALLOC
    recs["ptr2"] = numpy.arange(start, start + n, dtype=numpy.uint64)
    recs["time_ns"] = recs["ptr2"] + 1
    return recs


def hello_doc(**fields):
    doc = {
        "stream": uuid.uuid4().hex,
        "pid": 4242,
        "host": "h",
        "metadata": P.file_metadata(pid=4242, host="h", start_time="2026-11-24T10:00:00Z"),
    }
    doc.update(fields)
    return doc


def open_stream(port, source="127.0.0.1", **fields):
    """A connection that sent a HELLO of FIELDS: (socket, first frame's kind, its JSON)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20, source_address=(source, 0))
    s.sendall(protocol.hello_frame(hello_doc(**fields)))
    kind, payload = protocol.recv_frame(s)
    return s, kind, json.loads(payload)


def data_frame(offset, recs):
    blob = recs.tobytes()
    return protocol.HEADER.pack(protocol.DATA, protocol.OFFSET.size + len(blob)) + protocol.OFFSET.pack(offset) + blob


def rest_of(s):
    """Every frame until the collector closes the connection."""
    frames = []
    while True:
        try:
            frames.append(protocol.recv_frame(s))
        except (protocol.ProtocolError, OSError):
            return frames


def closed_by_peer(s, timeout):
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


# ------------------------------------------------------------ slow unauthenticated clients


@pytest.mark.bpf
def test_real_recorders_served_under_70_slow_unauthenticated_connections(collector, token_file, cbuild, tmp_path):
    """70 clients trickling HELLOs (14 from each of 127.0.0.1-5: the recorders' own address
    too) hold more than the 64 connection slots; 15 real `record --to` streams started
    during the attack are each served at their first attempt (no "unreachable", no refusal)
    and deliver every record."""
    prog = cbuild("record_calls", "-no-pie")
    c = collector("--token-file", token_file)
    client = tmp_path / "client.yml"
    client.write_text(f"authorization:\n  credentials_file: {token_file}\n")
    here = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(pymtrace.__file__))}
    hello = protocol.hello_frame(hello_doc(auth={"token": "x" * 40}))
    sources = [f"127.0.0.{1 + i // 14}" for i in range(70)]
    slow = SlowClients(c.port, sources, hello[:-1], period=0.5, duration=120)  # never the whole HELLO
    try:
        deadline = time.monotonic() + 10
        while slow.connects < 70 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # every slot taken by now
        procs = [
            subprocess.Popen(
                PYMTRACE
                + ["record", "--json", "--to", c.address, "--web-config", client, "--send-timeout", "5"]
                + ["--", prog],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp_path,  # what a recorder could not deliver is kept in its current directory
                env=here,
            )
            for _ in range(15)
        ]
        errs = [p.communicate(timeout=240)[1] for p in procs]
        attack = (slow.connects, slow.closed_by_server)
    finally:
        slow.close()
    c.stop()
    failed = [e for p, e in zip(procs, errs) if p.returncode != 0 or "unreachable" in e or "refused" in e]
    print(
        f"attack: {attack[0]} connections, {attack[1]} closed by the collector; recorders closed before a "
        f"reply: {sum('unreachable' in e for e in errs)} of 15, not delivered: {sum(p.returncode != 0 for p in procs)}"
    )
    assert not failed, (len(failed), failed[:2])
    assert attack[1] >= 6, attack  # the slow clients were cut off, not just outnumbered
    for err in errs:
        f = json.loads(err.strip().splitlines()[-1])["files"][0]
        assert f["acknowledged"] == f["entries"] > 0, err


def test_a_new_connection_evicts_the_oldest_unauthenticated_one(collector):
    """At the connection cap a new connection closes the oldest one still before its HELLO
    (it is not closed unread itself); only authenticated streams are never evicted."""
    c = collector("--max-connections", "2")
    idle = [socket.create_connection(("127.0.0.1", c.port)) for _ in range(2)]
    time.sleep(0.3)
    s, kind, _ = open_stream(c.port)
    assert kind == protocol.WELCOME
    assert closed_by_peer(idle[0], 5) and not closed_by_peer(idle[1], 0.3)
    t, kind, _ = open_stream(c.port)  # evicts idle[1]
    assert kind == protocol.WELCOME and closed_by_peer(idle[1], 5)
    with socket.create_connection(("127.0.0.1", c.port)) as third:  # two streams: full
        assert closed_by_peer(third, 5)
    for x in (s, t, *idle):
        x.close()


def test_per_client_cap_on_unauthenticated_connections(collector):
    """One address holds at most 16 connections before authentication: its 17th closes its
    oldest; another address's connection is not touched."""
    c = collector()
    other = socket.create_connection(("127.0.0.1", c.port), source_address=("127.0.0.3", 0))
    time.sleep(0.2)
    mine = []
    for _ in range(17):
        mine.append(socket.create_connection(("127.0.0.1", c.port), source_address=("127.0.0.2", 0)))
        time.sleep(0.02)
    assert closed_by_peer(mine[0], 5)
    assert not any(closed_by_peer(x, 0.05) for x in [*mine[1:], other])
    for x in [*mine, other]:
        x.close()


def test_a_trickled_tls_handshake_is_cut_at_the_deadline(collector, tls_files):
    """The TLS handshake and the HELLO together have 5 s, however slowly the bytes come."""
    c = collector("--web-config", tls_files / "web.yml")
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    out = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    client_hello = out.read()
    s = socket.create_connection(("127.0.0.1", c.port))
    t0 = time.monotonic()
    closed = False
    for i in range(len(client_hello) - 1):  # never complete
        try:
            s.send(client_hello[i : i + 1])
        except OSError:
            closed = True
            break
        if select.select([s], [], [], 0.3)[0]:
            closed = s.recv(1) == b""
            break
    took = time.monotonic() - t0
    s.close()
    assert closed and took < 7, took


# ------------------------------------------------------------ symlinks inside --dir


def as_nobody(fn, *args):
    """Run FN(*ARGS) in a child process as the user nobody."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setgroups([])
            os.setuid(NOBODY)
            fn(*args)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_dir_writable_by_another_user_is_refused(tmp_path):
    needs_root()
    tmp_path.chmod(0o755)
    for mode, owner in ((0o777, 0), (0o700, NOBODY)):
        ds = tmp_path / f"ds-{mode:o}-{owner}"
        ds.mkdir(mode=mode)
        ds.chmod(mode)
        os.chown(ds, owner, owner)
        proc = run_pymtrace("collect", "--listen", "127.0.0.1:0", "--dir", ds, timeout=30)
        assert proc.returncode == 1, proc.stderr
        line = proc.stderr.strip()
        assert "\n" not in line and str(ds) in line and "another user" in line, line
        assert os.listdir(ds) == []


@pytest.fixture
def shared_tmp():
    """A directory another user can reach (pytest's tmp_path is private to root)."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="pymtrace-attack-")
    os.chmod(path, 0o755)
    yield __import__("pathlib").Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_dir_a_symlink_another_user_planted_is_refused(shared_tmp):
    """--dir names a symlink that another user made where anyone can create names (/tmp)."""
    needs_root()
    (shared_tmp / "private").mkdir(mode=0o700)
    shared_tmp.chmod(0o1777)
    as_nobody(os.symlink, str(shared_tmp / "private"), str(shared_tmp / "planted"))
    proc = run_pymtrace("collect", "--listen", "127.0.0.1:0", "--dir", shared_tmp / "planted", timeout=30)
    assert proc.returncode == 1 and "symbolic link another user made" in proc.stderr, proc.stderr
    assert os.listdir(shared_tmp / "private") == []


def test_symlinks_planted_by_another_user_are_not_followed(shared_tmp):
    """Another user, while --dir was writable, planted host=evil -> ELSEWHERE and a host=mine
    directory of their own holding date=... -> ELSEWHERE; the directory was made private
    again. Streams naming them are refused, nothing is written under ELSEWHERE; a stream's own
    host=/date=/pid= directories are 0700."""
    needs_root()
    ds, elsewhere = shared_tmp / "ds", shared_tmp / "elsewhere"
    ds.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o777)
    elsewhere.chmod(0o777)
    ds.chmod(0o777)

    def plant(ds, elsewhere):
        os.symlink(elsewhere, os.path.join(ds, "host=evil"))
        os.mkdir(os.path.join(ds, "host=mine"), 0o755)
        os.symlink(elsewhere, os.path.join(ds, "host=mine", "date=2026-11-24"))

    as_nobody(plant, str(ds), str(elsewhere))
    ds.chmod(0o700)
    with collectors(ds) as make:
        c = make()
        check_planted_links(c, ds)
    assert os.listdir(elsewhere) == []
    for sub in ("host=good", "host=good/date=2026-11-24", "host=good/date=2026-11-24/pid=4242"):
        assert stat.S_IMODE(os.stat(ds / sub).st_mode) == 0o700, sub
    assert c.stderr.count("host=evil") == 1 and c.stderr.count("host=mine") == 1, c.stderr


def check_planted_links(c, ds):
    for host in ("evil", "mine"):
        s, kind, doc = open_stream(c.port, host=host)
        s.close()
        assert kind == protocol.REFUSED and doc["code"] == "disk", doc
    s, kind, _ = open_stream(c.port, host="good")
    assert kind == protocol.WELCOME
    s.sendall(data_frame(0, records(100)) + protocol.frame(protocol.END, protocol.OFFSET.pack(100)))
    assert protocol.recv_frame(s)[0] == protocol.ACK
    s.close()
    c.stop()


# ------------------------------------------------------------ memory per stream


def vm_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(key)


def test_memory_bounded_under_24_streams_of_two_16_mib_frames(collector):
    """24 authenticated streams each sending two DATA frames of 16 MiB at once: the
    collector's peak RSS (VmHWM) grows by less than its documented bound of 350 MiB."""
    c = collector()
    pid = c.proc.pid
    base = vm_kib(pid, "VmHWM")
    n = protocol.MAX_FRAME // protocol.RECORD_SIZE - 1
    frames = [data_frame(0, records(n)), data_frame(n, records(n, n))]
    end = protocol.frame(protocol.END, protocol.OFFSET.pack(2 * n))
    acks = []

    def stream(i):
        s, kind, _ = open_stream(c.port, pid=1000 + i)
        assert kind == protocol.WELCOME
        for fr in frames:
            s.sendall(fr)
        s.sendall(end)
        acks.append([protocol.OFFSET.unpack(p)[0] for k, p in rest_of(s) if k == protocol.ACK])
        s.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    peak = vm_kib(pid, "VmHWM")
    c.stop()
    grew_mib = (peak - base) / 1024
    print(f"collector VmHWM {base / 1024:.0f} MiB -> {peak / 1024:.0f} MiB (+{grew_mib:.0f} MiB)")
    assert len(acks) == 24 and all(a and a[-1] == 2 * n for a in acks), acks
    assert grew_mib < 350, grew_mib


# ------------------------------------------------------------ HELLO validation, partitions


BAD_HELLOS = [
    ({"pid": 1e400}, "pid"),
    ({"pid": -5}, "pid"),
    ({"pid": 0}, "pid"),
    ({"pid": 10**30}, "pid"),
    ({"pid": True}, "pid"),
    ({"pid": "12"}, "pid"),
    ({"pid": 12.0}, "pid"),
    ({"metadata": "x"}, "metadata"),
    ({"metadata": {"pymtrace.start_time": 5}}, "metadata"),
    ({"host": 5}, "host"),
    ({"host": "h" * 300}, "host"),
    ({"stream": 7}, "stream"),
]


def test_malformed_hellos_refused_in_one_line(collector):
    c = collector()
    for fields, word in BAD_HELLOS:
        s, kind, doc = open_stream(c.port, **fields)
        assert kind == protocol.REFUSED and doc["code"] == "bad" and word in doc["message"], (fields, doc)
        assert rest_of(s) == []
        s.close()
    s, kind, _ = open_stream(c.port)  # still serving
    assert kind == protocol.WELCOME
    s.close()
    c.stop()
    assert "Traceback" not in c.stderr, c.stderr
    assert c.stderr.count("malformed HELLO") == len(BAD_HELLOS), c.stderr
    assert not parts(c.directory)


def test_start_time_in_other_digits_is_not_a_date(collector):
    """`\\d` matches Arabic-Indic digits: a start time in them names no partition; the
    stream goes to today's date (UTC), as one without a start time."""
    c = collector()
    meta = P.file_metadata(pid=77, host="h", start_time="١٢٣٤-٠١-٠١T00:00:00Z")
    s, kind, _ = open_stream(c.port, pid=77, metadata=meta)
    assert kind == protocol.WELCOME
    s.sendall(data_frame(0, records(10)) + protocol.frame(protocol.END, protocol.OFFSET.pack(10)))
    assert protocol.recv_frame(s)[0] == protocol.ACK
    s.close()
    c.stop()
    (dates,) = {p.split("/")[1] for p in parts(c.directory)}
    assert dates.isascii() and dates[len("date=") :] in {
        time.strftime("%Y-%m-%d", time.gmtime(time.time() - d)) for d in (0, 86400)
    }


# ------------------------------------------------------------ a full disk


def test_disk_full_one_line_per_stream_and_no_ack_after_refused(tmp_path):
    """A dataset on a 256 KiB tmpfs: a stream of incompressible records refused three times
    (one connection each) is logged once, and a REFUSED is the last frame of its connection."""
    needs_root()
    from support.collect import CollectorProcess

    ds = tmp_path / "ds"
    ds.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(ds)], check=True)
    c = None
    try:
        c = CollectorProcess(ds)
        recs = records(50_000)
        recs["ptr1"] = numpy.random.default_rng(1).integers(0, 1 << 60, len(recs), dtype=numpy.uint64)
        stream = uuid.uuid4().hex
        for _ in range(3):
            s, kind, _ = open_stream(c.port, stream=stream)
            assert kind == protocol.WELCOME
            s.sendall(data_frame(0, recs) + protocol.frame(protocol.END, protocol.OFFSET.pack(len(recs))))
            frames = rest_of(s)
            s.close()
            assert [k for k, _ in frames] == [protocol.REFUSED], frames
            assert json.loads(frames[0][1])["code"] == "disk"
        c.stop()
        assert c.stderr.count("disk full: cannot write") == 1, c.stderr
    finally:
        if c is not None:
            c.close()
        subprocess.run(["umount", str(ds)], check=False)
