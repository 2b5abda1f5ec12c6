"""Ground truth of the record_calls workload, shared by the record tests of every format."""


def text_range(binary):
    """[start, end) of a non-PIE binary's executable segment (callers inside it are its own)."""
    from elftools.elf.elffile import ELFFile

    with open(binary, "rb") as f:
        for seg in ELFFile(f).iter_segments():
            if seg["p_type"] == "PT_LOAD" and seg["p_flags"] & 1:
                return seg["p_vaddr"], seg["p_vaddr"] + seg["p_memsz"]
    raise AssertionError("no text segment")


def ground_truth(stdout):
    """The CALL lines record_calls prints: [(tid, type, ptr1, ptr2, size, size2, size3)]."""
    return [tuple(int(x, 16) for x in line.split()[1:]) for line in stdout.splitlines() if line.startswith("CALL ")]


def key(r):
    """A record's fields as ground_truth gives a call: (tid, type, ptr1, ptr2, size, size2, size3)."""
    return (r.thread, r.type, r.ptr1, r.ptr2, r.size, r.size2, r.size3)


def check_own_calls(records, prog, truth):
    """The records whose caller is in PROG (a non-PIE binary) are exactly TRUTH (its CALL
    lines), each thread's in the order the thread made them; {tid: its calls}."""
    import collections

    lo, hi = text_range(prog)
    own = [r for r in records if lo <= r.caller < hi]
    assert collections.Counter(map(key, own)) == collections.Counter(truth)
    by_thread = collections.defaultdict(list)
    for t in truth:
        by_thread[t[0]].append(t)
    for tid, calls in by_thread.items():
        assert [key(r) for r in own if r.thread == tid] == calls
    return by_thread
