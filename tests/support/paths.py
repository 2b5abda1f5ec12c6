"""Where the tests find the source tree and the C workloads."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
WORKLOADS = ROOT / "tests" / "support" / "workloads"
