"""The exporter's TLS and basic auth (pymtrace.sinks.webconfig served by pymtrace.sinks.http):
the bcrypt budget (repeated credentials, a wrong-password flood), TLS with basic auth,
client certificates, web config errors (one line each, from the library and the CLI)."""

import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest
from support.exporter import FakeSource, basic_auth, proc_entry, timed_get
from support.machine import slowness
from support.prometheus import http_get

from pymtrace.sinks import webconfig


def _auth_config(tmp_path, cost=8):
    import bcrypt

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(cost)).decode()
    cfg = tmp_path / "auth.yml"
    cfg.write_text(f"basic_auth_users:\n  prom: '{hashed}'\n")
    return webconfig.load(cfg)


@pytest.fixture
def bcrypt_calls(monkeypatch):
    """Counts bcrypt.checkpw calls (what a password check costs: ~70 ms at cost 10)."""
    import bcrypt

    calls = []
    real = bcrypt.checkpw

    def counting(password, hashed):
        calls.append(password)
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    return calls


def test_repeated_valid_credentials_cost_one_bcrypt_check(served, tmp_path, bcrypt_calls):
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})], web=_auth_config(tmp_path))
    # a burst of concurrent requests with the same credentials, then sequential ones
    barrier = threading.Barrier(12)
    results = []

    def get():
        barrier.wait()
        results.append(http_get(ex.url + "/metrics", basic_auth("prom", "s3cret"))[0])

    threads = [threading.Thread(target=get) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    results += [http_get(ex.url + "/metrics", basic_auth("prom", "s3cret"))[0] for _ in range(10)]
    assert results == [200] * 22
    assert len(bcrypt_calls) == 1
    # a wrong password is refused, and refused again without another bcrypt check
    assert http_get(ex.url + "/metrics", basic_auth("prom", "s3cre"))[0] == 401
    assert http_get(ex.url + "/metrics", basic_auth("prom", "s3cre"))[0] == 401
    assert len(bcrypt_calls) == 2
    assert http_get(ex.url + "/metrics", basic_auth("prom", "s3cret"))[0] == 200
    assert len(bcrypt_calls) == 2


def test_wrong_password_flood_costs_bounded_bcrypt_and_a_valid_scrape_is_served(served, tmp_path, bcrypt_calls):
    """4 clients send wrong passwords as fast as they can for 3 s (one repeated wrong
    password, and a new one each time), from another address than the scraper's. Each used
    to cost a bcrypt check; now repeats cost none and each address gets a few checks a
    second (then 429). Scrapes with the valid password go on being served meanwhile."""
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})], web=_auth_config(tmp_path))
    statuses = {}
    lock = threading.Lock()
    stop = time.monotonic() + 3.0

    def flood(k):
        for i in range(400):
            if time.monotonic() > stop:
                break
            pw = "wrong" if i % 2 else f"wrong-{k}-{i}"
            status, _ = timed_get(ex.url + "/metrics", basic_auth("prom", pw), source="127.0.0.2")
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=flood, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    scrapes = []
    while time.monotonic() < stop:
        scrapes.append(timed_get(ex.url + "/metrics", basic_auth("prom", "s3cret")))
        time.sleep(0.3)
    for t in threads:
        t.join(30)
    # 1 for the scraper, a burst of 5 and about 1/s for the flooding address
    assert len(bcrypt_calls) <= 1 + 5 + 4 + 1, (len(bcrypt_calls), statuses)
    # it was a flood (the emulated VMs made 80 requests in the 3 s: slowness() ~14 there)
    assert sum(statuses.values()) >= 100 / slowness(), statuses
    assert set(statuses) <= {401, 429}, statuses
    assert scrapes and all(status == 200 for status, _ in scrapes), scrapes
    assert max(t for _, t in scrapes) < 3.0, scrapes


def test_tls_and_basic_auth(served, tls_files):
    web = webconfig.load(tls_files / "web.yml")
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=4)}})], web=web)
    ctx = ssl.create_default_context(cafile=str(tls_files / "cert.pem"))
    assert http_get(ex.url + "/metrics", context=ctx)[0] == 401
    assert http_get(ex.url + "/metrics", basic_auth("prom", "wrong"), context=ctx)[0] == 401
    assert http_get(ex.url + "/metrics", basic_auth("nobody", "s3cret"), context=ctx)[0] == 401
    assert http_get(ex.url + "/", context=ctx)[0] == 401
    status, headers, body = http_get(ex.url + "/metrics", basic_auth("prom", "s3cret"), context=ctx)
    assert status == 200 and b'call="malloc"' in body
    assert headers.get("X-Frame-Options") == "deny"
    # plain HTTP to the TLS port gets nothing useful, and a client stuck in the handshake
    # does not hold up others
    stuck = socket.create_connection(("127.0.0.1", ex.port))
    try:
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{ex.port}/metrics", timeout=5).read()
        assert http_get(ex.url + "/metrics", basic_auth("prom", "s3cret"), context=ctx, timeout=5)[0] == 200
    finally:
        stuck.close()


