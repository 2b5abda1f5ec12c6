"""`pymtrace replay`: replay a workload against allocators and settings, side by side.

The replay itself is the native simulator pymtrace/replay/native/replay.c, compiled on first use
into a cache directory keyed by the source's hash. Each configuration runs it in its own
process with the allocator LD_PRELOADed, GLIBC_TUNABLES set and mallopt() called, --repeat
times; the table shows medians. A configuration that fails (missing library, crash, the
preload being ignored) is reported in its row and the others still run.
"""

import atexit
import hashlib
import json
import os
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile

from pymtrace.bpf import structs
from pymtrace.errors import CorruptFile, PymtraceError
from pymtrace.trace.files import atomic_output, check_new

HELP = (
    "Replay a .wl workload (or a binary trace, converted on the fly) against allocators and tunables and compare them."
)
EPILOG = """configurations (one table row each):
  --allocator NAME[:SETTING,...]   NAME: glibc, jemalloc, tcmalloc, mimalloc or /path/lib.so
      SETTING: glibc.malloc.X=V (GLIBC_TUNABLES), M_NAME=V (mallopt), trim=N (malloc_trim)
  --tunable/--mallopt/--trim-interval apply to every configuration.

examples:
  pymtrace replay app.wl --allocator glibc --allocator jemalloc --allocator tcmalloc
  pymtrace replay app.mtrace --allocator glibc --allocator glibc:glibc.malloc.arena_max=1 --repeat 5
  pymtrace replay app.wl --allocator glibc:M_MMAP_THRESHOLD=65536,trim=10000 --plot cmp.png --json
  pymtrace replay app.wl --text        # upstream trace_run style report per run

Times are CPU cycles from RDTSCP (the 'unit' column says ns when the CPU has none and
clock_gettime was used). Max RSS is the simulator's peak RSS during the replay (VmHWM):
the allocator's memory plus the simulator's own (tables, code), not the workload file, whose
pages are dropped as they are replayed. Ideal RSS is the peak of requested live bytes; peak
anon RSS comes from /proc/self/statm sampled every --sample-ms. --timeout also bounds the
validation of the workload."""

NATIVE_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "replay.c")
NATIVE_HEADER = os.path.join(os.path.dirname(NATIVE_SRC), "wl.h")  # the contract, read by both sides
CFLAGS = ["-O2", "-g", "-pthread", "-Wall"]
KNOWN_ALLOCATORS = {
    "glibc": None,
    "jemalloc": ["libjemalloc.so.2", "libjemalloc.so"],
    "tcmalloc": ["libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"],
    "mimalloc": ["libmimalloc.so.2", "libmimalloc.so"],
}
MALLOPT_NAMES = {
    "M_MXFAST",
    "M_NLBLKS",
    "M_GRAIN",
    "M_KEEP",
    "M_TRIM_THRESHOLD",
    "M_TOP_PAD",
    "M_MMAP_THRESHOLD",
    "M_MMAP_MAX",
    "M_CHECK_ACTION",
    "M_PERTURB",
    "M_ARENA_TEST",
    "M_ARENA_MAX",
}
_WL = structs.native_header("wl")
CALL_TYPES = list(_WL.names("WL_CALL_").values())  # the simulator's "calls", in its order
EXIT_MEANING = {
    _WL.consts["WL_EXIT_INVALID"]: "invalid workload",
    _WL.consts["WL_EXIT_DEADLOCK"]: "deadlock or stall",
    _WL.consts["WL_EXIT_RESOURCE"]: "out of resources",
}


