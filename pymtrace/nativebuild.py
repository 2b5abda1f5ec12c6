"""Native helpers compiled on first use: a trusted cache keyed by the sources' hash.

    path = build_cached("replay", [src, header], ["-O2"], kind="exe")
    path = build_cached("unwind", [src], ["-O2"], libs=["-ldw", "-lelf"], kind="shared")

The result lives in `native/pymtrace-NAME-HASH` under $PYMTRACE_CACHE_DIR (default
$XDG_CACHE_HOME/pymtrace, ~/.cache/pymtrace), HASH covering the sources, compiler and flags, so
an edited source is rebuilt and concurrent users never see a half-written file (each build goes
to a private mkdtemp directory and is renamed into place). Nothing in the cache is executed or
loaded unless the file and every directory above it belong to this user (or root) and nobody
else can write them; otherwise the build goes to a private temporary directory removed at exit.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from pymtrace.errors import PymtraceError

KINDS = ("exe", "shared")


class BuildFailed(PymtraceError):
    """The compiler rejected a native helper (or none was found). `output`: its whole stderr."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


SYSTEM_CACHE = "/var/cache/pymtrace/native"  # root's builds every user may load (build_cached(everyone=True))


def cache_dir() -> str:
    """The directory the compiled helpers are cached in (it may not exist yet)."""
    base = os.environ.get("PYMTRACE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pymtrace"
    )
    return os.path.join(base, "native")


def untrusted(path: str, kind: str) -> str | None:
    """Why PATH (kind "file" or "dir") or a directory above it could be changed by someone
    other than this user or root, or None. A sticky directory (like /tmp) may be writable
    by others: they cannot rename or remove what they do not own in it."""
    uid = os.geteuid()
    while True:
        try:
            st = os.lstat(path)
        except OSError as exc:
            return f"cannot check {path}: {exc.strerror}"
        want = stat.S_ISREG if kind == "file" else stat.S_ISDIR
        if not want(st.st_mode):
            return f"{path} is not a {'regular file' if kind == 'file' else 'directory'}"
        if st.st_uid not in (uid, 0):
            return f"{path} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and (kind == "file" or not st.st_mode & stat.S_ISVTX):
            return f"{path} is writable by others"
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path, kind = parent, "dir"


def _compile(what: str, compiler: str, directory: str, target: str, command: Sequence[str], mode: int = 0o700) -> None:
    """Run COMPILER COMMAND -o OUT in a private directory inside DIRECTORY, then rename OUT to
    TARGET with MODE (atomic: concurrent builders just race to the same result)."""
    try:
        work = tempfile.mkdtemp(prefix=".build-", dir=directory)
    except OSError as exc:
        raise BuildFailed(f"cannot build the {what} in {directory}: {exc.strerror}") from None
    try:
        out = os.path.join(work, "out")
        proc = subprocess.run([compiler, *command, "-o", out], capture_output=True, text=True)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            first = [ln for ln in lines if "error" in ln or "cannot find" in ln] or lines or ["no output"]
            raise BuildFailed(
                f"building the {what} failed ({os.path.basename(compiler)}): {first[0].strip()}", proc.stderr
            )
        try:
            os.chmod(out, mode)
            os.replace(out, target)
        except OSError as exc:
            raise BuildFailed(f"cannot install the {what} as {target}: {exc.strerror}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_cached(
    name: str,
    sources: Sequence[str],
    flags: Sequence[str] = (),
    libs: Sequence[str] = (),
    kind: str = "exe",
    what: str | None = None,
    cache_label: str | None = None,
    everyone: bool = False,
) -> str:
    """Path of NAME compiled from SOURCES (C or C++ files; headers listed too, so a change to
    one is a new build, but not compiled) with FLAGS, linked with LIBS, as an executable (kind
    "exe") or a shared library ("shared"), building it if this exact input has not been built
    yet. The compiler is $CC, else gcc. WHAT names the result in errors ("the replay
    simulator"); CACHE_LABEL in the note printed when the cache is not trusted. EVERYONE (a
    library other users' processes load: the interposer in a child that switched user): built
    by root into SYSTEM_CACHE, readable (not writable) by all, rather than root's own cache.

    Raises BuildFailed (a PymtraceError: one line) when no compiler exists or it fails."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    what = what or f"native helper {name}"
    text = b""
    for path in sources:
        try:
            with open(path, "rb") as f:
                text += f.read() + b"\0"
        except OSError as exc:
            raise BuildFailed(
                f"the {what}'s source {path} is unreadable ({exc.strerror}); reinstall pymtrace"
            ) from None
    cc = os.environ.get("CC", "gcc")
    compiled = [s for s in sources if not s.endswith((".h", ".hpp"))]
    command = [*flags, *(["-shared", "-fPIC"] if kind == "shared" else []), *compiled, *libs]
    key_text = text + cc.encode() + b"\0" + " ".join([*flags, kind, *libs]).encode()
    filename = f"pymtrace-{name}-{hashlib.sha256(key_text).hexdigest()[:16]}" + (".so" if kind == "shared" else "")
    shared = everyone and os.geteuid() == 0
    cache = SYSTEM_CACHE if shared else os.path.abspath(cache_dir())
    existing = cache
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    why = untrusted(os.path.realpath(existing), "dir")  # checked before creating anything in it
    if why is None:
        try:
            os.makedirs(cache, mode=0o755 if shared else 0o700, exist_ok=True)
            cache = os.path.realpath(cache)
            why = untrusted(cache, "dir")
        except OSError as exc:
            why = f"cannot create {cache}: {exc.strerror}"
    if why is None:
        target = os.path.join(cache, filename)
        if untrusted(target, "file") is None:
            return target
    compiler = shutil.which(cc)
    if compiler is None:
        raise BuildFailed(
            f"building the {what} needs a C compiler, and `{cc}` was not found "
            f"(Debian/Ubuntu: apt install gcc; Fedora: dnf install gcc; or set CC)"
        )
    if why is not None:
        print(
            f"pymtrace: note: not using the {cache_label or name} cache ({why}); building it privately",
            file=sys.stderr,
        )
        cache = tempfile.mkdtemp(prefix=f"pymtrace-{name}-")
        atexit.register(shutil.rmtree, cache, True)
        target = os.path.join(cache, filename)
    _compile(what, compiler, cache, target, command, 0o755 if shared else 0o700)
    return target
