"""Helpers for the slab tests (no tests here): kmem tracepoint format files of kernels
whose slab tracepoints lack fields, installed through kfeatures' test hook."""

from pymtrace.bpf import kfeatures

# kmem_cache_alloc as Linux 6.1 (Debian 12) has it: no `name` field (TP_STRUCT__entry of its
# include/trace/events/kmem.h); kmem_cache_free there has call_site, ptr and name, like this host.
FORMAT_ALLOC_NO_NAME = """name: kmem_cache_alloc
ID: 1
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned long call_site;\toffset:8;\tsize:8;\tsigned:0;
\tfield:const void * ptr;\toffset:16;\tsize:8;\tsigned:0;
\tfield:size_t bytes_req;\toffset:24;\tsize:8;\tsigned:0;
\tfield:size_t bytes_alloc;\toffset:32;\tsize:8;\tsigned:0;
\tfield:unsigned long gfp_flags;\toffset:40;\tsize:8;\tsigned:0;
\tfield:int node;\toffset:48;\tsize:4;\tsigned:1;
\tfield:bool accounted;\toffset:52;\tsize:1;\tsigned:0;

print fmt: "call_site=%pS ptr=%p bytes_req=%zu bytes_alloc=%zu", REC->call_site, REC->ptr, REC->bytes_req, REC->bytes_alloc
"""


FORMAT_FREE_NO_NAME = """name: kmem_cache_free
ID: 2
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned long call_site;\toffset:8;\tsize:8;\tsigned:0;
\tfield:const void * ptr;\toffset:16;\tsize:8;\tsigned:0;
"""


def fake_formats(tmp_path, monkeypatch, **formats):
    """Emulate a kernel whose kmem tracepoints have the given format files, and which has no
    BTF (else the slab program would read the caches from BTF, whatever the formats say)
    (kfeatures' test hooks)."""
    monkeypatch.setenv(kfeatures.FAKE_BTF_ENV, str(tmp_path / "no-btf"))
    for tp, text in formats.items():
        d = tmp_path / "formats" / "kmem" / tp
        d.mkdir(parents=True)
        (d / "format").write_text(text)
    monkeypatch.setenv(kfeatures.FAKE_FORMAT_ENV, str(tmp_path / "formats"))
