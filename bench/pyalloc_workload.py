"""A Python program whose allocations come from a mix of ordinary work, each in a function of
its own, for bench/pyframes_bench.py (memray against `pymtrace heap`, and the cost of reading
Python frames). Standard library only; runs on CPython 3.10-3.13.

    python pyalloc_workload.py [ROUNDS] [wait]

ROUNDS (default 1) times over (~0.1 s each): rows built as dicts, encoded to JSON and decoded back, joined
into text, compressed, searched with a regex, sorted; a list and a dict grown item by item;
large bytes objects. With `wait`: prints "ready", waits for a line on stdin before the work,
prints its CPU seconds (time.process_time) when done and waits for the end of stdin.
"""

import json
import re
import sys
import time
import zlib


def make_rows(n):
    rows = []
    for i in range(n):
        rows.append({"id": i, "name": f"row {i}", "tags": ["t"] * (i % 9), "score": i * 0.5})
    return rows


def encode(rows):
    return json.dumps(rows)


def decode(text):
    return json.loads(text)


def join_lines(rows):
    return "\n".join(row["name"] * 20 for row in rows)


def compress(text):
    return zlib.compress(text.encode(), 6)


def find_names(text):
    return re.findall(r"row \d+", text)


def sort_words(text):
    return sorted(text.split())


def grow_list(n):
    out = []
    for i in range(n):
        out.append(i)
    return out


def grow_dict(n):
    table = {}
    for i in range(n):
        table[i] = i
    return table


def big_blocks(n):
    return [bytes(200_000 + i) for i in range(n)]


def work():
    rows = make_rows(8_000)
    text = encode(rows)
    decode(text)
    lines = join_lines(rows)
    compress(lines)
    find_names(lines)
    sort_words(lines[:400_000])
    grow_list(100_000)
    grow_dict(50_000)
    big_blocks(40)


def main():
    args = sys.argv[1:]
    wait = "wait" in args
    rounds = int(next((a for a in args if a.isdigit()), "1"))
    if wait:
        print("ready", flush=True)
        sys.stdin.readline()
    start = time.process_time()
    for _ in range(rounds):
        work()
    if wait:
        print(f"cpu {time.process_time() - start:.6f}", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