def configure(parser):
    parser.add_argument("workload", help=".wl workload, or a binary mtrace trace (converted first)")
    parser.add_argument(
        "--allocator",
        action="append",
        metavar="NAME[:SETTINGS]",
        help="a configuration to run (repeatable; default glibc)",
    )
    parser.add_argument(
        "--tunable",
        action="append",
        default=[],
        metavar="glibc.malloc.X=V",
        help="GLIBC_TUNABLES entry for every configuration (repeatable)",
    )
    parser.add_argument(
        "--mallopt",
        action="append",
        default=[],
        metavar="M_NAME=V",
        help="mallopt() setting for every configuration (repeatable)",
    )
    parser.add_argument(
        "--trim-interval",
        type=int,
        default=0,
        metavar="N",
        help="each replay thread calls malloc_trim(0) after every N of its calls",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, metavar="K", help="run each configuration K times, report medians"
    )
    parser.add_argument(
        "--sync",
        choices=("futex", "mutex"),
        default="futex",
        help="cross-thread ordering: futex words (default) or upstream's mutex+condvar",
    )
    parser.add_argument("--timer", choices=("auto", "rdtscp", "clock"), default="auto")
    parser.add_argument("--sample-ms", type=int, default=5, metavar="MS", help="RSS sampling interval (default 5)")
    parser.add_argument(
        "--no-fill", action="store_true", help="do not write 0x11/0x22 into blocks (pages stay untouched)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600,
        metavar="S",
        help="stop validating the workload, or a run, after S seconds (default 600)",
    )
    parser.add_argument("--plot", metavar="FILE.png|svg", help="plot RSS over time and cycles per call type")
    parser.add_argument(
        "--force", action="store_true", help="replace the --plot FILE if it exists (never through a symlink)"
    )
    parser.add_argument("--json", action="store_true", help="print all results as JSON instead of the table")
    parser.add_argument("--text", action="store_true", help="also print each run's upstream-style text report")


# -- building the simulator ----------------------------------------------------------------
def _cache_dir():
    base = os.environ.get("PYMTRACE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pymtrace"
    )
    return os.path.join(base, "native")


def _untrusted(path, kind):
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


