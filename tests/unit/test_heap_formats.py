"""The heap profile model and its four formats, from a synthetic profile whose every value is
known (tests/support/heapprofile.py), read back by protobuf's parser (the round trip); real
clients (`go tool pprof`, headless Chromium) read them in tests/integration/test_heap_clients.py."""

import gzip
import io
import math
import random
import re
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.heapprofile import (
    CXX_MAKE,
    CXX_NEW,
    CXX_WORKER,
    DROPS,
    END_NS,
    EXE,
    EXPECTED,
    EXPECTED_OLDER_30,
    FRAMES,
    HOSTILE,
    LIB,
    LIBC,
    ROOT_FIRST,
    STACKS,
    FakeSymbolizer,
    build_profile,
    written,
)
from support.paths import ROOT

from pymtrace.sinks import profile_pb2
from pymtrace.sinks.flamegraph import render_html
from pymtrace.sinks.folded import folded_lines, folded_name, write_folded
from pymtrace.sinks.heap_text import render_text
from pymtrace.sinks.pprof import write_pprof
from pymtrace.sources.heapprofile import VALUE_TYPES, HeapProfile, sample_weight
from pymtrace.tracee.unwind import Frame, Module

# ---------------------------------------------------------------- the model


def test_sample_weight():
    assert sample_weight(100, 1) == 1.0  # every call sampled: exact
    assert sample_weight(4096, 4096) == 1.0  # at least the mean: always sampled
    assert sample_weight(10**6, 4096) == 1.0
    assert sample_weight(1024, 4096) == pytest.approx(1 / (1 - math.exp(-1024 / 4096)), rel=1e-12)
    # tiny blocks: 1/p ~ mean/size (expm1 keeps it accurate)
    assert sample_weight(1, 1 << 20) == pytest.approx((1 << 20) + 0.5, rel=1e-9)


def test_model_values_counters_and_interning():
    profile = build_profile()
    by_stack = {entry.stack: entry for entry in profile.stacks()}
    assert len(profile) == len(STACKS)  # equal stacks built as separate tuples: one entry each
    for name, stack in STACKS.items():
        assert by_stack[stack].values() == EXPECTED[name], name
    assert by_stack[STACKS["chain"]].samples == 1000
    assert (profile.samples, profile.complete_samples) == (1035, 1033)
    assert profile.drops == DROPS and profile.dropped() == 3
    assert not by_stack[STACKS["partial"]].complete and by_stack[STACKS["leak"]].complete
    with pytest.raises(RuntimeError):
        profile.add(5000, STACKS["chain"], 1, 0, True)


def test_older_counts_only_blocks_allocated_that_long_before_the_end():
    profile = build_profile(older_s=30)
    for entry in profile.stacks():
        name = next(n for n, s in STACKS.items() if s == entry.stack)
        assert entry.values() == EXPECTED_OLDER_30[name], name
    assert "in use: only blocks older than 30 s" in profile.summary_lines()


# ---------------------------------------------------------------- folded


@pytest.mark.parametrize("older", [None, 30])
@pytest.mark.parametrize("value", VALUE_TYPES)
def test_folded_has_the_exact_value_of_every_stack(value, older):
    expected = EXPECTED if older is None else EXPECTED_OLDER_30
    index = VALUE_TYPES.index(value)
    want = {ROOT_FIRST[name]: values[index] for name, values in expected.items() if values[index]}
    text = written(write_folded, build_profile(older), value=value).decode()
    got = {}
    for line in text.split("\n")[:-1]:
        stack, amount = line.rsplit(" ", 1)
        got[stack] = int(amount)
    assert got == want
    assert text.endswith("\n")


def test_folded_default_is_inuse_space_and_names_are_sanitized():
    text = written(write_folded, build_profile()).decode()
    assert f"{ROOT_FIRST['leak']} 40000\n" in text
    assert ROOT_FIRST["chain"] not in text  # freed: no bytes in use, left out
    assert HOSTILE not in text and "<img src=x onerror=alert(1)>_x" in text  # ';' would split the frame


def test_folded_merges_stacks_with_the_same_names():
    profile = HeapProfile(1, {})
    a, b = ((LIBC, 0x100), (EXE, 0x240)), ((LIBC, 0x100), (EXE, 0x241))  # two pcs in main
    profile.add(1, a, 10, 0, True)
    profile.add(2, b, 20, 0, True)
    profile.finish({1, 2}, 1)
    assert folded_lines(profile, FakeSymbolizer()) == {"main;malloc": 30}


