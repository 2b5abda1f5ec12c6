"""The heap_chains workload (workloads/heap_chains.c + heap_chains_lib.c: known allocation call
chains, one through a shared library) built -O2 -fomit-frame-pointer, as the heap and top
--stacks tests use it."""

import subprocess

from conftest import WORKLOADS, missing_or_fail

NO_FP = ("-O2", "-fomit-frame-pointer")


def build(build_dir):
    """Compile libheapchain.so and heap_chains into BUILD_DIR; the executable's path."""
    lib = build_dir / "libheapchain.so"
    exe = build_dir / "heap_chains"
    try:
        subprocess.run(["gcc", *NO_FP, "-shared", "-fPIC", "-o", lib, WORKLOADS / "heap_chains_lib.c"], check=True)
        subprocess.run(
            ["gcc", *NO_FP, "-pthread", "-o", exe, WORKLOADS / "heap_chains.c"]
            + ["-L", build_dir, "-lheapchain", f"-Wl,-rpath,{build_dir}"],
            check=True,
        )
    except FileNotFoundError:
        missing_or_fail("gcc is not installed")
    return str(exe)