def test_client_certificates_required_and_verified(served, tls_files, tmp_path):
    cfg = tmp_path / "mtls.yml"
    cfg.write_text(
        f"tls_server_config:\n  cert_file: {tls_files}/cert.pem\n  key_file: {tls_files}/key.pem\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {tls_files}/cert.pem\n"
        "  min_version: TLS12\n"
    )
    ex = served([FakeSource({"processes": {"1": proc_entry(1, "app", malloc=1)}})], web=webconfig.load(cfg))
    ctx = ssl.create_default_context(cafile=str(tls_files / "cert.pem"))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(ex.url + "/metrics", timeout=5, context=ctx).read()
    ctx.load_cert_chain(str(tls_files / "cert.pem"), str(tls_files / "key.pem"))
    assert http_get(ex.url + "/metrics", context=ctx)[0] == 200


def test_web_config_errors(tmp_path, tls_files):
    cases = {
        "tls_server_config:\n  cert_file: x\n": "cert_file and key_file",
        "tls_server_config:\n  cert_flie: x\n": "unknown key",
        "basic_auth_users:\n  u: plaintext\n": "bcrypt",
        "bogus: 1\n": "unknown key",
        f"tls_server_config:\n  cert_file: {tls_files}/cert.pem\n  key_file: {tls_files}/key.pem\n"
        "  min_version: TLS99\n": "min_version",
        ": : :\n": "YAML",
    }
    for text, needle in {**cases, **BAD_WEB_CONFIGS(tls_files)}.items():
        f = tmp_path / "w.yml"
        f.write_text(text)
        with pytest.raises(webconfig.WebConfigError, match=needle):
            webconfig.load(f)
    with pytest.raises(webconfig.WebConfigError, match="cannot read"):
        webconfig.load(tmp_path / "missing.yml")
    (tmp_path / "bin.yml").write_bytes(b"\xff\xfe\x00\x01 binary")
    with pytest.raises(webconfig.WebConfigError, match="web config"):
        webconfig.load(tmp_path / "bin.yml")


def BAD_WEB_CONFIGS(tls_files):
    """Web configs that cannot work or have the wrong types -> the one-line error expected."""
    tls = f"tls_server_config:\n  cert_file: {tls_files}/cert.pem\n  key_file: {tls_files}/key.pem\n"
    return {
        # no TLS version is both >= min and <= max: refused instead of failing every handshake
        tls + "  min_version: TLS13\n  max_version: TLS12\n": "min_version TLS13 is above max_version TLS12",
        tls + "  max_version: TLS11\n": "min_version TLS12 is above max_version TLS11",  # default min TLS12
        # a header value with CR/LF would inject headers into every response
        'http_server_config:\n  headers:\n    X-Frame-Options: "deny\\r\\nSet-Cookie: a=b"\n': "line break",
        'http_server_config:\n  headers:\n    X-Frame-Options: "deny\\nX: y"\n': "line break",
        "http_server_config:\n  headers:\n    'X Bad': deny\n": "not a valid header name",
        # wrong types: one line each, never a traceback
        "tls_server_config:\n  cert_file: [a, b]\n  key_file: k\n": "cert_file must be a string, not a list",
        tls + "  client_auth_type: [RequireAndVerifyClientCert]\n": "client_auth_type must be a string",
        tls + "  min_version: [TLS12]\n": "min_version must be a string",
        tls + "  max_version: {a: 1}\n": "max_version must be a string, not a mapping",
        tls + "  client_ca_file: 7\n": "client_ca_file must be a string, not a number",
        tls + "  cipher_suites: [1, 2]\n": "cipher_suites must be a list of strings",
        tls + "  prefer_server_cipher_suites: maybe\n": "true or false",
        "http_server_config:\n  headers:\n    X-Frame-Options: [deny, sameorigin]\n": "X-Frame-Options must be a string",
        "http_server_config:\n  headers: [a]\n": "headers must be a mapping, not a list",
        "http_server_config: [1]\n": "http_server_config must be a mapping",
        "http_server_config:\n  http2: [true]\n": "http2 must be true or false",
        "basic_auth_users:\n  prom: [a, b]\n": "bcrypt hash",
        "basic_auth_users: [prom]\n": "basic_auth_users must be a mapping",
        "- a\n- b\n": "the file must be a mapping",
    }


def test_bad_web_configs_are_one_line_errors_from_the_cli(tmp_path, tls_files):
    from support.cli import run_pymtrace

    for i, text in enumerate(BAD_WEB_CONFIGS(tls_files)):
        f = tmp_path / f"bad{i}.yml"
        f.write_text(text)
        r = run_pymtrace("exporter", "--listen", "127.0.0.1:0", "--web-config", str(f), timeout=30)
        assert r.returncode == 2, (text, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pymtrace: error: web config"), (text, r.stderr)