# ---------------------------------------------------------------- pprof


def parsed_pprof(data):
    message = profile_pb2.Profile()
    message.ParseFromString(gzip.decompress(data))
    return message


def test_pprof_message_layout():
    p = parsed_pprof(written(write_pprof, build_profile()))
    s = p.string_table
    assert s[0] == ""
    assert [(s[t.type], s[t.unit]) for t in p.sample_type] == [
        ("alloc_objects", "count"),
        ("alloc_space", "bytes"),
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    ]
    assert (s[p.period_type.type], s[p.period_type.unit], p.period) == ("space", "bytes", 1)
    assert s[p.default_sample_type] == "inuse_space"
    # the main executable is mapping 1 (pprof names the profile after it); build IDs kept
    assert [(m.id, s[m.filename], s[m.build_id]) for m in p.mapping] == [
        (1, EXE.path, EXE.build_id),
        (2, LIBC.path, ""),
        (3, LIB.path, LIB.build_id),
    ]
    comments = [s[c] for c in p.comment]
    assert "drops: ring_full 3" in comments and "samples: 1035, complete root-to-leaf: 1033" in comments
    functions = {f.id: s[f.name] for f in p.function}
    locations = {loc.id: loc for loc in p.location}
    inlined = [loc for loc in p.location if len(loc.line) > 1]
    assert len(inlined) == 1
    assert [functions[line.function_id] for line in inlined[0].line] == ["inl_mid", "leaf"]  # callee first
    assert [line.line for line in inlined[0].line] == [6, 7]
    chain = next(smp for smp in p.sample if list(smp.value) == list(EXPECTED["chain"]))
    leaf_first = [functions[locations[i].line[-1].function_id] for i in chain.location_id]
    assert leaf_first == ["malloc", "leaf", "b", "a", "main", "__libc_start_call_main", "_start"]
    assert {functions[i] for i in functions} >= {CXX_NEW, CXX_MAKE, CXX_WORKER, HOSTILE, "libchain.so+0x999"}


def test_pprof_is_deterministic():
    assert written(write_pprof, build_profile()) == written(write_pprof, build_profile())


# ---------------------------------------------------------------- text


def test_text_report_like_memleak():
    text = render_text(build_profile(), FakeSymbolizer(), top=2)
    assert text.startswith("pymtrace heap: chain 1000 10\n")
    assert "drops: ring_full 3" in text
    assert (
        "\t40000 bytes in 10 allocations from stack\n\t\tmalloc [libc.so.6] malloc.c:3287\n\t\tlib_inner [libchain.so]"
        in text
    )
    assert "\t15000 bytes in 3 allocations from stack" in text
    assert "\t640 bytes" not in text  # top 2 only
    assert "55640 bytes in 23 allocations in use in 3 stacks; top 2 by inuse_space:" in text
    alloc = render_text(build_profile(), FakeSymbolizer(), top=1, value="alloc_space")
    assert "\t103500 bytes in 1000 allocations from stack\n\t\tmalloc [libc.so.6]" in alloc
    assert "\t\tinl_mid [chain] chain.c:6 (inlined)\n\t\tleaf [chain] chain.c:7\n" in alloc


# ---------------------------------------------------------------- html


def test_html_is_self_contained_and_keeps_names_out_of_markup():
    page = render_html(build_profile(), FakeSymbolizer())
    assert "<img" not in page  # the hostile name only as escaped JSON data
    assert "\\u003cimg src=x onerror=alert(1)\\u003e;x" in page
    assert "http://" not in page.split("<script>")[0] and "src=" not in page.split("<script>")[0]
    assert "<title>pymtrace heap: chain 1000 10</title>" in page
    assert "d3-flame-graph 5.0.0" in page and "d3 7.9.2" in page
    for name in VALUE_TYPES:
        assert f'<option value="{name}"' in page


# ---------------------------------------------------------------- generated code


def test_committed_profile_pb2_matches_the_proto(tmp_path):
    if shutil.which("protoc") is None:
        pytest.skip("protoc is not installed (Debian protobuf-compiler): only needed to regenerate profile_pb2.py")
    sinks = ROOT / "pymtrace" / "sinks"
    subprocess.run(
        ["protoc", f"--proto_path={sinks}", f"--python_out={tmp_path}", str(sinks / "profile.proto")], check=True
    )
    assert (tmp_path / "profile_pb2.py").read_text() == (sinks / "profile_pb2.py").read_text(), (
        "regenerate: protoc --proto_path=pymtrace/sinks --python_out=pymtrace/sinks pymtrace/sinks/profile.proto"
    )


