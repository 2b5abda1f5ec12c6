"""`record -- CMD` in-process: the launched command (and, with --follow-forks, its children)
preloads pymtrace's interposer (sources.interposer), which writes every malloc-API call into
a shared-memory ring per process image; the records drained from the rings go into the same
outputs as the uprobe path's (mtrace-bin, mtrace-text, Parquet, --to). No BPF, no trap: a
call costs the process tens of nanoseconds, and a full ring makes the calling thread wait
(counted, reported) rather than lose a record.

choose(options) decides the path: the interposer for a launched command that can preload
it, uprobes (recorder.Recorder) otherwise, with the reason."""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import queue
import sys
import time
from typing import Callable

import numpy as np

from pymtrace import stopping
from pymtrace.bpf import structs, uprobes
from pymtrace.bpf.ringbuf import RingReader
from pymtrace.errors import PymtraceError, printable
from pymtrace.recorder import drain
from pymtrace.recorder.options import RecordOptions
from pymtrace.recorder.outputs import PAGE, Output, Outputs, exit_status, print_summary
from pymtrace.recorder.stacks import RingStacks, StackUnwinder
from pymtrace.sources import interposer
from pymtrace.trace.formats import mtrace_bin
from pymtrace.tracee import libc, proc

STACK_FRAMES = 128  # --stacks: return addresses kept per allocation (deeper stacks are cut, counted)
FINISH_S = 2.0  # after the last watched process ended: how long its rings' last records are awaited


def choose(options: RecordOptions) -> tuple[str, str | None]:
    """("interposer" | "uprobes", why uprobes were chosen for a launched command, or None).
    PymtraceError when --via interposer was asked for and cannot be had."""
    asked = options.via
    if options.pid is not None:
        if asked == "interposer":
            raise PymtraceError("--via interposer records a launched command (-- CMD); -p attaches through uprobes")
        return "uprobes", None
    why = None
    if asked == "uprobes":
        return "uprobes", None  # asked for: nothing to explain
    if options.libc is not None:
        why = "--libc names a libc to put uprobes on"
    else:
        why = interposer.not_preloadable(options.cmd)
    if why is None and options.stacks:
        why = stacks_problem(options)
    if why is not None and asked == "interposer":
        raise PymtraceError(f"--via interposer: {why}")
    return ("uprobes", why) if why is not None else ("interposer", None)


def stacks_problem(options: RecordOptions) -> str | None:
    """Why --stacks cannot be taken in-process for OPTIONS.cmd (one line), or None."""
    if not ctypes.util.find_library("unwind"):
        return "--stacks in-process unwinds with libunwind (libunwind.so.8), which is not installed"
    if not options.native and interposer.runs_python(options.cmd):
        return "--stacks reads a Python program's frames in BPF (--native: native stacks, in-process)"
    return None


def record_in_process(options: RecordOptions) -> int:
    """Record the launched command OPTIONS.cmd through the interposer (see the module)."""
    return InProcessRecorder(options).run()


class RingPacer(drain.DrainPacer):
    """The drains of the interposer's rings: a program in-process makes calls up to ~50M/s
    (a storm), and a ring it fills makes it wait, so a quiet one may burst that fast."""

    BURST_RATE = 50e6


