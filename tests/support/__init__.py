"""Helpers shared by tests/unit and tests/live (no tests here): top.py runs `pymtrace top`
and workloads as subprocesses; workloads/ holds the C programs whose calls are the ground truth."""
