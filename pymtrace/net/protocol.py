"""The wire protocol between `pymtrace record --to` and `pymtrace collect` (docs/collect.md).

Every frame is a 5-byte header, KIND (u8) and LENGTH (u32), then LENGTH payload bytes
(integers big endian):

    HELLO    recorder -> collector  MAGIC, u16 version, JSON {stream, pid, host, metadata, auth}
    WELCOME  collector -> recorder  JSON {version, acked}: records of the stream already durable
    DATA     recorder -> collector  u64 offset of the first record, then N raw 64-byte records
    ACK      collector -> recorder  u64: every record below this offset is durable on disk
    END      recorder -> collector  u64 final offset: close the part, ACK, recording over
    REFUSED  collector -> recorder  JSON {code, message}: version, auth, disk, busy, bad

The records are the recorder's raw mtrace-bin records (the cheapest thing for the recorder
to send: no encoding while recording); the collector encodes them into Parquet parts.
Offsets count records of one stream (one traced process of one recording), from 0.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import struct
from typing import Any

from pymtrace import jsonread
from pymtrace.errors import PymtraceError

MAGIC = b"PMTR"
VERSION = 1
HELLO, WELCOME, DATA, ACK, END, REFUSED = 1, 2, 3, 4, 5, 6
HEADER = struct.Struct(">BI")  # kind, payload length
OFFSET = struct.Struct(">Q")
VERSION_FIELD = struct.Struct(">4sH")
MAX_HELLO = 64 * 1024  # a HELLO (before authentication) larger than this is refused
MAX_FRAME = 16 * 1024 * 1024  # a DATA frame's payload at most (262,143 records)
RECORD_SIZE = 64
# REFUSED codes
R_VERSION, R_AUTH, R_DISK, R_BUSY, R_BAD = "version", "auth", "disk", "busy", "bad"


class ProtocolError(PymtraceError):
    """The peer sent something that is not this protocol (or closed the connection)."""


class Refused(PymtraceError):
    """The collector refused the stream: CODE (R_*) and its message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """The header of a frame of KIND with PAYLOAD, followed by the payload (small frames)."""
    return HEADER.pack(kind, len(payload)) + bytes(payload)


def json_frame(kind: int, doc: dict) -> bytes:
    return frame(kind, json.dumps(doc, separators=(",", ":")).encode())


