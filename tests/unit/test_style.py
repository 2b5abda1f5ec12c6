"""The tree's own rules, checked like any behaviour: lint and format (ruff, clang-format), the
dependency rule between subpackages (import-linter contracts in pyproject.toml) and no import of
another module's private name. Each tool is installed by install.sh (ruff and import-linter are
test extras, clang-format a system package)."""

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from support.needs import missing_or_fail

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


def tool(name):
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        missing_or_fail(f"{name} is not installed (./install.sh installs it)")
    return str(path)


# Not project files: where a tree without git (the test VMs get an rsync of the working tree)
# keeps caches and results
UNTRACKED_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", "results"}


def tracked(*patterns):
    """The project's files matching PATTERNS (git's; in a tree without git, as in the test VMs,
    every file below the root but caches and results)."""
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True)
        files = out.stdout.split() if out.returncode == 0 else None
    except FileNotFoundError:  # no git at all
        files = None
    if files is None:
        files = sorted(
            {
                str(f.relative_to(ROOT))
                for pattern in patterns
                for f in ROOT.rglob(pattern)
                if f.is_file()
                and not UNTRACKED_DIRS & set(f.relative_to(ROOT).parts)
                and not any(part.endswith(".egg-info") for part in f.relative_to(ROOT).parts)
            }
        )
    return files


def run(cmd):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


# --no-cache: nothing written into the tree, which may be read-only to the user running the tests
def test_ruff_lint():
    out = run([tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."])
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format():
    out = run([tool("ruff"), "format", "--no-cache", "--check", "."])
    assert out.returncode == 0, out.stdout + out.stderr


# The tree's C is formatted by this clang-format major version (Debian 12's, the CI
# machine's); others lay out the same .clang-format differently (Debian 13's 19 failed it).
CLANG_FORMAT_MAJOR = 14


def test_clang_format():
    version = run([tool("clang-format"), "--version"]).stdout
    major = re.search(r"version (\d+)", version)
    if major is None or int(major.group(1)) != CLANG_FORMAT_MAJOR:
        pytest.skip(f"the C is formatted by clang-format {CLANG_FORMAT_MAJOR}, this is: {version.strip()}")
    files = tracked("*.c", "*.h")
    assert any(f.startswith("bpf/") for f in files)
    out = run([tool("clang-format"), "--dry-run", "-Werror", *files])
    assert out.returncode == 0, out.stderr[-4000:]


def test_dependency_rule():
    """The layers of pyproject.toml's contracts hold (each imports only those below it, the
    packages of one layer are independent), no command imports another, and no sibling modules
    or packages import each other in a cycle."""
    out = run([tool("lint-imports"), "--no-cache"])
    assert out.returncode == 0, out.stdout[-4000:]
    assert "BROKEN" not in out.stdout


def import_cycles(edges):
    """The strongly connected components of more than one module in EDGES {module: imported}."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_import_cycles_finder():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_modules():
    """No module imports itself back through others, counting what Python imports implicitly:
    importing pymtrace.a.b runs pymtrace.a's __init__ first, so a package's __init__ that imports
    its own modules is in a cycle with every one of them that imports from the package."""
    import grimp  # import-linter's graph library, installed with it

    graph = grimp.build_graph("pymtrace", cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    for module in graph.modules:
        if "." in module:  # every module's parent package runs before it
            edges[module].add(module.rsplit(".", 1)[0])
    assert import_cycles(edges) == []


def test_no_module_imports_another_modules_private_name():
    bad = []
    for rel in tracked("pymtrace/*.py", "pymtrace/**/*.py"):
        tree = ast.parse((ROOT / rel).read_text(), rel)
        me = rel[:-3].replace("/", ".").removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pymtrace"):
                if node.module == me:
                    continue
                bad += [f"{rel}:{node.lineno} {node.module}.{a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                # module._name through an imported pymtrace module (e.g. `launch._interpreter`)
                if isinstance(node.value, ast.Name) and node.value.id in _pymtrace_modules(tree):
                    bad.append(f"{rel}:{node.lineno} {node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _pymtrace_modules(tree):
    """Names bound to pymtrace modules by this file's imports (`from pymtrace.x import y as z`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pymtrace"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if (ROOT / (full.replace(".", "/") + ".py")).exists() or (ROOT / full.replace(".", "/")).is_dir():
                    names.add(a.asname or a.name)
    return names


def test_no_test_imports_conftest():
    """Helpers live in tests/support; conftest.py holds fixtures and hooks, which pytest
    provides without an import."""
    bad = [
        rel
        for rel in tracked("tests/*.py", "tests/**/*.py")
        if re.search(r"^\s*(from conftest import|import conftest)", (ROOT / rel).read_text(), re.M)
    ]
    assert bad == []


def test_test_files_have_distinct_names():
    """Test directories are not packages: pytest imports each test file by its basename, so
    two with one name (tests/unit/test_x.py, tests/live/test_x.py) stop the suite's
    collection with an import mismatch."""
    names = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
