"""Loading BCC programs from bpf/ with clear, one-line failures.

Every BPF program is one C file in bpf/ plus one header for the structs it shares with
user space (see pymtrace.structs). BCC compiles them at run time with clang and the
kernel headers under /lib/modules/$(uname -r)/build.
"""
import os
import pathlib

from pymtrace.errors import NotRootError, PymtraceError

TRACEFS = "/sys/kernel/tracing"


def bpf_dir():
    """The directory holding the BPF C sources (source tree or installed package)."""
    src = pathlib.Path(__file__).resolve().parent.parent / "bpf"
    if (src / "common.h").exists():
        return src
    import importlib.resources

    return pathlib.Path(str(importlib.resources.files("pymtrace.bpf")))


def import_bcc():
    """Import the distro's BCC module, or fail with what to install."""
    try:
        import bcc  # noqa: F401
    except ImportError as exc:
        raise PymtraceError(
            "BCC's Python module is missing: install python3-bpfcc (Debian/Ubuntu) or "
            "python3-bcc (Fedora) and use a Python that sees it (./install.sh does both); "
            f"({exc})"
        ) from None
    if not hasattr(bcc, "BPF"):
        raise PymtraceError(
            f"the `bcc` module at {getattr(bcc, '__file__', '?')} is the unrelated PyPI "
            "package; uninstall it (pip uninstall bcc) and use the distro's python3-bpfcc"
        )
    return bcc


def require_root(what="this command"):
    if os.geteuid() != 0:
        raise NotRootError(what)


def ensure_tracefs():
    """BCC creates and removes uprobe events through tracefs; mount it if it is not."""
    if os.path.exists(os.path.join(TRACEFS, "uprobe_events")):
        return
    rc = os.system(f"mount -t tracefs nodev {TRACEFS} >/dev/null 2>&1")
    if rc != 0 or not os.path.exists(os.path.join(TRACEFS, "uprobe_events")):
        raise PymtraceError(
            f"tracefs is not mounted at {TRACEFS} and mounting it failed; "
            f"run: mount -t tracefs nodev {TRACEFS}"
        )


def load(program, defines=None, prelude="", what=None):
    """Compile bpf/PROGRAM.bpf.c with BCC and return the bcc.BPF object.

    defines: {NAME: value} passed as -DNAME=value (sizes, feature switches).
    prelude: extra C text placed before the file (generated code, e.g. USDT argument readers).
    """
    require_root(what or f"loading the {program} BPF program")
    bcc = import_bcc()
    ensure_tracefs()
    directory = bpf_dir()
    path = directory / f"{program}.bpf.c"
    cflags = [f"-I{directory}", "-Wno-macro-redefined", "-Wno-unused-function"]
    for name, value in (defines or {}).items():
        cflags.append(f"-D{name}={value}")
    text = prelude + path.read_text()
    try:
        return bcc.BPF(text=text.encode(), cflags=cflags)
    except Exception as exc:  # BCC raises plain Exception on compile/load failures
        build = f"/lib/modules/{os.uname().release}/build"
        hint = (
            f"kernel headers not found at {build} (run ./install.sh or pymtrace doctor)"
            if not os.path.exists(build)
            else "run `pymtrace doctor` to see which requirement is missing"
        )
        raise PymtraceError(f"cannot compile/load BPF program {program}: {exc}; {hint}") from None


def detach_all(bpf):
    """Detach every probe and free the maps; safe to call twice."""
    if bpf is None:
        return
    try:
        bpf.cleanup()
    except Exception:  # cleanup after a partially failed attach must not mask the real error
        pass


def own_uprobe_events(pid=None):
    """uprobe_events lines that belong to this process's BCC (BCC names them ..._bcc_PID)."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(os.path.join(TRACEFS, "uprobe_events")) as f:
            return [line for line in f if f"_bcc_{pid}" in line]
    except OSError:
        return []