def hello_frame(doc: dict, version: int = VERSION) -> bytes:
    return frame(HELLO, VERSION_FIELD.pack(MAGIC, version) + json.dumps(doc, separators=(",", ":")).encode())


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """N bytes from SOCK (not copied again: a DATA frame is 16 MiB); ProtocolError when the
    peer closes before."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ProtocolError("connection closed by the peer")
        got += k
    return buf


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> tuple[int, bytearray]:
    """(kind, payload) of the next frame; ProtocolError when its payload exceeds LIMIT."""
    kind, length = HEADER.unpack(recv_exact(sock, HEADER.size))
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes is over the limit of {limit}")
    return kind, recv_exact(sock, length)


def parse_json(payload: bytes | bytearray) -> dict:
    try:
        doc = jsonread.loads(payload.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("malformed JSON in a frame") from None
    if not isinstance(doc, dict):
        raise ProtocolError("a JSON frame that is not an object")
    return doc


def parse_address(text: str, what: str) -> tuple[str, int]:
    """HOST:PORT (HOST may be [v6]) as (host, port); one-line error otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise PymtraceError(f"{what}: expected HOST:PORT, got {text!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether HOST names only this machine (plain TCP is allowed only there)."""
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    import ipaddress

    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


# ---------------------------------------------------------------- the recorder's config


class ClientConfig:
    """How `record --to` connects: SSL_CONTEXT (None: plain TCP) and the credentials it sends
    (AUTH: {"user", "password"} or {"token"}, or {})."""

    def __init__(
        self, ssl_context: ssl.SSLContext | None = None, auth: dict | None = None, server_name: str | None = None
    ) -> None:
        self.ssl_context = ssl_context
        self.auth = dict(auth or {})
        self.server_name = server_name


_CLIENT_KEYS = {"tls_config", "basic_auth", "authorization"}
_CLIENT_TLS_KEYS = {"ca_file", "cert_file", "key_file", "server_name", "min_version"}


def _secret(section: dict, key: str, where: str, base: str) -> str | None:
    """SECTION[KEY] or the first line of the file SECTION[KEY_file] (relative to BASE)."""
    value = section.get(key)
    name = section.get(key + "_file")
    if value is not None and name is not None:
        raise PymtraceError(f"web config: {where}: give {key} or {key}_file, not both")
    if name is not None:
        path = name if os.path.isabs(name) else os.path.join(base, name)
        try:
            with open(path) as f:
                return f.readline().rstrip("\r\n")
        except OSError as exc:
            raise PymtraceError(f"web config: cannot read {where}.{key}_file {path}: {exc.strerror}") from None
    if value is not None and not isinstance(value, str):
        raise PymtraceError(f"web config: {where}.{key} must be a string")
    return value


def load_client_config(path: str | None) -> ClientConfig:
    """The recorder's side of a web config (docs/collect.md): `tls_config` (ca_file, and
    cert_file/key_file for a client certificate, server_name, min_version), `basic_auth`
    (username, password or password_file) or `authorization` (credentials or
    credentials_file: a token). The keys and meanings of Prometheus's scrape configs."""
    if path is None:
        return ClientConfig()
    try:
        import yaml

        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as exc:
        raise PymtraceError(f"cannot read web config {path}: {exc.strerror}") from None
    except (yaml.YAMLError, ValueError) as exc:
        raise PymtraceError(f"web config {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:  # PyYAML's parser recurses once per nesting level
        raise PymtraceError(f"web config {path} is not valid YAML: nested too deep") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise PymtraceError(f"web config {path}: the file must be a mapping")
    unknown = sorted(set(map(str, doc)) - _CLIENT_KEYS)
    if unknown:
        raise PymtraceError(
            f"web config {path}: unknown key(s) for record --to: {', '.join(unknown)} "
            f"(expected {', '.join(sorted(_CLIENT_KEYS))})"
        )
    base = os.path.dirname(os.path.abspath(path))
    ctx, server_name = None, None
    tls = doc.get("tls_config")
    if tls is not None:
        if not isinstance(tls, dict):
            raise PymtraceError(f"web config {path}: tls_config must be a mapping")
        unknown = sorted(set(map(str, tls)) - _CLIENT_TLS_KEYS)
        if unknown:
            raise PymtraceError(f"web config {path}: unknown key(s) in tls_config: {', '.join(unknown)}")

        def resolve(name: str) -> str:
            return name if os.path.isabs(name) else os.path.join(base, name)

        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if tls.get("min_version") == "TLS13":
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        try:
            if tls.get("ca_file"):
                ctx.load_verify_locations(resolve(tls["ca_file"]))
            if tls.get("cert_file") or tls.get("key_file"):
                ctx.load_cert_chain(resolve(tls.get("cert_file", "")), resolve(tls.get("key_file", "")))
        except (OSError, ssl.SSLError) as exc:
            raise PymtraceError(f"web config {path}: cannot load the tls_config files: {exc}") from None
        server_name = tls.get("server_name")
    auth = {}
    basic = doc.get("basic_auth")
    if basic is not None:
        if not isinstance(basic, dict) or not isinstance(basic.get("username"), str):
            raise PymtraceError(f"web config {path}: basic_auth needs a username")
        auth = {"user": basic["username"], "password": _secret(basic, "password", "basic_auth", base) or ""}
    bearer = doc.get("authorization")
    if bearer is not None:
        if basic is not None:
            raise PymtraceError(f"web config {path}: give basic_auth or authorization, not both")
        if not isinstance(bearer, dict):
            raise PymtraceError(f"web config {path}: authorization must be a mapping")
        token = _secret(bearer, "credentials", "authorization", base)
        if not token:
            raise PymtraceError(f"web config {path}: authorization needs credentials or credentials_file")
        auth = {"token": token}
    return ClientConfig(ctx, auth, server_name)


def describe(doc: Any) -> str:
    """A REFUSED frame's message, printable on one line."""
    text = str(doc.get("message", "")) if isinstance(doc, dict) else ""
    return " ".join(text.split())[:300] or "no reason given"