class RingDrainer(drain.Drainer):
    """drain.Drainer's loop, fed from the interposer's rings instead of a BPF ring buffer."""

    PACER = RingPacer

    def __init__(
        self,
        rings: interposer.RingSet,
        output_for: Callable[[int], Output],
        target: int,
        fmt: str,
        stacks: RingStacks | None = None,
    ) -> None:
        super().__init__(None, output_for, target, ring_records=rings.options.slots)
        self.rings = rings
        self.stacks = stacks  # --stacks: labels each batch with its output's stack ids
        self.words = fmt == "parquet"  # the columns take the records' words without a copy
        self.records = 0
        self.on_poll: Callable[[], None] | None = None  # called after each drain but the last
        self.uprobes: drain.Drainer | None = None  # a program run without the interposer: its BPF ring

    def _write(self, batches: list[interposer.Batch]) -> int:
        n = 0
        for batch in batches:
            out = self.output_for(batch.pid)
            if self.stacks is not None:
                self.stacks.label_batch(batch, out)
            if self.words and hasattr(out, "write_words"):
                out.write_words(np.frombuffer(batch.data, dtype=np.uint64).reshape(batch.count, 8))
            else:
                out.write(batch.data, batch.count, batch.types)
            n += batch.count
        self.records += n
        return n

    def drain(self, final: bool = False) -> int:
        now = time.monotonic()
        if self.last_poll is not None:
            self.max_gap = max(self.max_gap, now - self.last_poll)
        self.last_poll = now
        t0 = time.thread_time()
        total = 0
        try:
            with stopping.stop_deferred():  # a batch taken from a ring is written whole
                # the command ended (not a stop signal, --duration or a failed write): its
                # processes' last records are awaited, else what is there is taken at once
                if final and not self.interrupted and self.failure is None and not proc.exists(self.target):
                    for batch in self.rings.finish(timeout=FINISH_S):
                        total += self._write([batch])
                else:
                    while True:
                        batches = self.rings.drain()
                        total += self._write(batches)
                        if not self.rings.busy(batches):
                            break
            if self.on_poll is not None and not final:
                self.on_poll()
            return total + self.drain_uprobes(final)  # (the last one too: its BPF ring's rest)
        finally:
            self.consumer_cpu += time.thread_time() - t0
            self.polls += 1

    def drain_uprobes(self, final: bool = False) -> int:
        if self.uprobes is None:
            return 0
        n = self.uprobes.drain(final)
        self.failure = self.failure or self.uprobes.failure
        return n

    def at_exit(self, pid: int) -> None:
        """The launched command held at its exit: its maps kept; a program it exec'd that
        runs through uprobes has its last stacks unwound while it is there."""
        super().at_exit(pid)
        if self.uprobes is not None:
            self.uprobes.at_exit(pid)

    def image_ended(self, pid: int) -> None:
        """PID exec'd (held at its exec stop): its old image's records, all of them, now."""
        self._write(self.rings.ended(pid))

    def close(self) -> None:
        if self.uprobes is not None:  # the rings are closed by their owner
            self.uprobes.close()


class ExecWatched(drain.Watched):
    """drain.Watched, also telling the followed processes' execs (take_execs): each with its
    LD_PRELOAD and executable, read as the event comes (a short-lived process is gone by the
    next drain)."""

    KINDS = ("fork", "exec", "exit")

    def __init__(self, target: int, launched: object, follow: bool) -> None:
        super().__init__(target, launched, follow)
        # (pid, environment, exe, euid): appended in the events' thread, taken in the drain's
        # (one deque: a list swapped for a new one lost appends bound to the old one meanwhile)
        self.execs: collections.deque[tuple[int, dict[str, str], str, int | None]] = collections.deque()
        self.tree: set[int] = {target}  # every process followed, also those ended since

    def start(self) -> None:
        super().start(on_event=self._seen)

    def _seen(self, ev: object) -> None:  # in the events' reader thread
        # the tree is kept here, in the events' order: a child's fork and exec can both come
        # between poll()'s drain and take_execs(), where a tree kept by poll() lacks the child
        if ev.kind == "fork" and ev.pid == ev.tgid and ev.parent_tgid in self.tree:
            self.tree.add(ev.tgid)
        elif ev.kind == "exec" and ev.pid == ev.tgid and ev.tgid in self.tree:
            pid = ev.tgid
            try:
                env, exe = interposer.process_image(pid)
            except PymtraceError:  # gone already: nothing to tell
                pass
            else:
                self.execs.append((pid, env, exe, proc.effective_uid(pid)))
        try:
            self.procevents.queue.put_nowait(ev)
        except queue.Full:
            self.procevents.dropped += 1

    def take_execs(self) -> list[tuple[int, dict[str, str], str, int | None]]:
        """The execs of processes followed seen since the last call."""
        execs = []
        while self.execs:
            execs.append(self.execs.popleft())
        return execs


