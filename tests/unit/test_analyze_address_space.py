"""`pymtrace analyze` under an address-space limit (RLIMIT_AS, `ulimit -v`), in a subprocess
with the limit set before it starts: DuckDB's threads and memory limit are fitted to what the
limit leaves, so that no thread start fails (the dynamic loader ends the process, exit 127,
when it cannot allocate a new thread's thread-local data) and the report is exact; a limit too
small for that is one line of error."""

import json
import resource
import subprocess

import pytest
from support import synthetic
from support.cli import PYMTRACE

STEPS, SLOTS, THREADS = 30_000, 500, 4
MiB = 1 << 20
LIMITS_MIB = range(320, 2560, 128)  # from just above what loading the libraries takes to ample
ALWAYS_FROM_MIB = 640  # from here up every run succeeds (448 MiB on Debian 12 with DuckDB 2.0)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "synth.parquet"
    synthetic.write(str(path), STEPS, SLOTS, THREADS)
    return path, synthetic.truth(STEPS, SLOTS, THREADS)


def _analyze_under(limit, *args):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run(
        PYMTRACE + ["analyze", *map(str, args)], capture_output=True, text=True, preexec_fn=set_limit, timeout=120
    )


def test_analyze_under_address_space_limits(synth):
    path, truth = synth
    outcomes = {}
    for mib in LIMITS_MIB:
        run = _analyze_under(mib * MiB, "--json", path)
        where = f"under {mib} MiB: rc={run.returncode} {run.stderr[-600:]!r}"
        if run.returncode == 0:
            assert synthetic.agrees(json.loads(run.stdout), truth), where
        else:
            assert run.returncode == 1, where
            lines = run.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("pymtrace: error: "), where
        outcomes[mib] = run.returncode
    assert all(rc == 0 for mib, rc in outcomes.items() if mib >= ALWAYS_FROM_MIB), outcomes


def test_sql_under_an_address_space_limit(synth):
    path, truth = synth
    run = _analyze_under(ALWAYS_FROM_MIB * MiB, "--sql", "SELECT count(*) FROM calls", path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[1] == str(truth["events"])


def test_duckdb_fitted_to_what_is_left(synth):
    """The settings _connect gives DuckDB when LEFT bytes of address space are left: threads
    whose stacks and arenas take at most a quarter of it, a memory limit of at most half the
    rest, and one line of error when that is below what the report needs."""
    from pymtrace.errors import PymtraceError
    from pymtrace.trace import analysis

    per_thread = analysis._thread_bytes()
    assert analysis._fitted_threads(4 * 3 * per_thread, 8) == {"threads": 4, "async_threads": 0}
    assert analysis._fitted_threads(4 * 3 * per_thread, 2)["threads"] == 2
    assert analysis._fitted_threads(per_thread, 8)["threads"] == 1
    path, _ = synth
    with analysis.TraceSet([str(path)]) as ts:
        con = ts._connect(":memory:")
        left = 400 * MiB + per_thread
        ts._fit_memory_limit(con, left, 2)
        (limit,) = con.execute("SELECT current_setting('memory_limit')").fetchone()
        assert analysis._size_bytes(limit) == pytest.approx(200 * MiB, rel=0.01), limit
        assert ts.memory_limit == "200MiB"
        with pytest.raises(PymtraceError, match=r"^the address-space limit .* too little for DuckDB"):
            ts._fit_memory_limit(con, 60 * MiB, 1)
