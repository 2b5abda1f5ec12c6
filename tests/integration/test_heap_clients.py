"""The heap profile's pprof and HTML outputs read by real clients: `go tool pprof` (exact
values per stack) and headless Chromium (the flame graph drawn); the synthetic profile is
tests/support/heapprofile.py, the formats' own tests are tests/unit/test_heap_formats.py."""

import html.parser
import re

import pytest
from support.clients import chromium, go_pprof, screenshot_colours, traces
from support.heapprofile import CXX_MAKE, CXX_WORKER, EXE, EXPECTED, HOSTILE, FakeSymbolizer, build_profile, written

from pymtrace.sinks.flamegraph import write_html
from pymtrace.sinks.pprof import write_pprof
from pymtrace.sources.heapprofile import VALUE_TYPES

# ---------------------------------------------------------------- pprof


@pytest.fixture(scope="module")
def pprof_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pprof") / "heap.pb.gz"
    path.write_bytes(written(write_pprof, build_profile()))
    return str(path)


PPROF_TRACES = {  # pprof shortens C++ names and marks inlined frames
    "chain": ("malloc", "inl_mid (inline)", "leaf", "b", "a", "main", "__libc_start_call_main", "_start"),
    "leak": ("malloc", "lib_inner", "lib_outer", "gamma_", "main", "__libc_start_call_main", "_start"),
    "cxx": ("operator new(unsigned long)", "shapes::Pool::make", "shapes::worker", "start_thread", "__clone3"),
    "partial": ("malloc", "libchain.so+0x999"),
}


@pytest.mark.parametrize("value", VALUE_TYPES)
def test_go_tool_pprof_reads_exact_values_per_stack(pprof_file, value):
    got = traces(go_pprof(pprof_file, "-traces", f"-sample_index={value}", "-unit=B"))
    index = VALUE_TYPES.index(value)
    for name, frames in PPROF_TRACES.items():
        assert got.pop(frames) == EXPECTED[name][index], name
    (hostile_frames, amount), *rest = got.items()  # pprof cuts the <...> of the hostile name
    assert not rest and hostile_frames[0] == "malloc" and hostile_frames[2] == "main"
    assert amount == EXPECTED["hostile"][index]


def test_go_tool_pprof_cumulative_values_reach_main(pprof_file):
    out = go_pprof(
        pprof_file, "-top", "-cum", "-nodefraction=0", "-nodecount=1000", "-sample_index=alloc_space", "-unit=B"
    )
    assert "File: chain" in out and f"Build ID: {EXE.build_id}" in out
    assert "drops: ring_full 3" in out
    total = sum(v[1] for v in EXPECTED.values())
    assert f"Showing nodes accounting for {total}B, 100% of {total}B total" in out
    rows = {}
    for line in out.split("\n"):
        m = re.match(r"\s*(\d+)B?\s+\S+%\s+\S+%\s+(\d+)B?\s+\S+%\s+(.+)$", line)
        if m:
            rows[m.group(3).strip()] = (int(m.group(1)), int(m.group(2)))
    through_main = EXPECTED["chain"][1] + EXPECTED["leak"][1] + EXPECTED["hostile"][1]
    assert rows["main"] == (0, through_main)
    assert rows["_start"] == (0, through_main)
    assert rows["a"] == (0, EXPECTED["chain"][1]) and rows["gamma_"] == (0, EXPECTED["leak"][1])
    assert rows["malloc"][0] == total - EXPECTED["cxx"][1]


def test_go_tool_pprof_top_in_use_objects_by_default_index(pprof_file):
    out = go_pprof(pprof_file, "-raw")
    assert "inuse_space/bytes[dflt]" in out and "PeriodType: space bytes" in out
    out = go_pprof(pprof_file, "-top", "-nodefraction=0", "-sample_index=inuse_objects")
    total = sum(v[2] for v in EXPECTED.values())
    assert f"Showing nodes accounting for {total}, 100% of {total} total" in out


# ---------------------------------------------------------------- html


class DomScan(html.parser.HTMLParser):
    """Elements of a dumped DOM: tag counts, flame graph frames (name attribute) and their
    tooltip titles."""

    def __init__(self):
        super().__init__()
        self.tags = {}
        self.frames = set()
        self.titles = []
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        attrs = dict(attrs)
        if tag == "g" and "frame" in (attrs.get("class") or ""):
            self.frames.add(attrs.get("name"))
        self._in_title = tag == "title"

    def handle_endtag(self, tag):
        self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.titles.append(data)


@pytest.fixture(scope="module")
def html_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("html") / "heap.html"
    with open(path, "wb") as f:
        write_html(build_profile(), FakeSymbolizer(), f)
    return path


def test_html_renders_frames_in_headless_chromium(html_file, tmp_path):
    # d3-flame-graph writes each frame's name as its element's `name` attribute and its
    # <title> text at once; the visible label follows after an animation frame, which
    # --dump-dom does not run (the screenshot below shows the labels drawn)
    dom = chromium(tmp_path, "--dump-dom", html_file.as_uri()).decode()
    scan = DomScan()
    scan.feed(dom)
    # every frame in use is drawn, the hostile name among them as plain text
    assert {"all", "_start", "main", "gamma_", "lib_outer", "lib_inner", "malloc", CXX_WORKER, CXX_MAKE} <= scan.frames
    assert HOSTILE in scan.frames and "a" not in scan.frames  # inuse_space first: the chain was freed
    assert "lib_inner (40,000 bytes)" in scan.titles
    assert f"{HOSTILE} (15,000 bytes)" in scan.titles
    assert "img" not in scan.tags  # the name created no element
    assert scan.tags.get("svg", 0) >= 1


def test_html_value_selector_shows_allocations_of_freed_blocks(html_file, tmp_path):
    dom = chromium(tmp_path, "--dump-dom", html_file.as_uri() + "#alloc_space").decode()
    scan = DomScan()
    scan.feed(dom)
    # the chain's blocks were all freed: only alloc_space shows a, b, leaf and the inlined inl_mid
    assert {"a", "b", "leaf", "inl_mid", "lib_inner"} <= scan.frames
    assert "a (103,500 bytes)" in scan.titles
    total = sum(v[1] for v in EXPECTED.values())
    assert f"all ({total:,} bytes)" in scan.titles


def test_html_screenshot_is_not_blank(html_file, tmp_path):
    colours, total = screenshot_colours(tmp_path, html_file.as_uri(), "1000,600")
    assert colours is not None and len(colours) >= 16, "too few colours: blank page?"
    white = sum(n for n, c in colours if c == (255, 255, 255))
    flame = sum(n for n, (r, g, b) in colours if r > 200 and g < 160 and b < 100)  # the warm frame colours
    assert white < total * 0.95 and flame > total * 0.05
