"""heap's BPF programs on the USDT sites of pymtrace's interposer in sampling mode.

    sites = InterposerSites(lib)          # lib: sources.interposer.library()
    prelude = sites.prelude()             # C before bpf/heap.bpf.c: one function per site
    sites.attach(bpf, pid)                # PID -1: every process that maps lib

The interposer (tracee/native/interpose.c) draws heap's samples in-process and fires
pymtrace:heap_alloc(call, pointer, size, tracked) for a sampled allocation and
pymtrace:heap_free(pointer) for the free of a sampled block. Each site gets a function that
reads the arguments where the site's `.note.stapsdt` says they are (sources.usdt's decoder,
the one glibc's probes use) and calls hp_usdt_alloc / hp_usdt_free of bpf/heap.bpf.c; it is
attached as a plain uprobe at the site, by the library's path.
"""

from __future__ import annotations

from typing import Any

from pymtrace.bpf import uprobes
from pymtrace.errors import ProcessGone, PymtraceError
from pymtrace.sources import interposer, usdt
from pymtrace.sources.base import uprobe
from pymtrace.tracee import proc

_ARGS = {"heap_alloc": 4, "heap_free": 1}
_DECLARATIONS = """#include <uapi/linux/ptrace.h>
static __always_inline int hp_usdt_alloc(struct pt_regs *ctx, u64 call, u64 ptr, u64 size, u64 tracked);
static __always_inline int hp_usdt_free(struct pt_regs *ctx, u64 ptr);
"""


class InterposerSites:
    """The interposer LIB's sampling sites, as BPF functions and their uprobes."""

    def __init__(self, lib: str) -> None:
        self.lib = lib
        self.probes = interposer.sample_sites(lib)
        self.pids: set[int] = set()  # attached for (-1: every process)

    def _fn(self, index: int) -> str:
        return f"hp_site_{index}"

    def prelude(self) -> str:
        """The C placed before bpf/heap.bpf.c: the handlers' declarations and a function per site."""
        code = [_DECLARATIONS]
        for i, probe in enumerate(self.probes):
            specs = probe.arg_specs
            if len(specs) != _ARGS[probe.name]:
                raise PymtraceError(f"{self.lib}: {probe.name} has {len(specs)} arguments, not {_ARGS[probe.name]}")
            try:
                reads = " ".join(usdt.arg_code(usdt.parse_arg(s), n, probe.address, {}) for n, s in enumerate(specs))
            except usdt.UnresolvedArg as exc:
                raise PymtraceError(f"{self.lib}: {probe.name}'s arguments cannot be read ({exc})") from None
            args = ", ".join(f"a{n}" for n in range(len(specs)))
            code.append(
                f"int {self._fn(i)}(struct pt_regs *ctx) {{\n\tu64 a0 = 0, a1 = 0, a2 = 0, a3 = 0;\n"
                f"\tu32 flags = 0;\n\t{reads}\n\t(void)flags;\n"
                f"\treturn hp_usdt_{probe.name[len('heap_') :]}(ctx, {args});\n}}\n"
            )
        return "\n".join(code)

    def attach(self, bpf: Any, pid: int) -> None:
        """Attach every site for PID (-1: every process mapping the library; the BPF program
        keeps the calls of the processes it traces through the interposer). Once per PID."""
        if pid in self.pids or -1 in self.pids:
            return
        probes = [
            uprobe(self.lib, p.address, self._fn(i), pid, what=f"{interposer.SAMPLE_PROVIDER}:{p.name}")
            for i, p in enumerate(self.probes)
        ]
        try:
            uprobes.attach(bpf, probes)
        except Exception as exc:  # BCC's attach raises plain Exception, a link OSError
            if pid != -1 and not proc.alive(pid):
                raise ProcessGone(pid) from None
            raise PymtraceError(f"cannot attach to the interposer's USDT sites in {self.lib}: {exc}") from None
        self.pids.add(pid)
