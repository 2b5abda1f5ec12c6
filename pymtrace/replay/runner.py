"""The replay library behind `pymtrace replay`: build the native simulator, configure and run it.

The replay itself is the native simulator pymtrace/replay/native/replay.c, compiled on first use
into a cache directory keyed by the source's hash (trusted only if nobody else can write it).
Each configuration (`Config`) runs it in its own process with the allocator LD_PRELOADed,
GLIBC_TUNABLES set and mallopt() called (`run_once`); `median_result` folds repeated runs.
What the simulator and Python share (call names, exit codes, mallopt parameters) is read from
pymtrace/replay/native/wl.h. The table and the plot are pymtrace/replay/report.py's.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import subprocess
from collections.abc import Iterable

from pymtrace import jsonread, nativebuild
from pymtrace.bpf import structs
from pymtrace.errors import CorruptFile, PymtraceError

NATIVE_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "replay.c")
NATIVE_HEADER = os.path.join(os.path.dirname(NATIVE_SRC), "wl.h")  # the contract, read by both sides
CFLAGS = ["-O2", "-g", "-pthread", "-Wall"]
KNOWN_ALLOCATORS = {
    "glibc": None,
    "jemalloc": ["libjemalloc.so.2", "libjemalloc.so"],
    "tcmalloc": ["libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"],
    "mimalloc": ["libmimalloc.so.2", "libmimalloc.so.3", "libmimalloc.so"],  # .3: Debian 13
}
REPORT_LIMIT = 64 << 20  # the simulator's JSON report: its statistics, never near this
_WL = structs.native_header("wl")
CALL_TYPES = list(_WL.names("WL_CALL_").values())  # the simulator's "calls", in its order
# mallopt() parameters the simulator knows by name: {"M_MMAP_THRESHOLD": -3, ...}
MALLOPT_PARAMS = {
    "M_" + name[len("WL_MALLOPT_") :]: value for name, value in _WL.consts.items() if name.startswith("WL_MALLOPT_")
}
MALLOPT_NAMES = frozenset(MALLOPT_PARAMS)
EXIT_MEANING = {
    _WL.consts["WL_EXIT_INVALID"]: "invalid workload",
    _WL.consts["WL_EXIT_DEADLOCK"]: "deadlock or stall",
    _WL.consts["WL_EXIT_RESOURCE"]: "out of resources",
}


# -- building the simulator ----------------------------------------------------------------
def simulator_path() -> str:
    """Path of the compiled simulator, building it if this source has not been built yet.

    The cache (target/nativebuild.py) is used only if it and every directory above it belong
    to this user (or root) and nobody else can write them; otherwise the simulator is built
    into a private temporary directory, removed at exit, and nothing in the cache is executed.
    wl.h is part of the key: a change to either file is a new build."""
    return nativebuild.build_cached(
        "replay", [NATIVE_SRC, NATIVE_HEADER], CFLAGS, what="replay simulator", cache_label="simulator"
    )


# -- configurations -------------------------------------------------------------------------
def find_library(name: str) -> str:
    """Path of an allocator library, or raise PymtraceError saying what is missing."""
    if "/" in name:
        if not os.path.exists(name):
            raise PymtraceError(f"library not found: {name}")
        return os.path.realpath(name)
    candidates = KNOWN_ALLOCATORS.get(name)
    if candidates is None:
        raise PymtraceError(f"unknown allocator {name!r} (glibc, jemalloc, tcmalloc, mimalloc or a path)")
    found = _ldconfig()
    for cand in candidates:
        if cand in found:
            return os.path.realpath(found[cand])
    pkg = {
        "jemalloc": "libjemalloc2",
        "tcmalloc": "libtcmalloc-minimal4",
        "mimalloc": "libmimalloc2.0 (Debian 13: libmimalloc3)",
    }[name]
    raise PymtraceError(f"{name} not installed ({' / '.join(candidates)} not in ldconfig; Debian: apt install {pkg})")


_LDCONFIG = None


def _ldconfig() -> dict[str, str]:
    global _LDCONFIG
    if _LDCONFIG is None:
        _LDCONFIG = {}
        try:
            out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        except OSError:
            out = ""
        for line in out.splitlines():
            if "=>" in line and ("x86-64" in line or "64" not in line.split("=>")[0]):
                name = line.strip().split()[0]
                _LDCONFIG.setdefault(name, line.split("=>")[1].strip())
    return _LDCONFIG


class Config:
    """One configuration (one table row): an allocator with its tunables, mallopt() settings
    and malloc_trim interval, parsed and checked from `NAME[:SETTING,...]`."""

    def __init__(self, spec: str, tunables: Iterable[str] = (), mallopts: Iterable[str] = (), trim: int = 0):
        name, _, settings = spec.partition(":")
        self.spec = spec
        self.allocator = name or "glibc"
        self.tunables = list(tunables)
        self.mallopts = list(mallopts)
        self.trim = trim
        for item in filter(None, (s.strip() for s in settings.split(","))):
            if item.startswith("glibc."):
                self.tunables.append(item)
            elif item.startswith("M_") or item.split("=")[0].lstrip("-").isdigit():
                self.mallopts.append(item)
            elif item.startswith("trim="):
                value = item[5:]
                if not (value.isascii() and value.isdigit() and len(value) <= 18):
                    raise PymtraceError(f"--allocator {spec}: trim=N needs a number of calls, not {value!r}")
                self.trim = int(value)
            else:
                raise PymtraceError(
                    f"--allocator {spec}: unknown setting {item!r} (glibc.malloc.X=V, M_NAME=V or trim=N)"
                )
        for t in self.tunables:
            if "=" not in t or not t.startswith("glibc."):
                raise PymtraceError(f"tunable {t!r} is not glibc.NAMESPACE.NAME=VALUE")
        for m in self.mallopts:
            name, eq, value = m.partition("=")
            if not eq or not (name in MALLOPT_NAMES or name.lstrip("-").isdigit()):
                raise PymtraceError(
                    f"mallopt setting {m!r} is not M_NAME=VALUE with M_NAME one of "
                    + ", ".join(sorted(MALLOPT_NAMES))
                    + " (or a parameter number)"
                )
            try:
                int(value, 0)
            except ValueError:
                raise PymtraceError(f"mallopt setting {m!r}: {value!r} is not a number") from None

    @property
    def label(self) -> str:
        """The configuration as the table's first column shows it."""
        parts = [self.allocator] + self.tunables + self.mallopts + ([f"trim={self.trim}"] if self.trim else [])
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How every configuration's simulator runs (the replay command's common options)."""

    sync: str = "futex"  # cross-thread ordering: "futex" or "mutex"
    timer: str = "auto"  # "auto", "rdtscp" or "clock"
    sample_ms: int = 5  # RSS sampling interval
    text: bool = False  # also produce the upstream-style text report
    no_fill: bool = False  # do not write into the blocks
    timeout: float = 600  # seconds for one run


def check_workload(sim: str, wl_path: str, name: str, timeout: float) -> None:
    """Validate the workload with the simulator's --check (bounded by TIMEOUT seconds); raise
    CorruptFile with the simulator's one-line reason if it is invalid."""
    try:
        check = subprocess.run([sim, "--check", wl_path], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PymtraceError(f"{name}: validating the workload took more than --timeout {timeout:g} s") from None
    if check.returncode != 0:
        msg = (check.stderr.strip().splitlines() or ["invalid workload"])[-1]
        raise CorruptFile(msg.split(": ", 1)[-1] if msg.startswith("pymtrace-replay: ") else msg)


def run_once(
    sim: str, wl_path: str, cfg: Config, options: RunOptions, json_path: str
) -> tuple[dict | None, str | None, str]:
    """Run the simulator SIM once on WL_PATH under configuration CFG, its --json report going to
    JSON_PATH; returns (result dict or None, error string or None, the text report)."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    lib = None
    if cfg.allocator != "glibc":
        lib = find_library(cfg.allocator)
        env["LD_PRELOAD"] = lib
    if cfg.tunables:
        env["GLIBC_TUNABLES"] = ":".join(cfg.tunables)
    else:
        env.pop("GLIBC_TUNABLES", None)
    cmd = [
        sim,
        "--json",
        json_path,
        "--sync",
        options.sync,
        "--timer",
        options.timer,
        "--sample-ms",
        str(options.sample_ms),
    ]
    if options.text:
        cmd.append("--text")
    if options.no_fill:
        cmd.append("--no-fill")
    if cfg.trim:
        cmd += ["--trim", str(cfg.trim)]
    for m in cfg.mallopts:
        cmd += ["--mallopt", m]
    cmd.append(wl_path)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=options.timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {options.timeout:g} s", ""
    err = proc.stderr.strip()
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        return None, f"crashed: {sig}" + (f" ({err.splitlines()[-1]})" if err else ""), proc.stdout
    if proc.returncode != 0:
        meaning = EXIT_MEANING.get(proc.returncode, f"exit {proc.returncode}")
        return None, f"{meaning}: " + (err.splitlines()[-1] if err else "no message"), proc.stdout
    try:
        with open(json_path) as f:
            result = jsonread.load(f, REPORT_LIMIT)
    except (OSError, ValueError) as exc:
        return None, f"no report from the simulator ({exc})", proc.stdout
    if lib is not None:
        mapped = {os.path.realpath(p) for p in result.get("libraries", [])}
        if lib not in mapped:
            why = next((line for line in err.splitlines() if "LD_PRELOAD" in line), "")
            return (
                None,
                f"{os.path.basename(lib)} was not loaded into the simulator" + (f": {why}" if why else ""),
                proc.stdout,
            )
        result["allocator_library"] = lib
    if "ld.so" in err and "cannot be preloaded" in err:
        return None, err.splitlines()[-1], proc.stdout
    return result, None, proc.stdout


def median_result(results: list[dict]) -> dict:
    """Per-field medians over repeated runs; the RSS curve is the median-wall run's."""
    if len(results) == 1:
        return results[0]
    by_wall = sorted(results, key=lambda r: r["wall_us"])
    out = dict(by_wall[len(by_wall) // 2])
    for key, value in results[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in results)
    calls = {}
    for name in results[0]["calls"]:
        calls[name] = {
            k: statistics.median(r["calls"][name][k] for r in results if name in r["calls"])
            for k in results[0]["calls"][name]
        }
    out["calls"] = calls
    out["runs"] = len(results)
    out["uprobed"] = " ".join(sorted({f for r in results for f in r.get("uprobed", "").split()}))
    return out


def prepare_workload(path: str, tmpdir: str) -> tuple[str, dict | None]:
    """A .wl path for PATH: itself, or a conversion of the binary trace it holds (into TMPDIR);
    with the conversion's statistics, or None when PATH is used as it is."""
    from pymtrace.trace.formats import mtrace_bin

    try:
        mtrace_bin.detect_byteorder(mtrace_bin.read_first(path))
    except CorruptFile:
        return path, None
    from pymtrace.trace import workload

    out = os.path.join(tmpdir, "workload.wl")
    stats, counts = workload.convert_file(path, out, max_warnings=5)
    return out, stats
