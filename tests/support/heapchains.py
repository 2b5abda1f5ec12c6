"""The heap_chains workload (workloads/heap_chains.c + heap_chains_lib.c: known allocation call
chains, one through a shared library) built -O2 -fomit-frame-pointer, as the heap and top
--stacks tests use it."""

import subprocess

from support.needs import missing_or_fail
from support.paths import WORKLOADS

NO_FP = ("-O2", "-fomit-frame-pointer")
# _start, libc's __libc_start_main (exported), its static __libc_start_call_main (a name only
# where libc's debug info is installed, else "libc.so.6+0x..."), main
ROOT = r"_start;__libc_start_main;[^;]+;main"
MALLOC = r"(__libc_)?malloc"
# (folded stack regex, calls, bytes requested) of each chain (record --stacks' test)
CHAINS = {
    # above worker: libc's start_thread and clone3 (named only with libc's debug info)
    "thread": (rf".*;worker;thread_leaf;{MALLOC}", 50, sum(2500 + i for i in range(50))),
    "alpha": (rf"{ROOT};alpha;beta;leaf_alloc;{MALLOC}", 200, sum(100 + i % 8 for i in range(200))),
    "gamma": (rf"{ROOT};gamma_;lib_outer;lib_inner;{MALLOC}", 10, 10 * 4000),
    "delta": (rf"{ROOT};delta;young_leaf;{MALLOC}", 3, 3 * 3000),
}


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
