"""The recording's outputs: one trace file (or network stream) per process, opened at its
first record, closed together at the end, and the closing summary on stderr."""

from __future__ import annotations

import bisect
import json
import mmap
import os
import struct
import sys
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from pymtrace.errors import PymtraceError, RecordingStopped, WriteFailed, printable
from pymtrace.recorder.options import RecordOptions
from pymtrace.trace import mappings, stacktable
from pymtrace.trace.files import open_exclusive, open_unique, side_file
from pymtrace.trace.formats import mtrace_bin, mtrace_text
from pymtrace.tracee import elf, libc, proc

if TYPE_CHECKING:
    import numpy

EXIT_LOST = 3  # events were lost (the ring buffer was full), unless --allow-drops
PAGE = mmap.PAGESIZE
_RECORD = struct.Struct("<" + mtrace_bin.RECORD_FORMAT)
_B_FREE = mtrace_bin.FREE
_B_PLUS = (mtrace_bin.MALLOC, mtrace_bin.CALLOC, mtrace_bin.MEMALIGN, mtrace_bin.VALLOC, mtrace_bin.PVALLOC)


def close_outputs(outputs: list) -> WriteFailed | None:
    """Close every output (Output, NetOutput); the first WriteFailed, if any. The network
    outputs' ends are begun together first (begin_close), so with --follow-forks the end
    waits one --send-timeout in all, not one per process."""
    for out in outputs:
        if hasattr(out, "begin_close"):
            out.begin_close()
    failure = None
    for out in outputs:
        try:
            out.close()
        except WriteFailed as exc:
            failure = failure or exc
    return failure


