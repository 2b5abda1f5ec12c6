"""The recorder behind `pymtrace record`: every malloc-API call of a process into a trace file.

Data path: BPF uprobes/uretprobes on glibc's malloc functions (bpf/record.bpf.c) write
complete 64-byte dj/malloc records into a BPF ring buffer (no wakeups). The recorder reads
the ring buffer's pages itself (pymtrace.bpf.ringbuf: no per-event callback), and every
poll copies all committed records out of it with a few strided copies and one write(2):
no per-event Python work.

record(options) runs one recording: its probes (plan), its drain loop (drain), its files
and closing summary (outputs), and with --stacks its stack unwinder (stacks).
"""

from __future__ import annotations

import ctypes
import sys
import time

from pymtrace.bpf import load as bpfload
from pymtrace.bpf import structs
from pymtrace.bpf.ringbuf import RingReader
from pymtrace.errors import PymtraceError, printable
from pymtrace.recorder import drain, inprocess
from pymtrace.recorder.options import RecordOptions
from pymtrace.recorder.outputs import PAGE, Outputs, exit_status, print_summary
from pymtrace.recorder.plan import ProbePlan
from pymtrace.recorder.stacks import StackUnwinder
from pymtrace.trace.formats import mtrace_bin


def record(options: RecordOptions) -> int:
    """Record as OPTIONS say until the process exits, --duration or a stop signal; the exit
    status (0, or outputs.EXIT_LOST). PymtraceError when it cannot record, RecordingStopped
    when it stopped early (a failed write, a program a launched command exec'd that cannot be
    probed: the files keep every complete record). A launched command that can preload
    pymtrace's interposer is recorded in-process (recorder.inprocess), anything else through
    uprobes (Recorder)."""
    via, why = inprocess.choose(options)
    if via == "interposer":
        return inprocess.record_in_process(options)
    if why is not None and options.progress:
        print(f"pymtrace: recording through uprobes: {printable(why)}", file=sys.stderr)
    return Recorder(options, why).run()