# ---------------------------------------------------------------- properties

MEAN = 4096
ONE_STACK = ((LIBC, 0x100), (EXE, 0x240))


def simulated_estimates(sizes, rng, runs):
    """The BPF side's sampler (per thread: bytes left until the next sample, drawn Exp(mean);
    a block >= mean always sampled) run RUNS times over SIZES, each run's samples added to a
    HeapProfile: the mean of its (alloc_objects, alloc_space) estimates over the runs, and
    the standard deviations of those means (a Poisson process over the bytes samples each
    block independently with p = 1 - exp(-size/mean))."""
    objects = space = 0.0
    for _ in range(runs):
        profile = HeapProfile(MEAN, {})
        left = rng.expovariate(1 / MEAN)
        for sample_id, size in enumerate(sizes):
            if size < MEAN:
                left -= size
                if left > 0:
                    continue
                left = rng.expovariate(1 / MEAN)
            profile.add(sample_id, ONE_STACK, size, 0, True)
        profile.finish(set(), 0)
        totals = profile.totals()
        objects += totals["alloc_objects"]
        space += totals["alloc_space"]
    probabilities = [-math.expm1(-s / MEAN) if s < MEAN else 1.0 for s in sizes]
    sd_objects = math.sqrt(sum((1 - p) / p for p in probabilities) / runs)
    sd_space = math.sqrt(sum(s * s * (1 - p) / p for s, p in zip(sizes, probabilities)) / runs)
    return objects / runs, space / runs, sd_objects, sd_space


@settings(max_examples=25, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(64, 3 * MEAN), min_size=1, max_size=200), seed=st.integers(0, 2**32 - 1))
def test_poisson_weighted_estimates_are_unbiased(sizes, seed):
    """Any size list: the mean estimate is the truth within 6 standard deviations."""
    objects, space, sd_objects, sd_space = simulated_estimates(sizes, random.Random(seed), runs=100)
    assert abs(objects - len(sizes)) <= 6 * sd_objects + 1e-9
    assert abs(space - sum(sizes)) <= 6 * sd_space + 1e-6


def test_poisson_estimates_on_a_storm_within_the_stated_bound():
    """A storm's sizes (16..4096 bytes, a few blocks above the mean), seeded: bytes within
    6 sd, where 6 sd is under 2 % (so a biased weight, e.g. 5 % off, fails)."""
    rng = random.Random(13)
    sizes = [rng.randint(16, 4096) for _ in range(2000)] + [3 * MEAN] * 5
    objects, space, sd_objects, sd_space = simulated_estimates(sizes, rng, runs=100)
    assert 6 * sd_space < 0.02 * sum(sizes)
    assert abs(space - sum(sizes)) <= 6 * sd_space
    assert abs(objects - len(sizes)) <= 6 * sd_objects