class Output:
    """One process's trace, written as it is recorded: the MAGIC record then raw records
    (mtrace-bin), "= Start" then glibc's text lines (mtrace-text), or Parquet row groups
    (parquet; METADATA: its key-value metadata). A failed write cuts the file back to its
    last complete record (parquet: row group) and raises WriteFailed."""

    def __init__(
        self,
        path: str,
        fd: int,
        fmt: str,
        tgid: int,
        fallback_maps: Callable[[Output], None] | None = None,
        metadata: dict[str, str] | None = None,
        stacks: bool = False,
        allocator: str | None = None,
    ) -> None:
        self.path = path
        self.allocator = allocator or "glibc"
        self.stacks = stacks
        self.stack_table: stacktable.TableWriter | None = None  # record --stacks: set by Outputs
        self.maps = mappings.MapsLog(tgid, path)  # its executable mappings (trace/mappings.py)
        self.maps_fd: int | None = None  # mtrace-bin, mtrace-text: FILE.maps (set by Outputs)
        self.fmt = fmt
        self.tgid = tgid
        self.fd = fd
        self.counts = [0] * 9
        self.entries = 0
        self.bytes_written = 0
        self.failed = None
        self.resolver = mtrace_text.CallerResolver() if fmt == "mtrace-text" else None
        self.fallback_maps = fallback_maps  # adds the maps BPF saw, for a process gone from /proc
        self.last_refresh = 0.0
        self.parquet = None
        if fmt == "parquet":
            from pymtrace.trace.formats import parquet  # pyarrow: imported only when needed

            try:
                self.parquet = parquet.Writer(fd, metadata, stacks=stacks)
            except OSError as exc:
                os.close(fd)
                try:
                    os.unlink(path)
                except OSError:
                    pass
                raise WriteFailed(f"cannot write {path}: {exc.strerror or exc}") from None
            self.bytes_written = self.parquet.size
            self._dtype = mtrace_bin.record_dtype("<")
            return
        head = (
            b"= Start\n"
            if self.resolver is not None
            else mtrace_bin.magic_record(tgid, stacks=stacks, allocator=allocator)
        )
        _, exc = self._put(head, [])
        if exc is not None:
            os.close(fd)
            try:
                os.unlink(path)  # holds nothing
            except OSError:
                pass
            raise WriteFailed(f"cannot write {path}: {exc.strerror or exc}")

    def set_allocator(self, family: str, path: str | None) -> None:
        """Name FAMILY (in PATH) as the recorded allocator (`record -- CMD` after an exec into a
        program on another allocator): the MAGIC record rewritten in place (mtrace-bin), the
        metadata in a new footer (parquet)."""
        if self.fmt == "mtrace-text" or self.failed is not None or family == self.allocator:
            return
        self.allocator = family
        try:
            if self.parquet is not None:
                items = {"pymtrace.allocator": family}
                if path:
                    items["pymtrace.allocator_path"] = path
                self.parquet.update_metadata(items)
            else:
                os.pwrite(self.fd, mtrace_bin.magic_record(self.tgid, stacks=self.stacks, allocator=family), 0)
        except OSError as exc:
            self.failed = exc
            raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def _put(self, blob: bytes | bytearray, ends: Sequence[int]) -> tuple[int, OSError | None]:
        """Append BLOB; ENDS: where each of its records ends in it. Returns how many of them
        are in the file: all, or, when the write fails, those written whole (WriteFailed)."""
        view = memoryview(blob)
        done = 0
        try:
            while done < len(view):
                done += os.write(self.fd, view[done:])
        except OSError as exc:
            kept = bisect.bisect_right(ends, done)
            keep = self.bytes_written + (ends[kept - 1] if kept else 0)
            if not ends:  # the file's header itself
                keep = 0
            try:
                os.ftruncate(self.fd, keep)
            except OSError:
                pass
            self.bytes_written = keep
            self.failed = exc
            return kept, exc
        self.bytes_written += done
        return len(ends), None

    def write(self, data: bytes, n: int, types: Sequence[int] | None = None) -> None:
        """Append N records (DATA: 64 bytes each); TYPES: their counts per call type, if known."""
        rs = mtrace_bin.RECORD_SIZE
        if self.parquet is not None:
            import numpy

            self._parquet_step(self.parquet.write_records, numpy.frombuffer(data, self._dtype, count=n))
            return
        if self.resolver is None:
            blob, ends = data, range(rs, (n + 1) * rs, rs)
        else:
            blob, ends = self._text(data)
        kept, exc = self._put(blob, ends)
        if types is None or kept < n:
            kinds = bytes(data[4 : kept * rs : rs])  # ~0.014 us/event
            types = [kinds.count(t) for t in range(9)]
        for t in range(1, 9):
            self.counts[t] += types[t]
        self.entries += kept
        if exc is not None:
            raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}")

    def write_words(self, words: numpy.ndarray) -> None:
        """Parquet: records as an (N, 8) uint64 array of their words (a view of the ring buffer:
        copied once, into the writer's columns)."""
        self._parquet_step(self.parquet.write_words, words)

    def _parquet_step(self, step: Callable[..., object], *args: object) -> None:
        """Run a parquet Writer step; count the rows it put in the file; WriteFailed on OSError."""
        try:
            step(*args)
        except OSError as exc:
            self.failed = exc
            raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}") from None
        finally:
            self.counts = list(self.parquet.type_counts)
            self.entries = self.parquet.rows
            self.bytes_written = self.parquet.size

    def poll(self) -> None:
        """Called on every poll: parquet writes a row group when its oldest row is old enough."""
        if self.parquet is not None and self.failed is None:
            self._parquet_step(self.parquet.maybe_flush)

    def _text(self, data: bytes | bytearray) -> tuple[bytes, list[int]]:
        """glibc's text lines for the records in DATA, as one blob, and each record's end in it.
        The lines of mtrace_text.record_lines, inlined for the common calls (~1 us a record:
        this runs while recording)."""
        rows = list(_RECORD.iter_unpack(data))
        self._resolve_all({r[8] for r in rows})
        resolve = self.resolver
        parts, ends, pos = [], [], 0
        for row in rows:
            _, ty, p1, p2, size, _, _, _, caller = row
            ty &= 0xFF
            where = resolve(caller)
            at = f"@ {where} " if where else ""
            if ty == _B_FREE:
                text = f"{at}- {p1:#x}\n" if p1 else ""
            elif ty in _B_PLUS and p2 and size:
                text = f"{at}+ {p2:#x} {size:#x}\n"
            else:
                lines = mtrace_text.record_lines(mtrace_bin.Record(row[0], ty, *row[2:]), where)
                text = "".join(line + "\n" for line in lines)
            parts.append(text)
            pos += len(text)
            ends.append(pos)
        return "".join(parts).encode(), ends

    def _resolve_all(self, callers: Iterable[int]) -> None:
        """Read the maps again (or take BPF's) if a caller is in no module known yet (a
        library loaded since the last snapshot); at most every 0.2 s."""
        now = time.monotonic()
        if now - self.last_refresh < 0.2:
            return
        if any(a and self.resolver(a).startswith("[") for a in set(callers)):
            self.last_refresh = now
            if not self.snapshot_maps() and self.fallback_maps is not None:
                self.fallback_maps(self)

    def record_maps(self) -> None:
        """Read the process's maps now and keep its executable mappings not kept yet: in the
        Parquet metadata (a new footer) or appended to FILE.maps."""
        if self.failed is not None or not self.maps.snapshot():
            return
        try:
            if self.parquet is not None:
                self.parquet.update_metadata({"pymtrace." + mappings.METADATA_KEY: self.maps.text()})
            elif self.maps_fd is not None:
                data = memoryview(self.maps.take_new().encode())
                while data:
                    data = data[os.write(self.maps_fd, data) :]
        except OSError as exc:
            self.failed = exc
            where = self.path if self.parquet is not None else mappings.side_path(self.path)
            raise WriteFailed(f"cannot write {where}: {exc.strerror or exc}") from None

    def note_exec(self) -> None:
        """The process exec'd: the mappings read from now on are its new program's."""
        self.maps.exec()
        self.record_maps()

    def snapshot_maps(self) -> bool:
        """Add the process's current maps to the caller resolver (mtrace-text); whether it could."""
        if self.resolver is not None:
            try:
                self.resolver.add_maps(libc.read_maps(self.tgid))
                return True
            except (PymtraceError, OSError):
                pass
        return False

    def close(self) -> None:
        try:
            self.record_maps()  # what it loaded since the last read, if it still runs
        finally:
            if self.maps_fd is not None:
                os.close(self.maps_fd)
                self.maps_fd = None
        if self.stack_table is not None:
            table, self.stack_table = self.stack_table, None
            try:
                table.close()
            except OSError as exc:
                self.failed = self.failed or exc
                raise WriteFailed(f"cannot write {table_path_of(self.path)}: {exc.strerror or exc}") from None
        if self.parquet is not None and self.failed is None:
            try:
                self._parquet_step(self.parquet.close)
            finally:
                os.close(self.fd)
            return
        if self.resolver is not None and self.failed is None:
            _, exc = self._put(b"= End\n", [6])
            if exc is not None:
                os.close(self.fd)
                raise WriteFailed(f"cannot write {self.path}: {exc.strerror or exc}")
        os.close(self.fd)

    def summary(self) -> dict:
        return {
            "file": self.path,
            "pid": self.tgid,
            "format": self.fmt,
            "entries": self.entries,
            "counts": {mtrace_bin.TYPE_NAMES[t]: self.counts[t] for t in range(1, 9)},
            "bytes_written": self.bytes_written,
        }