class Recorder:
    """One recording: the probe plan, the outputs, the drainer, put together and taken down."""

    def __init__(self, options: RecordOptions, why: str | None = None) -> None:
        self.options = options
        self.why = why  # why a launched command is recorded through uprobes (inprocess.choose)
        self.plan = ProbePlan(options)
        self.unwinder: StackUnwinder | None = None
        self.outputs: Outputs | None = None
        self.drainer: drain.Drainer | None = None
        self.watched: drain.Watched | None = None

    def run(self) -> int:
        """The recording, start to end (see record); whatever fails, the probes come off."""
        options = self.options
        bpfload.require_root("pymtrace record")
        plan = self.plan
        plan.resolve()
        try:
            if plan.libc_path is None:
                raise PymtraceError(
                    "the process does not use a shared libc (static binary?): nothing to probe; use --libc PATH"
                )
            if options.stacks:
                self.unwinder = StackUnwinder(plan.libc_path, python=not options.native)
                if plan.allocator is not None:  # its functions are the leaf where it is mapped
                    self.unwinder.add_leaf_file(plan.allocator.path)
                if plan.launched is None:
                    self.unwinder.capture(plan.target)
            self.outputs = Outputs(
                options,
                plan.target,
                plan.libc_path,
                plan.allocator,
                symbolize=self.unwinder.symbolizer.frames if self.unwinder is not None else None,
                fallback_maps=plan.note_bases,
            )
            self.outputs.output_for(plan.target)
            try:
                self._start()
            except BaseException:
                self.outputs.discard()  # nothing was recorded: leave no empty trace behind
                raise
            self.drainer.run(options, self.outputs, self.watched, self._probe_program)
            return self._finish()
        finally:
            self._cleanup()

    def _start(self) -> None:
        """Load the BPF program, put the probes on and start recording."""
        options, plan = self.options, self.plan
        unwinder = self.unwinder
        if unwinder is None:
            plan.load(options.pages)
        else:
            plan.load(options.pages, unwinder.on_event, unwinder.py_map.py_frames if unwinder.py_map else 0)
            unwinder.attach(plan.bpf)
            if plan.launched is None:
                unwinder.find_python(plan.target)
        self.watched = drain.Watched(plan.target, plan.launched, options.follow_forks)
        if options.follow_forks:
            self.watched.start()
        plan.attach()
        if plan.launched is not None:  # its allocator and operator new, as they resolve now
            self._probe_program(plan.target, at_start=True)
        plan.enable()
        sample = ctypes.sizeof(structs.header("record").structs["record_event"])
        reader = RingReader(plan.bpf["events"].map_fd, options.pages * PAGE, sample, mtrace_bin.RECORD_SIZE)
        # a parquet file of one process: the records go from the ring straight into the columns
        direct = (
            options.format == "parquet"
            and self.unwinder is None
            and not options.follow_forks
            and options.network is None
        )
        self.drainer = drain.Drainer(
            reader,
            self.outputs.output_for,
            plan.target,
            direct=direct,
            unwinder=self.unwinder,
            consume_stacks=plan.bpf.ring_buffer_consume,
        )

    def _probe_program(self, pid: int, at_start: bool = False) -> None:
        """A launched command's program (at start, and after each exec): probed where its
        calls resolve (ProbePlan.probe_program); after an exec, the trace names its allocator
        and keeps the new program's mappings."""
        if not at_start:
            self.outputs.note_exec(pid)
        if self.unwinder is not None:
            self.unwinder.find_python(pid)
        found = self.plan.probe_program(pid, at_start)
        if found is None:
            return
        foreign = found.family != "glibc"
        if foreign and self.unwinder is not None:
            self.unwinder.add_leaf_file(found.path)
        if at_start:
            return
        self.outputs.set_allocator(found if foreign else None, found.path)  # the last program's

    def _finish(self) -> int:
        """Close the outputs, print the summary; the exit status."""
        plan, drainer, outputs, unwinder = self.plan, self.drainer, self.outputs, self.unwinder
        lost = drain.lost_events(plan.bpf) + drainer.reader.discarded
        stacks_lost = n_stacks = stacks_unsent = 0
        if unwinder is not None:
            tables = [o.stack_table for o in outputs.all() if o.stack_table is not None]
            stacks_lost = unwinder.missing + sum(t.overflow for t in tables)
            n_stacks = sum(len(t.ids) for t in tables)
            stacks_unsent = drain.stacks_not_copied(plan.bpf)
        t0 = time.thread_time()  # closing writes what is buffered (parquet: the last row group)
        closed = outputs.close()  # every output, also after a failed write: each keeps what it has
        failure = drainer.failure or closed
        drainer.consumer_cpu += time.thread_time() - t0
        summary = {
            "via": "uprobes",
            "files": [o.summary() for o in outputs.all()],
            "entries": sum(o.entries for o in outputs.all()),
            "lost": lost,
            "duration_s": round(drainer.duration, 3),
            "bytes_written": sum(o.bytes_written for o in outputs.all()),
            "buffer_size": self.options.pages * PAGE,
            "consumer_cpu_s": round(drainer.consumer_cpu, 6),
            "polls": drainer.polls,
            "max_poll_gap_s": round(drainer.max_gap, 4),
            "reserve_retries": drain.reserve_retries(plan.bpf),
            "max_backlog_bytes": drainer.reader.max_backlog,
        }
        if unwinder is not None:
            summary["stacks"] = n_stacks
            summary["stacks_lost"] = stacks_lost  # allocation records with stack id 0
            summary["stacks_not_copied"] = stacks_unsent  # in BPF: ring full or scratch slot reused
            summary["stacks_incomplete"] = unwinder.incomplete
            summary["unwinder_cpu_s"] = round(unwinder.cpu, 6)
            summary["python"] = unwinder.python_lines()
        if self.why is not None:
            summary["why"] = self.why
        if failure is not None:
            summary["error"] = str(failure)
        if plan.launched is not None:
            # a held command's stops must be taken by service() (Popen.poll would swallow one)
            summary["command_exit_status"] = plan.launched.service(drainer.at_exit)
        print_summary(summary, self.options)
        return exit_status(summary, self.options)

    def _cleanup(self) -> None:
        if self.watched is not None:
            self.watched.stop()
        if self.drainer is not None:
            self.drainer.close()
        self.plan.release()