def _build(compiler, directory, exe):
    """Compile the simulator into a private directory inside DIRECTORY, then rename it to EXE
    (atomic: concurrent builders just race to the same result)."""
    try:
        work = tempfile.mkdtemp(prefix=".build-", dir=directory)
    except OSError as exc:
        raise PymtraceError(f"cannot build the replay simulator in {directory}: {exc.strerror}") from None
    try:
        out = os.path.join(work, "replay")
        proc = subprocess.run([compiler, *CFLAGS, "-o", out, NATIVE_SRC], capture_output=True, text=True)
        if proc.returncode != 0:
            raise PymtraceError(
                f"building the replay simulator failed ({os.path.basename(compiler)}): "
                + (proc.stderr.strip().splitlines() or ["no output"])[-1]
            )
        try:
            os.chmod(out, 0o700)
            os.replace(out, exe)
        except OSError as exc:
            raise PymtraceError(f"cannot install the replay simulator as {exe}: {exc.strerror}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def simulator_path():
    """Path of the compiled simulator, building it if this source has not been built yet.

    The cache is used only if it and every directory above it belong to this user (or root)
    and nobody else can write them; otherwise the simulator is built into a private
    temporary directory, removed at exit, and nothing in the cache is executed."""
    src = b""
    for path in (NATIVE_SRC, NATIVE_HEADER):  # a change to either is a new build
        with open(path, "rb") as f:
            src += f.read()
    cc = os.environ.get("CC", "gcc")
    key = hashlib.sha256(src + b"\0" + cc.encode() + b"\0" + " ".join(CFLAGS).encode()).hexdigest()[:16]
    name = f"pymtrace-replay-{key}"
    cache = os.path.abspath(_cache_dir())
    existing = cache
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    why = _untrusted(os.path.realpath(existing), "dir")  # checked before creating anything in it
    if why is None:
        try:
            os.makedirs(cache, mode=0o700, exist_ok=True)
            cache = os.path.realpath(cache)
            why = _untrusted(cache, "dir")
        except OSError as exc:
            why = f"cannot create {cache}: {exc.strerror}"
    if why is None:
        exe = os.path.join(cache, name)
        if _untrusted(exe, "file") is None:
            return exe
    compiler = shutil.which(cc)
    if compiler is None:
        raise PymtraceError(
            f"building the replay simulator needs a C compiler, and `{cc}` was not found "
            f"(Debian/Ubuntu: apt install gcc; or set CC)"
        )
    if why is not None:
        print(f"pymtrace: note: not using the simulator cache ({why}); building it privately", file=sys.stderr)
        cache = tempfile.mkdtemp(prefix="pymtrace-sim-")
        atexit.register(shutil.rmtree, cache, True)
        exe = os.path.join(cache, name)
    _build(compiler, cache, exe)
    return exe


# -- configurations -------------------------------------------------------------------------
def find_library(name):
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
    pkg = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4", "mimalloc": "libmimalloc2.0"}[name]
    raise PymtraceError(f"{name} not installed ({' / '.join(candidates)} not in ldconfig; Debian: apt install {pkg})")


_LDCONFIG = None


def _ldconfig():
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
    def __init__(self, spec, tunables=(), mallopts=(), trim=0):
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
    def label(self):
        parts = [self.allocator] + self.tunables + self.mallopts + ([f"trim={self.trim}"] if self.trim else [])
        return " ".join(parts)


def run_once(sim, wl_path, cfg, args, json_path):
    """Run the simulator once; returns (result dict or None, error string or None, text)."""
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
    cmd = [sim, "--json", json_path, "--sync", args.sync, "--timer", args.timer, "--sample-ms", str(args.sample_ms)]
    if args.text:
        cmd.append("--text")
    if args.no_fill:
        cmd.append("--no-fill")
    if cfg.trim:
        cmd += ["--trim", str(cfg.trim)]
    for m in cfg.mallopts:
        cmd += ["--mallopt", m]
    cmd.append(wl_path)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {args.timeout:g} s", ""
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
            result = json.load(f)
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


def _median_result(results):
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


def prepare_workload(path, tmpdir):
    """A .wl path for PATH: itself, or a conversion of the binary trace it holds."""
    from pymtrace.trace.formats import mtrace_bin

    try:
        with open(path, "rb") as f:
            head = f.read(mtrace_bin.RECORD_SIZE)
    except OSError as exc:
        raise PymtraceError(f"cannot read {path}: {exc.strerror}") from None
    try:
        mtrace_bin.detect_byteorder(head)
    except CorruptFile:
        return path, None
    from pymtrace.trace import workload

    out = os.path.join(tmpdir, "workload.wl")
    stats, counts = workload.convert_file(path, out, max_warnings=5)
    return out, stats


def _fmt(v, digits=0):
    """An exact number with thousands separators ('12,345'): the replay table's columns name
    their unit (KiB, ms), so not pymtrace.sinks.text's scaled units (which replay, beside
    sinks in the dependency rule, does not import either)."""
    if v is None:
        return ""
    if isinstance(v, float) and digits:
        return f"{v:,.{digits}f}"
    return f"{int(round(v)):,}"


def table_rows(rows):
    """(headers, rows) for tabulate from [(label, result|None, error|None)]."""
    types = [t for t in CALL_TYPES if any(r and t in r["calls"] and r["calls"][t]["count"] for _, r, _ in rows)]
    headers = [
        "configuration",
        "status",
        "wall ms",
        "cpu ms",
        "Max RSS KiB (no .wl)",
        "peak anon KiB",
        "Ideal KiB",
        "unit",
    ]
    for t in types:
        headers += [f"{t} mean", f"{t} p99"]
    headers += ["calls"]
    out = []
    for label, r, err in rows:
        if r is None:
            out.append([label, err] + [""] * (len(headers) - 2))
            continue
        notes = []
        if r.get("runs", 1) > 1:
            notes.append(f"median of {r['runs']}")
        if r.get("uprobed"):
            notes.append("UPROBED: " + r["uprobed"].split()[0] + "... times include trace traps")
        line = [
            label,
            "ok" + (f" ({'; '.join(notes)})" if notes else ""),
            _fmt(r["wall_us"] / 1000, 1),
            _fmt((r["cpu_user_us"] + r["cpu_sys_us"]) / 1000, 1),
            _fmt(r["max_rss_kb"]),
            _fmt(r["anon_rss_peak_kb"]),
            _fmt(r["ideal_rss_peak_bytes"] / 1024),
            r["unit"],
        ]
        for t in types:
            c = r["calls"].get(t)
            line += [_fmt(c["mean"]) if c and c["count"] else "", _fmt(c["p99"]) if c and c["count"] else ""]
        line.append(_fmt(sum(c["count"] for k, c in r["calls"].items() if k != "malloc_trim")))
        out.append(line)
    return headers, out


def plot(rows, path, force=False):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PymtraceError("--plot needs matplotlib (pip install 'pymtrace[plot]')") from None
    ok = [(label, r) for label, r, _ in rows if r is not None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8))
    for label, r in ok:
        xs = [s[0] / 1000 for s in r["rss_samples"]]
        ax1.plot(xs, [s[2] / 1024 for s in r["rss_samples"]], label=label)
    ok = [(label + (" (uprobed: times include traps)" if r.get("uprobed") else ""), r) for label, r in ok]
    ax1.set_xlabel("time (ms)")
    ax1.set_ylabel("anonymous RSS (MiB)")
    ax1.set_title("RSS over time")
    if ok:
        ax1.legend(fontsize="small")
    types = [t for t in CALL_TYPES if any(t in r["calls"] and r["calls"][t]["count"] for _, r in ok)]
    width = 0.8 / max(1, len(ok))
    for i, (label, r) in enumerate(ok):
        vals = [r["calls"][t]["mean"] if t in r["calls"] else 0 for t in types]
        ax2.bar([x + i * width for x in range(len(types))], vals, width, label=label)
    ax2.set_xticks([x + width * (len(ok) - 1) / 2 for x in range(len(types))])
    ax2.set_xticklabels(types)
    ax2.set_ylabel(f"mean {ok[0][1]['unit'] if ok else 'cycles'} per call")
    ax2.set_yscale("log")
    ax2.set_title("cost per call type")
    if ok:
        ax2.legend(fontsize="small")
    fig.tight_layout()
    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    try:
        with atomic_output(path, force) as out:
            fig.savefig(out, format=fmt)
    except (OSError, ValueError) as exc:
        raise PymtraceError(f"cannot write the plot {path}: {exc}") from None
    plt.close(fig)


