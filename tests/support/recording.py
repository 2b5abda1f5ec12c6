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
