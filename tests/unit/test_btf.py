"""pymtrace.bpf.btf on a BTF blob built here (every offset known), and on this kernel's own."""

import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.btf import blob

from pymtrace.bpf import kfeatures
from pymtrace.bpf.btf import Btf


def test_offsets_and_tracepoint_arguments_of_a_known_blob(tmp_path):
    btf = Btf(blob())
    assert btf.member_offsets("kmem_cache", ["name", "size", "object_size"]) == {
        "name": 16,
        "size": 4,
        "object_size": 8,
    }
    assert btf.member_offsets("kmem_cache", ["name", "missing"]) is None
    assert btf.member_offsets("no_such_struct", ["name"]) is None
    assert btf.tracepoint_arg("kmem_cache_free", "kmem_cache") == 1  # ctx->args[1]
    assert btf.tracepoint_arg("kmem_cache_alloc", "kmem_cache") is None
    assert btf.tracepoint_arg("kmem_cache_free", "other") is None
    path = tmp_path / "btf"
    path.write_bytes(blob())
    assert Btf.read(str(path)).starts == btf.starts
    assert Btf.read(str(tmp_path / "missing")) is None
    path.write_bytes(b"\0" * 64)
    assert Btf.read(str(path)) is None  # not BTF


def test_slab_switches_from_btf(tmp_path, monkeypatch):
    # no kmem_cache_alloc tracepoint with a cache argument: no raw programs at all
    assert kfeatures.slab_raw(Btf(blob())) == {}
    assert kfeatures.slab_raw(None) == {}
    assert kfeatures.slab_raw(Btf(blob(alloc=True))) == {
        "SLAB_RAW_ALLOC": 1,
        "SLAB_ALLOC_CACHE_ARG": 1,
        "SLAB_OFF_NAME": 16,
        "SLAB_OFF_SIZE": 4,
        "SLAB_OFF_OBJECT_SIZE": 8,
        "SLAB_RAW_FREE": 1,
        "SLAB_FREE_CACHE_ARG": 1,
    }
    monkeypatch.setenv(kfeatures.FAKE_BTF_ENV, str(tmp_path / "none"))
    assert kfeatures.read_btf() is None


@pytest.mark.skipif(not os.path.exists("/sys/kernel/btf/vmlinux"), reason="this kernel has no BTF")
def test_this_kernels_kmem_cache():
    btf = Btf.read()
    offsets = btf.member_offsets("kmem_cache", ["name", "size", "object_size"])
    assert offsets and len(set(offsets.values())) == 3
    assert btf.tracepoint_arg("kmem_cache_free", "kmem_cache") is not None


def test_member_paths_of_a_known_blob(tmp_path):
    """Through a named member's type and an anonymous union: kmem_cache has size and, in its
    anonymous union, object_size; name is a char *, no struct to go into."""
    path = tmp_path / "btf"
    path.write_bytes(blob())
    btf = Btf.read(str(path))
    assert btf.has_member_path("kmem_cache", ["size"]) and btf.has_member_path("kmem_cache", ["object_size"])
    assert not btf.has_member_path("kmem_cache", ["missing"])
    assert not btf.has_member_path("kmem_cache", ["name", "size"])
    assert not btf.has_member_path("no_such_struct", ["size"])


@pytest.mark.skipif(not os.path.exists("/sys/kernel/btf/vmlinux"), reason="this kernel has no BTF")
def test_this_kernels_link_info_members():
    """Member paths through bpf_link_info's anonymous union: raw_tracepoint.tp_name on every
    kernel pymtrace supports (5.8+); the kprobe_multi record, where there is one (6.6+: not
    Debian 12's 6.1), always with addrs; its `missed` tells tracepoint_misses_counted()."""
    btf = Btf.read()
    assert btf.has_member_path("bpf_link_info", ["raw_tracepoint", "tp_name"])
    assert not btf.has_member_path("bpf_link_info", ["raw_tracepoint", "no_such_member"])
    if btf.has_member_path("bpf_link_info", ["kprobe_multi"]):
        assert btf.has_member_path("bpf_link_info", ["kprobe_multi", "addrs"])
    assert kfeatures.tracepoint_misses_counted() == btf.has_member_path("bpf_link_info", ["kprobe_multi", "missed"])


@settings(max_examples=400, deadline=None)
@given(cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 399), st.integers(0, 255)), max_size=8))
def test_a_corrupt_blob_is_refused_or_answers_no_question_wrongly(cut, flips):
    """Truncated or bit-flipped blobs: the constructor refuses them (ValueError or
    struct.error, which read() turns into None) or every question returns an answer of its
    type (None / False when the records do not hold one), never raises, never hangs."""
    raw = bytearray(blob(alloc=True))
    for index, value in flips:
        if index < len(raw):
            raw[index] = value
    data = bytes(raw[: len(raw) - cut] if cut < len(raw) else raw)
    try:
        btf = Btf(data)
    except (ValueError, struct.error):
        return
    offsets = btf.member_offsets("kmem_cache", ["name", "size"])
    assert offsets is None or (isinstance(offsets, dict) and set(offsets) == {"name", "size"})
    arg = btf.tracepoint_arg("kmem_cache_free", "kmem_cache")
    assert arg is None or isinstance(arg, int)
    assert btf.has_member_path("kmem_cache", ["name"]) in (True, False)
