"""Python allocations through known call chains, for heap's Python frames (tests/live/
test_heap_python.py, tests/support/pychains.py). Runs on CPython 3.10-3.13, standard library only.

    python py_chains.py [wait | sizes | loop]

Prints one JSON line, the bytes each chain allocates as the interpreter itself sizes them
(`sizes`: nothing else; `loop`: then alpha's chains every 20 ms until killed), then (with
`wait`: after a line on stdin) runs the chains, prints "done" and exits: with `wait` at the
end of stdin, normally; else at once with os._exit, so that the leak is still in use when the
process ends (a normal exit's finalization would free the module's globals). Every
allocation counted is larger than pymalloc's 512 bytes, so it is a malloc of exactly that
size (but leaf_objects': pymalloc's own, seen with --python-allocators). The lines that
allocate carry `# at: NAME` comments: the tests find their line numbers there. No
comprehensions: 3.10 and 3.11 run them as frames of their own.
"""

import asyncio
import ctypes
import json
import os
import sys
import threading
import time

SIZE_A, COUNT_A = 100_000, 20  # leaf_a: bytes objects, malloc(SIZE_A + 33) each, freed
LIST_N, COUNT_L = 40_000, 10  # leaf_list: a list's items, malloc(LIST_N * 8) each, freed
DICT_N = 5000  # leaf_leak: a dict's keys, kept
SIZE_LEAK = 70_000  # leaf_leak: a bytes object, kept
SIZE_C, COUNT_C = 30_000, 5  # callback_leaf, called by libc's qsort through ctypes, freed
SIZE_T, COUNT_T = 20_000, 7  # thread_leaf in a thread, freed
SIZE_ASYNC, COUNT_ASYNC = 10_000, 3  # async_leaf in an asyncio task, freed
N_OBJECTS = 20_000  # leaf_objects: object() instances, from pymalloc's arenas (no malloc call)
KEEP = []  # the leak: held to the end


def leaf_a():
    out = [None] * COUNT_A
    for i in range(COUNT_A):
        out[i] = b"\x01" * SIZE_A  # at: bytes_a
    return len(out)


def leaf_list():
    for _ in range(COUNT_L):
        items = [None] * LIST_N  # at: list
        del items


def leaf_leak():
    table = dict.fromkeys(range(DICT_N))  # at: dict
    KEEP.append(table)
    KEEP.append(b"\x02" * SIZE_LEAK)  # at: leak


def beta():
    leaf_a()  # at: beta_a
    leaf_list()  # at: beta_list


def gamma():
    leaf_leak()  # at: gamma


def alpha():
    beta()  # at: alpha_beta
    gamma()  # at: alpha_gamma


def leaf_objects():
    keep = [None] * N_OBJECTS
    for i in range(N_OBJECTS):
        keep[i] = object()  # at: objects
    return keep


def callback_leaf():
    for _ in range(COUNT_C):
        block = b"\x03" * SIZE_C  # at: callback
        del block


def compare(a, b):
    callback_leaf()  # at: compare
    return 0


COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def through_c():
    """libc's qsort (C) calls compare (Python) once for two elements."""
    libc = ctypes.CDLL(None)
    pair = (ctypes.c_int * 2)(2, 1)
    libc.qsort(pair, 2, ctypes.sizeof(ctypes.c_int), COMPARE(compare))  # at: qsort


def thread_leaf():
    for _ in range(COUNT_T):
        block = b"\x04" * SIZE_T  # at: thread
        del block


def worker():
    thread_leaf()  # at: worker


async def async_leaf():
    for _ in range(COUNT_ASYNC):
        block = b"\x05" * SIZE_ASYNC  # at: async
        del block
        await asyncio.sleep(0)


async def task_outer():
    await async_leaf()  # at: task_outer


async def async_main():
    await asyncio.gather(asyncio.ensure_future(task_outer()))


def expected():
    """The bytes of each chain, as this interpreter sizes its objects."""
    dict_keys = dict.fromkeys(range(DICT_N)).__sizeof__() - {}.__sizeof__()
    return {
        "bytes_a": COUNT_A * sys.getsizeof(b"\x01" * SIZE_A),
        "list": COUNT_L * ([None] * LIST_N).__sizeof__() - COUNT_L * [].__sizeof__(),
        "dict": dict_keys,
        "leak": sys.getsizeof(b"\x02" * SIZE_LEAK),
        "callback": COUNT_C * sys.getsizeof(b"\x03" * SIZE_C),
        "thread": COUNT_T * sys.getsizeof(b"\x04" * SIZE_T),
        "async": COUNT_ASYNC * sys.getsizeof(b"\x05" * SIZE_ASYNC),
        "objects": N_OBJECTS * object().__sizeof__(),
        "objects_count": N_OBJECTS,
        "version": list(sys.version_info[:3]),
    }


def main():
    wait = sys.argv[1:] == ["wait"]
    print(json.dumps(expected()), flush=True)
    if sys.argv[1:] == ["sizes"]:
        return
    if sys.argv[1:] == ["loop"]:  # alpha's chains every 20 ms, until killed
        while True:
            alpha()
            time.sleep(0.02)
    if wait:
        sys.stdin.readline()
    alpha()  # at: main_alpha
    leaf_objects()  # at: main_objects
    through_c()  # at: main_c
    thread = threading.Thread(target=worker, name="pychains-worker")
    thread.start()
    thread.join()
    asyncio.run(async_main())  # at: main_async
    print("done", flush=True)
    if wait:
        sys.stdin.read()
    else:
        os._exit(0)


if __name__ == "__main__":
    main()  # at: main
