"""Helpers shared by the test tiers (no tests here), one module per topic: paths (the tree),
needs (a missing prerequisite skips or fails), cli (pymtrace as a subprocess), uprobes (what
a process attached), top (`pymtrace top` and workloads as subprocesses), and the helpers of
one subject each; workloads/ holds the C programs whose calls are the ground truth."""