MODULES = [Module("/bin/app", "ab"), Module("/lib/libc.so.6", ""), Module("/lib/libx.so", "cd" * 20)]
location_st = st.tuples(st.sampled_from(MODULES), st.integers(0, 1 << 24))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    samples=st.lists(
        st.tuples(st.lists(location_st, min_size=0, max_size=6), st.integers(1, 1 << 20), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    sample_bytes=st.sampled_from([1, 4096, 1 << 19]),
)
def test_pprof_round_trip(samples, sample_bytes):
    profile = HeapProfile(sample_bytes, {"exe": "/bin/app"})
    for sample_id, (stack, size, _live) in enumerate(samples):
        profile.add(sample_id, tuple(stack), size, 0, True)
    profile.finish({i for i, (_s, _z, live) in enumerate(samples) if live}, 1)
    p = parsed_pprof(written(write_pprof, profile))
    s = p.string_table
    mappings = {m.id: m for m in p.mapping}
    where = {}
    for loc in p.location:
        m = mappings[loc.mapping_id]
        assert m.memory_start <= loc.address < m.memory_limit
        where[loc.id] = (s[m.filename], s[m.build_id], loc.address - m.memory_start + m.file_offset)
    got = {tuple(where[i] for i in smp.location_id): tuple(smp.value) for smp in p.sample}
    want = {
        tuple((m.path, m.build_id, pc) for m, pc in e.stack): e.values() for e in profile.stacks() if any(e.values())
    }
    assert got == want
    assert p.period == sample_bytes


@settings(max_examples=40, deadline=None, derandomize=True)
@given(stacks=st.lists(st.lists(st.text(max_size=12), min_size=1, max_size=5), min_size=1, max_size=10))
def test_folded_line_format(stacks):
    frames = {}
    profile = HeapProfile(1, {})
    for i, names in enumerate(stacks):
        stack = tuple((MODULES[0], i * 16 + depth) for depth in range(len(names)))
        for loc, name in zip(stack, reversed(names)):  # names root first, stack leaf first
            frames[loc] = [Frame(name)]
        profile.add(i, stack, 10 + i, 0, True)
    profile.finish(set(range(len(stacks))), 1)
    out = io.BytesIO()
    write_folded(profile, FakeSymbolizer(frames), out)
    lines = out.getvalue().decode().split("\n")
    assert lines[-1] == ""
    depths = sorted(len(names) for names in stacks)
    seen = []
    for line in lines[:-1]:
        assert re.fullmatch(r"[^;\n]+(;[^;\n]+)* [1-9][0-9]*", line), repr(line)
        assert not re.search(r"[\x00-\x1f\x7f]", line)
        stack, amount = line.rsplit(" ", 1)
        seen.append((stack.count(";") + 1, int(amount)))
    assert sum(amount for _, amount in seen) == sum(10 + i for i in range(len(stacks)))
    if len({";".join(folded_name(name) for name in names) for names in stacks}) == len(stacks):
        assert sorted(depth for depth, _ in seen) == depths


def test_finish_end_time_is_the_older_reference():
    profile = HeapProfile(1, {})
    profile.add(1, ONE_STACK, 8, END_NS - 31 * 10**9, True)
    profile.add(2, ONE_STACK, 16, END_NS - 29 * 10**9, True)
    profile.finish({1, 2}, END_NS, older_s=30)
    (entry,) = profile.stacks()
    assert entry.values() == (2, 24, 1, 8)


def test_freed_samples_are_not_in_use_at_the_end():
    profile = HeapProfile(1, {})
    profile.add(1, ONE_STACK, 8, 0, True)
    profile.add(2, ONE_STACK, 16, 0, True)
    profile.freed(1)
    profile.freed(77)  # never sampled: nothing
    profile.finish({1, 2}, END_NS)  # 1 reported live by mistake: already forgotten
    (entry,) = profile.stacks()
    assert entry.values() == (2, 24, 1, 16)


def test_pprof_main_executable_first_without_exe_in_meta():
    profile = HeapProfile(1, {"command": "x"})  # no "exe": the outermost frame's module (_start)
    profile.add(1, STACKS["cxx"], 64, 0, True)  # complete, but libc holds its outermost frame
    for i in range(2, 5):
        profile.add(i, STACKS["chain"], 100, 0, True)
    profile.finish(set(), 1)
    p = parsed_pprof(written(write_pprof, profile))
    assert p.string_table[p.mapping[0].filename] == EXE.path


def test_every_writer_accepts_an_empty_profile():
    profile = HeapProfile(1 << 19, {"pids": [1]})
    profile.finish(set(), 1, drops={"ring_full": 0})
    assert written(write_folded, profile) == b""
    assert len(parsed_pprof(written(write_pprof, profile)).sample) == 0
    assert "0 bytes in 0 allocations in use in 0 stacks" in render_text(profile, FakeSymbolizer())
    assert "<title>pymtrace heap: pid 1</title>" in render_html(profile, FakeSymbolizer())


def test_text_sums_stacks_that_print_the_same():
    """An unrolled loop (gcc 14 -O2) calls lib_inner from two return addresses in lib_outer:
    without line numbers the two stacks read alike, so the report shows them as one."""
    frames = dict(FRAMES)
    frames[(LIB, 0x121)] = frames[(LIB, 0x120)]
    profile = HeapProfile(1, {"command": "chain", "pids": [4242], "exe": EXE.path})
    for i in range(10):
        stack = list(STACKS["leak"])
        stack[2] = (LIB, 0x120 + i % 2)
        profile.add(i + 1, tuple(stack), 4000, 10**9, True)
    profile.finish(set(range(1, 11)), END_NS)
    text = render_text(profile, FakeSymbolizer(frames))
    assert "40000 bytes in 10 allocations in use in 1 stacks; top 1 by inuse_space:" in text
    assert text.count("allocations from stack") == 1
    assert "\t40000 bytes in 10 allocations from stack\n\t\tmalloc [libc.so.6] malloc.c:3287\n" in text