def table_path_of(path: str) -> str:
    return stacktable.table_path(path)


class Outputs:
    """The recording's outputs by process id: the first process (TARGET) writes to OPTIONS'
    file, each other one (--follow-forks) beside it, or each streams to the collector
    (--to). The metadata names the recorded ALLOCATOR (None: the glibc in LIBC_PATH).
    SYMBOLIZE: the stack unwinder's, for the stack tables (--stacks); FALLBACK_MAPS: adds
    the maps BPF saw to an mtrace-text output whose process is gone from /proc."""

    def __init__(
        self,
        options: RecordOptions,
        target: int,
        libc_path: str | None,
        allocator: libc.Allocator | None = None,
        symbolize: Callable | None = None,
        fallback_maps: Callable[[Output], None] | None = None,
    ) -> None:
        self.options = options
        self.target = target
        self.libc_path = libc_path
        self.allocator = allocator
        self.symbolize = symbolize
        self.fallback_maps = fallback_maps
        self.by_pid: dict[int, Output] = {}

    @property
    def family(self) -> str:
        """The allocator family recorded ("glibc", or a tracee.allocators.FAMILIES key)."""
        return self.allocator.family if self.allocator is not None else "glibc"

    def pids(self) -> set[int]:
        return set(self.by_pid)

    def all(self) -> list[Output]:
        return list(self.by_pid.values())

    def output_for(self, tgid: int) -> Output:
        """Process TGID's output, opened now if it has none yet."""
        out = self.by_pid.get(tgid)
        if out is not None:
            return out
        options = self.options
        if options.network is not None:  # record --to: see net.sender
            return self._network_output(tgid)
        if tgid == self.target:
            if options.output:
                path, fd = options.output, open_exclusive(options.output, options.force)
            else:
                suffix = ".parquet" if options.format == "parquet" else ""
                path, fd = open_unique(f"mtrace.out.{tgid}{suffix}")
        else:
            base = f"{self.by_pid[self.target].path}.{tgid}"
            try:
                path, fd = open_unique(base)
            except PymtraceError as exc:  # a full disk: stop like a failed write
                raise WriteFailed(str(exc)) from None
        meta = self._parquet_metadata(tgid) if options.format == "parquet" else None
        if options.stacks and meta is not None:
            meta["pymtrace.stacks"] = os.path.basename(stacktable.table_path(path))
        side_fds = {}  # the side files, by suffix
        for suffix, wanted in ((stacktable.SUFFIX, options.stacks), (mappings.SUFFIX, options.format != "parquet")):
            if not wanted:
                continue
            try:
                side_fds[suffix] = open_exclusive(side_file(path, suffix), options.force)
            except PymtraceError:
                for other in side_fds:
                    os.close(side_fds[other])
                    os.unlink(side_file(path, other))
                os.close(fd)
                os.unlink(path)
                raise
        out = Output(
            path,
            fd,
            options.format,
            tgid,
            fallback_maps=self.fallback_maps,
            metadata=meta,
            stacks=options.stacks,
            allocator=self.family,
        )
        if stacktable.SUFFIX in side_fds:
            out.stack_table = stacktable.TableWriter(side_fds[stacktable.SUFFIX], path, tgid, self.symbolize)
        out.maps_fd = side_fds.get(mappings.SUFFIX)
        if out.maps_fd is not None:
            os.write(out.maps_fd, out.maps.take_new().encode())  # the header
        self.by_pid[tgid] = out
        out.snapshot_maps()
        out.record_maps()
        if options.progress:
            print(f"pymtrace: writing to {path}", file=sys.stderr)
        return out

    def _network_output(self, tgid: int) -> Output:
        """Process TGID's records streamed to a collector (record --to), with the metadata a
        local Parquet recording would have."""
        from pymtrace.net.sender import NetOutput

        network = self.options.network
        meta = self._parquet_metadata(tgid)
        out = NetOutput(
            network.address,
            network.config,
            tgid,
            meta,
            network.spool_memory,
            quiet=self.options.quiet,
            close_wait=network.send_timeout,
        )
        self.by_pid[tgid] = out
        if self.options.progress:
            print(f"pymtrace: streaming process {tgid} to the collector at {out.path}", file=sys.stderr)
        return out

    def _parquet_metadata(self, tgid: int) -> dict[str, str]:
        """The Parquet key-value metadata of process TGID's recording (docs/formats.md)."""
        from pymtrace.trace.formats import parquet

        libc_path = self.libc_path
        cmd = self.options.cmd
        return parquet.file_metadata(
            pid=tgid,
            magic_thread=tgid,
            comm=proc.comm(tgid) or None,
            host=os.uname().nodename,
            libc_path=libc_path,
            libc_build_id=elf.build_id(libc_path) if libc_path else None,
            page_size=PAGE,
            start_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            start_time_ns=time.time_ns(),
            start_monotonic_ns=time.monotonic_ns(),
            command=" ".join(cmd) if tgid == self.target and cmd else None,
            byteorder=sys.byteorder,
            source_format="record",
            allocator=self.family,
            allocator_path=self.allocator.path if self.allocator is not None else libc_path,
        )

    def set_allocator(self, allocator: libc.Allocator | None, path: str) -> None:
        """A launched command exec'd into a program on ALLOCATOR (None: glibc) in PATH: the
        outputs open and to come name it."""
        self.allocator = allocator
        for out in self.by_pid.values():
            if hasattr(out, "set_allocator"):
                out.set_allocator(self.family, path)

    def poll(self) -> None:
        """Every drain: parquet row groups due, mtrace-text maps read again (see Output)."""
        for out in list(self.by_pid.values()):
            out.poll()

    def snapshot_maps(self) -> None:
        for out in self.by_pid.values():
            out.snapshot_maps()

    def record_maps(self, pid: int | None = None) -> None:
        """Keep the executable mappings of process PID (None: of every process) learned since."""
        for tgid, out in list(self.by_pid.items()):
            if hasattr(out, "record_maps") and pid in (None, tgid):
                out.record_maps()

    def note_exec(self, pid: int) -> None:
        """Process PID exec'd (a launched command, held at its exec)."""
        out = self.by_pid.get(pid)
        if out is not None and hasattr(out, "note_exec"):
            out.note_exec()

    def close(self) -> WriteFailed | None:
        return close_outputs(list(self.by_pid.values()))

    def discard(self) -> None:
        """Close and delete every output (nothing was recorded: no empty trace left behind)."""
        for out in self.by_pid.values():
            if out.fd is None:  # record --to: no file, stop its sender
                out.discard()
                continue
            if getattr(out, "stack_table", None) is not None:
                try:
                    os.close(out.stack_table.fd)
                    os.unlink(stacktable.table_path(out.path))
                except OSError:
                    pass
            if getattr(out, "maps_fd", None) is not None:
                try:
                    os.close(out.maps_fd)
                    os.unlink(mappings.side_path(out.path))
                except OSError:
                    pass
            for fd in (out.fd, getattr(out, "final_fd", None)):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            try:
                os.unlink(out.path)
            except OSError:
                pass
        self.by_pid.clear()


