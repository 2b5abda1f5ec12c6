"""TLS and basic-auth settings for the exporter, read from a web config file.

The file has the format of the Prometheus exporter-toolkit's `--web.config.file`, so one
file can serve node_exporter and pymtrace alike:

    tls_server_config:
      cert_file: /etc/pymtrace/tls.crt
      key_file: /etc/pymtrace/tls.key
      # optional: client certificates
      client_auth_type: RequireAndVerifyClientCert   # NoClientCert (default), RequestClientCert,
                                                      # RequireAnyClientCert, VerifyClientCertIfGiven
      client_ca_file: /etc/pymtrace/ca.crt
      min_version: TLS12                              # TLS10 .. TLS13
      max_version: TLS13
    http_server_config:
      headers:
        X-Frame-Options: deny
    basic_auth_users:
      prometheus: $2y$10$...   # bcrypt hash, e.g. from `htpasswd -nBC 10 "" | tr -d ':'`

Unknown keys are errors (as in exporter-toolkit): a typo must not silently disable TLS.
Relative file names are resolved against the config file's directory.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import os
import re
import ssl
import threading
import time
from typing import Any, Mapping

from pymtrace.errors import PymtraceError

_TLS_KEYS = {
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "min_version",
    "max_version",
    "cipher_suites",
    "curve_preferences",
    "prefer_server_cipher_suites",
    "client_allowed_sans",
}
_TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users"}
_HTTP_KEYS = {"headers", "http2"}
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# A valid bcrypt hash of a random password: unknown user names cost as much as known ones.
_DUMMY_HASH = b"$2b$10$/J4io3xjn8xPDTkDc8IhauLyXpPtlnaVFXefw4CbTxKsc7I4tFUaO"


class WebConfigError(PymtraceError):
    exit_code = 2


# Authentication results of WebConfig.authenticate
AUTH_OK, AUTH_DENIED, AUTH_LIMITED = "ok", "denied", "limited"
# bcrypt (~70 ms at cost 10) is what an unauthenticated client can make the exporter spend:
# per client address, a burst of _BCRYPT_BURST checks, then _BCRYPT_RATE a second; one check
# at a time in all (a request waits at most _BCRYPT_WAIT seconds for its turn); the last
# _FAILED_MAX wrong credentials are remembered and refused without a check.
_BCRYPT_BURST, _BCRYPT_RATE, _BCRYPT_WAIT = 5, 1.0, 2.0
_FAILED_MAX, _CLIENTS_MAX = 256, 4096


class WebConfig:
    """Parsed web config: an SSLContext (or None), basic-auth users, extra headers."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None = None,
        users: Mapping[str, bytes] | None = None,
        headers: Mapping[str, str] | None = None,
        path: str | None = None,
    ) -> None:
        self.ssl_context = ssl_context
        self.users = dict(users or {})
        self.headers = dict(headers or {})
        self.path = path
        self._key = os.urandom(32)  # credentials are cached as HMACs under this key
        self._verified = {}  # user -> HMAC of the credentials that passed bcrypt (one per user)
        self._failed = collections.OrderedDict()  # HMACs of recently refused credentials
        self._buckets = collections.OrderedDict()  # client address -> (checks left, when counted)
        self._lock = threading.Lock()  # guards the three caches
        self._bcrypt = threading.Lock()  # one bcrypt check at a time

    @property
    def auth_required(self) -> bool:
        return bool(self.users)

    def check_authorization(self, header: str | None, client: str | None = None) -> bool:
        """True when HEADER (the Authorization request header) names a configured user."""
        return self.authenticate(header, client) == AUTH_OK

    def authenticate(self, header: str | None, client: str | None = None) -> str:
        """AUTH_OK, AUTH_DENIED, or AUTH_LIMITED (CLIENT has used up its bcrypt checks)."""
        if not self.users:
            return AUTH_OK
        if not header or not header.startswith("Basic "):
            return AUTH_DENIED
        try:
            user, _, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return AUTH_DENIED
        return self._check(user, password, client)

    def check_password(self, user: str, password: str, client: str | None = None) -> bool:
        return self._check(user, password, client) == AUTH_OK

    def _known(self, user: str, digest: bytes) -> str | None:
        """AUTH_OK / AUTH_DENIED when DIGEST was checked before, else None (call under _lock)."""
        good = self._verified.get(user)
        if good is not None and hmac.compare_digest(good, digest):
            return AUTH_OK
        if digest in self._failed:  # a keyed digest: its lookup time tells nothing
            self._failed.move_to_end(digest)
            return AUTH_DENIED
        return None

    def _take_token(self, client: str | None) -> bool:
        """Spend one of CLIENT's bcrypt checks; False when it has none left (call under _lock)."""
        now = time.monotonic()
        tokens, last = self._buckets.pop(client, (_BCRYPT_BURST, now))
        tokens = min(_BCRYPT_BURST, tokens + (now - last) * _BCRYPT_RATE)
        ok = tokens >= 1
        self._buckets[client] = (tokens - 1 if ok else tokens, now)
        while len(self._buckets) > _CLIENTS_MAX:
            self._buckets.popitem(last=False)
        return ok

    def _check(self, user: str, password: str, client: str | None) -> str:
        # Verified credentials are remembered by a keyed digest (as exporter-toolkit does),
        # so a 1 s scrape interval costs no bcrypt; repeated wrong ones cost none either.
        digest = hmac.new(self._key, f"{user}\0{password}".encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
        with self._lock:
            known = self._known(user, digest)
        if known is not None:
            return known
        if not self._bcrypt.acquire(timeout=_BCRYPT_WAIT):
            return AUTH_LIMITED
        try:
            with self._lock:  # checked meanwhile by a concurrent request with the same credentials?
                known = self._known(user, digest)
                if known is None and not self._take_token(client):
                    return AUTH_LIMITED
            if known is not None:
                return known
            import bcrypt

            hashed = self.users.get(user)
            try:  # unknown users cost as much as wrong passwords
                ok = bcrypt.checkpw(password.encode("utf-8", "surrogatepass"), hashed if hashed else _DUMMY_HASH)
            except ValueError:
                ok = False
            ok = ok and hashed is not None
            with self._lock:
                if ok:
                    self._verified[user] = digest
                else:
                    self._failed[digest] = True
                    while len(self._failed) > _FAILED_MAX:
                        self._failed.popitem(last=False)
            return AUTH_OK if ok else AUTH_DENIED
        finally:
            self._bcrypt.release()


def _expect_mapping(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"web config: {where} must be a mapping, not {_kind(value)}")
    return value


def _kind(value: object) -> str:
    return {
        list: "a list",
        dict: "a mapping",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
    }.get(type(value), type(value).__name__)


def _typed(
    mapping: Mapping[str, Any], key: str, where: str, types: tuple[type, ...] = (str,), what: str = "a string"
) -> Any:
    """MAPPING[KEY] when it is one of TYPES (None when absent or null), else a one-line error."""
    value = mapping.get(key)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise WebConfigError(f"web config: {where}.{key} must be {what}, not {_kind(value)}")
    return value


def _string_list(mapping: Mapping[str, Any], key: str, where: str) -> list[str] | None:
    value = _typed(mapping, key, where, (list,), "a list of strings")
    if value and not all(isinstance(v, str) for v in value):
        raise WebConfigError(f"web config: {where}.{key} must be a list of strings")
    return value


def _check_keys(mapping: Mapping[Any, Any], allowed: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted(set(map(str, mapping)) - allowed)
    if unknown:
        raise WebConfigError(f"web config: unknown key(s) in {where}: {', '.join(unknown)}")


# RFC 9110 field names are tokens; values are visible characters, spaces and tabs (no CR,
# LF or NUL: a value with a line break would inject headers into every response)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")


def load(path: str) -> WebConfig:
    """Read and validate the web config file at PATH; returns a WebConfig."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML is a dependency
        raise WebConfigError("web config needs PyYAML (pip install PyYAML)") from None
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as exc:
        raise WebConfigError(f"cannot read web config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise WebConfigError(f"web config {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    except ValueError as exc:  # not UTF-8 text
        raise WebConfigError(f"web config {path} is not a text file: {exc}") from None
    except RecursionError:  # PyYAML's parser recurses once per nesting level
        raise WebConfigError(f"web config {path} is not valid YAML: nested too deep") from None
    doc = _expect_mapping(doc, "the file")
    _check_keys(doc, _TOP_KEYS, "the top level")
    base = os.path.dirname(os.path.abspath(path))

    def resolve(name: str) -> str:
        return name if os.path.isabs(name) else os.path.join(base, name)

    tls = _expect_mapping(doc.get("tls_server_config"), "tls_server_config")
    _check_keys(tls, _TLS_KEYS, "tls_server_config")
    where = "tls_server_config"
    for key in ("cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version"):
        _typed(tls, key, where)
    for key in ("cipher_suites", "curve_preferences", "client_allowed_sans"):
        _string_list(tls, key, where)
    _typed(tls, "prefer_server_cipher_suites", where, (bool,), "true or false")
    ctx = None
    if tls:
        cert, key = tls.get("cert_file"), tls.get("key_file")
        if not cert or not key:
            raise WebConfigError("web config: tls_server_config needs both cert_file and key_file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        low = tls.get("min_version") or "TLS12"
        ctx.minimum_version = _VERSIONS[_version(low, "min_version")]
        if tls.get("max_version"):
            high = tls["max_version"]
            if _VERSIONS[_version(high, "max_version")] < _VERSIONS[low]:
                raise WebConfigError(
                    f"web config: min_version {low} is above max_version {high}: no TLS version could be negotiated"
                )
            ctx.maximum_version = _VERSIONS[high]
        try:
            ctx.load_cert_chain(resolve(cert), resolve(key))
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(f"web config: cannot load cert_file/key_file: {exc}") from None
        auth = tls.get("client_auth_type", "NoClientCert")
        if auth not in _CLIENT_AUTH:
            raise WebConfigError(f"web config: client_auth_type {auth!r} is not one of {', '.join(_CLIENT_AUTH)}")
        if _CLIENT_AUTH[auth] != ssl.CERT_NONE:
            ca = tls.get("client_ca_file")
            if auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert") and not ca:
                raise WebConfigError(f"web config: client_auth_type {auth} needs client_ca_file")
            if ca:
                try:
                    ctx.load_verify_locations(resolve(ca))
                except (OSError, ssl.SSLError) as exc:
                    raise WebConfigError(f"web config: cannot load client_ca_file: {exc}") from None
            elif auth in ("RequestClientCert", "RequireAnyClientCert"):
                raise WebConfigError(
                    f"web config: client_auth_type {auth} without client_ca_file is not supported "
                    "(Python's TLS cannot accept unverified client certificates); give client_ca_file"
                )
            ctx.verify_mode = _CLIENT_AUTH[auth]

    http = _expect_mapping(doc.get("http_server_config"), "http_server_config")
    _check_keys(http, _HTTP_KEYS, "http_server_config")
    _typed(http, "http2", "http_server_config", (bool,), "true or false")
    headers = _expect_mapping(http.get("headers"), "http_server_config.headers")
    for name, value in headers.items():
        where = f"http_server_config.headers.{name}"
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise WebConfigError(f"web config: http_server_config.headers: {name!r} is not a valid header name")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise WebConfigError(f"web config: {where} must be a string, not {_kind(value)}")
        if not _HEADER_VALUE.fullmatch(str(value)):
            raise WebConfigError(
                f"web config: {where} contains a line break or control character "
                "(it would inject headers into every response)"
            )
        if not str(value).isascii():
            raise WebConfigError(f"web config: {where} must be ASCII")
        if name.lower() in (
            "authorization",
            "www-authenticate",
            "content-type",
            "content-length",
            "content-encoding",
            "server",
            "date",
        ):
            raise WebConfigError(f"web config: header {name} cannot be overridden")

    users = _expect_mapping(doc.get("basic_auth_users"), "basic_auth_users")
    parsed = {}
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"web config: basic_auth_users.{user} must be a bcrypt hash ($2y$...)")
        parsed[str(user)] = hashed.encode()
    return WebConfig(ctx, parsed, {str(k): str(v) for k, v in headers.items()}, path)


def _version(value: object, what: str) -> str:
    if not isinstance(value, str) or value not in _VERSIONS:
        raise WebConfigError(f"web config: {what} {value!r} is not one of {', '.join(_VERSIONS)}")
    return value