def run(args):
    if args.repeat < 1:
        raise PymtraceError("--repeat must be at least 1")
    if args.plot:
        check_new(args.plot, args.force)  # before the replay, not after it
    specs = args.allocator or ["glibc"]
    configs = [Config(s, args.tunable, args.mallopt, args.trim_interval) for s in specs]
    sim = simulator_path()
    with tempfile.TemporaryDirectory(prefix="pymtrace-replay-") as tmp:
        wl_path, conv = prepare_workload(args.workload, tmp)
        try:
            check = subprocess.run([sim, "--check", wl_path], capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise PymtraceError(
                f"{args.workload}: validating the workload took more than --timeout {args.timeout:g} s"
            ) from None
        if check.returncode != 0:
            msg = (check.stderr.strip().splitlines() or ["invalid workload"])[-1]
            raise CorruptFile(msg.split(": ", 1)[-1] if msg.startswith("pymtrace-replay: ") else msg)
        rows = []
        for n, cfg in enumerate(configs):
            results, error = [], None
            for k in range(args.repeat):
                try:
                    res, error, text = run_once(sim, wl_path, cfg, args, os.path.join(tmp, f"run{n}-{k}.json"))
                except PymtraceError as exc:
                    res, error, text = None, str(exc), ""
                if args.text and text:
                    print(f"== {cfg.label} (run {k + 1}) ==\n{text}", file=sys.stderr if args.json else sys.stdout)
                if error:
                    break
                results.append(res)
            rows.append((cfg.label, _median_result(results) if not error else None, error))
    if args.plot:
        plot(rows, args.plot, args.force)
    if args.json:
        json.dump(
            {
                "workload": args.workload,
                "converted": conv,
                "configurations": [{"configuration": label, "error": err, "result": r} for label, r, err in rows],
            },
            sys.stdout,
            indent=1,
        )
        print()
    else:
        from tabulate import tabulate

        headers, body = table_rows(rows)
        print(
            tabulate(
                body, headers=headers, disable_numparse=True, colalign=["left", "left"] + ["right"] * (len(headers) - 2)
            )
        )
    return 0 if any(r is not None for _, r, _ in rows) else 1
