"""Apache Parquet recordings: one row per malloc-API call, in columns, compressed (docs/formats.md, section 5).

The schema (SCHEMA) and the mapping between mtrace-bin records and rows are defined here
once: a record's fields become the columns of the same name (`pad[0]` is `time_ns`,
`pad[1]` is `caller`), the call type code becomes its name in the dictionary-encoded
`type` column, and the path flags (bits 8-21 of the record's type word, always 0 in
pymtrace's recordings) the `path` column, so mtrace-bin -> parquet -> mtrace-bin gives the
same bytes. `stack` is reserved for call stacks (null until stacks are recorded).

Writer appends one row group at a time and the file stays a complete Parquet file while it
does (Writer._commit), so a recorder killed with SIGKILL leaves a file that pyarrow, DuckDB or
Spark read up to its last row group; the one exception, a kill while the previous footer is
being copied to the new end, leaves a file that repair() truncates back to it.
All row processing is vectorized (numpy, pyarrow): no Python work per record.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import IO, Iterator, Mapping, Sequence

import numpy
import pyarrow
import pyarrow.compute
import pyarrow.parquet

from pymtrace.errors import CorruptFile, PymtraceError
from pymtrace.trace.formats import mtrace_bin
from pymtrace.trace.formats import thrift_compact as thrift

FORMAT_VERSION = "1"  # pymtrace.format_version: bumped when the schema changes incompatibly
MAGIC = b"PAR1"
META_PREFIX = "pymtrace."

# the call names of the `type` column, in call type code order (code = index + 1)
TYPE_NAMES = tuple(mtrace_bin.TYPE_NAMES[code] for code in range(1, 9))
_TYPE_DICT = pyarrow.array(TYPE_NAMES, pyarrow.string())

# One definition of the columns: name -> (Arrow type, nullable, what it holds).
COLUMNS = {
    "thread": (pyarrow.int32(), False, "kernel thread id (TID) of the caller"),
    "type": (pyarrow.dictionary(pyarrow.int8(), pyarrow.string()), False, "call name: " + ", ".join(TYPE_NAMES)),
    "ptr1": (pyarrow.uint64(), False, "pointer passed in (free, realloc); posix_memalign's return code"),
    "ptr2": (pyarrow.uint64(), False, "pointer returned (0: NULL, or none)"),
    "size": (pyarrow.uint64(), False, "bytes requested"),
    "size2": (pyarrow.uint64(), False, "chunk size released (free, realloc), alignment, or page size"),
    "size3": (pyarrow.uint64(), False, "chunk size of the block returned"),
    "time_ns": (pyarrow.uint64(), False, "CLOCK_MONOTONIC ns when the call took ownership (0 = unknown)"),
    "caller": (pyarrow.uint64(), False, "the caller's return address, absolute (0 = unknown)"),
    "path": (pyarrow.uint16(), False, "glibc path flags, record type bits 8-21 shifted down (pymtrace: 0)"),
    "stack": (pyarrow.list_(pyarrow.uint64()), True, "return addresses, innermost first (null: not recorded)"),
}
SCHEMA = pyarrow.schema(
    [pyarrow.field(name, typ, nullable, metadata={"doc": doc}) for name, (typ, nullable, doc) in COLUMNS.items()]
)
# record --stacks: one more column, the stack id of each row in the stack table FILE.stacks
# (pymtrace.trace.stacktable; 0: none, e.g. a free). Ids, not frames: a stack repeats over
# thousands of rows, and a join with the small table is what analysis does anyway.
STACK_ID_COLUMN = (pyarrow.uint32(), False, "stack id in the stack table FILE.stacks (0: none; frees have none)")
STACKS_SCHEMA = SCHEMA.append(
    pyarrow.field("stack_id", STACK_ID_COLUMN[0], STACK_ID_COLUMN[1], metadata={"doc": STACK_ID_COLUMN[2]})
)
_UINT64 = ("ptr1", "ptr2", "size", "size2", "size3", "time_ns", "caller")  # record order
_LE_DTYPE = mtrace_bin.record_dtype("<")

# Encodings, chosen per column by measurement on a malloc storm and on python3 churning
# JSON (docs/formats.md, section 5): dictionary (RLE/bit-packed indices; PLAIN once the
# dictionary outgrows its page) for what repeats: thread, type, caller, path, size2
# and the pointers, which DELTA_BINARY_PACKED made 2.4x larger (allocations and frees interleave,
# so consecutive pointers are unrelated); DELTA_BINARY_PACKED for the nearly monotonic
# time; BYTE_STREAM_SPLIT for the requested size and the chunk size returned (size3: as small
# as its dictionary or smaller, no hashing).
# zstd on all.
DICTIONARY_COLUMNS = ["thread", "type", "ptr1", "ptr2", "size2", "caller", "path"]
COLUMN_ENCODINGS = {"time_ns": "DELTA_BINARY_PACKED", "size": "BYTE_STREAM_SPLIT", "size3": "BYTE_STREAM_SPLIT"}
STATISTICS_COLUMNS = ["thread", "time_ns", "size"]  # min/max per row group: lets queries skip groups
COMPRESSION, COMPRESSION_LEVEL = "zstd", 1  # level 3: ~5% smaller, ~60 ns a row more CPU
ROW_GROUP_ROWS = 1 << 18  # rows buffered before a row group is written (16 MiB of columns,
# ~40 ms of CPU to encode: a short pause of the recorder's drain loop; smaller groups cost
# more per row, measured: 65,536 rows ~25% more)
WRITE_BATCH_ROWS = 1 << 16  # rows pyarrow encodes at a time (its default 1024: ~8% more CPU, measured)
MAX_ROW_GROUP_ROWS = 1 << 21  # row groups grow up to this as the footer grows (see Writer)
_PAGE = 4096  # a write within one page is all or nothing (the page cache copies a folio at a time)
FLUSH_INTERVAL_S = 2.0  # a recording also writes a row group at least this often (see Writer),
MAX_FLUSH_INTERVAL_S = 10.0  # or, after 100 s, every 2% of its age up to this


def _writer_options() -> dict:
    return dict(
        compression=COMPRESSION,
        compression_level=COMPRESSION_LEVEL,
        use_dictionary=DICTIONARY_COLUMNS,
        column_encoding=COLUMN_ENCODINGS,
        write_statistics=STATISTICS_COLUMNS,
        write_page_index=False,  # page indexes sit between row groups and footer: Writer appends
        write_batch_size=WRITE_BATCH_ROWS,
        store_schema=True,
    )


# ---------------------------------------------------------------- records <-> rows


def record_words(recs: numpy.ndarray) -> numpy.ndarray:
    """A numpy record array (mtrace_bin.record_dtype, either byte order) as an (N, 8) array of
    little-endian uint64 words, one row per record (a view when it already is one)."""
    if recs.dtype != _LE_DTYPE:
        recs = recs.astype(_LE_DTYPE)
    return numpy.ascontiguousarray(recs).view(numpy.uint64).reshape(len(recs), 8)


def table_from_columns(cols: numpy.ndarray, stacks: bool = False) -> pyarrow.Table:
    """The rows (SCHEMA) of records given as columns: an (8, N) uint64 array whose row i is
    word i of every record (the transpose of record_words). The uint64 columns are used
    without a copy. STACKS: bits 8-31 of the type words are stack ids (STACKS_SCHEMA)."""
    n = cols.shape[1]
    head = cols[0].view(numpy.uint32).reshape(n, 2)  # thread, type word (little endian)
    words = head[:, 1]
    word_bytes = cols[0].view(numpy.uint8).reshape(n, 8)[:, 4:8]  # the type word's bytes
    # one pass each (a recording runs this on every row group): the call type code is the
    # type word's low byte, its dictionary index that minus 1
    index = numpy.subtract(word_bytes[:, 0], 1, dtype=numpy.int8, casting="unsafe")
    columns = {
        "thread": pyarrow.array(head[:, 0].view(numpy.int32).copy()),
        "type": pyarrow.DictionaryArray.from_arrays(pyarrow.array(index), _TYPE_DICT),
    }
    for i, name in enumerate(_UINT64, start=1):
        columns[name] = pyarrow.array(cols[i])
    if stacks or not word_bytes[:, 1:3].any():  # pymtrace's recordings: no path flags
        columns["path"] = pyarrow.array(numpy.zeros(n, numpy.uint16))
    else:
        columns["path"] = pyarrow.array(((words >> 8) & 0x3FFF).astype(numpy.uint16))
    columns["stack"] = pyarrow.nulls(n, SCHEMA.field("stack").type)
    if stacks:
        columns["stack_id"] = pyarrow.array((words >> 8).astype(numpy.uint32))
        return pyarrow.Table.from_pydict(columns, schema=STACKS_SCHEMA)
    return pyarrow.Table.from_pydict(columns, schema=SCHEMA)


def table_from_records(recs: numpy.ndarray) -> pyarrow.Table:
    """The rows (SCHEMA) of a numpy record array (mtrace_bin.record_dtype, either byte order)."""
    # one transposing copy makes every 8-byte field a contiguous column (strided fields
    # would each be gathered separately, ~3x slower)
    return table_from_columns(numpy.ascontiguousarray(record_words(recs).T))


def _type_codes(column: pyarrow.ChunkedArray | pyarrow.Array, name: str) -> numpy.ndarray:
    """Call type codes (uint8) of a `type` column, dictionary-encoded or plain strings."""
    if isinstance(column, pyarrow.ChunkedArray):
        column = column.combine_chunks()
    if pyarrow.types.is_dictionary(column.type):
        names = column.dictionary.to_pylist()
        lookup = numpy.array([TYPE_NAMES.index(n) + 1 if n in TYPE_NAMES else 0 for n in names] or [0], numpy.uint8)
        if column.null_count:
            raise CorruptFile(f"{name}: the type column has nulls")
        codes = lookup[column.indices.to_numpy(zero_copy_only=False).astype(numpy.int64)]
    else:
        codes = pyarrow.compute.index_in(column, value_set=_TYPE_DICT)
        if codes.null_count:
            codes = codes.fill_null(-1)
        codes = (codes.to_numpy(zero_copy_only=False) + 1).astype(numpy.uint8)
    if len(codes) and not codes.all():
        raise CorruptFile(f"{name}: a row has a call type that is none of " + ", ".join(TYPE_NAMES))
    return codes


def records_from_batch(batch: pyarrow.RecordBatch | pyarrow.Table, name: str = "trace") -> numpy.ndarray:
    """A numpy record array (little endian, mtrace_bin.record_dtype) of a batch of rows."""
    recs = numpy.zeros(batch.num_rows, mtrace_bin.record_dtype("<"))
    try:
        recs["type"] = _type_codes(batch.column("type"), name)
        if "stack_id" in batch.schema.names:  # record --stacks: the id where mtrace-bin keeps it
            values = batch.column("stack_id")
            if values.null_count:
                raise CorruptFile(f"{name}: the stack_id column has nulls")
            ids = values.cast(pyarrow.uint32()).to_numpy(zero_copy_only=False)
            if len(ids) and int(ids.max()) >= 1 << 24:
                raise CorruptFile(f"{name}: a stack id does not fit in 24 bits")
            recs["type"] |= ids.astype(numpy.uint32) << 8
        elif "path" in batch.schema.names:
            recs["type"] |= _column(batch, "path", name).astype(numpy.uint32) << 8
        recs["thread"] = _column(batch, "thread", name)
        for col in _UINT64:
            recs[col] = _column(batch, col, name)
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError, pyarrow.ArrowTypeError) as exc:
        raise CorruptFile(f"{name}: {str(exc).splitlines()[0]}") from None
    return recs


def _column(batch: pyarrow.RecordBatch | pyarrow.Table, col: str, name: str) -> numpy.ndarray:
    values = batch.column(col)
    if values.null_count:
        raise CorruptFile(f"{name}: the {col} column has nulls")
    return values.cast(COLUMNS[col][0]).to_numpy(zero_copy_only=False)


def raw_bytes(recs: numpy.ndarray, byteorder: str = "<") -> bytes:
    """RECS as mtrace-bin records in BYTEORDER."""
    return recs.astype(mtrace_bin.record_dtype(byteorder), copy=False).tobytes()


# ---------------------------------------------------------------- writing


def file_metadata(**items: object) -> dict[str, str]:
    """Key-value metadata for a recording, keys prefixed `pymtrace.`; None values left out.
    Always has format_version and pymtrace_version."""
    from pymtrace import __version__

    meta = {"format_version": FORMAT_VERSION, "pymtrace_version": __version__}
    meta.update({k: str(v) for k, v in items.items() if v is not None})
    return {META_PREFIX + k: v for k, v in meta.items()}


class Writer:
    """Write rows to the file descriptor FD (empty, positioned at 0) one row group at a time.

    write_records() buffers; a row group is written when ROW_GROUP_ROWS rows are buffered,
    when maybe_flush() finds the oldest buffered row FLUSH_INTERVAL_S old (or 2% of the
    writer's age, up to MAX_FLUSH_INTERVAL_S: fewer row groups, a smaller footer, for a long
    recording; a recording calls it on every poll) and at close().
    Each row group and a new footer listing every row group so far replace the previous
    footer, in three steps that keep the file a complete Parquet file (_commit). The footer
    grows by ~0.8 KB a row group, so once it has grown by 64 KiB row groups grow too (2 rows
    per footer byte, up to MAX_ROW_GROUP_ROWS): rewriting it stays a small part of the
    writing. A failed write (disk full) restores the previous footer, so the file keeps every
    earlier row group, and raises OSError.
    """

    def __init__(
        self,
        fd: int,
        metadata: Mapping[str, str] | None = None,
        row_group_rows: int = ROW_GROUP_ROWS,
        flush_interval: float = FLUSH_INTERVAL_S,
        stacks: bool = False,
    ) -> None:
        self.fd = fd
        self.stacks = stacks  # records carry stack ids (record --stacks): the stack_id column
        self.schema = (STACKS_SCHEMA if stacks else SCHEMA).with_metadata(dict(metadata or {}))
        self.row_group_rows = row_group_rows
        self.flush_interval = flush_interval
        self.started = time.monotonic()
        # rows buffered, already as columns (8 x capacity words, reused: fresh large
        # buffers cost a page fault every 4 KiB), filled by one strided copy a batch
        self.pending = numpy.empty((8, 0), numpy.uint64)
        self.pending_rows = 0
        self.pending_since = None
        self.rows = 0  # rows in the file
        self.row_groups = []  # each row group's encoded thrift RowGroup
        self.data_end = len(MAGIC)  # where the footer starts
        self.type_counts = [0] * 9  # rows in the file per call type code (index 0 unused)
        empty, _ = self._segment(None)
        fields, _ = thrift.read_struct(empty, len(empty) - 8 - struct.unpack_from("<I", empty, len(empty) - 8)[0])
        self.template = fields  # FileMetaData: schema, key-value metadata, created_by
        self.footer = self._footer()
        self.base_footer = len(self.footer)
        self._pwrite([MAGIC, self.footer], 0)

    @property
    def size(self) -> int:
        """Bytes in the file."""
        return self.data_end + len(self.footer)

    def _segment(self, table: pyarrow.Table | None) -> tuple[bytes, int]:
        """(a complete one-row-group Parquet file of TABLE in memory, where its footer starts)."""
        sink = pyarrow.BufferOutputStream()
        with pyarrow.parquet.ParquetWriter(sink, self.schema, **_writer_options()) as w:
            if table is not None:
                w.write_table(table, row_group_size=max(1, table.num_rows))
        seg = memoryview(sink.getvalue()).cast("B")
        return seg, len(seg) - 8 - struct.unpack_from("<I", seg, len(seg) - 8)[0]

    def _footer(self) -> bytes:
        """FileMetaData listing every row group written, with its length and the magic."""
        out = bytearray()
        last = 0
        for fid, ttype, value in self.template:
            if fid == 3:
                value = self.rows
            if fid == 4:  # row_groups, already encoded
                out.append(((fid - last) << 4) | ttype)
                out += thrift.list_header(len(self.row_groups), thrift.STRUCT)
                for rg in self.row_groups:
                    out += rg
            else:
                thrift.write_struct([[fid - last, ttype, value]], out)
                out.pop()  # write_struct's stop byte: the struct goes on
            last = fid
        out.append(0)
        return bytes(out) + struct.pack("<I", len(out)) + MAGIC

    def write_records(self, recs: numpy.ndarray) -> None:
        """Buffer a numpy record array (mtrace_bin.record_dtype); writes full row groups."""
        if len(recs):
            self.write_words(record_words(recs))

    def write_words(self, words: numpy.ndarray) -> None:
        """Buffer records given as an (N, 8) uint64 array of their little-endian words (any
        strides: the recorder passes a view of the ring buffer itself, copied once, here, into
        the columns); writes full row groups."""
        if not len(words):
            return
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        growth = len(self.footer) - self.base_footer
        limit = self.row_group_rows
        if growth >= 1 << 16:
            limit = max(limit, min(MAX_ROW_GROUP_ROWS, 2 * growth))
        while len(words):
            if self.pending.shape[1] < limit:
                grown = numpy.empty((8, limit), numpy.uint64)
                grown[:, : self.pending_rows] = self.pending[:, : self.pending_rows]
                self.pending = grown
            take = min(len(words), limit - self.pending_rows)
            self.pending[:, self.pending_rows : self.pending_rows + take] = words[:take].T
            self.pending_rows += take
            words = words[take:]
            if self.pending_rows >= limit:
                self.flush()

    def maybe_flush(self, now: float | None = None) -> bool:
        """Write a row group if the oldest buffered row is FLUSH_INTERVAL_S old; whether it did."""
        if self.pending_since is None:
            return False
        now = time.monotonic() if now is None else now
        wait = max(self.flush_interval, min(MAX_FLUSH_INTERVAL_S, 0.02 * (now - self.started)))
        if now - self.pending_since < wait:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Write the buffered rows as one row group, and the new footer."""
        if not self.pending_rows:
            return
        n = self.pending_rows
        cols = self.pending[:, :n]
        seg, footer_at = self._segment(table_from_columns(cols, self.stacks))
        fields, _ = thrift.read_struct(seg, footer_at)
        rg = thrift.field(fields, 4)[2][1][0]
        _shift_row_group(rg, self.data_end - len(MAGIC), len(self.row_groups))
        data = seg[len(MAGIC) : footer_at]  # a memoryview: no copy
        self.row_groups.append(bytes(thrift.write_struct(rg)))
        self.rows += n
        footer = self._footer()
        try:
            self._commit(data, footer)
        except OSError:
            self.row_groups.pop()
            self.rows -= n
            raise
        self.data_end += len(data)
        self.footer = footer
        self.pending_rows, self.pending_since = 0, None
        counts = numpy.bincount(cols[0].view(numpy.uint8).reshape(n, 8)[:, 4], minlength=9)  # type codes
        self.type_counts = [a + int(b) for a, b in zip(self.type_counts, counts[:9])]

    def update_metadata(self, items: Mapping[str, str]) -> None:
        """Set key-value metadata ITEMS (`record -- CMD`: the allocator of the program the
        command exec'd); the footer is rewritten at once. Raises OSError."""
        meta = {k.decode(): v.decode() for k, v in (self.schema.metadata or {}).items()}
        meta.update(items)
        self.schema = self.schema.with_metadata(meta)
        empty, _ = self._segment(None)
        self.template, _ = thrift.read_struct(
            empty, len(empty) - 8 - struct.unpack_from("<I", empty, len(empty) - 8)[0]
        )
        footer = self._footer()
        self._commit(b"", footer)
        self.footer = footer

    def _commit(self, data: bytes | memoryview, footer: bytes) -> None:
        """Replace the footer at data_end with DATA (row group bytes) and FOOTER, the file a
        complete Parquet file at every moment a kill can find it in, but one:
        1. the current footer again, at (or past) where the new file will end: while this
           write is under way the file ends in a part of it (repair() cuts the file back to
           the footer it copies, which is still in place); a footer of at most a page is
           placed within one page, which the kernel writes whole or not at all;
        2. DATA and FOOTER over the current footer: the copy ends the file meanwhile;
        3. truncate the file after FOOTER (atomic).
        A write over the footer in place (one step) would leave, if killed half way, no footer
        at all. OSError: the file is put back as it was (disk full) and the error raised."""
        old = self.footer
        end = self.data_end + len(data) + len(footer)
        at = max(end, self.data_end + len(old))
        if len(old) <= _PAGE and at // _PAGE != (at + len(old) - 1) // _PAGE:
            at = (at // _PAGE + 1) * _PAGE
        try:
            self._pwrite([old], at)
            self._pwrite([data, footer], self.data_end)
            os.ftruncate(self.fd, end)
        except OSError:
            try:  # the copy at the end keeps the file complete until the truncate
                self._pwrite([old], self.data_end)
                os.ftruncate(self.fd, self.data_end + len(old))
            except OSError:
                pass
            raise

    def _pwrite(self, parts: list, offset: int) -> None:
        """Write PARTS (bytes-like) at OFFSET, all of them (pwritev can write less)."""
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            done = os.pwritev(self.fd, views, offset)
            offset += done
            while views and done >= len(views[0]):
                done -= len(views[0])
                views.pop(0)
            if views and done:
                views[0] = views[0][done:]

    def close(self) -> None:
        """Write what is buffered (the file descriptor stays open: its owner closes it)."""
        self.flush()


def _shift_row_group(rg: list, delta: int, ordinal: int) -> None:
    """Move a decoded RowGroup's file offsets by DELTA bytes and set its ordinal."""
    for entry in rg:
        if entry[0] == 5:  # file_offset
            entry[2] += delta
        elif entry[0] == 1:  # columns: list<ColumnChunk>
            for chunk in entry[2][1]:
                for c in chunk:
                    if c[0] in (2, 4, 6):  # file_offset, offset_index_offset, column_index_offset
                        c[2] += delta
                    elif c[0] == 3:  # ColumnMetaData: data/index/dictionary page, bloom filter
                        for m in c[2]:
                            if m[0] in (9, 10, 11, 14):
                                m[2] += delta
    rg[:] = [e for e in rg if e[0] != 7]
    if ordinal < 1 << 15:
        rg.append([7, thrift.I16, ordinal])
        rg.sort(key=lambda e: e[0])


def write_records(
    fileobj: IO[bytes], arrays: Iterator[numpy.ndarray], metadata: Mapping[str, str], stacks: bool = False
) -> int:
    """Write record arrays to the new, empty file FILEOBJ as Parquet; the number of rows.
    STACKS: the records' type words carry stack ids (the stack_id column)."""
    fileobj.flush()
    w = Writer(fileobj.fileno(), metadata, stacks=stacks)
    for recs in arrays:
        w.write_records(recs)
    w.close()
    return w.rows


# ---------------------------------------------------------------- reading


_ARROW_ERRORS = (pyarrow.ArrowException, OSError, ValueError, IndexError, KeyError, OverflowError)
# Reading runs on the calling thread only (no pre-buffering, no decoding threads): pyarrow
# reports an allocation that fails there as MemoryError, where one in a worker thread (or the
# thread's own creation, under an address-space limit) aborts the process.
READ_OPTIONS = dict(pre_buffer=False)
BATCH_PARTS = 1024  # batches gathered into one at most: one-row row groups give one-row batches
# pyarrow reports most failed allocations as MemoryError but aborts the process on some (a
# C++ std::bad_alloc where nothing catches it), so a read starts only when the address space
# it needs is free: its footer parsed (measured: 11 to 15 bytes a footer byte) and then row
# groups decoded one at a time (each a few times its uncompressed size, with the batch).
FOOTER_MEMORY = 16
ROW_GROUP_MEMORY = 4
READ_HEADROOM = 64 << 20

# The footer of the file read last, parsed: (path, dev, inode, size, mtime) -> FileMetaData.
# pyarrow's parse holds ~10 KB per row group (360 MB for 36,000 row groups), and one command
# asks a file several questions (format, schema, metadata, rows): parsed once, kept for one file.
_last_footer: tuple[tuple, pyarrow.parquet.FileMetaData] | None = None


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def footer(path: str) -> pyarrow.parquet.FileMetaData:
    """The parsed footer of PATH (pyarrow errors and MemoryError pass through)."""
    global _last_footer
    key = _identity(path)
    last = _last_footer
    if last is not None and last[0] == key:
        return last[1]
    _last_footer = None  # not two footers in memory at once
    _reserve(path, FOOTER_MEMORY * _footer_bytes(path) + READ_HEADROOM)
    md = pyarrow.parquet.read_metadata(path)
    if _identity(path) == key:  # unchanged while it was read: the same file next time
        _last_footer = (key, md)
    return md


def _footer_bytes(path: str) -> int:
    """The footer length PATH's last 8 bytes give, at most the file's size (0 if it has none)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(-8, os.SEEK_END)
            return min(size, struct.unpack("<I", f.read(4))[0])
    except (OSError, struct.error):
        return 0


def _reserve(path: str, size: int) -> None:
    """out_of_memory unless SIZE bytes of address space can be mapped now."""
    try:
        mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS).close()
    except (OSError, MemoryError, OverflowError):
        raise out_of_memory(path) from None


def out_of_memory(path: str) -> PymtraceError:
    """The one-line error for a read of PATH that ran out of memory."""
    return PymtraceError(
        f"{path}: out of memory reading it (its footer, {_footer_bytes(path):,} bytes, takes 11 to 15 "
        "times that in memory, beside the row group being read)"
    )


def is_parquet(head: bytes) -> bool:
    return head[:4] == MAGIC


def open_file(path: str) -> pyarrow.parquet.ParquetFile:
    """A ParquetFile holding a pymtrace trace; CorruptFile (one line) on anything else."""
    if not os.path.isfile(path):
        raise PymtraceError(f"cannot read {path}: no such file")
    try:
        pf = pyarrow.parquet.ParquetFile(path, metadata=footer(path), **READ_OPTIONS)
        names = pf.schema_arrow.names
    except MemoryError:
        raise out_of_memory(path) from None
    except _ARROW_ERRORS as exc:
        if "bad_alloc" in str(exc):  # the footer's parse ran out of memory
            raise out_of_memory(path) from None
        kept = complete_end(path)
        if kept is not None:
            raise CorruptFile(
                f"{path}: the recorder was killed while it wrote a row group; "
                f"`pymtrace repair {path}` keeps the {kept[1]} rows written before it"
            ) from None
        raise CorruptFile(f"{path}: not a readable Parquet file (truncated or corrupt): {_first_line(exc)}") from None
    missing = [c for c in COLUMNS if c not in names and c not in ("path", "stack")]
    if missing:
        raise CorruptFile(f"{path}: not a pymtrace Parquet trace: no column " + ", ".join(missing))
    return pf


REPAIR_SCAN_BYTES = 1 << 30  # how far back from the end repair looks: past a row group and two footers
REPAIR_CANDIDATES = 256  # "PAR1"s tried (each a footer parse): bounded on a hostile file


def complete_end(path: str) -> tuple[int, int] | None:
    """For a file that does not end in a footer: (size, rows) of the file cut back to the last
    complete pymtrace footer within its last REPAIR_SCAN_BYTES, whose row groups all lie
    before it (what a writer killed in _commit's first step leaves); None if there is none."""
    try:
        size = os.stat(path).st_size
        if size < 12:
            return None
        buf = pyarrow.memory_map(path).read_buffer(size)
    except (OSError, ValueError, pyarrow.ArrowException):
        return None
    view = memoryview(buf)
    floor = max(8, size - REPAIR_SCAN_BYTES)
    hi, tried = size - 4, 0  # candidates start below hi: a "PAR1" ending the file would read
    while hi > floor and tried < REPAIR_CANDIDATES:
        lo = max(floor, hi - (8 << 20))
        chunk = bytes(view[lo : hi + 3])  # 8 MiB at a time, backwards
        end = len(chunk)
        while tried < REPAIR_CANDIDATES:
            q = chunk.rfind(MAGIC, 0, end)
            if q < 0:
                break
            tried += 1
            rows = _footer_ends_at(buf, lo + q + 4)
            if rows is not None:
                return lo + q + 4, rows
            end = q + 3
        hi = lo
    return None


def _footer_ends_at(buf: pyarrow.Buffer, end: int) -> int | None:
    """Rows of the pymtrace Parquet file BUF[:END] if it is one whose row groups lie before its footer."""
    footer_at = end - 8 - struct.unpack_from("<I", buf, end - 8)[0]
    if footer_at < len(MAGIC) or bytes(memoryview(buf)[:4]) != MAGIC:
        return None
    try:
        md = pyarrow.parquet.ParquetFile(pyarrow.BufferReader(buf.slice(0, end))).metadata
        if any(c not in md.schema.names for c in COLUMNS if c not in ("path", "stack")):
            return None
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            for j in range(rg.num_columns):
                col = rg.column(j)
                first = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
                if first < len(MAGIC) or first + col.total_compressed_size > footer_at:
                    return None
        return md.num_rows
    except _ARROW_ERRORS:
        return None


def repair(path: str) -> tuple[int, int]:
    """Cut a file a killed recorder left back to its last complete footer: (rows kept, bytes
    cut). PymtraceError if the file reads as it is, or has no such footer."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PymtraceError(f"cannot open {path}: {exc.strerror}") from None
    try:
        try:
            pyarrow.parquet.ParquetFile(path)  # reads the footer
            complete = True
        except _ARROW_ERRORS:
            complete = False
        if complete:
            raise PymtraceError(f"{path}: a complete Parquet file; nothing to repair")
        kept = complete_end(path)
        if kept is None:
            raise CorruptFile(f"{path}: no complete pymtrace Parquet footer to cut back to (not a pymtrace recording?)")
        size = os.fstat(fd).st_size
        os.ftruncate(fd, kept[0])
        return kept[1], size - kept[0]
    finally:
        os.close(fd)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def read_metadata(path: str) -> dict[str, str]:
    """The file's pymtrace.* key-value metadata, prefix removed."""
    try:
        kv = open_file(path).metadata.metadata or {}
    except MemoryError:
        raise out_of_memory(path) from None
    except _ARROW_ERRORS as exc:
        raise CorruptFile(f"{path}: {_first_line(exc)}") from None
    out = {}
    for k, v in kv.items():
        key = k.decode("utf-8", "replace")
        if key.startswith(META_PREFIX):
            out[key[len(META_PREFIX) :]] = v.decode("utf-8", "replace")
    return out


def iter_batches(
    path: str, columns: Sequence[str] | None = None, batch_size: int = 1 << 16
) -> Iterator[pyarrow.RecordBatch]:
    """Record batches of the file's rows (all columns, or COLUMNS), up to BATCH_SIZE rows each,
    read one row group at a time; CorruptFile on damage. Small row groups give small batches,
    gathered (up to BATCH_PARTS of them) into one, so that per-batch work stays small."""
    pf = open_file(path)
    md = pf.metadata
    largest = max((md.row_group(i).total_byte_size for i in range(md.num_row_groups)), default=0)
    _reserve(path, ROW_GROUP_MEMORY * largest + READ_HEADROOM)
    parts: list[pyarrow.RecordBatch] = []
    rows = 0
    try:
        for batch in pf.iter_batches(
            batch_size=batch_size, columns=list(columns) if columns else None, use_threads=False
        ):
            parts.append(batch)
            rows += batch.num_rows
            if rows >= batch_size or len(parts) >= BATCH_PARTS:
                yield _joined(parts)
                parts, rows = [], 0
        if parts:
            yield _joined(parts)
    except MemoryError:
        raise out_of_memory(path) from None
    except _ARROW_ERRORS as exc:
        raise CorruptFile(f"{path}: corrupt Parquet data: {_first_line(exc)}") from None


def _joined(parts: list[pyarrow.RecordBatch]) -> pyarrow.RecordBatch:
    """PARTS as one batch (each row group's `type` dictionary unified into one)."""
    if len(parts) == 1:
        return parts[0]
    table = pyarrow.Table.from_batches(parts).unify_dictionaries().combine_chunks()
    return table.to_batches()[0]


def iter_arrays(path: str, batch_size: int = 1 << 16) -> Iterator[numpy.ndarray]:
    """numpy record arrays (mtrace_bin.record_dtype, little endian) of the file's rows."""
    names = open_file(path).schema_arrow.names
    cols = [c for c in [*COLUMNS, "stack_id"] if c in names and c != "stack"]
    for batch in iter_batches(path, cols, batch_size):
        yield records_from_batch(batch, path)


def has_stacks(path: str) -> bool:
    """Whether the recording PATH has stack ids (record --stacks: the stack_id column)."""
    return "stack_id" in open_file(path).schema_arrow.names


def iter_records(path: str) -> Iterator[mtrace_bin.Record]:
    """mtrace_bin.Record objects of the file's rows (for per-record readers: dump, workload)."""
    stacks = has_stacks(path)
    for recs in iter_arrays(path):
        yield from iter_records_of(recs, stacks)


def iter_records_of(recs: numpy.ndarray, stacks: bool = False) -> Iterator[mtrace_bin.Record]:
    """mtrace_bin.Record objects of a numpy record array (STACKS: type bits 8-31 are stack ids)."""
    Record = mtrace_bin.Record
    for thread, word, p1, p2, s1, s2, s3, ts, caller in recs.tolist():
        if stacks:
            yield Record(thread, word & 0xFF, p1, p2, s1, s2, s3, ts, caller, 0, word >> 8)
        else:
            yield Record(thread, word & 0xFF, p1, p2, s1, s2, s3, ts, caller, (word >> 8) & 0x3FFF)


def magic_of(meta: Mapping[str, str]) -> tuple[str, int]:
    """(byte order, MAGIC thread) for writing the file as mtrace-bin again: those of the
    mtrace-bin file it came from, or the recorded pid and little endian."""
    order = ">" if meta.get("byteorder") == "big" else "<"
    try:
        thread = int(meta.get("magic_thread", meta.get("pid", "0")))
    except ValueError:
        thread = 0
    if not -(1 << 31) <= thread < 1 << 31:
        thread = 0
    return order, thread


def write_mtrace_bin(path: str, out: IO[bytes]) -> int:
    """Write the Parquet trace PATH to OUT as mtrace-bin (MAGIC first); the number of records."""
    order, thread = magic_of(read_metadata(path))
    out.write(mtrace_bin.magic_record(thread, order, stacks=has_stacks(path)))
    n = 0
    for recs in iter_arrays(path):
        out.write(raw_bytes(recs, order))
        n += len(recs)
    return n


def arrays_from_records(records: Iterator[mtrace_bin.Record], chunk: int = 1 << 16) -> Iterator[numpy.ndarray]:
    """numpy record arrays of Record objects (a text log's records), CHUNK at a time."""
    dtype = mtrace_bin.record_dtype("<")
    rows = []
    for r in records:
        rows.append((r.thread, r.type | r.path << 8, r.ptr1, r.ptr2, r.size, r.size2, r.size3, r.ts_ns, r.caller))
        if len(rows) == chunk:
            yield numpy.array(rows, dtype)
            rows = []
    if rows:
        yield numpy.array(rows, dtype)


def convert_to_parquet(path: str, fmt: str, out: IO[bytes], extra: Mapping[str, str] | None = None) -> int:
    """Write the trace PATH (in format FMT) to the new file OUT as Parquet; the row count.
    The MAGIC record's thread and the byte order of an mtrace-bin input are kept in the
    metadata, so converting back gives the same bytes. EXTRA: more metadata (pymtrace.* keys)."""
    if fmt == "parquet":
        meta = {META_PREFIX + k: v for k, v in read_metadata(path).items()}
        return write_records(out, iter_arrays(path), meta, stacks=has_stacks(path))
    if fmt == "mtrace-text":
        from pymtrace.trace.formats import mtrace_text

        records = mtrace_text.to_records(mtrace_text.read_file(path))
        return write_records(out, arrays_from_records(records), {**file_metadata(source_format=fmt), **(extra or {})})
    with open(path, "rb") as f:
        stacks = mtrace_bin.has_stacks(f.read(mtrace_bin.RECORD_SIZE), "<")
        f.seek(0)
        order, thread, arrays = mtrace_bin.read_arrays(f, path)
        if order != "<":
            f.seek(0)
            stacks = mtrace_bin.has_stacks(f.read(mtrace_bin.RECORD_SIZE), order)
            f.seek(0)
            order, thread, arrays = mtrace_bin.read_arrays(f, path)
        meta = file_metadata(
            source_format=fmt,
            magic_thread=thread,
            pid=thread or None,
            byteorder="big" if order == ">" else "little",
        )
        return write_records(out, arrays, {**meta, **(extra or {})}, stacks=stacks)
