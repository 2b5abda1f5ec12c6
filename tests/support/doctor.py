"""Helpers for the `pymtrace doctor` tests (no tests here)."""

import json

from support.cli import run_pymtrace


def doctor_json(*args, env=None, **kw):
    proc = run_pymtrace("doctor", "--json", *args, env=env, **kw)
    return proc, json.loads(proc.stdout)
