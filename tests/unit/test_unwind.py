"""target/unwind.py against real processes: C and C++ workloads built without frame pointers
dump their own registers and stack at a known point of a known call chain
(tests/support/workloads/heap_selfstack*.c, what the BPF heap sampler records at a malloc);
the unwinder must give back exactly that chain, symbolized, from the files captured while the
process lived (also after it exited and its binaries were deleted)."""

import ctypes
import io
import os
import pathlib
import re
import shutil
import struct
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.needs import missing_or_fail
from support.paths import WORKLOADS

from pymtrace import nativebuild
from pymtrace.errors import MissingLibrary, ProcessGone
from pymtrace.tracee import unwind

FLAGS = ["-O2", "-fomit-frame-pointer", "-fno-builtin", "-I", str(WORKLOADS)]
LIBC_START = ["__libc_start_call_main", "__libc_start_main", "_start"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The workloads, built like distribution code: -O2 without frame pointers."""
    for tool in ("gcc", "g++"):
        if shutil.which(tool) is None:
            missing_or_fail(f"{tool} is not installed")
    out = tmp_path_factory.mktemp("selfstack")
    lib = out / "libheap_selfstack_lib.so"

    def cc(*args):
        subprocess.run(list(args), check=True, capture_output=True)

    cc("gcc", *FLAGS, "-shared", "-fPIC", "-o", lib, WORKLOADS / "heap_selfstack_lib.c")
    cc(
        "gcc",
        *FLAGS,
        "-pthread",
        "-DWITH_LIB",
        "-o",
        out / "c",
        WORKLOADS / "heap_selfstack.c",
        f"-L{out}",
        "-lheap_selfstack_lib",
    )
    cc("gcc", *FLAGS, "-g", "-o", out / "c_g", WORKLOADS / "heap_selfstack.c")
    cc("g++", *FLAGS, "-o", out / "cxx", WORKLOADS / "heap_selfstack_cxx.cpp")
    return out


class Dumped:
    """A workload run: the image captured while it lived, and the stack it dumped."""

    def __init__(self, argv, dump, env=None, before_exit=None):
        proc = subprocess.Popen(
            [str(a) for a in argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        try:
            line = proc.stdout.readline()
            self.tid = int(line.split()[1]) if line.startswith("tid ") else proc.pid
            if line.startswith("tid "):
                line = proc.stdout.readline()
            assert line.startswith("ready")
            self.pid = proc.pid
            self.image = unwind.ProcessImage(proc.pid)
            if before_exit:
                before_exit(self)
        finally:
            proc.communicate("\n", timeout=30)
        data = dump.read_bytes()
        self.regs = struct.unpack_from("<8Q", data)
        (length,) = struct.unpack_from("<Q", data, 64)
        self.stack = data[72 : 72 + length]
        assert len(self.stack) == length > 0

    def unwind(self, length=None):
        return self.image.unwind(self.tid, self.regs, self.stack, len(self.stack) if length is None else length)

    def names(self, stack, symbolizer=None):
        if symbolizer is None:
            symbolizer = unwind.Symbolizer()
            symbolizer.add(self.image)
        return [[f.function for f in symbolizer.frames(loc)] for loc in stack]


def lib_env(built):
    return dict(os.environ, LD_LIBRARY_PATH=str(built))


def libc_start_frames(names):
    """The frames below main: exact where libc's symbol table is there (libc6-dbg), else at
    least the exported __libc_start_main and the executable's _start, the local function
    between named by module and offset (Debian 13's libc6-dbg gave no symbols in its VM)."""
    tail = [n[-1] for n in names[names.index(["main"]) + 1 :]]
    if "__libc_start_call_main" not in tail:
        assert tail[-2:] == ["__libc_start_main", "_start"] or tail[-1] == "_start", tail
        assert all(re.fullmatch(r"libc\.so\.6\+0x[0-9a-f]+", n) for n in tail[: tail.index("_start")][:-1]), tail
        return tail
    assert tail == LIBC_START, tail
    return tail


def test_unwinds_the_exact_chain_without_frame_pointers(built, tmp_path):
    run = Dumped(
        [built / "c", "exe", tmp_path / "dump"], tmp_path / "dump", lib_env(built), lambda run: run.image.refresh()
    )
    stack, complete = run.unwind()
    names = run.names(stack)
    assert complete
    assert names == [["leaf"], ["b"], ["a"], ["main"]] + [[n] for n in libc_start_frames(names)]
    exe = unwind.Module(str(built / "c"), stack[0][0].build_id)
    assert [loc[0] for loc in stack[:4]] == [exe] * 4 and len(exe.build_id) == 40
    assert run.image.unwind(run.pid, run.regs, run.stack, len(run.stack)) == (stack, complete)  # repeatable
    copy = ctypes.create_string_buffer(run.stack, len(run.stack))  # an address, as the ring buffer gives it
    assert run.image.unwind(run.pid, run.regs, ctypes.addressof(copy), len(run.stack)) == (stack, complete)


def test_a_chain_through_a_shared_library_symbolizes_after_exit_and_deletion(built, tmp_path):
    """The binaries are deleted while the process runs, then it exits: the descriptors taken
    through /proc/PID/map_files still name the files that were mapped."""
    private = tmp_path / "bin"
    shutil.copytree(built, private)

    def delete(run):
        (private / "c").unlink()
        (private / "libheap_selfstack_lib.so").unlink()

    run = Dumped([private / "c", "lib", tmp_path / "dump"], tmp_path / "dump", lib_env(private), delete)
    assert not (private / "c").exists()
    stack, complete = run.unwind()
    names = run.names(stack)
    assert complete
    assert names == [["lib_leaf"], ["lib_b"], ["a"], ["main"]] + [[n] for n in libc_start_frames(names)]
    assert stack[0][0].path == str(private / "libheap_selfstack_lib.so")
    assert stack[2][0].path == str(private / "c")


def test_a_file_rewritten_in_place_is_not_trusted(built, tmp_path):
    """Same inode, other contents (a build-ID mismatch with what was captured): the new bytes
    are not used, so the stack ends there, incomplete, at a pc in no known file."""
    private = tmp_path / "bin"
    shutil.copytree(built, private)
    run = Dumped([private / "c", "lib", tmp_path / "dump"], tmp_path / "dump", lib_env(private))
    lib = private / "libheap_selfstack_lib.so"
    other = tmp_path / "other.so"
    subprocess.run(
        ["gcc", *FLAGS, "-O1", "-shared", "-fPIC", "-o", other, WORKLOADS / "heap_selfstack_lib.c"], check=True
    )
    inode = lib.stat().st_ino
    with open(lib, "r+b") as f:  # truncate and write: the inode the image holds changes contents
        f.truncate(0)
        f.write(other.read_bytes())
    assert lib.stat().st_ino == inode
    stack, complete = run.unwind()
    assert not complete and len(stack) == 1
    assert stack[0] == (unwind.UNKNOWN, run.regs[0])  # no file to relate it to: the absolute pc
    assert run.names(stack) == [[f"[unknown]+0x{run.regs[0]:x}"]]


def test_a_thread_stack_unwinds_to_the_thread_start(built, tmp_path):
    """A thread's outermost frames are libc's start_thread and clone3 (names need libc's
    symbol table: libc6-dbg), the stack still complete."""
    run = Dumped([built / "c", "thread", tmp_path / "dump"], tmp_path / "dump", env=lib_env(built))
    assert run.tid != run.pid
    stack, complete = run.unwind()
    names = [n[-1] for n in run.names(stack)]
    assert complete
    assert names[:4] == ["leaf", "b", "a", "thread_main"]
    assert len(names) == 6 and {loc[0].path for loc in stack[4:]} == {stack[4][0].path}  # both in libc
    if "start_thread" in names:
        assert names[4:] == ["start_thread", "__clone3"]


def test_cxx_names_are_demangled(built, tmp_path):
    run = Dumped([built / "cxx", tmp_path / "dump"], tmp_path / "dump")
    stack, complete = run.unwind()
    names = run.names(stack)
    assert complete
    assert names[:3] == [
        ["shapes::Pool<shapes::Node>::make(long, char const*)"],
        ["shapes::build(int, char const*)"],
        ["main"],
    ]
    assert names[3:] == [[n] for n in libc_start_frames(names)]


def test_inlined_frames_where_debug_info_exists(built, tmp_path):
    """In the -g build inl_leaf is inlined into b_inl: one pc, several frames, innermost
    first; the caller's line is the inlined call's own line in the source."""
    run = Dumped([built / "c_g", "inline", tmp_path / "dump"], tmp_path / "dump")
    stack, complete = run.unwind()
    assert complete
    symbolizer = unwind.Symbolizer()
    symbolizer.add(run.image)
    leaf = symbolizer.frames(stack[0])
    functions = [f.function for f in leaf]
    assert functions[-2:] == ["inl_leaf", "b_inl"], functions
    assert set(functions[:-2]) <= {"selfstack_capture", "selfstack_mapping_end"}
    assert [f.inlined for f in leaf] == [True] * (len(leaf) - 1) + [False]
    source = (WORKLOADS / "heap_selfstack.c").read_text().splitlines()
    call_line = next(i for i, text in enumerate(source, 1) if "return inl_leaf(path" in text)
    assert (os.path.basename(leaf[-1].file), leaf[-1].line) == ("heap_selfstack.c", call_line)
    assert run.names(stack)[1:3] == [["a"], ["main"]]
    assert symbolizer.frames(stack[1])[0].line == next(
        i for i, text in enumerate(source, 1) if "r = b_inl(path" in text
    )


def test_a_truncated_stack_is_reported_incomplete(built, tmp_path):
    run = Dumped([built / "c", "exe", tmp_path / "dump"], tmp_path / "dump", env=lib_env(built))
    full, _ = run.unwind()
    stack, complete = run.unwind(length=8)
    assert not complete
    assert 1 <= len(stack) < len(full) and stack[0] == full[0]


def test_an_unknown_pc_is_named_by_module_and_offset(built, tmp_path):
    run = Dumped([built / "c", "exe", tmp_path / "dump"], tmp_path / "dump", env=lib_env(built))
    stack, _ = run.unwind()
    symbolizer = unwind.Symbolizer()
    symbolizer.add(run.image)
    module = stack[0][0]
    assert symbolizer.frames((module, 0x7)) == [unwind.Frame("c+0x7")]
    assert unwind.Symbolizer().frames((module, 0x1A2B)) == [unwind.Frame("c+0x1a2b")]  # image not added


def test_the_vdso_is_captured_and_symbolized(built, tmp_path):
    """The vdso has no file: its bytes are read from the process. The kernel gives every
    process the same image, so this process's copy says where its functions are."""
    from elftools.elf.elffile import ELFFile

    run = Dumped([built / "c", "exe", tmp_path / "dump"], tmp_path / "dump", env=lib_env(built))
    vdso = [m for m in run.image.modules if m.path == "[vdso]"]
    assert len(vdso) == 1 and vdso[0].build_id
    mine = next(m for m in unwind.parse_maps(pathlib.Path("/proc/self/maps").read_text()) if m.path == "[vdso]")
    with open("/proc/self/mem", "rb", buffering=0) as mem:
        mem.seek(mine.start)
        elf = ELFFile(io.BytesIO(mem.read(mine.end - mine.start)))
    symbol = next(s for s in elf.get_section_by_name(".dynsym").iter_symbols() if s.name == "__vdso_clock_gettime")
    symbolizer = unwind.Symbolizer()
    symbolizer.add(run.image)
    assert symbolizer.frames((vdso[0], symbol["st_value"] + 4))[0].function == "__vdso_clock_gettime"


def test_a_gone_process_is_a_clear_error(built, tmp_path):
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(ProcessGone, match=f"process {proc.pid} does not exist"):
        unwind.ProcessImage(proc.pid)


def test_missing_libdw_headers_name_the_package(tmp_path, monkeypatch):
    """A compiler that cannot find elfutils' headers (shadowed here by an include directory
    whose libdwfl.h is an #error: a real compile that fails the same way) gives one line
    naming the package to install."""
    inc = tmp_path / "inc" / "elfutils"
    inc.mkdir(parents=True)
    (inc / "libdwfl.h").write_text('#error "elfutils/libdwfl.h: No such file or directory"\n')
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec gcc -I{inc.parent} "$@"\n')
    wrapper.chmod(0o700)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("PYMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(unwind, "_LIB", None)
    with pytest.raises(MissingLibrary, match="libdw-dev.*elfutils-devel"):
        unwind.native_library()


def test_shared_build_is_cached_and_an_untrusted_cache_is_not_loaded(tmp_path, monkeypatch, capsys):
    src = tmp_path / "x.c"
    src.write_text("int x(void) { return 7; }\n")
    monkeypatch.setenv("PYMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    first = nativebuild.build_cached("t", [str(src)], ["-O2"], kind="shared")
    assert first.endswith(".so") and os.stat(first).st_mode & 0o777 == 0o700
    assert nativebuild.build_cached("t", [str(src)], ["-O2"], kind="shared") == first
    inode = os.stat(first).st_ino
    os.chmod(first, 0o720)  # group-writable: someone else could have replaced it
    assert nativebuild.build_cached("t", [str(src)], ["-O2"], kind="shared") == first  # rebuilt, renamed over it
    assert os.stat(first).st_ino != inode and os.stat(first).st_mode & 0o777 == 0o700
    os.chmod(tmp_path / "cache" / "native", 0o770)  # a cache others can write: nothing in it is used
    private = nativebuild.build_cached("t", [str(src)], ["-O2"], kind="shared")
    assert os.path.dirname(private) != os.path.dirname(first)
    assert "not using the t cache" in capsys.readouterr().err
    os.chmod(tmp_path / "cache" / "native", 0o700)
    src.write_text("int x(void) { return syntax error; }\n")
    with pytest.raises(nativebuild.BuildFailed, match="building the native helper t failed"):
        nativebuild.build_cached("t", [str(src)], ["-O2"], kind="shared")


maps_paths = st.one_of(
    st.just(""),
    st.sampled_from(["[heap]", "[stack]", "[vdso]", "[anon:x]"]),
    st.text(st.characters(blacklist_characters="\n\0", blacklist_categories=("Cs",)), min_size=1).map(
        lambda s: "/" + s.strip(" ")
    ),
)
map_lines = st.builds(
    unwind.MapLine,
    start=st.integers(0, 2**47 - 1),
    end=st.integers(0, 2**47 - 1),
    perms=st.sampled_from(["r--p", "r-xp", "rw-p", "---p", "rwxs"]),
    offset=st.integers(0, 2**40),
    dev=st.sampled_from(["00:00", "fe:01", "103:0a"]),
    inode=st.integers(0, 2**40),
    path=maps_paths,
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # (an emulated VM draws slowly)
@given(st.lists(map_lines, max_size=20))
def test_maps_text_round_trips(lines):
    """format_maps writes what parse_maps (and libdwfl's reader) reads: paths with spaces,
    " (deleted)" marks and anonymous lines included."""
    assert unwind.parse_maps(unwind.format_maps(lines)) == lines


@given(st.lists(map_lines, max_size=20))
def test_elf_file_lines_are_all_mappings_of_files_with_code(lines):
    kept = unwind.elf_file_lines(lines)
    code = {m.path for m in lines if m.path.startswith("/") and "x" in m.perms}
    assert kept == [m for m in lines if m.path in code]
    assert all(m.path.startswith("/") for m in kept)


def test_the_real_maps_of_this_process_round_trip():
    text = pathlib.Path("/proc/self/maps").read_text()
    lines = unwind.parse_maps(text)
    assert len(lines) == len(text.splitlines())
    assert unwind.parse_maps(unwind.format_maps(lines)) == lines


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_recorded_image_of_a_fifo_or_directory_is_refused_at_once(tmp_path, kind):
    """The in-process stacks name their objects by path (a traced process writes them): a
    FIFO or a directory there is one error line, never a wait for a writer."""
    from pymtrace.errors import PymtraceError

    path = tmp_path / kind
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(PymtraceError, match="not a regular file|Is a directory"):
        unwind.RecordedImage(0x1000, 0x2000, 0, str(path), str(path))
