"""The CPython interpreters the Python-frame tests run on, and the py_chains workload
(workloads/py_chains.py: known call chains, one through libc's qsort) as folded-stack patterns.

Interpreters: $PYMTRACE_TEST_PYTHONS (paths, colon-separated) if set; else pyenv's newest of
each of 3.10-3.13 ($PYENV_ROOT, default /root/.pyenv; a minor missing skips its tests, or fails
them under PYMTRACE_REQUIRE_BPF=1) and the system's python3 when it is one of those versions
(Debian 12: 3.11, Debian 13: 3.13). In a VM without pyenv:
PYMTRACE_TEST_PYTHONS=/usr/bin/python3.
"""

import functools
import glob
import json
import os
import re
import subprocess

from support.needs import missing_or_fail
from support.paths import WORKLOADS

MINORS = ("3.10", "3.11", "3.12", "3.13")
WORKLOAD = WORKLOADS / "py_chains.py"
MALLOC = r"(__libc_)?malloc"
NATIVE = r"(;[^;()]+)*"  # native frames: no Python frame ("name (file:line)") among them


@functools.lru_cache(maxsize=None)
def version_of(python):
    """'3.11' for the interpreter at PYTHON, or None when it does not run."""
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def pyenv_python(minor):
    """pyenv's newest interpreter of MINOR ('3.12'), or None."""
    root = os.environ.get("PYENV_ROOT", "/root/.pyenv")
    found = glob.glob(os.path.join(root, "versions", f"{minor}.*", "bin", f"python{minor}"))
    found = [p for p in found if re.search(rf"/{re.escape(minor)}\.\d+/bin/", p)]
    return max(found, key=lambda p: int(p.split("/versions/")[1].split("/")[0].split(".")[2]), default=None)


def interpreters():
    """[(test id, python path or None, minor)]: what the tests are parametrized over."""
    given = os.environ.get("PYMTRACE_TEST_PYTHONS")
    if given:
        return [(f"{version_of(p) or '?'}-{os.path.basename(p)}", p, version_of(p)) for p in given.split(":") if p]
    out = [(minor, pyenv_python(minor), minor) for minor in MINORS]
    system = "/usr/bin/python3"
    if version_of(system) in MINORS:
        out.append((f"system-{version_of(system)}", system, version_of(system)))
    return out


def python_or_missing(python, minor):
    """PYTHON, or skip (fail under PYMTRACE_REQUIRE_BPF=1) when it is not there."""
    if python is None or version_of(python) is None:
        missing_or_fail(f"no CPython {minor} (pyenv install {minor}, or set PYMTRACE_TEST_PYTHONS)")
    return python


@functools.lru_cache(maxsize=None)
def lines():
    """{marker: line number} of the workload's `# at: NAME` comments."""
    found = {}
    for number, text in enumerate(WORKLOAD.read_text().splitlines(), 1):
        m = re.search(r"# at: (\w+)", text)
        if m:
            found[m.group(1)] = number
    return found


def frame(function, marker):
    """The folded name of a workload frame: FUNCTION at the line of MARKER."""
    return rf"{re.escape(function)} \({re.escape(str(WORKLOAD))}:{lines()[marker]}\)"


def expected(python):
    """The bytes of each chain as PYTHON sizes them (the workload's first line)."""
    out = subprocess.run([python, str(WORKLOAD), "sizes"], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.splitlines()[0])


# folded patterns (root first) of each chain's allocations: from the root (native frames up
# to the script's <module>) through the leaf's native frames to malloc
ROOT = r"[^()]*;" + frame("<module>", "main")  # _start, libc's start-up; the script
_ALPHA = f"{ROOT};{frame('main', 'main_alpha')}"
CHAINS = {
    "bytes_a": f"{_ALPHA};{frame('alpha', 'alpha_beta')};{frame('beta', 'beta_a')};{frame('leaf_a', 'bytes_a')}",
    "list": f"{_ALPHA};{frame('alpha', 'alpha_beta')};{frame('beta', 'beta_list')};{frame('leaf_list', 'list')}",
    "dict": f"{_ALPHA};{frame('alpha', 'alpha_gamma')};{frame('gamma', 'gamma')};{frame('leaf_leak', 'dict')}",
    "leak": f"{_ALPHA};{frame('alpha', 'alpha_gamma')};{frame('gamma', 'gamma')};{frame('leaf_leak', 'leak')}",
    # libc's qsort (C) between through_c and the Python comparison it calls back
    "callback": f"{ROOT};{frame('main', 'main_c')};{frame('through_c', 'qsort')}(;[^;()]+)*;[^;()]*qsort[^;()]*"
    + f"(;[^;()]+)*;{frame('compare', 'compare')};{frame('callback_leaf', 'callback')}",
    # above worker: the thread's start (native) and threading's frames
    "thread": f".*;{frame('worker', 'worker')};{frame('thread_leaf', 'thread')}",
    # above task_outer: asyncio's event loop, Python and C (the _asyncio extension's task_step)
    "async": f"{ROOT};{frame('main', 'main_async')};.*;{frame('task_outer', 'task_outer')};{frame('async_leaf', 'async')}",
}
CHAINS = {name: f"{chain}{NATIVE};{MALLOC}" for name, chain in CHAINS.items()}
# object() instances: pymalloc's, seen with --python-allocators (its allocator, not malloc, the leaf)
OBJECTS = f"{ROOT};{frame('main', 'main_objects')};{frame('leaf_objects', 'objects')}{NATIVE}"
# --python-only: the same chains without native frames
PYTHON_ONLY = {
    "bytes_a": ";".join(
        [frame("<module>", "main"), frame("main", "main_alpha"), frame("alpha", "alpha_beta")]
        + [frame("beta", "beta_a"), frame("leaf_a", "bytes_a")]
    ),
    "callback": ";".join(
        [frame("<module>", "main"), frame("main", "main_c"), frame("through_c", "qsort")]
        + [frame("compare", "compare"), frame("callback_leaf", "callback")]
    ),
}


def folded(path):
    """{stack root first: value} of a folded file."""
    out = {}
    for line in open(path, encoding="utf-8"):
        stack, value = line.rstrip("\n").rsplit(" ", 1)
        out[stack] = out.get(stack, 0) + int(value)
    return out


def total(stacks, pattern):
    """The summed value of the folded STACKS matching PATTERN (a regex over a whole stack)."""
    return sum(v for s, v in stacks.items() if re.fullmatch(pattern, s))
