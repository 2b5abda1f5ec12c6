"""The recording's drain loop: the ring buffer's records copied into the outputs until the
process (and, with --follow-forks, its children) exits, --duration ends or a stop signal
comes; then one last drain of everything committed before the stop."""

from __future__ import annotations

import ctypes
import os
import select
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from pymtrace import stopping
from pymtrace.bpf.ringbuf import RingReader
from pymtrace.errors import PymtraceError, RecordingStopped, WriteFailed
from pymtrace.recorder.options import RecordOptions
from pymtrace.recorder.outputs import Output, Outputs
from pymtrace.recorder.stacks import StackUnwinder
from pymtrace.trace.formats import mtrace_bin
from pymtrace.tracee import proc

if TYPE_CHECKING:
    import numpy

    from pymtrace.tracee.launch import Launched

DIRECT_CHUNK = 8192  # records copied from the ring at a time (640 KiB of samples: the copy stays in the cache)
STACKS_POLL_INTERVAL_S = 0.01  # record --stacks drains this often (DrainPacer's wait otherwise)
MAPS_INTERVAL_S = 1.0  # how often the traced processes' maps are read again (libraries dlopen'ed since)


class DrainPacer:
    """How long the recorder sleeps before its next drain of the ring buffer (no --poll-interval).

    Every drain has a fixed cost besides its per-record work: a wakeup into caches other
    processes have taken, the Python calls of a drain, numpy and pyarrow calls per batch. A real
    program's calls arrive at a few 100k a second, so a drain every 10 ms would take batches of ~2,500
    records and the fixed cost would be ~40 ns a record. The pacer waits until about BATCH records
    are expected (from the rate of the last interval, falling at most by half a drain), at
    least MIN_WAIT_S and at most MAX_WAIT_S (the latency of a recording's end and of its row
    groups), and never longer than a quarter of the ring buffer takes to fill at BURST_RATE,
    so that a burst after a quiet period still fits (BPF never wakes us: BPF_RB_NO_WAKEUP).
    FIXED (seconds): a constant wait instead (--poll-interval)."""

    BATCH = 1 << 16  # records a drain aims for (and at most a quarter of the ring)
    MIN_WAIT_S = 0.001
    MAX_WAIT_S = 0.1
    BURST_RATE = 1e6  # records/s a quiet process may suddenly make (a storm: ~0.75M/s traced)

    def __init__(self, ring_records: int, fixed: float | None = None) -> None:
        self.fixed = fixed
        self.batch = max(1, min(self.BATCH, ring_records // 4))
        self.max_wait = max(self.MIN_WAIT_S, min(self.MAX_WAIT_S, ring_records / 4 / self.BURST_RATE))
        self.rate = 0.0  # records/s expected
        self.last = None  # when the previous drain ended

    def wait(self, drained: int, now: float) -> float:
        """Seconds to sleep after a drain that took DRAINED records and ended at NOW."""
        if self.fixed is not None:
            return self.fixed
        if self.last is not None and now > self.last:
            self.rate = max(drained / (now - self.last), self.rate / 2)
        self.last = now
        if self.rate <= 0:
            return self.max_wait
        return min(self.max_wait, max(self.MIN_WAIT_S, self.batch / self.rate))


class Watched:
    """The processes a recording waits for: TARGET (LAUNCHED: the command pymtrace started)
    and, with FOLLOW (--follow-forks), its descendants, from the proc connector's fork and
    exit events when it can be read, else from /proc and the processes with an output."""

    KINDS = ("fork", "exit")  # the process events read (on_event)

    def __init__(self, target: int, launched: Launched | None, follow: bool) -> None:
        self.target = target
        self.launched = launched
        self.follow = follow
        self.alive: set[int] = set()
        self.procevents: Any = None
        self.events_error: str | None = None  # why process events could not be followed

    def start(self, on_event: Callable[[Any], None] | None = None) -> None:
        """Start following forks (before the probes go on: no child is missed). ON_EVENT: sees
        each event first, in the events' reader thread (then it must queue it itself)."""
        self.alive = {self.target}
        try:
            from pymtrace.tracee.procevents import ProcEvents

            self.procevents = ProcEvents(on_event=on_event, kinds=self.KINDS).start()
        except (PymtraceError, OSError) as exc:
            self.procevents = None  # fall back to scanning /proc for children
            self.events_error = str(exc)

    def target_alive(self, pidfd: int, at_exit: Callable[[int], None] | None) -> bool:
        """Whether the target runs on (PIDFD: its pidfd; AT_EXIT: a held command's last call)."""
        if self.launched is not None:
            if self.launched.held:
                return self.launched.service(at_exit) is None
            if self.launched.proc.poll() is not None:
                return False
        else:
            r, _, _ = select.select([pidfd], [], [], 0)
            if r:
                return False
        return True

    def children_alive(self, recorded: set[int]) -> bool:
        """Whether a descendant of the target runs on (RECORDED: the processes with an output)."""
        if not self.follow:
            return False
        self.poll()
        self.alive |= recorded
        self.alive = {p for p in self.alive if p != self.target and proc.exists(p)}
        return bool(self.alive)

    def poll(self) -> None:
        """Read the process events come since."""
        if self.procevents is not None:
            for ev in self.procevents.drain():
                self.on_event(ev)

    def on_event(self, ev: Any) -> None:
        """A process event (tracee.procevents.ProcEvent) of one of KINDS."""
        if ev.kind == "fork" and ev.pid == ev.tgid and ev.parent_tgid in self.alive:
            self.alive.add(ev.tgid)
        elif ev.kind == "exit" and ev.pid == ev.tgid:
            self.alive.discard(ev.tgid)

    def stop(self) -> None:
        if self.procevents is not None:
            self.procevents.stop()


class Drainer:
    """Copies the committed records of the ring buffer READER into the outputs (OUTPUT_FOR:
    a process's output) of TARGET and, with --follow-forks, its children. DIRECT: a parquet
    file of one process, the records copied from the ring straight into its columns.
    UNWINDER (--stacks): labels the records with their stacks, whose events
    CONSUME_STACKS takes from their own ring first."""

    PACER = DrainPacer

    def __init__(
        self,
        reader: RingReader | None,
        output_for: Callable[[int], Output],
        target: int,
        direct: bool = False,
        unwinder: StackUnwinder | None = None,
        consume_stacks: Callable[[], Any] | None = None,
        ring_records: int | None = None,
    ) -> None:
        self.reader = reader
        self.ring_records = ring_records if ring_records is not None else reader.max_batch
        self.output_for = output_for
        self.target = target
        self.direct = direct
        self.unwinder = unwinder
        self.consume_stacks = consume_stacks
        self.consumer_cpu = 0.0  # CPU time spent draining the ring buffer and writing
        self.polls = 0
        self.last_poll: float | None = None
        self.max_gap = 0.0
        self.duration = 0.0
        self.interrupted = False
        self.failure: RecordingStopped | None = None
        self.outputs: Outputs | None = None  # run()'s

    def drain(self, final: bool = False) -> int:
        """Copy what the ring holds into the outputs; how many records. FINAL: the last drain,
        which waits briefly for a record reserved before the stop that is still being written."""
        total = 0
        now = time.monotonic()
        if self.last_poll is not None:
            self.max_gap = max(self.max_gap, now - self.last_poll)
        self.last_poll = now
        t0 = time.thread_time()
        # Only what was reserved when this drain began (the final drain: when stopping
        # began): a process whose calls our own draining causes (pymtrace's own writes
        # reaching a traced reader...) can never keep a drain, or the stop, going.
        limit = self.reader.producer()
        if self.unwinder is not None:
            # every record reserved before `limit` had its stack committed before it
            t1 = time.thread_time()
            with stopping.stop_deferred():  # raised in BCC's callback, a stop would be swallowed
                self.consume_stacks()
            self.unwinder.cpu += time.thread_time() - t1
        patience = time.monotonic() + 0.1
        direct = self.direct
        # a stop signal waits until this drain is done: a batch taken from the ring is
        # always written whole, and the counts match the file
        try:
            with stopping.stop_deferred():
                # Take what is there and go back to sleep: chasing the producer in a loop
                # would read tiny batches, and the per-batch cost would dominate. Read again
                # at once only while batches are large (the buffer was filling up).
                while True:
                    if direct:
                        n = self.drain_words(limit)
                    else:  # a chunk at a time: its copy and write(2) stay in the cache
                        data, n = self.reader.read(max_records=DIRECT_CHUNK, limit=limit)
                    if not n:
                        if final and self.reader.cons_pos[0] < limit and time.monotonic() < patience:
                            time.sleep(0.001)  # a record reserved before the stop, being written
                            continue
                        return total
                    total += n
                    if not direct:
                        self.dispatch(data, n)
                        if n == DIRECT_CHUNK:
                            continue
                    if n < self.ring_records // 8 and not final:
                        return total
        finally:
            self.consumer_cpu += time.thread_time() - t0
            self.polls += 1

    def drain_words(self, limit: int) -> int:
        """Copy the committed records from the ring into the target's parquet columns (one
        copy, no bytes object in between), DIRECT_CHUNK at a time: a chunk's header check
        brings its records into the cache the copy then reads (a whole large batch would not
        fit). How many."""
        total = 0
        while True:
            words, n = self.reader.read_words(limit=limit, max_records=DIRECT_CHUNK)
            if not n:
                return total
            try:
                self.output_for(self.target).write_words(words[:, 1:9])
            finally:
                del words  # the ring's mmap cannot close while a view of it lives
                self.reader.consume(n)
            total += n
            if n < DIRECT_CHUNK:
                return total

    def dispatch(self, data: tuple[bytes | bytearray, list[int] | numpy.ndarray | None], n: int) -> None:
        """Write N records (DATA: their bytes, and their processes or None: all the target's)
        to their processes' outputs."""
        recs, tg = data
        rs = mtrace_bin.RECORD_SIZE
        if self.unwinder is not None:
            recs = self.unwinder.label(recs, n, tg, self.target, self.output_for)
        if tg is None:
            self.output_for(self.target).write(recs, n)
            return
        first = int(tg[0])
        numpy = not isinstance(tg, list)  # the reader copies with numpy when it is installed
        if (numpy and bool((tg == first).all())) or (not numpy and tg.count(first) == n):
            self.output_for(first).write(recs, n)
            return
        # several processes in this batch (--follow-forks): split into runs
        tgids = tg.tolist() if numpy else tg
        i = 0
        while i < n:
            j = i
            t = tgids[i]
            while j < n and tgids[j] == t:
                j += 1
            self.output_for(t).write(recs[i * rs : j * rs], j - i)
            i = j

    def run(
        self,
        options: RecordOptions,
        outputs: Outputs,
        watched: Watched,
        on_exec: Callable[[int], None],
    ) -> None:
        """Drain until the recording ends (see the module), then the last drain. A launched
        command is resumed here (ON_EXEC: called at each of its execs). Sets duration,
        interrupted (a stop signal) and failure (a failed write, a program that cannot be
        probed: recording stopped)."""
        if options.poll_interval_ms is not None:
            fixed = max(options.poll_interval_ms, 0.5) / 1000.0
        else:  # --stacks: its stack events fill their ring ~100 times faster: every 10 ms
            fixed = STACKS_POLL_INTERVAL_S if options.stacks else None
        pacer = self.PACER(self.ring_records, fixed)
        pidfd = os.pidfd_open(self.target)
        start = time.monotonic()
        deadline = start + options.duration_s if options.duration_s else None
        self.outputs = outputs
        at_exit = self.at_exit
        if watched.launched is not None:
            # held at each exec (its new allocator probed) and at its exit, so that the
            # libraries it loaded are read (maps, --stacks' images) before they go
            watched.launched.resume(hold_exit=True, on_exec=on_exec)
        if options.progress:
            what = " ".join(options.cmd) if options.cmd else f"process {self.target}"
            print(f"pymtrace: recording {what}" + ("" if options.duration_s else "; Ctrl-C to stop"), file=sys.stderr)
        last_maps = last_kept = 0.0
        try:
            while True:
                drained = self.drain()
                if options.format == "parquet":
                    t0 = time.thread_time()
                    outputs.poll()
                    self.consumer_cpu += time.thread_time() - t0
                now = time.monotonic()
                if options.format == "mtrace-text" and now - last_maps > 0.2:
                    outputs.snapshot_maps()
                    last_maps = now
                if now - last_kept > MAPS_INTERVAL_S:  # libraries loaded since (dlopen)
                    outputs.record_maps()
                    last_kept = now
                if deadline is not None and now >= deadline:
                    break
                if not watched.target_alive(pidfd, at_exit) and not watched.children_alive(outputs.pids()):
                    break
                timeout = pacer.wait(drained, now)
                if deadline is not None:
                    timeout = max(0.0, min(timeout, deadline - now))
                time.sleep(timeout)
        except KeyboardInterrupt:
            self.interrupted = True
        except RecordingStopped as exc:  # disk full, a program that cannot be probed: what was
            self.failure = exc  # written whole stays, recording stops
        finally:
            os.close(pidfd)
            stopping.begin_stopping()  # from here on SIGINT/SIGTERM cannot cut the stop short
        # a last drain: everything committed before we stop (later SIGINT/SIGTERM are
        # ignored while stopping, see pymtrace.cli)
        if not isinstance(self.failure, WriteFailed):
            try:
                self.drain(final=True)
            except WriteFailed as exc:
                self.failure = exc
        self.duration = time.monotonic() - start

    def at_exit(self, pid: int) -> None:
        """A held command at its exit, its mappings still there: keep them (and --stacks: read
        the files it mapped since)."""
        if self.outputs is not None:
            self.outputs.record_maps(pid)
        if self.unwinder is not None:
            self.unwinder.at_exit(pid)
            # its Python frames named while its memory is there
            t1 = time.thread_time()
            with stopping.stop_deferred():
                self.consume_stacks()
            self.unwinder.cpu += time.thread_time() - t1

    def close(self) -> None:
        try:
            self.reader.close()
        except (BufferError, OSError, ValueError):  # a view still exported: the process exit frees it
            pass


# ---------------------------------------------------------------- record.bpf.c's counters


def lost_events(bpf: Any) -> int:
    """Records BPF could not reserve (the ring buffer was full)."""
    return int(bpf["lost"].sum(ctypes.c_int(0)).value)


def reserve_retries(bpf: Any) -> int:
    try:
        return int(bpf["retried"].sum(ctypes.c_int(0)).value)
    except KeyError:  # a program without the counter
        return 0


def stacks_not_copied(bpf: Any) -> int:
    """--stacks: stack events BPF could not send (their ring full or the scratch slot reused)."""
    return int(bpf["stack_lost"].sum(ctypes.c_int(0)).value)