class InProcessRecorder:
    """One recording through the interposer: the rings, the launched command, the outputs."""

    def __init__(self, options: RecordOptions) -> None:
        self.options = options
        self.rings: interposer.RingSet | None = None
        self.launched = None
        self.outputs: Outputs | None = None
        self.drainer: RingDrainer | None = None
        self.watched: drain.Watched | None = None
        self.untraced: dict[int, str] = {}  # pid -> why it runs on unrecorded
        self.via_uprobes: dict[int, str] = {}  # pid -> why it is recorded through uprobes (after an exec)
        self.plan = None  # recorder.plan.ProbePlan: uprobes for a program run without the interposer
        self.stacks: RingStacks | None = None  # --stacks

    def run(self) -> int:
        options = self.options
        try:
            slots = interposer.slots_for(options.pages * PAGE)
            frames = STACK_FRAMES if options.stacks else 0
            self.rings = interposer.RingSet(
                interposer.RingOptions(follow=options.follow_forks, slots=slots, frames=frames)
            )
            from pymtrace.tracee.launch import Launched

            self.launched = Launched(list(options.cmd), env=self.rings.env(os.environ))
            target = self.launched.pid
            self.launched.run_until_loaded()
            libc_path = libc.process_libc(target) or self.launched.libc_path()
            found = libc.allocator(target)
            foreign = found if found is not None and found.family not in (None, "glibc") else None
            if options.stacks:
                self.stacks = RingStacks(libc_path)
                if foreign is not None:  # its functions are the leaf where it is mapped
                    self.stacks.add_leaf_file(foreign.path)
            symbolize = self.stacks.symbolizer.frames if self.stacks is not None else None
            self.outputs = Outputs(options, target, libc_path, foreign, symbolize=symbolize)
            if options.progress:
                print(
                    f"pymtrace: process {target} ({printable(proc.comm(target) or options.cmd[0])}): "
                    "recorded in-process by pymtrace's interposer",
                    file=sys.stderr,
                )
            self.outputs.output_for(target)
            self.watched = ExecWatched(target, self.launched, options.follow_forks)
            if options.follow_forks:
                self.watched.start()
                if self.watched.events_error is not None:  # children found by scanning /proc
                    print(
                        f"pymtrace: warning: {printable(self.watched.events_error)}: a followed child "
                        "that execs a program without the interposer is not named",
                        file=sys.stderr,
                    )
            self.drainer = RingDrainer(self.rings, self.outputs.output_for, target, options.format, self.stacks)
            self.drainer.on_poll = self._check_execs
            self.drainer.run(options, self.outputs, self.watched, self._on_exec)
            return self._finish()
        finally:
            self._cleanup()

    def _check_execs(self) -> None:
        """Followed processes that exec'd a program the interposer cannot be in (their
        environment lost it, a static or setuid program) run on unrecorded: said so."""
        self.watched.poll()
        for pid, env, exe, uid in self.watched.take_execs():
            if pid == self.launched.pid:
                continue  # the launched command's execs are held (_on_exec)
            why = self._why_not_preloaded(env, exe, uid)
            if why is not None:
                self._untraced(pid, why, os.path.basename(exe or "?"))

    def _on_exec(self, pid: int) -> None:
        """The launched command exec'd, held with its new objects mapped, before any of their
        initializers ran: its old image's records first, then its new program's mappings and
        allocator. A program that runs without the interposer (its environment lost
        LD_PRELOAD, a setuid or static program) is recorded through uprobes from here on,
        exactly: nothing of it has run yet."""
        self.drainer.image_ended(pid)
        self.drainer.drain_uprobes()
        self.outputs.note_exec(pid)
        if self.stacks is not None:
            self.stacks.forget(pid)
        mapped = self._maps_interposer(pid)
        if mapped is None:
            return  # gone meanwhile: its end is seen by the drain loop
        if self.plan is not None:  # uprobes are on for it: on for this program too, or off
            self.plan.bpf["enabled"][ctypes.c_int(0)] = ctypes.c_uint32(int(not mapped))
        if mapped:
            uid = proc.effective_uid(pid)
            if uid is not None and uid != os.geteuid():  # (runuser without a fork of its own)
                exe = proc.exe(pid) or "?"
                self._untraced(pid, f"{exe} runs as user {uid}: its ring cannot be one of this pymtrace's")
                return
            found = libc.allocator(pid)
            if found is not None and found.family is not None:
                self.outputs.set_allocator(found if found.family != "glibc" else None, found.path)
                if self.stacks is not None:
                    self.stacks.add_leaf_file(found.path)
            return
        try:
            env, exe = interposer.process_image(pid)
            why = self._why_not_preloaded(env, exe, proc.effective_uid(pid))
        except PymtraceError:
            return  # gone meanwhile: its end is seen by the drain loop
        why = why or "its program runs without pymtrace's interposer"
        if self.plan is None:
            try:
                self._start_uprobes(pid)
            except PymtraceError as exc:
                self._untraced(pid, f"{why}, and uprobes cannot record it: {exc}")
                return
            self.via_uprobes[pid] = why
            if self.options.progress:
                print(
                    f"pymtrace: process {pid}: recorded through uprobes from its exec on: {printable(why)}",
                    file=sys.stderr,
                )
        found = self.plan.probe_program(pid)
        if found is not None:
            foreign = found.family != "glibc"
            self.outputs.set_allocator(found if foreign else None, found.path)
            unwinder = self.drainer.uprobes.unwinder
            if foreign and unwinder is not None:  # its functions are the leaf where it is mapped
                unwinder.add_leaf_file(found.path)

    def _start_uprobes(self, pid: int) -> None:
        """record.bpf.c's probes on PID's libc (and, per program, its allocator and C++
        runtime: ProbePlan.probe_program), its records drained with the rings'."""
        from pymtrace.recorder.plan import ProbePlan

        plan = ProbePlan(self.options)
        plan.target, plan.launched = pid, self.launched
        plan.libc_path = libc.process_libc(pid)
        if plan.libc_path is None:
            raise PymtraceError("it maps no shared libc (a static binary)")
        self.plan = plan
        unwinder = None
        if self.stacks is not None:  # its stacks copied by BPF, named with the rings' ones
            unwinder = StackUnwinder(plan.libc_path, python=not self.options.native, processes=self.stacks.processes)
            for path, _ in reversed(self.stacks.leaf_files):
                unwinder.add_leaf_file(path)
            plan.load(self.options.pages, unwinder.on_event, unwinder.py_map.py_frames if unwinder.py_map else 0)
            unwinder.attach(plan.bpf)
            unwinder.find_python(pid)
        else:
            plan.load(self.options.pages)
        plan.attach()
        plan.enable()
        sample = ctypes.sizeof(structs.header("record").structs["record_event"])
        reader = RingReader(plan.bpf["events"].map_fd, self.options.pages * PAGE, sample, mtrace_bin.RECORD_SIZE)
        consume = plan.bpf.ring_buffer_consume if unwinder is not None else None
        self.drainer.uprobes = drain.Drainer(
            reader, self.outputs.output_for, pid, unwinder=unwinder, consume_stacks=consume
        )

    def _why_not_preloaded(self, env: dict[str, str], exe: str, uid: int | None) -> str | None:
        """Why a program (EXE, started with ENV, as user UID) runs without the interposer's
        ring, or None."""
        if uid is not None and uid != os.geteuid():
            return f"{exe} runs as user {uid}: its ring cannot be one of this pymtrace's"
        return interposer.image_problem(self.rings.lib, env, exe)

    def _maps_interposer(self, pid: int) -> bool | None:
        """Whether PID maps the interposer (None: it is gone)."""
        try:
            maps = libc.read_maps(pid)
        except PymtraceError:
            return None
        return any(m.path == self.rings.lib for m in maps)

    def _untraced(self, pid: int, why: str, name: str = "?") -> None:
        if pid in self.untraced:
            return
        self.untraced[pid] = why
        print(
            f"pymtrace: warning: process {pid} ({printable(proc.comm(pid) or name)}) is not recorded from here on: "
            f"{printable(why)}; `record --via uprobes` records it",
            file=sys.stderr,
        )

    def _finish(self) -> int:
        drainer, outputs, rings = self.drainer, self.outputs, self.rings
        self._check_execs()  # those of the last moments
        # --stacks (never with --to: a NetOutput has no table); closing drops them
        tables = [o.stack_table for o in outputs.all() if getattr(o, "stack_table", None) is not None]
        n_stacks, overflow = sum(len(t.ids) for t in tables), sum(t.overflow for t in tables)
        t0 = time.thread_time()
        closed = outputs.close()
        failure = drainer.failure or closed
        drainer.consumer_cpu += time.thread_time() - t0
        stats = rings.stats()
        torn = sum(s.torn for s in stats)
        lost = torn
        if self.plan is not None:
            lost += drain.lost_events(self.plan.bpf) + drainer.uprobes.reader.discarded
        summary = {
            "via": "interposer",
            "files": [o.summary() for o in outputs.all()],
            "entries": sum(o.entries for o in outputs.all()),
            "lost": lost,  # slots a process reserved and died before writing; uprobes' lost events
            "duration_s": round(drainer.duration, 3),
            "bytes_written": sum(o.bytes_written for o in outputs.all()),
            "consumer_cpu_s": round(drainer.consumer_cpu, 6),
            "polls": drainer.polls,
            "max_poll_gap_s": round(drainer.max_gap, 4),
            "processes": [
                {
                    "pid": s.pid,
                    "image": s.generation,
                    "via": "interposer",
                    "allocator": s.allocator,
                    "records": s.records,
                    "waits": s.waits,
                    "wait_s": round(s.wait_ns / 1e9, 6),
                    "signal_deferred": s.deferred,
                    "torn": s.torn,
                }
                for s in stats
            ]
            + [{"pid": pid, "via": "uprobes", "why": why} for pid, why in self.via_uprobes.items()]
            + [{"pid": pid, "via": None, "why": why} for pid, why in self.untraced.items()],
        }
        if self.stacks is not None:
            self._stacks_summary(summary, stats, n_stacks, overflow)
        if failure is not None:
            summary["error"] = str(failure)
        summary["command_exit_status"] = self.launched.service(drainer.at_exit)
        print_summary(summary, self.options)
        return exit_status(summary, self.options)

    def _stacks_summary(self, summary: dict, stats: list[interposer.RingStats], n_stacks: int, overflow: int) -> None:
        """--stacks: the uprobe path's stack fields (allocations without a stack, stacks cut at
        STACK_FRAMES, the CPU time locating and naming them), and per process its table's."""
        unwinders = [self.stacks]
        if self.drainer.uprobes is not None and self.drainer.uprobes.unwinder is not None:
            unwinders.append(self.drainer.uprobes.unwinder)
        summary["stacks"] = n_stacks
        summary["stacks_lost"] = sum(u.missing for u in unwinders) + overflow
        summary["stacks_incomplete"] = sum(u.incomplete for u in unwinders)
        summary["unwinder_cpu_s"] = round(sum(u.cpu for u in unwinders), 6)
        by_image = {(s.pid, s.generation): s for s in stats}
        for entry in summary["processes"]:
            s = by_image.get((entry["pid"], entry.get("image")))
            if s is not None and entry["via"] == "interposer":
                entry.update(stack_ids=s.stacks, stacks_table_full=s.stacks_full, stacks_in_handlers=s.stacks_nested)
                if s.stack_error:
                    entry["stack_error"] = s.stack_error
        for s in stats:
            if s.stack_error and self.options.progress:
                print(
                    f"pymtrace: warning: process {s.pid}: no stacks: {printable(s.stack_error)}",
                    file=sys.stderr,
                )
        summary["python"] = [
            f"process {pid} runs CPython ({path}): its stacks are native only; "
            "`record --stacks --via uprobes` merges its Python frames"
            for pid, path in self.stacks.python_native.items()
        ]

    def _cleanup(self) -> None:
        if self.watched is not None:
            self.watched.stop()
        launched = self.launched
        if launched is not None and not launched.resumed:
            launched.kill()  # failed before it could run traced: do not let it run
        elif launched is not None:
            launched.release()  # still running (Ctrl-C, --duration): on, unrecorded
        if self.drainer is not None:
            self.drainer.close()
        if self.plan is not None:
            uprobes.detach(self.plan.bpf)
        if self.rings is not None:
            self.rings.close()  # a process still running finds its ring detached: never blocked
        if self.outputs is not None and self.drainer is None:
            self.outputs.discard()  # nothing was recorded
