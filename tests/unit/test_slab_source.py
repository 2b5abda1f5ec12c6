"""Slab source without BPF: the cache source read from the tracepoint format files, and a
program this kernel rejects leaving the others compiled (on real BPF: tests/live/test_top_slab.py)."""

import pytest
from support.btf import blob
from support.slab_formats import FORMAT_ALLOC_NO_NAME, FORMAT_FREE_NO_NAME, fake_formats

from pymtrace.bpf import kfeatures
from pymtrace.errors import PymtraceError


def test_slab_source_follows_the_tracepoint_fields(tmp_path, monkeypatch):
    assert kfeatures.parse_format(FORMAT_ALLOC_NO_NAME)["bytes_alloc"] == "size_t"
    assert "name" not in kfeatures.parse_format(FORMAT_ALLOC_NO_NAME)
    assert "common_pid" not in kfeatures.parse_format(FORMAT_ALLOC_NO_NAME)
    fake_formats(tmp_path, monkeypatch, kmem_cache_alloc=FORMAT_ALLOC_NO_NAME, kmem_cache_free=FORMAT_FREE_NO_NAME)
    src = kfeatures.slab_source()
    assert src.source == kfeatures.SLAB_BY_SIZE and not src.frees and "frees not counted" in src.detail
    assert src.defines() == {"SLAB_ALLOC_BY_NAME": 0, "SLAB_FREE_BY_NAME": 0}
    (tmp_path / "formats" / "kmem" / "kmem_cache_alloc" / "format").write_text(
        FORMAT_ALLOC_NO_NAME.replace("bytes_alloc", "other")
    )
    with pytest.raises(PymtraceError, match="neither `name` nor `bytes_alloc`"):
        kfeatures.slab_source()


def test_a_program_this_kernel_rejects_leaves_the_others_running(tmp_path, monkeypatch):
    """One compile for all: when it fails, each program is tried alone, the one that fails is
    dropped with its reason in errors[...] and the rest are compiled together. (The slab
    source is set up from Linux 6.1's tracepoint formats: this kernel's are root's to read.)"""
    from pymtrace.bpf import load as bpfload
    from pymtrace.sources import bundle

    fake_formats(tmp_path, monkeypatch, kmem_cache_alloc=FORMAT_ALLOC_NO_NAME, kmem_cache_free=FORMAT_FREE_NO_NAME)
    loads = []

    def load_parts(parts, what=None):
        names = [p.program for p in parts]
        loads.append(names)
        if "slab" in names:
            raise PymtraceError("cannot compile/load BPF program slab: no member named 'data_loc_name'")
        return object()

    monkeypatch.setattr(bpfload, "load_parts", load_parts)
    monkeypatch.setattr(bpfload, "detach_all", lambda bpf: None)
    cs = bundle.Sources(malloc=False, slab=True, faults=True, glibc=False, track_exits=False)
    bpf = cs._compile([c.part() for c in cs.sources.values()])
    assert bpf is not None
    assert list(cs.sources) == ["faults"]
    assert "data_loc_name" in cs.errors["slab"]
    assert loads[0] == ["faults", "slab"] and loads[-1] == ["faults"]


def test_raw_tracepoints_this_kernel_rejects_fall_back_to_the_tracepoint_fields(tmp_path, monkeypatch):
    """BTF offers the raw tracepoint programs, the kernel rejects them: the slab source is
    kept, compiled the way the tracepoints' fields allow, and its view says why."""
    from pymtrace.bpf import load as bpfload
    from pymtrace.sources import bundle

    fake_formats(tmp_path, monkeypatch, kmem_cache_alloc=FORMAT_ALLOC_NO_NAME)
    (tmp_path / "btf").write_bytes(blob(alloc=True))
    monkeypatch.setenv(kfeatures.FAKE_BTF_ENV, str(tmp_path / "btf"))
    assert kfeatures.slab_source().source == kfeatures.SLAB_BY_BTF
    loads = []

    def load_parts(parts, what=None):
        loads.append([(p.program, p.defines.get("SLAB_RAW_ALLOC", 0)) for p in parts])
        if any(p.defines.get("SLAB_RAW_ALLOC") for p in parts):
            raise PymtraceError("cannot compile/load BPF program slab: raw tracepoint rejected")
        return object()

    monkeypatch.setattr(bpfload, "load_parts", load_parts)
    monkeypatch.setattr(bpfload, "detach_all", lambda bpf: None)
    cs = bundle.Sources(malloc=False, slab=True, faults=True, glibc=False, track_exits=False)
    cs.sources["slab"].prepare()
    assert cs._compile([c.part() for c in cs.sources.values()]) is not None
    slab = cs.sources["slab"]
    assert list(cs.sources) == ["faults", "slab"] and "slab" not in cs.errors
    assert slab.source.source == kfeatures.SLAB_BY_SIZE and "raw tracepoint rejected" in slab.raw_rejected
    assert loads[-1] == [("faults", 0), ("slab", 0)]
    # alone, too (a bundle of one)
    cs = bundle.Sources(malloc=False, slab=True, faults=False, glibc=False, track_exits=False)
    cs.sources["slab"].prepare()
    assert cs._compile([cs.sources["slab"].part()]) is not None
    assert cs.sources["slab"].source.source == kfeatures.SLAB_BY_SIZE