# ---------------------------------------------------------------- the closing summary


def print_summary(summary: dict, options: RecordOptions) -> None:
    """The closing SUMMARY (Recorder.finish) on stderr: one JSON document (--json) or lines."""
    if options.json:
        print(json.dumps(summary), file=sys.stderr)
        return
    for o in summary["files"]:
        print(f"pymtrace: {o['entries']} entries recorded in {o['file']}", file=sys.stderr)
        counts = ", ".join(f"{k} {v}" for k, v in o["counts"].items() if v)
        print(f"pymtrace:   {counts or 'no calls'}; {o['bytes_written']} bytes written", file=sys.stderr)
    for p in summary.get("processes", ()):
        if p["via"] is None:
            print(f"pymtrace: process {p['pid']}: not recorded after an exec: {printable(p['why'])}", file=sys.stderr)
            continue
        if p["via"] == "uprobes":
            print(
                f"pymtrace: process {p['pid']}: through uprobes after an exec: {printable(p['why'])}", file=sys.stderr
            )
            continue
        waits = f"{p['waits']} waits for a full ring ({p['wait_s'] * 1000:.1f} ms)" if p["waits"] else "no waits"
        print(
            f"pymtrace: process {p['pid']}"
            + (f" (image {p['image']})" if p["image"] else "")
            + f": in-process, calls forwarded to {printable(p['allocator'])}; {waits}"
            + (f"; {p['torn']} records lost (the process died while writing them)" if p["torn"] else ""),
            file=sys.stderr,
        )
    lost = summary["lost"]
    print(f"pymtrace: {lost} events lost, {summary['duration_s']:.3f} s", file=sys.stderr)
    if "stacks" in summary:
        print(
            f"pymtrace: {summary['stacks']} distinct stacks in {len(summary['files'])} stack table(s); "
            f"{summary['stacks_lost']} allocations without a stack (id 0)",
            file=sys.stderr,
        )
    for line in summary.get("python", ()):
        print(f"pymtrace: python: {printable(line)}", file=sys.stderr)
    if lost:
        print(
            "pymtrace: events were lost: the ring buffer was full; use a larger --buffer-size"
            + ("" if options.allow_drops else " (or --allow-drops)"),
            file=sys.stderr,
        )


def exit_status(summary: dict, options: RecordOptions) -> int:
    """The recording's exit status from its SUMMARY: 0, or EXIT_LOST when events or stacks
    were lost (unless --allow-drops); RecordingStopped when it stopped early (a failed
    write, a program that cannot be probed)."""
    if "error" in summary:
        n = len(summary["files"])
        raise RecordingStopped(
            f"{summary['error']}; recording stopped, {summary['entries']} complete "
            f"entries kept" + (f" in {n} files" if n > 1 else "")
        )
    if (summary["lost"] or summary.get("stacks_lost")) and not options.allow_drops:
        return EXIT_LOST
    return 0
