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
import base64
import hashlib
import os
import ssl
import threading

from pymtrace.errors import PymtraceError

_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version",
             "max_version", "cipher_suites", "curve_preferences", "prefer_server_cipher_suites",
             "client_allowed_sans"}
_TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users"}
_HTTP_KEYS = {"headers", "http2"}
_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
             "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
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


class WebConfig:
    """Parsed web config: an SSLContext (or None), basic-auth users, extra headers."""

    def __init__(self, ssl_context=None, users=None, headers=None, path=None):
        self.ssl_context = ssl_context
        self.users = dict(users or {})
        self.headers = dict(headers or {})
        self.path = path
        self._cache = {}
        self._cache_lock = threading.Lock()

    @property
    def auth_required(self):
        return bool(self.users)

    def check_authorization(self, header):
        """True when HEADER (the Authorization request header) names a configured user."""
        if not self.users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        return self.check_password(user, password)

    def check_password(self, user, password):
        # bcrypt costs ~70 ms at cost 10: remember good (user, password) pairs by a keyed
        # digest, as exporter-toolkit does, so a 1 s scrape interval stays cheap.
        key = hashlib.sha256(f"{user}\0{password}".encode()).digest()
        with self._cache_lock:
            if key in self._cache:
                return True
        import bcrypt

        hashed = self.users.get(user)
        try:
            ok = bcrypt.checkpw(password.encode("utf-8"), hashed if hashed else _DUMMY_HASH)
        except ValueError:
            ok = False
        ok = ok and hashed is not None
        if ok:
            with self._cache_lock:
                if len(self._cache) > 1024:
                    self._cache.clear()
                self._cache[key] = True
        return ok


def _expect_mapping(value, where):
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"web config: {where} must be a mapping")
    return value


def _check_keys(mapping, allowed, where):
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise WebConfigError(f"web config: unknown key(s) in {where}: {', '.join(map(str, unknown))}")


def load(path):
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
        raise WebConfigError(f"web config {path} is not valid YAML: {exc}") from None
    doc = _expect_mapping(doc, "the file")
    _check_keys(doc, _TOP_KEYS, "the top level")
    base = os.path.dirname(os.path.abspath(path))

    def resolve(name):
        return name if os.path.isabs(name) else os.path.join(base, name)

    tls = _expect_mapping(doc.get("tls_server_config"), "tls_server_config")
    _check_keys(tls, _TLS_KEYS, "tls_server_config")
    ctx = None
    if tls:
        cert, key = tls.get("cert_file"), tls.get("key_file")
        if not cert or not key:
            raise WebConfigError("web config: tls_server_config needs both cert_file and key_file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = _VERSIONS[_version(tls.get("min_version", "TLS12"), "min_version")]
        if tls.get("max_version"):
            ctx.maximum_version = _VERSIONS[_version(tls["max_version"], "max_version")]
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
                    "(Python's TLS cannot accept unverified client certificates); give client_ca_file")
            ctx.verify_mode = _CLIENT_AUTH[auth]

    http = _expect_mapping(doc.get("http_server_config"), "http_server_config")
    _check_keys(http, _HTTP_KEYS, "http_server_config")
    headers = _expect_mapping(http.get("headers"), "http_server_config.headers")
    for name in headers:
        if name.lower() in ("authorization", "www-authenticate", "content-type", "content-length",
                            "content-encoding", "server", "date"):
            raise WebConfigError(f"web config: header {name} cannot be overridden")

    users = _expect_mapping(doc.get("basic_auth_users"), "basic_auth_users")
    parsed = {}
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"web config: basic_auth_users.{user} must be a bcrypt hash ($2y$...)")
        parsed[str(user)] = hashed.encode()
    return WebConfig(ctx, parsed, {str(k): str(v) for k, v in headers.items()}, path)


def _version(value, what):
    if value not in _VERSIONS:
        raise WebConfigError(f"web config: {what} {value!r} is not one of {', '.join(_VERSIONS)}")
    return value
